"""CPU settings chosen by measurement: the first time `eqtrain.tune_cpu` meets
a processor and JAX version, it times each candidate set of XLA flags on a
small training step (`_cpu_probe`, one process per candidate: XLA reads its
flags once), keeps the fastest, and caches the choice in the user's cache
directory, keyed by the processor (model name, family/model, the instruction
sets that change XLA's kernels, cores) and the jax/jaxlib versions. A new
processor, JAX version or candidate list measures again; a cached key never
does (a cached failure of the probe, after a week). The processes of one
machine measure one at a time (`eqtrain._cpu.choose` decides when to measure;
this module what and how). The default
(Eigen's products, unrolled layers) stays unless another candidate is faster
by more than `MARGIN`.

The choice also says whether a model's layers train faster scanned or
unrolled here (`model.scan_layers = "auto"` on the CPU follows it).

Where the cache lives: `$EQTRAIN_CACHE_DIR`, else `$XDG_CACHE_HOME/eqtrain`,
else `~/.cache/eqtrain`; the file is `cpu_tuning.json` (plain JSON).
"""

import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any


ISA = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
"""The CPU flags that decide which kernels XLA, oneDNN and torch pick."""
ARM_ISA = ("asimd", "asimddp", "sve", "sve2", "i8mm", "bf16", "sme")
"""The same for Arm processors (their `Features` line), which name no model:
there the implementer and part numbers stand for family and model, so a
cache shared by different Arm machines (a cluster's home directory) keeps a
choice per processor."""

EIGEN_DOTS = "--xla_cpu_experimental_ynn_fusion_type="
ONEDNN_FLAGS = "--xla_cpu_use_onednn=true --xla_cpu_experimental_onednn_fusion_type=dot"
"""oneDNN's products (XLA's oneDNN fusions of a dot and its elementwise
neighbours), as `XLA_FLAGS` for the probe process. A training process never
sets them process-wide: `eqtrain.jit` compiles its steps with them
(`ONEDNN_OPTIONS`) and checks each compiled step (`_onednn`), because this
jaxlib's oneDNN fusions abort the process on some graphs."""
ONEDNN_OPTIONS = {
    "xla_cpu_use_onednn": True,
    "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT",
}
"""`ONEDNN_FLAGS` as one compilation's options (`jax.jit(compiler_options=)`)."""
CANDIDATES = {
    "eigen_dots": EIGEN_DOTS,  # products by Eigen, over all of XLA's threads
    "xla_default": "",  # XLA's own choice (YNNPACK fusions)
    "eigen_dots_512": f"{EIGEN_DOTS} --xla_cpu_prefer_vector_width=512",
    "onednn_dots": f"{EIGEN_DOTS} {ONEDNN_FLAGS}",  # eqtrain.jit's steps by oneDNN
}
"""The XLA flag sets measured, by name. `eigen_dots_512` and `onednn_dots`
only where the processor has AVX-512; `onednn_dots` only where oneDNN may
run its AVX-512 kernels (`ONEDNN_ISA`, `ONEDNN_ISA_ENV`) and with a verified
jaxlib (`ONEDNN_JAXLIB`)."""
ONEDNN_ISA = ("avx512f", "avx512bw", "avx512vl")
"""oneDNN's products are a candidate only where oneDNN runs its AVX-512
kernels (`brg_matmul:avx512_core`, which needs these three): there they
train the Llama step as Eigen's do, to f32 rounding (`tests/test_onednn.py`).
Its older kernels (`gemm:jit:f32`, chosen on AVX2-only processors or under
`ONEDNN_MAX_CPU_ISA=AVX2`) corrupt the heap in this jaxlib's fusions. On
processor B held to AVX2, the tests' Llama at 1,024 tokens died in 3 of 4
runs of three steps (`double free or corruption`, a segmentation fault), and
its forward pass alone aborted or hung; at full ISA 6 of 6 runs matched."""
ONEDNN_ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""The variables that hold oneDNN below the processor's ISA. A value that
still allows `avx512_core` (`ONEDNN_ISA_ALLOWED`) keeps oneDNN a candidate;
any other (`AVX2`, a typo oneDNN would ignore) leaves it out."""
ONEDNN_ISA_ALLOWED = ("ALL", "DEFAULT", "AVX512_CORE", "AVX10")
ONEDNN_ISA_CAP = "AVX512_CORE_BF16"
"""`ONEDNN_MAX_CPU_ISA` wherever eqtrain runs oneDNN's products (its probe,
and a process that chose them) and the user set no cap: oneDNN stays on the
`avx512_core` kernels verified on processor B (whose own ISA this is), never
the AMX or AVX10 ones of newer processors, which no test has run. For f32
products it changes nothing (oneDNN runs AMX for bf16 and int8 only)."""
ONEDNN_JAXLIB = ("0.10.",)
"""The jaxlib versions whose oneDNN fusions `eqtrain._onednn`'s check was
verified against, shape by shape (`tests/test_onednn.py`): which fusions
abort the process and which compute wrongly change between versions.
jaxlib 0.11.2 (on an Intel Xeon with AVX-512) aborted on `c - x @ y`, which
0.10.2 runs; a new version is added here once the tests pass on it."""
FALLBACK = "eigen_dots"  # what is applied when nothing can be measured
CACHE_VERSION = 3  # 3: eqtrain's Llama step under tune_cpu's allocator settings
ALLOCATOR_THRESHOLD = 2**31 - 1  # mallopt takes an int: ~2 GB
PROBE_ALLOCATOR = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(ALLOCATOR_THRESHOLD),
    "MALLOC_TRIM_THRESHOLD_": str(ALLOCATOR_THRESHOLD),
}
"""glibc's settings as `tune_cpu` makes them (`mallopt` in a running process;
the variables at a new one's start), for the probe processes: a candidate is
timed as training will run. The user's own variables win."""
PROBE_TIMEOUT_S = 180

