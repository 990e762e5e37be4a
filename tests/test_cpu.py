"""`eqtrain.cpu.tune_cpu`: the CPU settings the CLI applies to itself, chosen by
measurement once per processor and cached; and the hint."""

import dataclasses
import datetime
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import eqtrain
from eqtrain.cpu import _onednn, _tune as _cpu, _tuning as _cpu_tuning


# What the fake probe reports per candidate: Eigen's products fastest, unrolled.
TIMES = {
    "eigen_dots": {"scanned_ms": 50.0, "unrolled_ms": 40.0},
    "xla_default": {"scanned_ms": 70.0, "unrolled_ms": 60.0},
    "eigen_dots_512": {"scanned_ms": 55.0, "unrolled_ms": 45.0},
    "onednn_dots": {"scanned_ms": 52.0, "unrolled_ms": 42.0},
}


class FakeProbe:
    """`_cpu_tuning.probe` without processes: `times` by flag set, counted."""

    def __init__(self, times=TIMES):
        self.times, self.calls = times, []

    def __call__(self, flags, threads=None):
        name = next(n for n, f in _cpu_tuning.CANDIDATES.items() if f == flags)
        name = f"{name} on {threads} threads" if threads else name
        self.calls.append(name)
        return dict(self.times[name])

    def close(self):
        pass


def _reset(monkeypatch):
    monkeypatch.setattr(_onednn, "_active", {})  # what tune_cpu activates
    monkeypatch.setattr(
        _cpu,
        "_state",
        {"allocator": False, "arena": False, "choice": None},
    )


