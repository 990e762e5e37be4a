"""Multi-process runs for real: two processes on 127.0.0.1 (gloo CPU collectives)
equal one process with two devices bit for bit, and a SIGTERM to one process stops
both at the same step with one checkpoint. Plus the cluster discovery rules."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eqtrain import ConfigError
from eqtrain.distributed import Cluster, agree, discover, first_host


WORKER = Path(__file__).parent / "dist_worker.py"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices, **extra):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    for key in ("EQTRAIN_COORDINATOR", "EQTRAIN_NUM_PROCESSES", "EQTRAIN_PROCESS_ID"):
        env.pop(key, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _start_pair(run_dir, *args, argv=None, each=({}, {})):
    """Two processes of one run (`dist_worker.py`, or `argv`), one device each;
    `each`: more variables for process 0 and process 1."""
    port = _free_port()
    argv = argv or [sys.executable, str(WORKER), "--run-dir", str(run_dir), *args]
    procs = [
        subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(
                1,
                EQTRAIN_COORDINATOR=f"127.0.0.1:{port}",
                EQTRAIN_NUM_PROCESSES=2,
                EQTRAIN_PROCESS_ID=i,
                **each[i],
            ),
        )
        for i in range(2)
    ]
    return procs, port


def _result(out):
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _finish(procs, timeout=240):
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-3000:]
            outs.append(_result(out))
    finally:
        for p in procs:
            p.kill()
    return outs


@pytest.mark.tuned  # re-run under each CPU setting (test_tuned_settings.py)
def test_two_processes_equal_one_process_with_two_devices(tmp_path):
    single = subprocess.run(
        [sys.executable, str(WORKER), "--single", "--run-dir", str(tmp_path / "one")],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(2),
    )
    assert single.returncode == 0, single.stderr[-3000:]
    expected = _result(single.stdout)["losses"]
    procs, _ = _start_pair(tmp_path / "two")
    results = _finish(procs)
    for r in results:
        assert r["losses"] == expected  # bit for bit
        assert r["stop"] == "max_steps"
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["12"]


LOOPBACK = ("0100007F", "0000000000000000FFFF00000100007F")  # v4, v4-mapped v6


def _listens_on_loopback_only(port):
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if Path(table).exists():
            rows += Path(table).read_text().splitlines()[1:]
    local = [r.split()[1] for r in rows if r.split()[3] == "0A"]  # LISTEN
    ours = [a for a in local if int(a.split(":")[1], 16) == port]
    return bool(ours) and all(a.split(":")[0] in LOOPBACK for a in ours)


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path):
    procs, port = _start_pair(tmp_path / "run", "--steps", "100000")
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "run" / "checkpoints").exists():
            assert all(p.poll() is None for p in procs), procs[0].communicate()
            assert time.monotonic() < deadline
            time.sleep(0.2)
        time.sleep(2.0)  # some steps
        if Path("/proc/net/tcp").exists():
            assert _listens_on_loopback_only(port)  # not on every interface
        procs[1].send_signal(signal.SIGTERM)
        results = _finish(procs)
    finally:
        for p in procs:
            p.kill()
    assert [r["stop"] for r in results] == ["signal", "signal"]
    stop = results[0]["stop_step"]
    assert results[1]["stop_step"] == stop and stop % 2 == 0  # agreed every 2 steps
    assert results[0]["losses"] == results[1]["losses"]
    assert os.listdir(tmp_path / "run" / "checkpoints") == [str(stop)]
    # Both processes resume from it together.
    procs, _ = _start_pair(tmp_path / "run", "--steps", str(stop + 2))
    resumed = _finish(procs)
    assert [r["resumed"] for r in resumed] == [stop, stop]
    assert [r["stop"] for r in resumed] == ["max_steps", "max_steps"]
    assert (
        resumed[0]["losses"] == resumed[1]["losses"] and len(resumed[0]["losses"]) == 2
    )


# -- discovery ----------------------------------------------------------------------
def test_discover_sources():
    assert discover(env={}) == Cluster(None, 1, 0, "single")
    assert discover("h:1", 2, 1, env={}) == Cluster("h:1", 2, 1, "arguments")
    env = {
        "EQTRAIN_COORDINATOR": "10.0.0.1:9000",
        "EQTRAIN_NUM_PROCESSES": "4",
        "EQTRAIN_PROCESS_ID": "3",
    }
    assert discover(env=env) == Cluster("10.0.0.1:9000", 4, 3, "environment")
    slurm = {
        "SLURM_NTASKS": "8",
        "SLURM_PROCID": "5",
        "SLURM_STEP_NODELIST": "gpu[07-08,12],cpu1",
        "EQTRAIN_COORDINATOR_PORT": "4444",
    }
    assert discover(env=slurm) == Cluster("gpu07:4444", 8, 5, "slurm")
    assert first_host("solo") == "solo"


@pytest.mark.parametrize(
    "env, match",
    [
        ({"EQTRAIN_NUM_PROCESSES": "2", "EQTRAIN_PROCESS_ID": "0"}, "host:port"),
        ({"EQTRAIN_COORDINATOR": "h:1", "EQTRAIN_NUM_PROCESSES": "2"}, "id"),
        (
            {
                "EQTRAIN_COORDINATOR": "h:1",
                "EQTRAIN_NUM_PROCESSES": "2",
                "EQTRAIN_PROCESS_ID": "2",
            },
            r"\[0, num_processes\)",
        ),
        ({"EQTRAIN_COORDINATOR": "h:1", "EQTRAIN_NUM_PROCESSES": "two"}, "integer"),
        ({"SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, "node list"),
    ],
)
def test_discover_errors(env, match):
    with pytest.raises(ConfigError, match=match):
        discover(env=env)


def test_agree_single_process_is_identity():
    assert agree([3, 0]).tolist() == [3, 0]


def test_processes_with_different_cpu_settings_are_refused(tmp_path):
    """Issue 51: processes equal devices bit for bit only under one CPU
    setting. Each process of a multi-process `eqtrain fit` says its setting;
    processes whose settings differ (here named two ways) are refused, every
    one of them, naming the setting to give them all."""
    argv = [sys.executable, "-m", "eqtrain.cli", "fit", "--dry-run"]
    argv += ["--set", f"run_dir={tmp_path / 'run'}", "--set", "distributed.processes=2"]
    settings = ["eigen_dots", "xla_default,scanned"]
    each = [{"EQTRAIN_CPU_TUNING": s} for s in settings]
    procs, _ = _start_pair(tmp_path / "run", argv=argv, each=each)
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 2, err[-3000:]
        assert f"process {i}: CPU settings" in err and "Traceback" not in err
        assert "apply different CPU settings" in err, err[-3000:]
        spec = ["eigen_dots,unrolled", "xla_default,scanned"][i]
        assert f"EQTRAIN_CPU_TUNING={spec}" in err
