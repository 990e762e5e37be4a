"""A pair of signals at any moment of a real `eqtrain fit`: the first only asks to
stop, the second ends the process at once with 128 + its number. Never a crash,
never a traceback raised into JAX's callbacks, never ignored, and the run directory
stays resumable.

The offsets count from the moment the process holds its SIGTERM handler (read from
/proc: before that, Python's own start-up handles signals as any program's does).
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import eqtrain.checkpoint
from eqtrain._fit import _signals

from .test_cli import write_tiny_config


EQTRAIN = [sys.executable, "-m", "eqtrain.cli"]
BAD = ("Traceback", "Exception ignored", "Segmentation", "Fatal Python error")


def _config(root: Path, steps: int) -> Path:
    """test_cli's tiny run, `steps` long on a constant schedule (a resumed run
    equals an uninterrupted one), a checkpoint every 4 steps."""
    root.mkdir(parents=True, exist_ok=True)
    config = write_tiny_config(root)
    text = config.read_text()
    text = text.replace("steps = 6", f"steps = {steps}").replace(
        "every = 3", "every = 4"
    )
    text = text.replace("warmup_steps = 1", 'warmup_steps = 1\nschedule = "constant"')
    config.write_text(text)
    return config


def _mask(pid: int, field: str) -> int:
    """A signal mask of /proc/PID/status (0 once the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


def _handles_sigterm(pid: int) -> bool:
    """Whether the process has installed a SIGTERM handler (the signal guard)."""
    return bool(_mask(pid, "SigCgt") >> (signal.SIGTERM - 1) & 1)


def _delivered(pid: int, sig: int) -> None:
    """Wait until `sig` is no longer pending: a second identical signal sent
    before the first was delivered would merge with it (POSIX does not queue
    them), and the process would rightly see one."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not (_mask(pid, "SigPnd") | _mask(pid, "ShdPnd")) >> (sig - 1) & 1:
            return
        time.sleep(0.001)


def _send_pair(config: Path, offset: float, gap: float, first: int, second: int):
    """Start `eqtrain fit config`, wait for its handler, then send `first` after
    `offset` s and `second` `gap` s later. Returns (outcome, returncode, stderr):
    outcome "aborted" (both delivered to a live process), "stopped" (it ended
    between the two) or "finished" (it ended before the first)."""
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.Popen(
        [*EQTRAIN, "fit", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 60
        while not _handles_sigterm(proc.pid):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(f"ended early: {proc.communicate()}")
            time.sleep(0.005)
        time.sleep(offset)
        outcome = "finished"
        if proc.poll() is None:
            proc.send_signal(first)
            _delivered(proc.pid, first)
            time.sleep(gap)
            outcome = "stopped"
            if proc.poll() is None:
                proc.send_signal(second)
                outcome = "aborted"
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    return outcome, proc.returncode, out, err


def _duration(config: Path) -> float:
    """Seconds from the process's SIGTERM handler to its exit, unsignalled."""
    proc = subprocess.Popen(
        [*EQTRAIN, "fit", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while not _handles_sigterm(proc.pid):
            assert proc.poll() is None
            time.sleep(0.005)
        start = time.monotonic()
        assert proc.wait(timeout=300) == 0
    finally:
        proc.kill()
    return time.monotonic() - start


def _check(outcome, code, out, err, second):
    for bad in BAD:
        assert bad not in err, err
    if code < 0:
        # Python's finalization puts the default handlers back: a signal that
        # lands there, after the run reported its end, ends the process by it
        assert -code in (signal.SIGINT, signal.SIGTERM), (code, err)
        assert "stopped: " in out, (code, out, err)
        return
    if outcome == "aborted":
        # never ignored: the second signal always ends the process, at once
        assert code == 128 + second, (code, err)
        assert f"aborted by a second signal ({signal.Signals(second).name})" in err
    else:
        assert code == 0, (code, err)


def _resumes(config: Path) -> None:
    """The aborted run reads back and trains on, two steps past its last
    checkpoint (or from scratch when it had none)."""
    run_dir = config.parent / "run"
    saved = eqtrain.checkpoint.list_steps(run_dir) if run_dir.exists() else []
    steps = f"loop.steps={max(saved, default=0) + 2}"
    done = subprocess.run(
        [*EQTRAIN, "fit", str(config), "--set", steps],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "stopped: max_steps" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize(
    "offset, first, second",
    [
        pytest.param(  # loading the config and data
            0.0, signal.SIGTERM, signal.SIGTERM, marks=pytest.mark.slow
        ),
        (1.0, signal.SIGINT, signal.SIGINT),  # compiling or training
    ],
)
def test_a_second_signal_aborts_cleanly(tmp_path, offset, first, second):
    config = _config(tmp_path, steps=200)
    outcome, code, out, err = _send_pair(config, offset, 0.05, first, second)
    assert outcome == "aborted"
    _check(outcome, code, out, err, second)
    _resumes(config)  # nothing the abort left is in the way


@pytest.mark.slow
def test_signal_pairs_at_twenty_offsets(tmp_path):
    rng = random.Random(0)
    steps = 24
    span = _duration(_config(tmp_path / "probe", steps=steps))
    outcomes = []
    for i in range(20):
        offset = span * i / 19
        first, second = rng.choices([signal.SIGINT, signal.SIGTERM], k=2)
        gap = rng.choice([0.0, 0.01, 0.1, 0.3])
        config = _config(tmp_path / f"run{i}", steps=steps)
        outcome, code, out, err = _send_pair(config, offset, gap, first, second)
        _check(outcome, code, out, err, second)
        outcomes.append(outcome)
        if outcome != "finished" and i % 4 == 0:
            _resumes(config)
    assert outcomes.count("aborted") >= 15, outcomes


def test_the_guard_restores_what_it_replaced():
    def mine(signum, frame):
        pass

    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, mine)
    try:
        previous_fd = signal.set_wakeup_fd(-1)
        with _signals.guarded() as guard:
            assert guard is not None and _signals.active() is guard
            with _signals.guarded() as inner:  # nested: the same guard
                assert inner is guard
            assert signal.getsignal(signal.SIGTERM) is not mine
        assert _signals.active() is None
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.set_wakeup_fd(previous_fd) == -1
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_first_signal_is_recorded_by_the_watchdog():
    with _signals.guarded() as guard:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler does nothing itself
        deadline = time.monotonic() + 10
        while guard.received is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert guard.received == signal.SIGTERM


def test_the_first_signal_prints_nothing_from_the_handler(capfd):
    """Printing from a signal's path can re-enter the stream it interrupted (a
    second Ctrl-C during compilation crashed so): the handler prints nothing,
    and outside `fit` (no `first_note`) neither does the watchdog."""
    with _signals.guarded() as guard:
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 10
        while guard.received is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert guard.received == signal.SIGINT
        time.sleep(0.1)  # anything the watchdog would write, it has written
    assert capfd.readouterr() == ("", "")


def test_fit_says_the_first_signal_at_once_not_after_a_long_step(capfd):
    """Issue 52: a GRPO step can run for seconds, and `fit`'s notice came only
    when it ended. Inside `fit` (its `Stopper`), the watchdog says it the
    moment the signal comes, with `os.write` (no Python stream, which the
    signal may have interrupted), once; the loop then stops as before."""
    from eqtrain._fit._stops import StopConditions, StopKind, Stopper

    with Stopper(StopConditions(), num_steps=10) as stopper:
        stopper.check(3)  # three steps done; the fourth is running
        os.kill(os.getpid(), signal.SIGINT)
        deadline = time.monotonic() + 1.0  # within a second
        while "received" not in capfd.readouterr().err:
            assert time.monotonic() < deadline, "no notice within a second"
            time.sleep(0.01)
        reason = stopper.check(4)
    assert (reason.kind, reason.step, reason.message) == (StopKind.SIGNAL, 4, "SIGINT")
    assert capfd.readouterr().err == ""  # said once