@pytest.fixture
def probe(monkeypatch, tmp_path):
    """A fresh process state, a cache directory of its own and a fake probe."""
    _reset(monkeypatch)
    monkeypatch.setattr(_cpu, "_backends_started", lambda: False)
    for name in (*_cpu.ALLOCATOR_ENV, _cpu.ARENA_ENV, _cpu.OPT_OUT):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("EQTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    fake = FakeProbe()
    monkeypatch.setattr(_cpu_tuning, "probe", lambda: fake)
    monkeypatch.setattr(_cpu_tuning, "thread_counts", lambda environ=None: [])
    return fake


@pytest.fixture
def fresh(probe):
    """A process state in which nothing was applied or hinted yet."""
    return probe


def test_applies_both_settings_once(fresh):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert eqtrain.cpu.tune_cpu(env) == ["allocator", "arena", "xla_flags"]
    assert env["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=8",
        "--xla_cpu_experimental_ynn_fusion_type=",
    ]
    assert _cpu.allocator_tuned(env)
    assert eqtrain.cpu.tune_cpu(env) == []  # idempotent: nothing twice
    assert env["XLA_FLAGS"].count("ynn_fusion_type") == 1


def test_user_choices_stand(fresh, monkeypatch):
    env = {
        "MALLOC_TRIM_THRESHOLD_": "1000",
        "MALLOC_ARENA_MAX": "4",
        "XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=individual_dot",
    }
    before = dict(env)
    assert eqtrain.cpu.tune_cpu(env) == []
    assert env == before
    _reset(monkeypatch)  # each allocator setting stands on its own
    assert eqtrain.cpu.tune_cpu({"MALLOC_ARENA_MAX": "4"}) == ["allocator", "xla_flags"]
    _reset(monkeypatch)
    assert eqtrain.cpu.tune_cpu({"MALLOC_MMAP_THRESHOLD_": "1"}) == [
        "arena",
        "xla_flags",
    ]


def test_opt_out_and_started_backend(fresh, monkeypatch):
    env = {_cpu.OPT_OUT: "0"}
    assert eqtrain.cpu.tune_cpu(env) == [] and env == {_cpu.OPT_OUT: "0"}
    monkeypatch.setattr(_cpu, "_backends_started", lambda: True)
    env = {}
    assert eqtrain.cpu.tune_cpu(env) == ["allocator", "arena"]  # too late for XLA_FLAGS
    assert "XLA_FLAGS" not in env


def test_the_cli_tunes_its_process_before_jax_starts():
    """`eqtrain` (the console entry point) applies the settings, and JAX then runs
    with the flag (an unknown or malformed flag would abort the backend)."""
    code = (
        "import os, sys\n"
        "sys.argv = ['eqtrain', '--help']\n"
        "import eqtrain.cli, eqtrain.cpu._tune as c\n"
        "try:\n"
        "    eqtrain.cli.main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "import jax.numpy as jnp\n"
        "print('FLAGS', os.environ['XLA_FLAGS'], c.allocator_tuned())\n"
        "print('SUM', float((jnp.ones((64, 64)) @ jnp.ones((64, 64))).sum()))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    env[_cpu.OPT_OUT] = "fixed"  # measuring: test_the_cli_measures_once_...
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines["FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type= True"
    assert lines["SUM"] == str(64.0**3)


_FAULTS = """
import resource
import eqtrain
eqtrain.cpu.tune_cpu(measure=False)
import jax, jax.numpy as jnp
x = jnp.ones((24576, 256))
w1, w2 = jnp.full((256, 1024), 1 / 1024), jnp.full((1024, 256), 1 / 256)
step = jax.jit(lambda x: jax.nn.relu(jax.nn.relu(x @ w1) @ w2) + x)
for _ in range(3):
    x = step(x).block_until_ready()
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = step(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults))
"""


def _faults_per_step(tuning: str) -> int:
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", _cpu.OPT_OUT: tuning}
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS], capture_output=True, text=True,
        env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(_cpu._glibc() is None, reason="glibc's mallopt only")
def test_a_steps_temporaries_stay_mapped_from_step_to_step():
    """The allocator settings keep a step's temporaries (here a 100 MB
    intermediate, more than a thread arena's 64 MB heap) in the heap: without
    them every step maps its buffers afresh and faults on each of their pages
    (~25,000 per intermediate); with them the pages are reused. The fewest
    faults of six steps: a step that happens to grow the heap (seen once in
    CI-like load: 12k faults, against 0 to 6k usually) says nothing about the
    steady state, while without the settings every step faults."""
    pages = 24576 * 1024 * 4 // 4096  # the intermediate's pages
    assert _faults_per_step("0") > pages
    assert _faults_per_step("fixed") < pages // 2


def test_scan_layers_auto_unrolls_on_the_cpu():
    """`model.scan_layers = "auto"` (the default) is unrolled on the CPU; true,
    false and "auto" parse from TOML and `--set`, anything else is refused."""
    from eqtrain import ConfigError, config, models

    section = config.load(None, []).model
    assert section.scan_layers == "auto"
    assert models.runtime_options(section)["scan_layers"] is False  # CPU backend
    for text, want in (("true", True), ("false", False), ("auto", "auto")):
        assert (
            config.load(None, [f"model.scan_layers={text}"]).model.scan_layers == want
        )
    with pytest.raises(ConfigError, match="scan_layers"):
        config.load(None, ["model.scan_layers=maybe"])


def _cache(tmp_path):
    return json.loads((tmp_path / "cache" / "cpu_tuning.json").read_text())


def test_measures_once_per_processor_then_reads_the_cache(probe, monkeypatch, tmp_path):
    said = []
    env = {"XLA_FLAGS": ""}
    applied = eqtrain.cpu.tune_cpu(env, say=said.append)
    assert applied == ["allocator", "arena", "xla_flags"]
    expected = set(_cpu_tuning.candidates(_cpu_tuning.processor()))
    assert set(probe.calls) == expected and len(said) == 1
    assert env["XLA_FLAGS"] == _cpu_tuning.CANDIDATES["eigen_dots"]
    assert "eigen_dots, unrolled layers (measured" in _cpu.cpu_settings()
    entry = _cache(tmp_path)["choices"][_cpu_tuning.cache_key()]
    assert entry["name"] == "eigen_dots" and entry["measured"]["xla_default"]
    # a new process on the same processor: the cache, no probe, no note
    _reset(monkeypatch)
    probe.calls.clear()
    env = {"XLA_FLAGS": ""}
    assert "xla_flags" in eqtrain.cpu.tune_cpu(env, say=said.append)
    assert probe.calls == [] and len(said) == 1
    assert env["XLA_FLAGS"] == _cpu_tuning.CANDIDATES["eigen_dots"]
    assert "(cached;" in _cpu.cpu_settings()


def test_the_fastest_candidate_wins_and_says_scanned_or_unrolled(probe, monkeypatch):
    from eqtrain import config, models
    from eqtrain.job import _resolve

    probe.times = {
        "eigen_dots": {"scanned_ms": 50.0, "unrolled_ms": 52.0},
        "xla_default": {"scanned_ms": 30.0, "unrolled_ms": 35.0},
        "eigen_dots_512": {"scanned_ms": 55.0, "unrolled_ms": 45.0},
        "onednn_dots": {"scanned_ms": 52.0, "unrolled_ms": 51.0},
    }
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    eqtrain.cpu.tune_cpu(env)
    # XLA's defaults: nothing added to the flags
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    assert _cpu.cpu_settings().startswith("xla_default, scanned layers")
    auto = config.load(None, [])  # scan_layers = "auto": the job resolves it
    assert _resolve.scan_layers(auto).model.scan_layers is True
    assert models.runtime_options(auto.model)["scan_layers"] is False  # the core
    _reset(monkeypatch)  # without a measured choice: unrolled on the CPU
    assert _resolve.scan_layers(auto).model.scan_layers is False


def test_the_cache_key_holds_processor_cores_versions_and_candidates(monkeypatch):
    cpu = {"cpu": "Some CPU", "family": "6", "model": "143", "isa": ["avx2", "fma"]}
    key = _cpu_tuning.cache_key(cpu, cores=8)
    assert "Some CPU" in key and "6/143" in key and "avx2+fma" in key
    assert "8 cores" in key and "candidates eigen_dots,xla_default " in key + " "
    others = [
        _cpu_tuning.cache_key({**cpu, "model": "85"}, cores=8),
        _cpu_tuning.cache_key({**cpu, "isa": ["avx2", "fma", "avx512f"]}, cores=8),
        _cpu_tuning.cache_key(cpu, cores=16),
    ]
    real = _cpu_tuning._version
    monkeypatch.setattr(
        _cpu_tuning, "_version", lambda n: "9.9" if n == "jax" else real(n)
    )
    others.append(_cpu_tuning.cache_key(cpu, cores=8))
    assert len({key, *others}) == 5


ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull crc32 atomics asimddp sve svebf16 i8mm bf16
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: {part}
CPU revision\t: 1
"""


LOCK_SCRIPT = """
import json, os, time
from pathlib import Path
from eqtrain.cpu import _tune as _cpu
calls, go, waiting = (Path(os.environ[n]) for n in ("CALLS", "GO", "WAITING"))

def run(flags):
    with open(calls, "a") as f:
        f.write(f"{os.getpid()}\\n")
    while not go.exists():  # measuring until the others are seen waiting
        time.sleep(0.05)
    return {"scanned_ms": 10.0, "unrolled_ms": 9.0}

def say(text):
    if "another process" in text:
        with open(waiting, "a") as f:
            f.write(f"{os.getpid()}\\n")

print(json.dumps({"source": _cpu.choose(run=run, say=say).source}))
"""


def _wait_for_lines(path, n, procs):
    deadline = time.monotonic() + 60
    while not (path.exists() and len(path.read_text().split()) >= n):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)


def test_processes_starting_together_measure_once(tmp_path):
    """Several `eqtrain fit` of one machine starting at once (a launch of
    several processes) do not all probe, each timing the others' load: one
    measures while holding the key's lock file, the others wait for it and
    read its choice."""
    names = {n: str(tmp_path / n.lower()) for n in ("CALLS", "GO", "WAITING")}
    env = {**os.environ, "EQTRAIN_CACHE_DIR": str(tmp_path / "cache"), **names}
    argv = [sys.executable, "-c", LOCK_SCRIPT]
    start = lambda: subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    first = start()
    _wait_for_lines(tmp_path / "calls", 1, [first])  # it holds the lock, measuring
    others = [start(), start()]
    _wait_for_lines(tmp_path / "waiting", 2, [first, *others])
    (tmp_path / "go").touch()
    outs = [json.loads(p.communicate(timeout=60)[0]) for p in [first, *others]]
    assert [p.returncode for p in [first, *others]] == [0, 0, 0]
    assert set((tmp_path / "calls").read_text().split()) == {str(first.pid)}
    assert [o["source"] for o in outs] == ["measured", "cached", "cached"]


def test_a_measurement_held_up_elsewhere_gives_the_default(probe, monkeypatch):
    """Waiting for another process's measurement is bounded: past
    `LOCK_WAIT_S` the default applies, nothing probed, nothing cached."""
    import fcntl

    monkeypatch.setattr(_cpu, "LOCK_WAIT_S", 0.3)
    path = _cpu_tuning.cache_path()
    path.parent.mkdir(parents=True)
    digest = hashlib.sha256(_cpu_tuning.cache_key().encode()).hexdigest()[:12]
    with open(path.parent / f"cpu_tuning-{digest}.lock", "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process, measuring
        said = []
        choice = _cpu.choose(say=said.append)
    assert choice.name == _cpu_tuning.FALLBACK and "still measuring" in choice.source
    assert probe.calls == [] and not path.exists() and len(said) == 1


def _cgroup_v2(tmp_path, cpu_max):
    """A cgroup v2 tree whose leaf holds `cpu_max`, and its /proc/self/cgroup."""
    leaf = tmp_path / "cg" / "kubepods" / "pod1"
    leaf.mkdir(parents=True)
    (leaf / "cpu.max").write_text(cpu_max)
    (tmp_path / "proc_cgroup").write_text("0::/kubepods/pod1\n")
    return tmp_path / "cg", tmp_path / "proc_cgroup"


def _cpu_tree(tmp_path, siblings):
    for n in sorted(os.sched_getaffinity(0)):
        topology = tmp_path / "cpus" / f"cpu{n}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(siblings(n))
    return tmp_path / "cpus"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_thread_counts_follow_a_cpu_quota_and_shared_cores(tmp_path):
    """XLA sizes its CPU thread pool by the schedulable CPUs: fewer threads
    are measured where a container's quota grants less CPU time (cgroup v2
    and v1) or where two threads share each core; never past `PJRT_NPROC`."""
    cpus = len(os.sched_getaffinity(0))
    own = _cpu_tree(tmp_path / "own", lambda n: f"{n}")  # one thread per core
    root, proc = _cgroup_v2(tmp_path / "v2", "100000 100000")  # 1 CPU
    assert _cpu_tuning.thread_counts({}, root, proc, own) == [1]
    root, proc = _cgroup_v2(tmp_path / "v2half", "50000 100000")  # 0.5: 1 thread
    assert _cpu_tuning.thread_counts({}, root, proc, own) == [1]
    root, proc = _cgroup_v2(tmp_path / "none", "max 100000")
    assert _cpu_tuning.thread_counts({}, root, proc, own) == []
    v1 = tmp_path / "v1" / "cpu,cpuacct" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000")
    (v1 / "cpu.cfs_period_us").write_text("100000")
    (tmp_path / "v1proc").write_text(
        "4:cpu,cpuacct:/docker/abc\n1:name=systemd:/\nnot a cgroup line\n"
    )  # a line it cannot read is passed over
    counts = _cpu_tuning.thread_counts({}, tmp_path / "v1", tmp_path / "v1proc", own)
    assert counts == [1]
    # two threads per core (siblings 2k and 2k+1): one thread per core
    smt = _cpu_tree(tmp_path / "smt", lambda n: f"{n - n % 2}-{n - n % 2 + 1}")
    none = tmp_path / "nowhere"
    assert _cpu_tuning.thread_counts({}, none, none, smt) == [cpus // 2]
    assert _cpu_tuning.thread_counts({}, none, none, own) == []
    assert _cpu_tuning.thread_counts({"PJRT_NPROC": "2"}, none, none, smt) == []


def test_fewer_threads_are_kept_only_where_faster_and_reach_pjrt_nproc(
    probe, monkeypatch
):
    """The chosen flags are timed again on each thread count; a count faster
    by `MARGIN` is chosen, cached, said, and applied as `PJRT_NPROC` (the
    user's own stands); one within the margin is not."""
    cpu = {"cpu": "x", "family": "6", "model": "85", "isa": ["avx2", "fma"]}
    times = {
        **TIMES,
        "eigen_dots on 1 threads": {"scanned_ms": 60.0, "unrolled_ms": 30.0},
    }
    choice = _cpu_tuning.measure(cpu, FakeProbe(times), threads=[1])
    assert choice.name == "eigen_dots" and choice.threads == 1
    assert "unrolled layers, 1 threads (measured" in choice.describe()
    entry = dataclasses.asdict(choice)
    assert _cpu_tuning.from_entry(entry, "cached").threads == 1
    times["eigen_dots on 1 threads"] = {"scanned_ms": 60.0, "unrolled_ms": 39.0}
    assert _cpu_tuning.measure(cpu, FakeProbe(times), threads=[1]).threads is None
    # applied before JAX starts, unless the user set PJRT_NPROC
    probe.times = {
        **TIMES,
        "eigen_dots on 1 threads": {"scanned_ms": 9.0, "unrolled_ms": 9.0},
    }
    monkeypatch.setattr(_cpu_tuning, "thread_counts", lambda environ=None: [1])
    env = {"XLA_FLAGS": ""}
    eqtrain.cpu.tune_cpu(env)
    assert env["PJRT_NPROC"] == "1" and "1 threads" in _cpu.cpu_settings()
    assert "threads 1" in _cpu_tuning.cache_key(threads=[1])
    _reset(monkeypatch)
    env = {"XLA_FLAGS": "", "PJRT_NPROC": "2"}
    eqtrain.cpu.tune_cpu(env)
    assert env["PJRT_NPROC"] == "2"


def test_arm_processors_are_told_apart_by_part_and_features():
    """Arm's `/proc/cpuinfo` names no model: the implementer and part stand
    for family and model, `Features` for the flags, so two Arm machines
    sharing one cache (a cluster's home directory) keep a choice each."""
    v1 = _cpu_tuning.processor(ARM_CPUINFO.format(part="0xd40"))
    assert v1 == {
        "cpu": "Arm 0x41 part 0xd40", "family": "0x41", "model": "0xd40",
        "isa": ["asimd", "asimddp", "sve", "i8mm", "bf16"],
    }  # fmt: skip
    n1 = _cpu_tuning.processor(ARM_CPUINFO.format(part="0xd0c"))
    assert _cpu_tuning.cache_key(v1, cores=4) != _cpu_tuning.cache_key(n1, cores=4)
    assert "onednn_dots" not in _cpu_tuning.candidates(v1)
    x86 = (
        "model name\t: Some CPU\ncpu family\t: 6\nmodel\t: 143\nflags\t: fma avx2 sme\n"
    )
    assert _cpu_tuning.processor(x86)["isa"] == ["avx2", "fma"]  # sme: AMD's SME


def test_a_stale_cache_entry_is_measured_again(probe, tmp_path):
    """An entry for another processor or JAX version, or a file of another
    cache version, is never used: the processor is measured again."""
    path = tmp_path / "cache" / "cpu_tuning.json"
    path.parent.mkdir(parents=True)
    other = {"name": "xla_default", "flags": "", "scan_layers": True, "measured": {}}
    key = _cpu_tuning.cache_key().replace("jax ", "jax 0.0.1-was-")
    version = _cpu_tuning.CACHE_VERSION
    path.write_text(json.dumps({"version": version, "choices": {key: other}}))
    assert _cpu.choose().source == "measured" and probe.calls
    assert set(_cache(tmp_path)["choices"]) == {key, _cpu_tuning.cache_key()}
    probe.calls.clear()
    old = {"version": version - 1, "choices": _cache(tmp_path)["choices"]}
    path.write_text(json.dumps(old))
    assert _cpu.choose().source == "measured" and probe.calls


def test_explicit_settings_win_over_the_measurement(probe):
    for flags in (
        "--xla_cpu_experimental_ynn_fusion_type=individual_dot",
        "--xla_cpu_prefer_vector_width=256",
    ):
        env = {"XLA_FLAGS": flags}
        eqtrain.cpu.tune_cpu(env)
        assert env == {"XLA_FLAGS": flags} and probe.calls == []
        assert _cpu.cpu_settings().startswith("yours")


def test_fixed_applies_the_settings_without_measuring(probe):
    env = {_cpu.OPT_OUT: "fixed", "XLA_FLAGS": ""}
    assert eqtrain.cpu.tune_cpu(env) == ["allocator", "arena", "xla_flags"]
    assert env["XLA_FLAGS"] == _cpu.XLA_CPU_FLAG and probe.calls == []
    assert _cpu.cpu_settings() == (
        "eigen_dots, unrolled layers (EQTRAIN_CPU_TUNING=fixed)"
    )


def test_a_failing_probe_falls_back_and_is_not_retried_at_every_start(probe, tmp_path):
    """A probe that cannot run here (a crash, a timeout) gives the default,
    and its failure is cached, so the next starts do not pay for it again;
    it is tried again after `RETRY_AFTER_DAYS`, and `eqtrain info` says so."""
    calls = []

    def broken(flags):
        calls.append(flags)
        raise RuntimeError("no CPU backend")

    choice = _cpu.choose(run=broken)
    assert choice.name == _cpu_tuning.FALLBACK and "no CPU backend" in choice.source
    entry = _cache(tmp_path)["choices"][_cpu_tuning.cache_key()]
    assert entry["failed"] == "no CPU backend" and "name" not in entry
    again = _cpu.choose(run=broken)
    assert len(calls) == 1 and again.name == _cpu_tuning.FALLBACK
    assert "failed on" in again.describe() and "delete" in again.describe()
    # a week later: measured again (and now it works)
    stale = datetime.date.today() - datetime.timedelta(_cpu.RETRY_AFTER_DAYS)
    _cpu_tuning.write_cache(
        _cpu_tuning.cache_path(), _cpu_tuning.cache_key(),
        {**entry, "measured_at": stale.isoformat()},
    )  # fmt: skip
    assert _cpu.choose().source == "measured" and probe.calls
    assert "failed" not in _cache(tmp_path)["choices"][_cpu_tuning.cache_key()]


@pytest.mark.slow  # two real probes of ~10 s, then `eqtrain fit --dry-run` twice
def test_the_cli_measures_once_and_the_dry_run_says_what_it_chose(tmp_path):
    env = {
        **os.environ,
        "EQTRAIN_CACHE_DIR": str(tmp_path / "cache"),
        "XLA_FLAGS": "",
        "JAX_PLATFORMS": "cpu",
    }
    env.pop(_cpu.OPT_OUT, None)
    argv = [sys.executable, "-m", "eqtrain.cli", "fit", "--dry-run"]
    runs = [
        subprocess.run(argv + ["--run-dir", str(tmp_path / f"run{i}")], env=env,
                       capture_output=True, text=True, timeout=400)
        for i in range(2)
    ]  # fmt: skip
    for done in runs:
        assert done.returncode == 0, done.stderr[-3000:]
    assert "measuring the CPU settings" in runs[0].stderr
    assert "measuring" not in runs[1].stderr
    entry = _cache(tmp_path)["choices"][_cpu_tuning.cache_key()]
    assert set(entry["measured"]) == set(
        _cpu_tuning.candidates(_cpu_tuning.processor())
    )
    for name, times in entry["measured"].items():  # each form, each round
        for form in ("scanned_ms", "unrolled_ms"):
            assert len(times[form]) == _cpu_tuning.ROUNDS, name
            assert all(t > 0 for t in times[form]), name
    lines = [ln for ln in runs[1].stdout.splitlines() if ln.startswith("cpu ")]
    assert len(lines) == 1
    if "noisy" in entry:  # a busy machine: nothing chosen, the default said
        assert "the probe's rounds disagreed on" in lines[0]
    else:
        assert entry["name"] in lines[0] and "cached" in lines[0]


def test_the_default_stays_within_the_margin_of_noise(probe):
    """A candidate a little faster than Eigen's products (less than
    `MARGIN`, one probe's noise) does not replace them; scanned layers
    likewise need to beat unrolled ones by more than that."""
    probe.times = {
        "eigen_dots": {"scanned_ms": 99.0, "unrolled_ms": 100.0},
        "xla_default": {"scanned_ms": 98.0, "unrolled_ms": 97.0},
        "eigen_dots_512": {"scanned_ms": 98.5, "unrolled_ms": 99.0},
        "onednn_dots": {"scanned_ms": 98.0, "unrolled_ms": 98.5},
    }
    choice = _cpu.choose()
    assert (choice.name, choice.scan_layers) == ("eigen_dots", False)


def test_a_command_that_trains_nothing_never_waits_for_the_probe(probe):
    """`measure=False` (the CLI's commands other than `fit`): the default flags
    until a choice is cached, no probe; a cached choice is used."""
    env = {"XLA_FLAGS": ""}
    eqtrain.cpu.tune_cpu(env, measure=False)
    assert probe.calls == [] and env["XLA_FLAGS"] == _cpu.XLA_CPU_FLAG
    assert "not measured yet" in _cpu.cpu_settings()
    _cpu.choose()  # what `eqtrain fit` does the first time
    probe.calls.clear()
    env = {"XLA_FLAGS": ""}
    eqtrain.cpu.tune_cpu(env, measure=False)
    assert probe.calls == [] and "(cached;" in _cpu.cpu_settings()


def test_the_probe_runs_this_eqtrain_under_the_allocator_settings(monkeypatch):
    """The probe process imports the same eqtrain (its parent directory first on
    the path, whatever the working directory), times under `flags` and glibc's
    settings as `tune_cpu` makes them, and the user's own variables win."""
    monkeypatch.setenv("MALLOC_ARENA_MAX", "3")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = _cpu_tuning.probe_env("--flag")
    root = str(Path(eqtrain.__file__).resolve().parent.parent)
    assert env["PYTHONPATH"].split(os.pathsep) == [root, "/elsewhere"]
    assert env["XLA_FLAGS"] == "--flag" and env["MALLOC_ARENA_MAX"] == "3"
    assert (
        env["MALLOC_TRIM_THRESHOLD_"]
        == _cpu_tuning.PROBE_ALLOCATOR["MALLOC_TRIM_THRESHOLD_"]
    )
    assert "ONEDNN_MAX_CPU_ISA" not in env  # Eigen's or XLA's products
    assert _cpu_tuning.probe_env("--flag", 1)["PJRT_NPROC"] == "1"
    env = _cpu_tuning.probe_env(_cpu_tuning.CANDIDATES["onednn_dots"])
    assert env["ONEDNN_MAX_CPU_ISA"] == _cpu_tuning.ONEDNN_ISA_CAP
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX512_CORE")  # the user's cap wins
    env = _cpu_tuning.probe_env(_cpu_tuning.CANDIDATES["onednn_dots"])
    assert "ONEDNN_MAX_CPU_ISA" not in env


PROBE_SCRIPT = """
import json, sys
print("READY", flush=True)
for i, line in enumerate(sys.stdin):
    assert line == "round\\n", line
    print(json.dumps({"scanned_ms": 2.0 + i, "unrolled_ms": 1.0 + i}), flush=True)
"""


def test_probe_processes_answer_round_after_round_and_fail_by_name(
    monkeypatch, tmp_path
):
    """`Probes` starts one process per setting at its first round and keeps
    it for the next (`-P -m eqtrain.cpu._probe --serve`); one that dies
    raises RuntimeError with its last line; `close` stops them all; no more
    run at once than the available memory holds."""
    started = []
    real = subprocess.Popen

    def popen(argv, **kwargs):
        started.append((argv, kwargs["env"]["XLA_FLAGS"]))
        assert argv[1:5] == ["-P", "-m", "eqtrain.cpu._probe", "--serve"]
        return real([sys.executable, "-c", PROBE_SCRIPT], **kwargs)

    monkeypatch.setattr(_cpu_tuning.subprocess, "Popen", popen)
    probes = _cpu_tuning.Probes()
    try:
        assert probes("--a") == {"scanned_ms": 2.0, "unrolled_ms": 1.0}
        assert probes("--b") == {"scanned_ms": 2.0, "unrolled_ms": 1.0}
        assert probes("--a") == {"scanned_ms": 3.0, "unrolled_ms": 2.0}
        assert [flags for _, flags in started] == ["--a", "--b"]
        bad = "import sys; print('boom: no CPU backend', file=sys.stderr)"
        monkeypatch.setattr(
            _cpu_tuning.subprocess,
            "Popen",
            lambda argv, **kw: real([sys.executable, "-c", bad], **kw),
        )
        with pytest.raises(RuntimeError, match="boom: no CPU backend"):
            probes("--c")
    finally:
        probes.close()
    assert probes._procs == {}
    # where memory holds one probe process only, the others wait their turn
    started.clear()
    monkeypatch.setattr(_cpu_tuning.subprocess, "Popen", popen)
    probes = _cpu_tuning.Probes(alive=1)
    try:
        for flags in ("--a", "--b", "--a"):
            assert probes(flags) == {"scanned_ms": 2.0, "unrolled_ms": 1.0}
            assert len(probes._procs) == 1
        assert [flags for _, flags in started] == ["--a", "--b", "--a"]
    finally:
        probes.close()
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000000 kB\nMemAvailable:    7340032 kB\n")
    assert _cpu_tuning._memory_allows(meminfo) == 2  # 7 GiB: two of 3 GiB
    assert _cpu_tuning._memory_allows(tmp_path / "none") == 1


def test_a_onednn_choice_reaches_eqtrain_jit_not_xla_flags(probe, monkeypatch):
    """Where oneDNN's products are named, the process gets Eigen's
    products in `XLA_FLAGS` and oneDNN as `eqtrain.jit`'s per-compilation
    options (never process-wide: `eqtrain.cpu._onednn`); the user's own XLA
    flags for the products win over the choice, oneDNN included."""
    if not _cpu_tuning.onednn_verified(_cpu_tuning.processor()):
        pytest.skip("oneDNN may be named with AVX-512 and a verified jaxlib only")
    env = {"XLA_FLAGS": "", _cpu.OPT_OUT: "onednn_dots"}
    eqtrain.cpu.tune_cpu(env)
    assert probe.calls == []  # named, never measured
    assert env["XLA_FLAGS"] == _cpu_tuning.EIGEN_DOTS
    assert _onednn.compiler_options() == _cpu_tuning.ONEDNN_OPTIONS
    # oneDNN held to the kernels verified (unless the user holds it elsewhere)
    assert env["ONEDNN_MAX_CPU_ISA"] == _cpu_tuning.ONEDNN_ISA_CAP
    assert _cpu.cpu_settings() == (
        "onednn_dots, unrolled layers (EQTRAIN_CPU_TUNING=onednn_dots,unrolled)"
    )
    _reset(monkeypatch)
    env = {
        "XLA_FLAGS": "",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        _cpu.OPT_OUT: "onednn_dots",
    }
    eqtrain.cpu.tune_cpu(env)
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    # the user's own products (or EQTRAIN_CPU_TUNING=0): none of eqtrain's
    for env in (
        {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=dot"},
        {"XLA_FLAGS": "", _cpu.OPT_OUT: "0"},
    ):
        _onednn.activate(_cpu_tuning.ONEDNN_OPTIONS)
        eqtrain.cpu.tune_cpu(env)
        assert _onednn.compiler_options() == {}
        assert "onednn" not in env["XLA_FLAGS"]


class BusyProbe:
    """A fake probe on a machine where another process competes for the
    cores: each round's true time (`TRUE`, ms) is slowed by a factor drawn
    afresh for every round of every candidate (`load`, a seeded generator),
    and by a small step-to-step jitter (`jitter`) as on a quiet machine."""

    TRUE = {  # XLA's own products 10% faster than the default, scanned no help
        "eigen_dots": {"scanned_ms": 41.0, "unrolled_ms": 40.0},
        "xla_default": {"scanned_ms": 37.0, "unrolled_ms": 36.0},
        "eigen_dots_512": {"scanned_ms": 47.0, "unrolled_ms": 45.0},
    }

    def __init__(self, seed, load=(1.0, 1.0), jitter=0.01):
        self.rng = __import__("random").Random(seed)
        self.load, self.jitter = load, jitter

    def __call__(self, flags, threads=None):
        name = next(n for n, f in _cpu_tuning.CANDIDATES.items() if f == flags)
        slow = self.rng.uniform(*self.load)
        return {
            form: ms * slow * self.rng.uniform(1 - self.jitter, 1 + self.jitter)
            for form, ms in self.TRUE[name].items()
        }

    def close(self):
        pass


CPU = {"cpu": "x", "family": "6", "model": "207", "isa": ["avx2", "fma", "avx512f"]}


def test_a_busy_machine_caches_the_quiet_choice_or_nothing():
    """Issue 51: a one-shot probe under load cached a choice 2x off, for
    good. Each round now chooses on its own, the candidates' times taken in
    turn; the choice stands only if every round made it with the rounds'
    noise under `MARGIN`. Quiet (1% jitter) or under a steady load (every
    round 1.6x slower), the choice is XLA's own products; with a busy
    process beside it (each round 1-2x slower, at random), 200 seeded
    measurements each give that same choice or "noisy" (nothing cached),
    and the busy ones mostly give "noisy"."""
    for load in ((1.0, 1.0), (1.6, 1.6)):
        for seed in range(20):
            choice = _cpu_tuning.measure(CPU, BusyProbe(seed, load))
            assert (choice.name, choice.scan_layers) == ("xla_default", False)
            assert choice.source == "measured", choice.describe()
    sources = []
    for seed in range(200):
        choice = _cpu_tuning.measure(CPU, BusyProbe(seed, (1.0, 2.0)))
        sources.append(choice.source)
        if choice.source == "measured":
            assert (choice.name, choice.scan_layers) == ("xla_default", False)
        else:
            assert (choice.source, choice.name) == ("noisy", "eigen_dots")
    assert sources.count("noisy") > 190, sources.count("noisy")
    # what the single round of the old probe would have done: a wrong choice
    wrong = [
        s for s in range(200)
        if _cpu_tuning._best(_cpu_tuning._round(_cpu_tuning._interleave(
            BusyProbe(s, (1.0, 2.0)), {n: (f, None) for n, f in
            _cpu_tuning.candidates(CPU).items()}, 1), 0))[0] != "xla_default"
    ]  # fmt: skip
    assert len(wrong) > 40


def test_rounds_that_disagree_cache_nothing_and_are_tried_the_next_day(
    probe, monkeypatch
):
    """A noisy measurement applies the default at once, caches the
    disagreement (not a choice) with each candidate's median and range, and
    is measured again after `NOISY_RETRY_DAYS`; `eqtrain info` says so."""
    busy = BusyProbe(0, (1.0, 2.0))
    monkeypatch.setattr(_cpu_tuning, "probe", lambda: busy)
    choice = _cpu.choose()
    assert choice.name == _cpu_tuning.FALLBACK and choice.measured == {}
    assert "the probe's rounds disagreed on" in choice.source
    assert "measured again from" in choice.source
    assert "xla_default" in choice.source and " ms (" in choice.source  # ranges
    entry = next(iter(_cpu_tuning.read_cache(_cpu_tuning.cache_path()).values()))
    assert "noisy" in entry and "name" not in entry
    again = _cpu.choose()  # the same day: the cached disagreement, no probe
    assert again.source == choice.source
    tomorrow = datetime.date.today() + datetime.timedelta(days=1)
    monkeypatch.setattr(
        _cpu.datetime, "date", type("D", (datetime.date,), {"today": lambda: tomorrow})
    )
    monkeypatch.setattr(_cpu_tuning, "probe", lambda: BusyProbe(0))  # quiet now
    chosen = _cpu.choose()
    assert (chosen.name, chosen.source) == ("xla_default", "measured")
    assert "xla_default 36 ms (" in chosen.describe()  # median (range)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("fixed", ("eigen_dots", False, None, "fixed")),
        ("eigen_dots_512,scanned", ("eigen_dots_512", True, None, "pinned")),
        ("XLA_default, threads=2", ("xla_default", False, 2, "pinned")),
        ("", None),
        ("auto", None),
    ],
)
def test_a_setting_can_be_named_instead_of_measured(value, expected):
    choice = _cpu_tuning.pinned(value, CPU)
    got = choice and (choice.name, choice.scan_layers, choice.threads, choice.source)
    assert got == expected
    if choice is not None:  # the spec names the same choice back
        assert _cpu_tuning.pinned(choice.spec, CPU).spec == choice.spec


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("eigen", "'eigen' is no setting; expected 0 \\(off\\), fixed, or one of"),
        ("eigen_dots,fast", "cannot read 'fast'"),
        ("eigen_dots,threads=0", "cannot read 'threads=0'"),
    ],
)
def test_a_setting_that_names_nothing_is_refused_by_name(value, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        _cpu_tuning.pinned(value, CPU)
    env = {**os.environ, _cpu.OPT_OUT: value, "EQTRAIN_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "eqtrain.cli", "info", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"error: EQTRAIN_CPU_TUNING={value!r}")


def test_the_ray_launcher_gives_its_workers_its_own_setting(probe, monkeypatch):
    """`eqtrain fit --launcher ray` measures (or reads) the setting once, in
    the driver, and every worker applies it by name, without measuring: one
    choice in every process. The caller's own variable wins."""
    import contextlib

    from eqtrain.ray import _launch

    result = object.__new__(_launch.LaunchResult)
    assert _cpu.shared_setting() == {}  # tune_cpu not called: nothing to share
    eqtrain.cpu.tune_cpu({"XLA_FLAGS": "", _cpu.OPT_OUT: "eigen_dots_512,scanned"})
    assert _cpu.shared_setting() == {_cpu.OPT_OUT: "eigen_dots_512,scanned"}
    seen = []

    class Supervisor:
        def __init__(self, ray, plan, config, say, env, signals):
            seen.append(env)

        def run(self, **kwargs):
            return result

    monkeypatch.setattr(_launch, "Supervisor", Supervisor)
    monkeypatch.setattr(_launch, "import_ray", lambda: None)
    monkeypatch.setattr(_launch, "connected", lambda *a: contextlib.nullcontext())
    monkeypatch.setattr(_launch, "Signals", lambda say: contextlib.nullcontext())
    monkeypatch.setattr(_launch.job, "prepare_data", lambda *a, **k: None)
    config = eqtrain.config.load(overrides=["distributed.processes=2"])
    assert _launch.fit(config, env={"XLA_FLAGS": "x"}) is result
    assert seen[-1] == {
        "EQTRAIN_CPU_TUNING": "eigen_dots_512,scanned",
        "XLA_FLAGS": "x",
    }
    _launch.fit(config, env={_cpu.OPT_OUT: "fixed"})
    assert seen[-1] == {_cpu.OPT_OUT: "fixed"}
    _reset(monkeypatch)
    eqtrain.cpu.tune_cpu({"XLA_FLAGS": "", _cpu.OPT_OUT: "0"})
    assert _cpu.shared_setting() == {_cpu.OPT_OUT: "0"}
