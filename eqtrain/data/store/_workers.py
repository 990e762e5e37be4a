"""Where a store's parts are built: in this process, in worker processes
(`python -m eqtrain.data.store._worker`, fed JSON tasks) or as Ray tasks. Each way
yields the same ledger entries (a part's bytes never depend on where it was built).
"""

import contextlib
import dataclasses
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .._errors import DataError
from ._encoder import Encoder, tokenizer_key
from ._parts import Task, build_part


Built = Iterator[tuple[dict[str, Any], Task]]
"""`(ledger entry, task)` pairs, as each part is committed."""

_RAY: dict[str, Any] = {}


def run_tasks(
    tasks: Iterable[Task], *, executor: str, workers: int, spec: Mapping[str, Any]
) -> Built:
    """Build `tasks`, yielding `(entry, task)` as each finishes: `executor`
    `"inline"`, `"processes"` (`workers` of them) or `"ray"`; `"auto"` takes
    processes when there are several workers and tasks."""
    tasks = iter(tasks)
    head = [t for _, t in zip(range(2), tasks, strict=False)]
    if not head:
        return
    if executor == "auto":
        executor = "processes" if workers > 1 and len(head) > 1 else "inline"
    run = {"inline": _run_inline, "processes": _run_processes, "ray": _run_ray}
    yield from run[executor](itertools.chain(head, tasks), workers, spec)


def _run_inline(tasks: Iterator[Task], workers: int, spec: Mapping[str, Any]) -> Built:
    encoder = Encoder(spec)
    for task in tasks:
        yield build_part(task, encoder), task


def _run_processes(
    tasks: Iterator[Task], workers: int, spec: Mapping[str, Any]
) -> Built:
    with WorkerPool(workers, spec) as pool:
        yield from pool.run(tasks)


def _run_ray(tasks: Iterator[Task], workers: int, spec: Mapping[str, Any]) -> Built:
    import ray

    remote = ray.remote(num_cpus=1)(build_with_spec)
    spec = ray.put(dict(spec))
    pending: dict[Any, Task] = {}
    limit = max(2 * int(ray.cluster_resources().get("CPU", 1)), 2)
    try:
        while True:
            while len(pending) < limit and (task := next(tasks, None)) is not None:
                pending[remote.remote(task, spec)] = task
            if not pending:
                return
            ready, _ = ray.wait(list(pending), num_returns=1)
            task = pending.pop(ready[0])
            yield ray.get(ready[0]), task
    finally:
        for ref in pending:  # stopped early (an error, Ctrl-C): the rest stop too
            with contextlib.suppress(Exception):
                ray.cancel(ref)  # a KeyboardInterrupt in the task: its files go


def build_with_spec(task: Task, spec: Mapping[str, Any]) -> dict[str, Any]:
    """`build_part` with an encoder built from `spec` (a Ray task's entry point;
    the encoder is kept for the worker's next task)."""
    key = tokenizer_key(spec)
    if _RAY.get("key") != key:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        _RAY["encoder"], _RAY["key"] = Encoder(spec), key
    return build_part(task, _RAY["encoder"])


def _worker_environment() -> dict[str, str]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1")
    env["JAX_PLATFORMS"] = "cpu"  # a worker never touches an accelerator
    return env


