"""`eqtrain.ray`: the launch plan, restart policy, signal forwarding and refusals
without Ray, and for real on a local Ray bound to 127.0.0.1: in the default suite,
one short run whose SIGKILLed worker restarts the group (resuming bit for bit) and
whose driver passes a SIGTERM on to the workers; under `slow`, two workers equal
one process with two devices bit for bit, a group restarted twice exports what an
uninterrupted run exports, and a worker that always fails ends the run after
`max_restarts`."""

import fcntl
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import eqtrain
from eqtrain import ConfigError, config as config_lib
from eqtrain.cli import app
from eqtrain.ray import (
    Exit,
    check_launchable,
    decide,
    plan,
    restart_delay,
    worker_args,
    worker_env,
)


TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 60


def _load(*overrides):
    return config_lib.load(overrides=list(overrides))


# -- the plan, without Ray --------------------------------------------------------
def test_distributed_keys_reach_the_plan():
    p = plan(
        _load(
            "distributed.processes=4",
            "distributed.resources_per_worker=cpu=8, gpu=1, pool=0.5",
            "distributed.placement=strict_spread",
            "distributed.ray_address=ray://head:10001",
            "distributed.max_restarts=7",
            "distributed.restart_delay=1m",
        )
    )
    assert p.processes == 4
    assert p.bundles == [{"CPU": 8.0, "GPU": 1.0, "pool": 0.5}] * 4
    assert p.strategy == "STRICT_SPREAD"
    assert p.address == "ray://head:10001"
    assert (p.max_restarts, p.restart_delay) == (7, 60.0)
    default = plan(_load())
    assert (default.processes, default.bundle, default.strategy) == (
        1,
        {"CPU": 1.0},
        "PACK",
    )
    assert default.address is None


@pytest.mark.parametrize(
    "override, match",
    [
        ("distributed.processes=0", "must be >= 1"),
        ("distributed.resources_per_worker=GPU", "NAME=AMOUNT"),
        ("distributed.resources_per_worker=GPU=-1", "NAME=AMOUNT"),
        ("distributed.resources_per_worker=CPU=0", "ask for some resource"),
        ("distributed.resources_per_worker=GPU=1,gpu=2", "names GPU twice"),
        ("distributed.placement=spread_strict", "Did you mean `spread`"),
        ("distributed.max_restarts=-1", "must be >= 0"),
        ("distributed.restart_delay=2h30", "has no unit"),
        ("distributed.procesess=2", "Did you mean `processes`"),
    ],
)
def test_bad_distributed_values_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        _load(override)


def test_what_a_launched_run_cannot_do_is_refused():
    dpo = config_lib.apply_overrides(  # checked by the launcher, not validate()
        config_lib.Config(),
        [
            "task.kind=dpo",
            "task.reference=precomputed",
            "distributed.processes=2",
        ],
    )
    with pytest.raises(ConfigError, match="precomputed.*distributed.processes = 2"):
        check_launchable(dpo)
    periodic = _load("export.hf=hf", "export.every=10")
    with pytest.raises(ConfigError, match="export.every = 10 is not supported"):
        check_launchable(periodic)


def test_restart_delay_doubles_up_to_a_cap():
    assert [restart_delay(k, 2.0) for k in (1, 2, 3, 4)] == [2.0, 4.0, 8.0, 16.0]
    assert restart_delay(30, 2.0) == 300.0
    assert restart_delay(5, 0.0) == 0.0


def _exit(worker, code, **kwargs):
    return Exit(worker, code, **kwargs)


