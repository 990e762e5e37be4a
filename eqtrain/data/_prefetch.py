"""Background prefetch: a daemon thread fills a bounded queue from a generator.

The thread holds only the generator, the queue and a stop event, never the
consumer-side iterator, so an iterator dropped mid-epoch is garbage-collected and
its `__del__` stops the thread. Prefetchers still running when the interpreter
exits are stopped before it tears down (`_close_all_at_exit`): a daemon thread
cut off inside JAX's C++ code (placing a batch on the device) aborts the whole
process ("terminate called after throwing an instance of ''", exit status 134).
"""

import atexit
import contextlib
import queue
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any


_ITEM, _END, _ERROR = "item", "end", "error"
_POLL = 0.05  # seconds between checks of the stop event while the queue is full
_EXIT_WAIT = 10.0
"""Seconds the interpreter's exit waits, at most, for running prefetch threads
to finish the item they are making and stop."""


class Prefetcher:
    """Run `source` in a thread, up to `size` items ahead of `get()`.

    `get()` returns the next item, raises `StopIteration` at the end, and re-raises
    (once) any exception the thread met. `close()` stops the thread and waits for
    it; it is idempotent and also runs when the prefetcher is collected.
    """

    def __init__(self, source: Iterator[Any], size: int):
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=_fill,
            args=(source, self._queue, self._stop),
            name="eqtrain-prefetch",
            daemon=True,
        )
        self._thread.start()
        _LIVE.add(self)

    def get(self) -> Any:
        if self._done:
            raise StopIteration
        kind, value = self._next()
        if kind == _ITEM:
            return value
        self._done = True
        self._thread.join()
        if kind == _ERROR:
            raise value
        raise StopIteration

    def _next(self) -> tuple[str, Any]:
        """The next `(kind, value)` the thread queued, once it is there."""
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise RuntimeError(
                        "the prefetch thread ended without a result (was it closed?)"
                    ) from None

    def close(self, *, deadline: float | None = None) -> None:
        """Stop the thread and wait for it (until `time.monotonic()` reaches
        `deadline`, if given)."""
        self._done = True
        self._stop.set()
        if threading.current_thread() is self._thread:  # collected by its own thread
            return
        while self._thread.is_alive():
            if deadline is not None and time.monotonic() >= deadline:
                return
            self._drain()  # unblock a producer waiting on a full queue
            self._thread.join(timeout=_POLL)

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def __del__(self, _exiting: Any = sys.is_finalizing) -> None:
        # At interpreter exit the modules `close` uses may already be torn
        # down; the daemon thread ends with the process anyway.
        if not _exiting():
            self.close()


_LIVE: "weakref.WeakSet[Prefetcher]" = weakref.WeakSet()


def _close_all_at_exit() -> None:
    """Stop every prefetcher still running, waiting `_EXIT_WAIT` seconds at most
    in all. `atexit` runs this while threads can still run: after it, the
    interpreter ends any daemon thread that wakes up, wherever it is."""
    deadline = time.monotonic() + _EXIT_WAIT
    for prefetcher in list(_LIVE):
        prefetcher.close(deadline=deadline)


atexit.register(_close_all_at_exit)


def _put(q: queue.Queue, item: tuple[str, Any], stop: threading.Event) -> bool:
    """Put `item` unless asked to stop first; returns whether it was put."""
    while not stop.is_set():
        with contextlib.suppress(queue.Full):
            q.put(item, timeout=_POLL)
            return True
    return False


def _fill(source: Iterator[Any], q: queue.Queue, stop: threading.Event) -> None:
    try:
        for item in source:
            if not _put(q, (_ITEM, item), stop):
                return
        _put(q, (_END, None), stop)
    except BaseException as error:  # handed to the consumer, which re-raises it
        _put(q, (_ERROR, error), stop)
    finally:
        _close(source)


def _close(source: Iterator[Any]) -> None:
    """Close a generator (its `finally` blocks run in this thread)."""
    close = getattr(source, "close", None)
    if close is not None:
        close()