Probe = Callable[..., dict[str, float]]  # (flags) or (flags, threads)
THREADS_ENV = "PJRT_NPROC"
"""The variable XLA's CPU client sizes its thread pool by (else the
schedulable CPUs)."""


def processor(text: str | None = None) -> dict[str, Any]:
    """Model name, family, model and ISA flags from `/proc/cpuinfo` (or `text`);
    on Arm the implementer and part numbers and its `Features`."""
    if text is None:
        text = _read_text(Path("/proc/cpuinfo"))
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    if "Features" in fields and "flags" not in fields:  # Arm: no model name
        arm = fields.get("CPU implementer"), fields.get("CPU part")
        label = "Arm {} part {}".format(*arm) if all(arm) else None
        flags = set(fields["Features"].split())
        return {
            "cpu": fields.get("model name") or label or platform.processor() or "?",
            "family": arm[0],
            "model": arm[1],
            "isa": [name for name in ARM_ISA if name in flags],
        }
    flags = set(fields.get("flags", "").split())
    return {
        "cpu": fields.get("model name") or platform.processor() or "unknown",
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "isa": [name for name in ISA if name in flags],
    }


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def onednn_isa_capped(environ: Mapping[str, str] | None = None) -> str | None:
    """`NAME=value` where the environment holds oneDNN below AVX-512
    (`ONEDNN_ISA_ENV`), else None."""
    environ = os.environ if environ is None else environ
    for name in ONEDNN_ISA_ENV:
        value = environ.get(name, "").strip().upper()
        if value and not value.startswith(ONEDNN_ISA_ALLOWED):
            return f"{name}={environ[name]}"
    return None


def cap_onednn(environ: MutableMapping[str, str]) -> None:
    """Hold oneDNN to the kernels verified (`ONEDNN_ISA_CAP`), unless the
    user set a cap of their own (`ONEDNN_ISA_ENV`)."""
    if not any(environ.get(name) for name in ONEDNN_ISA_ENV):
        environ[ONEDNN_ISA_ENV[0]] = ONEDNN_ISA_CAP