@pytest.mark.parametrize(
    "exits, stopping, restarts, expected",
    [
        ([_exit(0, 0), _exit(1, 0)], False, 0, "done"),
        # a non-finite stop exits 1 but reports its stop reason: not a failure
        ([_exit(0, 1, reported=True), _exit(1, 1, reported=True)], False, 0, "done"),
        ([_exit(1, -9), _exit(0, 0)], False, 0, "restart"),
        ([_exit(1, None), _exit(0, 0)], False, 2, "restart"),
        ([_exit(1, -9)], False, 3, "fail"),  # max_restarts = 3 spent
        ([_exit(0, 2)], False, 0, "fail"),  # a config error: the same next time
        ([_exit(1, 1)], True, 0, "stopped"),  # a signal: never restarted
        ([_exit(0, 0, reported=True)], True, 0, "done"),  # a clean signal stop
    ],
)
def test_restart_policy(exits, stopping, restarts, expected):
    assert decide(exits, stopping=stopping, restarts=restarts, limit=3) == expected


def test_exit_names_the_worker_and_its_last_line():
    text = Exit(1, -9, last_line="step 7/20").describe()
    expected = "it was killed by signal SIGKILL; its last line: 'step 7/20'"
    assert text == f"worker 1 failed: {expected}"
    assert "Ray actor died" in Exit(0, None).describe()


def test_worker_arguments_and_environment():
    first = worker_args(resume="never", overwrite=True, restart=False)
    assert first == ["--no-export", "--resume", "never", "--overwrite"]
    assert worker_args(resume=None, overwrite=False, restart=False) == ["--no-export"]
    # a restart continues from the last checkpoint and never discards any
    again = worker_args(resume="never", overwrite=True, restart=True)
    assert again == ["--resume", "auto", "--no-export"]
    base = {"PATH": "/bin", "EQTRAIN_PROCESS_ID": "5"}
    env = worker_env(base, {"XLA_FLAGS": "x"}, coordinator="h:1", processes=2, index=1)
    assert env["EQTRAIN_COORDINATOR"] == "h:1"
    assert (env["EQTRAIN_NUM_PROCESSES"], env["EQTRAIN_PROCESS_ID"]) == ("2", "1")
    assert (env["XLA_FLAGS"], env["PATH"]) == ("x", "/bin")
    single = worker_env(base, None, coordinator="h:1", processes=1, index=0)
    assert not any(k.startswith("EQTRAIN_") for k in single)


def test_unreachable_or_malformed_ray_address(monkeypatch):
    from eqtrain.ray._connect import _join

    class NoInit:  # the address is checked before Ray is asked
        def init(self, **kwargs):
            raise AssertionError("ray.init must not be reached")

    with pytest.raises(ConfigError, match="cannot reach the Ray cluster"):
        _join(NoInit(), "127.0.0.1:1")
    with pytest.raises(ConfigError, match="must be `auto`, `HOST:PORT`"):
        _load("distributed.ray_address=headnode")
    with pytest.raises(ConfigError, match="must be `auto`, `HOST:PORT`"):
        _load("distributed.ray_address=ray://head:port")


def test_local_ray_that_lacks_the_resources(monkeypatch):
    from eqtrain.ray._connect import _check_fits

    class Ray:
        def cluster_resources(self):
            return {"CPU": 2.0}

    gpus = plan(
        _load("distributed.processes=2", "distributed.resources_per_worker=GPU=1")
    )
    with pytest.raises(ConfigError, match="cannot place 2 workers with GPU=1.*GPU=0"):
        _check_fits(Ray(), gpus, local=True)
    spread = plan(
        _load("distributed.processes=2", "distributed.placement=strict_spread")
    )
    with pytest.raises(ConfigError, match="one node per worker"):
        _check_fits(Ray(), spread, local=True)
    _check_fits(Ray(), gpus, local=False)  # a cluster may grow: it waits