class WorkerPool:
    """`workers` processes running `python -m eqtrain.data.store._worker`, fed JSON
    tasks on standard input (one thread per process waits on its answers)."""

    def __init__(self, workers: int, spec: Mapping[str, Any]):
        self.workers, self.spec = workers, spec
        self.processes: list[Any] = []
        self._directories: set[str] = set()  # where the tasks' parts are

    def __enter__(self) -> "WorkerPool":
        env = _worker_environment()
        for _ in range(self.workers):
            self.processes.append(self._start(env))
        return self

    def _start(self, env: Mapping[str, str]) -> subprocess.Popen:
        """A worker process, told the tokenizer spec."""
        process = subprocess.Popen(
            [sys.executable, "-m", "eqtrain.data.store._worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
            encoding="utf-8",
        )
        process.stdin.write(json.dumps(dict(self.spec)) + "\n")
        process.stdin.flush()
        return process

    def __exit__(self, *exc: Any) -> None:
        for process in self.processes:
            with contextlib.suppress(OSError):
                process.stdin.close()  # the worker's end of input: it exits
        for process in self.processes:
            _wait_or_kill(process, timeout=0 if exc[0] is not None else 30)

    def run(self, tasks: Iterator[Task]) -> Built:
        """Build `tasks` on the pool's processes, each taking the next task when
        it has answered the last; yields `(entry, task)` in the order answered."""
        self._tasks, self._lock = tasks, threading.Lock()
        self._answers: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        threads = [
            threading.Thread(target=self._serve, args=(p,), daemon=True)
            for p in self.processes
        ]
        for thread in threads:
            thread.start()
        yield from self._collect(len(threads))

    def _collect(self, running: int) -> Built:
        """The answers of `running` serving threads, until each has ended. After
        the first error no task is handed out, the other processes finish (and
        commit) the part they are building, and the error is raised. Interrupted
        (Ctrl-C, or the consumer stops), the processes are killed at once and
        their unfinished files removed."""
        error: BaseException | None = None
        try:
            while running:
                item = self._answers.get()
                if item is None:
                    running -= 1
                    continue
                failure = item if isinstance(item, BaseException) else None
                if failure is None and "entry" not in item[0]:
                    failure = _failed(*item)
                if failure is not None:
                    error = error or failure
                    self._stop.set()
                    continue
                answer, task = item
                yield answer["entry"], task
        finally:
            self._stop.set()
            if running:
                self._kill()
        if error is not None:
            raise error

    def _kill(self) -> None:
        """End every process now, and remove the files of the parts they were
        writing (named after their process id)."""
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.wait()
            _remove_files_of(process, self._directories)

    def _serve(self, process: subprocess.Popen) -> None:
        """A thread's loop: hand `process` tasks and queue its answers; `None`
        queued last."""
        try:
            while not self._stop.is_set():
                with self._lock:
                    task = next(self._tasks, None)
                    if task is not None:
                        self._directories.add(task.directory)
                if task is None:
                    break
                answer = _ask(process, task)
                if "entry" not in answer:
                    self._stop.set()  # no task after an error, from any thread
                self._answers.put((answer, task))
        except BaseException as error:  # e.g. the source failed: re-raised above
            self._answers.put(error)
        finally:
            self._answers.put(None)


def _wait_or_kill(process: subprocess.Popen, *, timeout: int) -> None:
    try:
        process.wait(timeout=timeout)
    except Exception:
        process.kill()
        process.wait()


def _ask(process: subprocess.Popen, task: Task) -> dict[str, Any]:
    """The worker's answer to `task`: `{"entry": ...}` or `{"error", "message"}`."""
    try:
        process.stdin.write(json.dumps(dataclasses.asdict(task)) + "\n")
        process.stdin.flush()
        line = process.stdout.readline()
    except (OSError, ValueError) as error:
        return {"error": "OSError", "message": str(error)}
    if not line:
        return {"error": "WorkerError", "message": _died(process, task)}
    return json.loads(line)


def _failed(answer: Mapping[str, Any], task: Task) -> Exception:
    """The error a worker's `answer` to `task` reports: a DataError for the data
    or the disk, a RuntimeError (naming the part) for a bug."""
    if answer["error"] in ("DataError", "OSError", "WorkerError"):
        return DataError(answer["message"])
    return RuntimeError(
        f"a store worker failed while building part {task.index} "
        f"({_where(task)}): {answer['error']}: {answer['message']} (its traceback "
        "is above)"
    )


def _died(process: subprocess.Popen, task: Task) -> str:
    """What to say when `process` ended without answering `task` (the files it
    left are removed)."""
    try:
        code = process.wait(timeout=10)  # it closed its output: it is ending
    except subprocess.TimeoutExpired:
        code = None
    else:
        _remove_files_of(process, [task.directory])
    what = f"while building part {task.index} ({_where(task)})"
    kept = "The parts committed so far are kept; preparing again continues from them."
    if code == -signal.SIGKILL:
        return (
            f"a store worker was killed (SIGKILL) {what}. Most likely the machine "
            "ran out of memory and the kernel's out-of-memory killer ended it "
            "(the kernel's log, `dmesg`, says so). Prepare with fewer workers "
            f"(data.workers, or `workers=` in Python) or with more memory. {kept}"
        )
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        return f"a store worker was ended by {name} {what}. {kept}"
    return f"a store worker exited (code {code}) {what}; its error is above. {kept}"


def _remove_files_of(process: subprocess.Popen, directories: Iterable[str]) -> None:
    """Remove the unfinished part files of `process` (ended) in `directories`."""
    for directory in directories:
        for tmp in (Path(directory) / "parts").glob(f"*.tmp{process.pid}"):
            tmp.unlink(missing_ok=True)


def _where(task: Task) -> str:
    """The source a task reads, for messages: a file (and first line) or texts."""
    piece = task.piece
    if piece is None:
        return f"{len(task.texts or ())} texts from Python"
    if piece["kind"] == "text_files":
        paths = piece["paths"]
        more = f" and {len(paths) - 1} more files" if len(paths) > 1 else ""
        return f"{paths[0]}{more}"
    line = f" from line {piece['line']}" if piece["kind"] == "jsonl" else ""
    return f"{piece['path']}{line}"
