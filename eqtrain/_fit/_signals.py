"""SIGINT/SIGTERM handled outside the interrupted code: the first only records a stop
request, the second ends the process at once. No Python code runs in the signal's
path that could raise into (or print from inside) whatever the main thread was
doing: a JAX callback, a garbage-collector hook, a compilation, a checkpoint write.

How: Python's C-level handler writes each signal's number to a wakeup pipe
(`signal.set_wakeup_fd`) the moment it arrives, even while the main thread is
inside a long C call; a watchdog thread reads the pipe. The Python-level handler
itself does nothing. On the first signal the watchdog only records it (`fit`'s
loop says so at its next step boundary, see `_stops.Stopper`). On the second, the
watchdog writes one note to the standard error (with `os.write`, so no stream lock
is taken) and calls `os._exit(128 + signum)`: from the disk's point of view that is
a kill, which every checkpoint and export write already survives (they are atomic
renames).
"""

import atexit
import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any


SIGNALS = (signal.SIGINT, signal.SIGTERM)

_active: "SignalGuard | None" = None  # the process's guard (signal state is global)


def _ignore(signum: int, frame: Any) -> None:
    """The Python-level handler: the watchdog thread does the work."""


class SignalGuard:
    """Owns SIGINT/SIGTERM while installed (see the module docstring).

    Attributes:
        received: the first signal's number, or None.
        note: called on the second signal, in the watchdog thread; returns the
            text that says what the abort left behind (e.g. the last checkpoint).
        first_note: called on the first signal, in the watchdog thread, with
            its number; returns the text said at once (`fit`'s notice, which
            a long step would otherwise hold back until it ends), or None.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self.note: Callable[[], str] | None = None
        self.first_note: Callable[[int], str | None] | None = None
        self._previous: dict[int, Any] = {}
        self._wakeup: int | None = None
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    # -- installing -----------------------------------------------------------
    def install(self) -> "SignalGuard":
        read, write = os.pipe()
        os.set_blocking(write, False)  # required by set_wakeup_fd
        self._pipe = (read, write)
        for sig in SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, _ignore)
        self._wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._thread = threading.Thread(
            target=self._watch, args=(read,), name="eqtrain-signals", daemon=True
        )
        self._thread.start()
        return self

    def uninstall(self, *, defaults: bool = False) -> None:
        """Put the previous handlers back (`defaults`: the operating system's
        default action instead, which ends the process), then the wakeup fd."""
        # The handlers first, then the wakeup fd: the other order left a moment
        # in which a signal ran `_ignore` with no fd to wake the watchdog, and a
        # second signal was lost (exit 0: once, in the slow twenty-offsets test).
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if defaults else handler)
        self._previous.clear()
        signal.set_wakeup_fd(-1 if self._wakeup is None else self._wakeup)
        if self._pipe is not None:
            read, write = self._pipe
            os.close(write)  # the watchdog reads end-of-file and returns
            if self._thread is not None:
                self._thread.join(timeout=5)
            os.close(read)
            self._pipe = None

    # -- the watchdog ---------------------------------------------------------
    def _watch(self, read: int) -> None:
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                return
            if not data:
                return
            for number in data:
                if number in SIGNALS:
                    self._on(signal.Signals(number))

    def _on(self, sig: signal.Signals) -> None:
        if self.received is None:
            self.received = sig
            text = None if self.first_note is None else self.first_note(sig)
            if text:  # written with os.write: no Python stream's lock is taken
                _say(text)
            return
        text = f"error: aborted by a second signal ({sig.name})."
        if self.note is not None:
            try:
                text += " " + self.note()
            except Exception as e:  # noqa: BLE001 -- the exit must happen
                text += f" (What was left could not be listed: {e}.)"
        _say(text)
        os._exit(128 + sig)


def _say(text: str) -> None:
    try:
        os.write(2, ("\n" + " ".join(text.split()) + "\n").encode())
    except OSError:
        pass


def active() -> SignalGuard | None:
    """The installed guard, if any."""
    return _active


@contextlib.contextmanager
def guarded(enabled: bool = True) -> Iterator[SignalGuard | None]:
    """Install a `SignalGuard` for the block, or join the one already installed
    (it then stays installed). None when disabled or off the main thread (signal
    handlers can only be set there)."""
    global _active
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield None
        return
    if _active is not None:
        yield _active
        return
    guard = _active = SignalGuard().install()
    try:
        yield guard
    finally:
        _active = None
        guard.uninstall()


def install_for_process() -> SignalGuard:
    """Install a guard for the rest of the process (the `eqtrain` command's: a
    second signal during start-up, export or exit must abort as cleanly as one
    during training)."""
    global _active
    if _active is None:
        _active = SignalGuard().install()
        atexit.register(_at_exit, _active)
    return _active


def _at_exit(guard: SignalGuard) -> None:
    """The process guard's end, as the interpreter shuts down: the signals'
    default actions from here on. Registered first, so it runs after every
    later `atexit` hook (a checkpoint's last write among them), while the
    watchdog still aborts on a second signal. Past this point the watchdog
    (a daemon thread) could no longer run, and a second signal would be lost
    (exit 0: the slow twenty-offsets test caught it); with the defaults it
    ends the process, by the signal."""
    global _active
    if _active is guard:
        _active = None
        guard.uninstall(defaults=True)