# -- signals, without Ray: the supervisor's loop with stand-in actors -------------
class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _FakeActor:
    """A worker that saves and stops on SIGTERM (or, `stubborn`, never does: a
    second signal must then kill it); `poll` answers as the real actor does."""

    def __init__(self, stubborn=False, on_first_poll_after_signal=None):
        self.sent, self.killed, self.stubborn = [], False, stubborn
        self.after_signal = on_first_poll_after_signal
        self.send = _Remote(self.sent.append)
        self.kill = _Remote(lambda: setattr(self, "killed", True))
        self.poll = _Remote(self._poll)

    def _poll(self):
        self.polls = getattr(self, "polls", 0) + 1
        assert self.polls < 50, "after 10 s, no signal has reached this worker"
        if self.killed:
            return [], -signal.SIGKILL, None
        if self.sent and self.after_signal is not None:
            self.after_signal(), setattr(self, "after_signal", None)
        if self.sent and not self.stubborn:
            return ["stopped by SIGTERM"], 0, {"stop": "signal"}
        return [], None, None


class _FakeRay:
    class exceptions:  # noqa: N801 (as `ray.exceptions`)
        GetTimeoutError = RayError = type("NeverRaised", (Exception,), {})

    def get(self, ref, timeout=None):
        return ref


def _watch(actors, first_signal):
    from eqtrain.ray._signals import Signals
    from eqtrain.ray._supervisor import Group, Supervisor

    notes, config = [], _load("distributed.processes=2")
    before = signal.getsignal(first_signal)
    with Signals(notes.append) as signals:
        supervisor = Supervisor(
            _FakeRay(), plan(config), config, notes.append, {}, signals
        )
        os.kill(os.getpid(), first_signal)  # to the driver: this process
        exits = supervisor._watch(Group(None, actors))
    assert signal.getsignal(first_signal) is before  # handlers restored
    return exits, notes


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_the_driver_passes_sigint_and_sigterm_on_to_every_worker(signum):
    actors = [_FakeActor(), _FakeActor()]
    exits, notes = _watch(actors, signum)
    assert [a.sent for a in actors] == [[signal.SIGTERM]] * 2  # a clean stop
    assert not any(a.killed for a in actors)
    assert sorted(e.worker for e in exits) == [0, 1] and all(e.clean for e in exits)
    name = signal.Signals(signum).name
    assert notes[0].startswith(f"[ray] {name} received: asking every worker")


def test_a_second_signal_aborts_the_workers():
    again = lambda: os.kill(os.getpid(), signal.SIGINT)  # noqa: E731
    actors = [_FakeActor(stubborn=True, on_first_poll_after_signal=again)]
    actors.append(_FakeActor(stubborn=True))
    exits, notes = _watch(actors, signal.SIGTERM)
    assert all(a.killed for a in actors)
    assert [a.sent for a in actors] == [[signal.SIGTERM]] * 2  # once, then killed
    assert any("SIGINT received again: aborting the workers" in n for n in notes)
    assert all(e.code == -signal.SIGKILL for e in exits)


# -- the CLI, without Ray ---------------------------------------------------------
def _one_paragraph(result):
    assert result.exit_code == 2, result.output
    text = result.stderr if hasattr(result, "stderr") else result.output
    assert text.startswith("error: ") and "Traceback" not in text
    return text


def test_without_ray_the_launcher_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails
    result = CliRunner().invoke(app, ["fit", "--launcher", "ray"])
    text = _one_paragraph(result)
    assert "install eqtrain's `ray` extra (`pip install 'eqtrain[ray]'`)" in text
    assert text.count(". ") == 0  # one sentence


def test_cli_launcher_refusals():
    runner = CliRunner()
    text = _one_paragraph(runner.invoke(app, ["fit", "--launcher", "slurm"]))
    assert "--launcher must be `ray`" in text
    result = runner.invoke(app, ["fit", "--set", "distributed.processes=2"])
    assert "needs a launcher" in _one_paragraph(result)


# -- for real, on a local Ray -----------------------------------------------------
ONE_DEVICE = {
    "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
    "JAX_PLATFORMS": "cpu",
}
STEP = re.compile(r"^\[w0\] step (\d+)/")
LOSS = re.compile(r"\| loss (\S+) \|")
PIDS = re.compile(r"worker (\d+): pid (\d+)")


