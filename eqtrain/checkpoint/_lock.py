"""One run per directory: `RunLock` holds `<run_dir>/.lock` (JSON: PID, host, start
time) for the whole run. Created with `O_EXCL`; a lock left by a dead process on
this host is taken over with a note; released on every exit (explicitly, and at
interpreter exit)."""

import atexit
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from ._errors import CheckpointError


LOCK = ".lock"


class RunInUseError(CheckpointError):
    """Another live process holds the run directory."""


def _boot_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a live
    process from a new one that reused the PID."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def _alive(info: dict[str, Any]) -> bool:
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    started = info.get("proc_start")
    return started is None or _boot_time(pid) in (None, started)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # being written, or garbage: judged by its age below


def _since(info: dict[str, Any]) -> str:
    started = info.get("started")
    if isinstance(started, (int, float)):
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    return "an unknown time"


def _gone(info: dict[str, Any]) -> str:
    """Why the lock `info` describes is stale."""
    if not info:
        return "it was unreadable"
    return f"PID {info.get('pid')} (since {_since(info)}) is no longer running"


def _note(text: str) -> None:
    print(f"[eqtrain] note: {text}", file=sys.stderr, flush=True)


class RunLock:
    """`<run_dir>/.lock`, held from `acquire()` to `release()`.

    `acquire` raises `RunInUseError` ("<run_dir> is in use by PID 1234 since ...")
    when a live process holds it; a lock of a dead process on this host (or an
    unreadable lock file older than a minute) is taken over, with a note on
    standard error.
    """

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK
        self.token = uuid.uuid4().hex
        self.held = False

    def _content(self) -> str:
        return json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": time.time(),
                "proc_start": _boot_time(os.getpid()),
                "token": self.token,
                "argv": sys.argv[:8],
            }
        )

    def acquire(self) -> "RunLock":
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            with os.fdopen(fd, "w") as f:
                f.write(self._content())
            self.held = True
            atexit.register(self.release)
            return self
        raise RunInUseError(f"could not lock {self.run_dir} (contended {self.path}).")

    def _take_over_if_stale(self) -> None:
        """Take the lock over if its holder is gone; refuse if it is alive;
        return to try again if it was released or is being written."""
        info = _read(self.path)
        if info is None:
            return  # released meanwhile: try again
        if info == {} and not self._old_garbage():
            return
        if info:
            self._refuse_if_held(info)
        self._take_over(info)

    def _old_garbage(self) -> bool:
        """The unreadable lock file is over a minute old (else it is probably
        being written: wait a little)."""
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return False
        if age < 60:
            time.sleep(0.2)  # probably being written
            return False
        return True

    def _refuse_if_held(self, info: dict[str, Any]) -> None:
        """`RunInUseError` if the lock's holder is on another host, or alive."""
        host = info.get("host")
        if host != socket.gethostname():
            raise RunInUseError(
                f"{self.run_dir} is in use by PID {info.get('pid')} on host {host} "
                f"since {_since(info)} (lock {self.path}); wait for that run to end, "
                "or delete the lock file if it is no longer running."
            )
        if _alive(info):
            raise RunInUseError(
                f"{self.run_dir} is in use by PID {info.get('pid')} since "
                f"{_since(info)}; wait for that run to end or stop it (a second "
                f"`eqtrain fit` on one run directory would mix the two runs)."
            )

    def _take_over(self, info: dict[str, Any]) -> None:
        # Stale: move it aside under a unique name (only one taker wins the
        # rename), check that it is still the stale lock, then retry O_EXCL.
        aside = self.path.with_name(f"{LOCK}.stale-{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        taken = _read(aside)
        if taken != info and taken is not None and taken.get("token"):
            os.rename(aside, self.path)  # a fresh lock of another taker: give back
            return
        aside.unlink(missing_ok=True)
        _note(f"took over the stale lock {self.path}: {_gone(info)}.")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        info = _read(self.path)
        if info and info.get("token") == self.token:
            self.path.unlink(missing_ok=True)
        atexit.unregister(self.release)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()