def onednn_verified(
    cpu: Mapping[str, Any],
    jaxlib: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> bool:
    """Whether oneDNN's products may be measured on `cpu` with `jaxlib` (the
    installed one by default): AVX-512 (`ONEDNN_ISA`), oneDNN not held below it
    (`ONEDNN_ISA_ENV` in `environ`, the process's by default), and a jaxlib
    whose oneDNN fusions `eqtrain._onednn`'s check was verified against
    (`ONEDNN_JAXLIB`)."""
    jaxlib = _version("jaxlib") if jaxlib is None else jaxlib
    isa = all(name in cpu["isa"] for name in ONEDNN_ISA)
    capped = onednn_isa_capped(environ) is not None
    return isa and not capped and jaxlib.startswith(ONEDNN_JAXLIB)


def candidates(cpu: Mapping[str, Any]) -> dict[str, str]:
    """The flag sets worth measuring on `cpu` (`processor()`)."""
    skip = set()
    if "avx512f" not in cpu["isa"]:
        skip.add("eigen_dots_512")
    if not onednn_verified(cpu):
        skip.add("onednn_dots")
    return {k: v for k, v in CANDIDATES.items() if k not in skip}


def cache_key(
    cpu: Mapping[str, Any] | None = None,
    cores: int | None = None,
    threads: Sequence[int] = (),
) -> str:
    """What a choice holds for: the processor, its cores, jax and jaxlib, and
    the candidates (a new candidate measures again), thread counts included
    (`thread_counts`: where there are some)."""
    cpu = processor() if cpu is None else cpu
    parts = [
        cpu["cpu"], f"{cpu['family']}/{cpu['model']}", "+".join(cpu["isa"]),
        f"{os.cpu_count() if cores is None else cores} cores",
        f"jax {_version('jax')}", f"jaxlib {_version('jaxlib')}",
        "candidates " + ",".join(candidates(cpu)), f"v{CACHE_VERSION}",
    ]  # fmt: skip
    if threads:
        parts.insert(-1, "threads " + ",".join(map(str, threads)))
    return " | ".join(parts)


def cache_path() -> Path:
    """`cpu_tuning.json` in eqtrain's cache directory (see the module's doc)."""
    environ = os.environ
    if environ.get("EQTRAIN_CACHE_DIR"):
        root = Path(environ["EQTRAIN_CACHE_DIR"])
    elif environ.get("XDG_CACHE_HOME"):
        root = Path(environ["XDG_CACHE_HOME"]) / "eqtrain"
    else:
        root = Path.home() / ".cache" / "eqtrain"
    return root / "cpu_tuning.json"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The settings chosen for this processor.

    Attributes:
        name: the chosen flag set (a key of `CANDIDATES`).
        flags: its XLA flags.
        scan_layers: whether scanned layers trained faster than unrolled ones.
        measured: each candidate's probe (`{"scanned_ms", "unrolled_ms"}`),
            empty when nothing was measured (`FALLBACK`).
        source: "measured", "cached" or "default" (nothing could be measured).
        threads: XLA's CPU threads (`PJRT_NPROC`) where fewer than the
            schedulable CPUs measured faster (a container's CPU quota, one
            thread per core); None: XLA's own count.
    """

    name: str
    flags: str
    scan_layers: bool
    measured: dict[str, dict[str, float]]
    source: str
    threads: int | None = None

    @property
    def process_flags(self) -> str:
        """The flags for `XLA_FLAGS`: `flags` without `ONEDNN_FLAGS`, which
        `eqtrain.jit` applies per compiled step instead (`compiler_options`)."""
        return self.flags.replace(ONEDNN_FLAGS, "").strip()

    @property
    def compiler_options(self) -> dict[str, Any]:
        """The options `eqtrain.jit` compiles its steps with on the CPU."""
        return dict(ONEDNN_OPTIONS) if ONEDNN_FLAGS in self.flags else {}

    def describe(self) -> str:
        """One line for `eqtrain info` and the dry run."""
        if not self.measured:
            return f"{self.name} (not measured: {self.source})"
        ms = {n: min(m.values()) for n, m in self.measured.items()}
        times = ", ".join(f"{n} {t:.0f} ms" for n, t in sorted(ms.items()))
        layers = "scanned" if self.scan_layers else "unrolled"
        threads = f", {self.threads} threads" if self.threads else ""
        return (
            f"{self.name}, {layers} layers{threads} ({self.source}; a probe step:"
            f" {times})"
        )


MARGIN = 0.05
"""How much faster a candidate must be than the default (`FALLBACK`, unrolled
layers) to be chosen: one probe's step varies by 3-5% on a shared 2-core
machine, and a choice made on noise would flip from one measurement to the
next."""


def _faster(a: float, b: float) -> bool:
    """Whether `a` ms beats `b` ms by more than `MARGIN`."""
    return a < b * (1 - MARGIN)


def _best(measured: Mapping[str, Mapping[str, float]]) -> tuple[str, bool]:
    """The fastest flag set (by its faster layer form), unless the default is
    within `MARGIN` of it; and whether scanned layers beat unrolled ones by
    more than `MARGIN` under it."""
    name = min(measured, key=lambda n: min(measured[n].values()))
    if FALLBACK in measured:
        fallback, best = min(measured[FALLBACK].values()), min(measured[name].values())
        name = name if _faster(best, fallback) else FALLBACK
    timings = measured[name]
    return name, _faster(timings["scanned_ms"], timings["unrolled_ms"])


def probe(flags: str, threads: int | None = None) -> dict[str, float]:
    """`_cpu_probe` (eqtrain's own Llama step) run in a fresh process under
    `flags` and `PROBE_ALLOCATOR` (and `ONEDNN_ISA_CAP` for oneDNN's
    products; `PJRT_NPROC` for `threads`), importing this eqtrain (its parent
    directory first on the path; `-P`: the working directory's files never
    shadow a module)."""
    env = {**PROBE_ALLOCATOR, **os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    if threads:
        env[THREADS_ENV] = str(threads)
    if "onednn" in flags:
        cap_onednn(env)
    here = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-P", "-m", "eqtrain._cpu_probe"], capture_output=True,
        text=True, timeout=PROBE_TIMEOUT_S, env=env,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1:] or "probe failed")
    return json.loads(done.stdout.strip().splitlines()[-1])


def read_cache(path: Path) -> dict[str, Any]:
    """The cache file's choices, or {} (missing, unreadable or another version)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    ok = isinstance(data, dict) and data.get("version") == CACHE_VERSION
    return data.get("choices", {}) if ok else {}


def write_cache(path: Path, key: str, entry: dict[str, Any]) -> None:
    """Add `entry` under `key` to the cache file, atomically (best effort: an
    unwritable cache only means measuring again next time)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        choices = {**read_cache(path), key: entry}
        text = json.dumps({"version": CACHE_VERSION, "choices": choices}, indent=1)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".cpu_tuning-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        pass


def from_entry(entry: Mapping[str, Any], source: str) -> Choice | None:
    """A cached entry as a `Choice` (None if it names an unknown flag set)."""
    name = entry.get("name")
    if name not in CANDIDATES or not isinstance(entry.get("measured"), dict):
        return None
    scan = bool(entry.get("scan_layers", False))
    threads = entry.get("threads")
    threads = threads if isinstance(threads, int) and threads > 0 else None
    measured = dict(entry["measured"])
    return Choice(name, CANDIDATES[name], scan, measured, source, threads)


def measure(
    cpu: Mapping[str, Any], run: Probe | None = None, threads: Sequence[int] = ()
) -> Choice:
    """Probe every candidate of `cpu` (`run(flags)`, default `probe`) and
    choose the fastest; then the chosen flags on each of `threads`
    (`run(flags, n)`), kept where faster by `MARGIN`. A candidate whose probe
    fails is left out (the default's failing fails the measurement)."""
    run = probe if run is None else run
    measured = {}
    for name, flags in candidates(cpu).items():
        try:
            measured[name] = run(flags)
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError):
            if name == FALLBACK:
                raise
    name, scan = _best(measured)
    best, chosen = min(measured[name].values()), None
    for n in threads:
        try:
            timings = measured[f"{name} on {n} threads"] = run(CANDIDATES[name], n)
        except (OSError, RuntimeError, ValueError, subprocess.SubprocessError):
            continue
        if _faster(min(timings.values()), best):
            best, chosen = min(timings.values()), n
            scan = _faster(timings["scanned_ms"], timings["unrolled_ms"])
    return Choice(name, CANDIDATES[name], scan, measured, "measured", chosen)


def thread_counts(
    environ: Mapping[str, str] | None = None,
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    cpu_root: Path = Path("/sys/devices/system/cpu"),
) -> list[int]:
    """Thread counts for XLA's CPU client worth measuring against its own
    (one per schedulable CPU): the container's CPU quota, where below the
    schedulable CPUs (XLA's threads then outnumber the CPU time the kernel
    grants), and one thread per physical core, where cores run two threads.
    Nothing when the user set `PJRT_NPROC`."""
    environ = os.environ if environ is None else environ
    if environ.get(THREADS_ENV):
        return []
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    found = {_cgroup_cpus(cgroup_root, proc_cgroup), _cores(cpus, cpu_root)}
    return sorted(n for n in found if n is not None and 0 < n < len(cpus))


def _cgroup_cpus(root: Path, proc_cgroup: Path) -> int | None:
    """The CPU quota of this process's cgroup and its ancestors (v2's
    `cpu.max`, v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`), rounded up to
    whole CPUs; None without one."""
    try:
        lines = proc_cgroup.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, _, rest = line.partition(":")
        controllers, colon, where = rest.partition(":")
        if not colon:  # not a cgroup line
            continue
        if controllers == "":  # v2
            for d in _ancestors(root, where):
                quotas.append(_ratio(_read_text(d / "cpu.max"), None))
        elif "cpu" in controllers.split(","):
            mounts = dict.fromkeys([controllers, "cpu", "cpu,cpuacct"])
            for mount in (root / name for name in mounts):
                for d in _ancestors(mount, where):
                    quota = _read_text(d / "cpu.cfs_quota_us")
                    quotas.append(_ratio(quota, _read_text(d / "cpu.cfs_period_us")))
    found = [q for q in quotas if q is not None]
    return math.ceil(min(found)) if found else None


def _ancestors(root: Path, where: str) -> list[Path]:
    parts = [p for p in where.strip().split("/") if p]
    return [root.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def _ratio(quota: str, period: str | None) -> float | None:
    """`quota / period` CPUs: v2's `"200000 100000"` (period None) or v1's
    two files; None for no limit (`max`, -1) or nothing readable."""
    fields = quota.split() if period is None else [quota, period]
    try:
        q, p = float(fields[0]), float(fields[1])
    except (IndexError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def _cores(cpus: Sequence[int], root: Path) -> int | None:
    """How many physical cores `cpus` sit on (their `thread_siblings_list`);
    None if unreadable."""
    siblings = {_read_text(root / f"cpu{n}" / "topology" / "thread_siblings_list")
                for n in cpus}  # fmt: skip
    return None if "" in siblings or not siblings else len(siblings)