@pytest.fixture(scope="module")
def ray_home(tmp_path_factory):
    """A local Ray on 127.0.0.1 for this module (HOME in a temporary directory:
    Ray writes ~/.ray); always shut down, leaving no Ray process behind."""
    if importlib.util.find_spec("ray") is None:  # a failure in CI (conftest.py)
        pytest.skip("needs the `ray` extra")
    # One local Ray at a time on this machine: the tuned runs
    # (test_tuned_settings.py) start this module in a pytest process of their
    # own, and two Rays starting together timed out waiting for their GCS.
    with open(Path(tempfile.gettempdir()) / "eqtrain-tests-ray.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield from _local_ray(tmp_path_factory)


def _local_ray(tmp_path_factory):
    home = tmp_path_factory.mktemp("home")
    saved = {k: os.environ.get(k) for k in ("HOME", "RAY_USAGE_STATS_ENABLED")}
    os.environ["HOME"] = str(home)
    from eqtrain.ray import import_ray

    # Not `importorskip`: Ray must be imported after the variables that keep it
    # on loopback are set, which `import_ray` does.
    ray = import_ray()
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
        num_cpus=4,
    )
    try:
        yield home
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        assert not _processes_with_home(home), "Ray left processes behind"


def _processes_with_home(home):
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"HOME={home}".encode() in environ:
            out.append(int(entry.name))
    return out


LOOPBACK = ("0100007F", "0000000000000000FFFF00000100007F")  # v4, v4-mapped v6


def _non_loopback_listeners(pids):
    """The TCP sockets `pids` listen on other than 127.0.0.1, with their owners."""
    owners = {}
    for pid in pids:
        try:
            name = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:4]
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    owners[target[8:-1]] = f"{pid} {b' '.join(name).decode()}"
        except OSError:
            continue
    bad = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            address, state, inode = cols[1], cols[3], cols[9]
            if state == "0A" and inode in owners:
                if address.split(":")[0] not in LOOPBACK:
                    bad.append((address, owners[inode]))
    return bad


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    for i in range(3):
        (root / f"{i}.txt").write_text(TEXT * (i + 1))
    return root


def _overrides(text_dir, run_dir, *extra):
    return [
        f"run_dir={run_dir}",
        f"data.train={text_dir}",
        "data.eval=",
        "model.hidden_size=32",
        "model.num_layers=1",
        "data.seq_len=16",
        "data.batch_size=8",
        "loop.steps=12",
        "loop.eval_every=0",
        "loop.eval_at_end=false",
        "checkpoint.every=4",
        "checkpoint.keep_last=2",  # pruning in a multi-process run, too
        "log.progress=lines",
        "optim.schedule=constant",
        "export.hf=hf",
        *extra,
    ]


def _launch(text_dir, run_dir, *extra, echo=None, env=None):
    import eqtrain.ray

    lines = []

    def collect(line):
        lines.append(line)
        if echo is not None:
            echo(line)

    config = config_lib.load(
        overrides=_overrides(text_dir, run_dir, "distributed.processes=2", *extra)
    )
    result = eqtrain.ray.fit(config, echo=collect, env={**ONE_DEVICE, **(env or {})})
    return result, lines


