"""The Ray actor that holds one worker's resources and runs its `eqtrain fit` as a
subprocess (a JAX runtime cannot join a new group in a live process once a peer
has died, so every attempt is a fresh process). Methods return at once: the
supervisor polls them."""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
from typing import Any


MAX_LINES = 10_000  # kept between two polls (a stalled driver must not grow us)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILL when the actor dies (Linux), so a
    killed actor leaves no training process behind."""
    with contextlib.suppress(Exception):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


class Worker:
    """One worker: `start_fit` / `start_export` spawn a process, `poll` returns
    its new output lines and exit status, `send` signals it, `kill` ends it."""

    def __init__(self, index: int):
        self.index = index
        self.proc: subprocess.Popen[str] | None = None
        self.reader: threading.Thread | None = None
        self.lines: list[str] = []
        self.lock = threading.Lock()
        self.dir = tempfile.mkdtemp(prefix=f"eqtrain-ray-{index}-")
        self.result_file = os.path.join(self.dir, "result.json")

    def environ(self) -> dict[str, str]:
        """This actor's environment, which the worker processes start from."""
        return dict(os.environ)

    def address(self, avoid: list[int]) -> str:
        """`ip:port` for the coordinator: this node's address and a port that is
        free now (and not one of `avoid`, the ports of earlier attempts)."""
        import ray

        ip = ray.util.get_node_ip_address()
        for _ in range(100):
            with socket.socket() as s:
                s.bind((ip, 0))
                port = s.getsockname()[1]
            if port not in avoid:
                break
        return f"{ip}:{port}"

    def start_fit(
        self, config_text: str, args: list[str], env: dict[str, str], cwd: str
    ) -> int:
        """Start `eqtrain fit` on `config_text` (TOML); returns its PID."""
        from ._plan import fit_argv

        path = os.path.join(self.dir, "config.toml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(config_text)
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.result_file)
        return self._spawn(fit_argv(path, args, self.result_file), env, cwd)

    def start(self, argv: list[str], env: dict[str, str], cwd: str) -> int:
        """Start any command (the final export); returns its PID."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.result_file)
        return self._spawn(argv, env, cwd)

    def _spawn(self, argv: list[str], env: dict[str, str], cwd: str) -> int:
        self.kill()
        self.lines = []
        self.proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd if os.path.isdir(cwd) else None,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 -- before exec only
        )
        self.reader = threading.Thread(target=self._read, args=(self.proc,))
        self.reader.daemon = True
        self.reader.start()
        return self.proc.pid

    def _read(self, proc: "subprocess.Popen[str]") -> None:
        assert proc.stdout is not None
        for line in proc.stdout:  # progress bars redraw with \r: keep the last
            text = line.rstrip("\n").rsplit("\r", 1)[-1]
            with self.lock:
                if len(self.lines) < MAX_LINES:
                    self.lines.append(text)

    def poll(self) -> tuple[list[str], int | None, dict[str, Any] | None]:
        """New output lines, the exit code (None: still running) and, once it has
        ended, the result `eqtrain fit` reported (None: it reported none)."""
        code = None if self.proc is None else self.proc.poll()
        if code is not None and self.reader is not None:
            self.reader.join(timeout=2.0)  # the last lines, once the pipe closes
        with self.lock:
            lines, self.lines = self.lines, []
        return lines, code, self._result() if code is not None else None

    def _result(self) -> dict[str, Any] | None:
        try:
            with open(self.result_file, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def send(self, signum: int) -> None:
        """Send `signum` to the running process (the save-and-stop request)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL the running process and wait for it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