def _losses(run_dir):
    import json

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(ray_home, text_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("ray") / "run"
    listeners = []

    def check_ports(line):  # once, mid-run: Ray's and the coordinator's sockets
        if STEP.match(line) and not listeners:
            listeners.append(_non_loopback_listeners(_processes_with_home(ray_home)))

    result, lines = _launch(text_dir, run_dir, echo=check_ports)
    return run_dir, result, lines, listeners


def test_killed_worker_restarts_the_group_and_a_sigterm_reaches_the_workers(
    ray_home, text_dir, tmp_path
):
    """The default suite's real Ray run (the smallest that shows both): worker
    1's `eqtrain fit` SIGKILLed at step 3, the group restarts (from checkpoint 2
    when it was committed) and repeats the steps after it with the same losses;
    then a SIGTERM to the driver is passed on to both workers, which save and stop
    together, cleanly."""
    pids, kills, signals, resumed = {}, [], [], []
    deadline = time.monotonic() + 300

    def act(line):
        assert time.monotonic() < deadline, "the Ray run took over 300 s"
        for worker, pid in PIDS.findall(line):
            pids[int(worker)] = int(pid)
            # the group restarted (from checkpoint 2, or from scratch when the
            # kill came before that save was committed)
            resumed.extend(["yes"] if kills and int(pid) not in kills else [])
        step = STEP.match(line)
        if step is None:
            return
        if int(step.group(1)) >= 3 and not kills:
            os.kill(pids[1], signal.SIGKILL)  # worker 1's training process
            kills.append(pids[1])
        elif int(step.group(1)) >= 4 and resumed and not signals:
            os.kill(os.getpid(), signal.SIGTERM)  # to the driver: this process
            signals.append(int(step.group(1)))

    run_dir = tmp_path / "run"
    result, lines = _launch(
        text_dir, run_dir, "loop.steps=40", "checkpoint.every=2", echo=act
    )
    assert kills and signals and result.restarts == 1, lines
    failures = [x for x in lines if x.startswith("[ray] worker")]
    assert "worker 1 failed: it was killed by signal SIGKILL" in failures[0]
    assert any("SIGTERM received: asking every worker" in x for x in lines)
    stop = result.stop_reason
    assert (str(stop.kind), stop.message) == ("signal", "SIGTERM"), stop
    assert signals[0] <= result.step < 40
    assert eqtrain.checkpoint.list_steps(run_dir)[-1] == result.step  # saved
    # steps the killed attempt printed and the restarted one printed again: the
    # same losses (to the printed digits; the slow test compares exports bit for
    # bit); metrics.jsonl holds each step once, the restarted attempt's
    seen = {}
    for line in lines:
        step, loss = STEP.match(line), LOSS.search(line)
        if step is not None and loss is not None:
            seen.setdefault(int(step.group(1)), []).append(loss.group(1))
    repeated = {k: v for k, v in seen.items() if len(v) > 1}
    assert repeated and all(len(set(v)) == 1 for v in repeated.values()), seen
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, result.step + 1))
    assert all(
        f"{r['loss']:.4f}" == seen[r["step"]][-1] for r in rows if r["step"] in seen
    )


@pytest.mark.slow
@pytest.mark.tuned  # re-run under each CPU setting (test_tuned_settings.py)
def test_two_ray_workers_equal_one_process_with_two_devices(
    uninterrupted, text_dir, tmp_path
):
    run_dir, result, lines, listeners = uninterrupted
    assert listeners == [[]]  # everything Ray and the workers opened: 127.0.0.1
    assert (str(result.stop_reason.kind), result.step) == ("max_steps", 12)
    assert result.restarts == 0 and result.export_dir == run_dir / "hf"
    assert any("coordinator 127.0.0.1:" in line for line in lines)
    single = tmp_path / "single"
    cmd = [sys.executable, "-m", "eqtrain.cli", "fit"]
    cmd += [f"--set={o}" for o in _overrides(text_dir, single)]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _losses(run_dir) == _losses(single)  # bit for bit
    assert len(_losses(run_dir)) == 12
    ours = (run_dir / "hf" / "model.safetensors").read_bytes()
    assert ours == (single / "hf" / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_killed_worker_restarts_the_group_and_the_export_is_identical(
    uninterrupted, text_dir, tmp_path
):
    """Worker 1's `eqtrain fit` SIGKILLed at step 6 (the actors stay: the group
    restarts in them), then worker 0's Ray actor SIGKILLed at step 10 (its process
    dies with it: the group is placed anew); the export equals the uninterrupted
    run's byte for byte."""
    pids, kills = {}, []

    def kill(line):
        for worker, pid in PIDS.findall(line):
            pids[int(worker)] = int(pid)
        step = STEP.match(line)
        if step is None:
            return
        if int(step.group(1)) >= 6 and not kills:
            os.kill(pids[1], signal.SIGKILL)  # worker 1's training process
            kills.append(pids[1])
        elif int(step.group(1)) >= 10 and len(kills) == 1 and pids[1] != kills[0]:
            actor = int(Path(f"/proc/{pids[0]}/stat").read_text().split()[3])
            os.kill(actor, signal.SIGKILL)  # worker 0's actor (its parent)
            kills.append(actor)

    run_dir = tmp_path / "run"
    result, lines = _launch(text_dir, run_dir, echo=kill)
    assert len(kills) == 2
    assert result.restarts == 2
    assert (str(result.stop_reason.kind), result.step) == ("max_steps", 12)
    failures = [x for x in lines if x.startswith("[ray] worker")]
    assert "worker 1 failed: it was killed by signal SIGKILL" in failures[0]
    assert "worker 0 failed: its Ray actor or node died" in failures[1]
    assert sum("resumed from" in x for x in lines) >= 2
    expected = (uninterrupted[0] / "hf" / "model.safetensors").read_bytes()
    assert (run_dir / "hf" / "model.safetensors").read_bytes() == expected
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["12", "8"]  # pruned


@pytest.mark.slow
def test_a_worker_that_always_fails_ends_the_run(ray_home, text_dir, tmp_path):
    from eqtrain.ray import LaunchError

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('EQTRAIN_PROCESS_ID') == '1':\n"
        "    print('worker one cannot start', flush=True)\n"
        "    os._exit(3)\n"
    )
    extra = ("distributed.max_restarts=1", "distributed.restart_delay=0")
    with pytest.raises(LaunchError) as info:
        _launch(text_dir, tmp_path / "run", *extra, env={"PYTHONPATH": str(site)})
    message = str(info.value)
    assert "worker 1 failed: it exited with code 3" in message
    assert "its last line: 'worker one cannot start'" in message
    assert "after 1 restart(s) (distributed.max_restarts = 1)" in message


def test_a_store_prepared_by_ray_tasks_is_byte_identical(ray_home, tmp_path):
    """`eqtrain data prepare --launcher ray` runs each piece as a Ray task; the
    parts and ledger are those of a local prepare, byte for byte."""
    from eqtrain.data import ByteTokenizer, prepare

    source = tmp_path / "c.jsonl"
    source.write_text(
        "".join(
            json.dumps({"text": f"{TEXT} {i}" * (i % 7 + 1)}) + "\n" for i in range(200)
        )
    )
    stores = {
        executor: prepare(
            source,
            ByteTokenizer(),
            cache_dir=tmp_path / executor,
            piece_bytes=4000,
            executor=executor,
        )
        for executor in ("inline", "ray")
    }
    assert stores["ray"].num_parts > 3

    def files(store):
        root = store.directory
        return {
            p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock"
        }

    assert files(stores["ray"]) == files(stores["inline"])


@pytest.mark.slow
def test_grpo_ray_workers_train_what_two_devices_train(ray_home, tmp_path):
    """GRPO under the Ray launcher: tests/test_grpo_processes.py's run, as two
    workers with one device each."""
    import eqtrain.ray

    from .test_grpo_processes import _equal_steps, _settings, _steps, _two_devices

    one, _, extra = _two_devices(tmp_path)
    settings = _settings(tmp_path, "two") + ["distributed.processes=2"]
    config = config_lib.load(overrides=settings)
    result = eqtrain.ray.fit(config, echo=lambda _: None, env={**ONE_DEVICE, **extra})
    assert result.restarts == 0
    _equal_steps(one, _steps(tmp_path, "two"))
    calls = (tmp_path / "calls.jsonl").read_text().splitlines()
    pids = {json.loads(x)["pid"] for x in calls}
    assert len(pids) == 2  # each worker scored its device's rows
