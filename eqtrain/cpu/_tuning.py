"""CPU settings chosen by measurement: the first time `eqtrain.cpu.tune_cpu` meets
a processor and JAX version, it times each candidate set of XLA flags on a
small training step (`_probe`, one process per candidate: XLA reads its
flags once), in `ROUNDS` rounds that interleave the candidates in time,
keeps the fastest, and caches the choice in the user's cache directory,
keyed by the processor (model name, family/model, the instruction
sets that change XLA's kernels, cores) and the jax/jaxlib versions. A new
processor, JAX version or candidate list measures again; a cached key never
does (a cached failure of the probe, after a week; rounds that disagreed,
after a day). The processes of one machine measure one at a time
(`eqtrain.cpu._tune.choose` decides when to measure; this module what and how).
The default (Eigen's products, unrolled layers) stays unless another
candidate is faster by more than `MARGIN`.

Each round chooses on its own, from its candidates' times taken back to
back; a choice is cached only when every round made it and each
candidate's time relative to the default's in the same round varies by
less than `MARGIN` over the rounds (`noise`). A busy machine (another job
beside the probe) breaks one or the other, and then nothing is cached: the
default applies and the probe runs again the next day. `eqtrain info` shows
each candidate's median and range over the rounds.

`EQTRAIN_CPU_TUNING` may also name a setting, which applies without
measuring (`pinned`): `fixed` (the default's), or a candidate with
`scanned`/`unrolled` and `threads=N`, e.g. `eigen_dots_512,scanned`. That
is how oneDNN's products are had (`onednn_dots`, never chosen by
measurement: jaxlib 0.10 computes some of its fusions wrongly, silently;
`eqtrain.cpu._onednn` checks each compiled step), and how the processes of a
multi-process run share one setting (the Ray launcher passes its own).

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
"""The XLA flag sets, by name. `eigen_dots_512` is measured only where the
processor has AVX-512. `onednn_dots` is never measured (`AUTOMATIC`); it is
had by naming it (`pinned`), only where oneDNN may run its AVX-512 kernels
(`ONEDNN_ISA`, `ONEDNN_ISA_ENV`) and with a verified jaxlib
(`ONEDNN_JAXLIB`)."""
AUTOMATIC = ("eigen_dots", "xla_default", "eigen_dots_512")
"""The flag sets measurement may choose. Not `onednn_dots`: jaxlib 0.10's
oneDNN fusions can compute wrongly without a sign (a fusion writing over an
input it reads later, `eqtrain.cpu._onednn`), and a setting that a known defect
can make silently wrong is had only by asking for it."""
ENV = "EQTRAIN_CPU_TUNING"
MEASURED = ("", "1", "on", "true", "yes", "auto")
"""`ENV` values that measure (the default); `0`/`off`/`false`/`no` turn
tuning off (`eqtrain.cpu._tune`); anything else names a setting (`pinned`)."""
ONEDNN_ISA = ("avx512f", "avx512bw", "avx512vl")
"""oneDNN's products are a candidate only where oneDNN runs its AVX-512
kernels (`brg_matmul:avx512_core`, which needs these three): there they
train the Llama step as Eigen's do, to f32 rounding (`tests/test_onednn.py`).
Its older kernels (`gemm:jit:f32`, chosen on AVX2-only processors or under
`ONEDNN_MAX_CPU_ISA=AVX2`) corrupt the heap in jaxlib 0.10's fusions: the
tests' Llama at 1,024 tokens, held to AVX2, dies (`double free or
corruption`, a segmentation fault) where the AVX-512 kernels match."""
ONEDNN_ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""The variables that hold oneDNN below the processor's ISA. A value that
still allows `avx512_core` (`ONEDNN_ISA_ALLOWED`) keeps oneDNN a candidate;
any other (`AVX2`, a typo oneDNN would ignore) leaves it out."""
ONEDNN_ISA_ALLOWED = ("ALL", "DEFAULT", "AVX512_CORE", "AVX10")
ONEDNN_ISA_CAP = "AVX512_CORE_BF16"
"""`ONEDNN_MAX_CPU_ISA` wherever eqtrain runs oneDNN's products (its probe,
and a process that chose them) and the user set no cap: oneDNN stays on the
`avx512_core` kernels the tests verified, never the AMX or AVX10 ones of newer
processors, which no test has run. For f32
products it changes nothing (oneDNN runs AMX for bf16 and int8 only)."""
ONEDNN_JAXLIB = ("0.10.",)
"""The jaxlib versions whose oneDNN fusions `eqtrain.cpu._onednn`'s check was
verified against, shape by shape (`tests/test_onednn.py`): which fusions
abort the process and which compute wrongly change between versions.
jaxlib 0.11.2 aborts on `c - x @ y`, which
0.10.2 runs; a new version is added here once the tests pass on it."""
FALLBACK = "eigen_dots"  # what is applied when nothing can be measured
CACHE_VERSION = 4  # 4: interleaved rounds, each candidate's times kept
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
ROUNDS = 3
"""How many times each candidate is timed, interleaved with the others."""
STEPS = 3
"""Steps per form in a round (their median is the round's time)."""
PROBE_MEMORY = 3 * 2**30
"""What one probe process may hold, with room to spare (the JAX runtime,
two compiled steps, and glibc keeping freed memory, as `tune_cpu`'s
allocator settings make it). `Probes` keeps only as many alive as the
available memory holds this often; the others are stopped and started
again for their next round (a compilation more each)."""

Probe = Callable[..., dict[str, float]]  # (flags) or (flags, threads): one round
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
    whose oneDNN fusions `eqtrain.cpu._onednn`'s check was verified against
    (`ONEDNN_JAXLIB`)."""
    jaxlib = _version("jaxlib") if jaxlib is None else jaxlib
    isa = all(name in cpu["isa"] for name in ONEDNN_ISA)
    capped = onednn_isa_capped(environ) is not None
    return isa and not capped and jaxlib.startswith(ONEDNN_JAXLIB)


def candidates(cpu: Mapping[str, Any]) -> dict[str, str]:
    """The flag sets measured on `cpu` (`processor()`): `AUTOMATIC`, less
    512-bit vectors without AVX-512."""
    skip = set() if "avx512f" in cpu["isa"] else {"eigen_dots_512"}
    return {k: CANDIDATES[k] for k in AUTOMATIC if k not in skip}


def pinned(value: str, cpu: Mapping[str, Any] | None = None) -> "Choice | None":
    """The setting `EQTRAIN_CPU_TUNING=value` names, applied without
    measuring; None where `value` asks for measurement (`MEASURED`).
    `fixed` is the default (`FALLBACK`, unrolled); otherwise a name of
    `CANDIDATES`, then optionally `scanned` or `unrolled` and `threads=N`,
    comma-separated. Raises ValueError, saying what is accepted, for
    anything else, and for `onednn_dots` where oneDNN's products cannot run
    safely (`onednn_verified`)."""
    text = value.strip().lower()
    if text in MEASURED:
        return None
    name, *rest = [part.strip() for part in text.split(",")]
    name, source = (FALLBACK, "fixed") if name == "fixed" else (name, "pinned")
    accepted = (
        f"expected 0 (off), fixed, or one of {', '.join(CANDIDATES)} followed "
        "by ',scanned' or ',unrolled' and ',threads=N' if wanted (e.g. "
        "eigen_dots_512,scanned)"
    )
    if name not in CANDIDATES:
        raise ValueError(f"{ENV}={value!r}: {name!r} is no setting; {accepted}.")
    scan, threads = False, None
    for part in rest:
        count = part.removeprefix("threads=")
        if part in ("scanned", "unrolled"):
            scan = part == "scanned"
        elif part.startswith("threads=") and count.isdigit() and int(count) > 0:
            threads = int(count)
        else:
            raise ValueError(f"{ENV}={value!r}: cannot read {part!r}; {accepted}.")
    if name == "onednn_dots" and not onednn_verified(cpu or processor()):
        raise ValueError(
            f"{ENV}={value!r}: oneDNN's products run safely only with AVX-512 "
            f"({'/'.join(ONEDNN_ISA)}), oneDNN not held below it "
            f"({'/'.join(ONEDNN_ISA_ENV)}) and jaxlib {ONEDNN_JAXLIB[0]}x; "
            "choose another setting."
        )
    return Choice(name, CANDIDATES[name], scan, {}, source, threads)


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
        measured: each candidate's times, a list of one per round by form
            (`{"scanned_ms": [...], "unrolled_ms": [...]}`), empty when
            nothing was measured.
        source: "measured", "cached", "noisy" (the rounds disagreed: the
            default applies), "fixed"/"pinned" (`EQTRAIN_CPU_TUNING` named
            it) or why nothing was measured.
        threads: XLA's CPU threads (`PJRT_NPROC`) where fewer than the
            schedulable CPUs measured faster (a container's CPU quota, one
            thread per core); None: XLA's own count.
    """

    name: str
    flags: str
    scan_layers: bool
    measured: dict[str, dict[str, list[float]]]
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

    @property
    def spec(self) -> str:
        """The `EQTRAIN_CPU_TUNING` value that applies this choice anywhere
        without measuring (`pinned`)."""
        layers = "scanned" if self.scan_layers else "unrolled"
        threads = f",threads={self.threads}" if self.threads else ""
        return f"{self.name},{layers}{threads}"

    def describe(self) -> str:
        """One line for `eqtrain info` and the dry run: the setting, why, and
        each candidate's probe step over the rounds (median, and the range
        where the rounds differ)."""
        layers = "scanned" if self.scan_layers else "unrolled"
        threads = f", {self.threads} threads" if self.threads else ""
        if self.source in ("fixed", "pinned"):
            spec = "fixed" if self.source == "fixed" else self.spec
            return f"{self.name}, {layers} layers{threads} ({ENV}={spec})"
        if not self.measured:
            return f"{self.name} (not measured: {self.source})"
        said = f"{self.source}; a probe step: {spreads(self.measured)}"
        return f"{self.name}, {layers} layers{threads} ({said})"


MARGIN = 0.05
"""How much faster a candidate must be than the default (`FALLBACK`, unrolled
layers) to be chosen: one probe's step varies by a few percent on a shared
machine, and a choice made on noise would flip from one measurement to the
next."""


def _rounds_of(m: Mapping[str, Any]) -> list[float]:
    """A candidate's time per round, its faster form's (a cached single
    number counts as one round)."""
    forms = [v if isinstance(v, list) else [v] for v in m.values()]
    return [min(ts) for ts in zip(*forms, strict=False)]


def _spread(m: Mapping[str, Any]) -> str:
    """`1317 ms` or `1317 ms (1290-1402)`: the median round and the range."""
    ts = sorted(_rounds_of(m))
    mid = ts[len(ts) // 2]
    return f"{mid:.0f} ms" + (f" ({ts[0]:.0f}-{ts[-1]:.0f})" if ts[-1] > ts[0] else "")


def spreads(measured: Mapping[str, Mapping[str, Any]]) -> str:
    """Each candidate's probe step over the rounds, by name (`_spread`)."""
    return ", ".join(f"{n} {_spread(m)}" for n, m in sorted(measured.items()))


def _faster(a: float, b: float) -> bool:
    """Whether `a` ms beats `b` ms by more than `MARGIN`."""
    return a < b * (1 - MARGIN)


def _best(
    measured: Mapping[str, Mapping[str, float]], base: str = FALLBACK
) -> tuple[str, bool]:
    """One round's choice: the fastest variant (by its faster layer form),
    unless `base` is within `MARGIN` of it; and whether scanned layers beat
    unrolled ones by more than `MARGIN` under it."""
    name = min(measured, key=lambda n: min(measured[n].values()))
    if base in measured:
        fallback, best = min(measured[base].values()), min(measured[name].values())
        name = name if _faster(best, fallback) else base
    timings = measured[name]
    return name, _faster(timings["scanned_ms"], timings["unrolled_ms"])


def probe_env(flags: str, threads: int | None = None) -> dict[str, str]:
    """The environment of a probe process: `flags`, `PROBE_ALLOCATOR` (the
    user's own variables win), `ONEDNN_ISA_CAP` for oneDNN's products,
    `PJRT_NPROC` for `threads`, and this eqtrain's parent directory first
    on the path."""
    env = {**PROBE_ALLOCATOR, **os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    if threads:
        env[THREADS_ENV] = str(threads)
    if "onednn" in flags:
        cap_onednn(env)
    here = str(Path(__file__).resolve().parents[2])  # the folder holding eqtrain/
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    return env


class Probes:
    """The probe processes of one measurement: `probes(flags, threads)` times
    one round of `_probe` (eqtrain's own Llama step) under `flags`, in a
    process started for that setting at its first round and kept until
    `close()`, so that the rounds of several settings interleave and each
    compiles once (`-P`: the working directory's files never shadow a
    module). A process that fails, or takes over `PROBE_TIMEOUT_S` for a
    start or a round, raises RuntimeError and is stopped. At most `alive`
    processes run at once (by default as many as the available memory
    holds, `PROBE_MEMORY` each): starting one more stops the oldest."""

    def __init__(self, alive: int | None = None) -> None:
        self.alive = _memory_allows() if alive is None else alive
        self._procs: dict[tuple[str, int | None], subprocess.Popen[str]] = {}
        self._errs: dict[int, Any] = {}  # each process's standard error, a file

    def __call__(self, flags: str, threads: int | None = None) -> dict[str, float]:
        key = (flags, threads)
        proc = self._procs.get(key)
        if proc is None:
            while len(self._procs) >= max(1, self.alive):
                self._stop(next(iter(self._procs)))
            err = tempfile.TemporaryFile()  # noqa: SIM115 (closed with the probe)
            proc = self._procs[key] = subprocess.Popen(
                [sys.executable, "-P", "-m", "eqtrain.cpu._probe", "--serve",
                 f"--steps={STEPS}"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, text=True, env=probe_env(flags, threads),
            )  # fmt: skip
            self._errs[proc.pid] = err
            self._line(proc)  # READY: compiled and warmed up
        try:
            assert proc.stdin is not None
            proc.stdin.write("round\n")
            proc.stdin.flush()
        except OSError as e:
            raise RuntimeError(self._failure(proc, str(e))) from None
        return json.loads(self._line(proc))

    def _line(self, proc: subprocess.Popen[str]) -> str:
        import select

        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], PROBE_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        if not line:
            why = "it exited" if ready else f"no answer within {PROBE_TIMEOUT_S} s"
            raise RuntimeError(self._failure(proc, why))
        return line.strip()

    def _failure(self, proc: subprocess.Popen[str], why: str) -> str:
        proc.kill()
        proc.wait()
        err = self._errs[proc.pid]
        err.seek(0)
        last = err.read().decode(errors="replace").strip().splitlines()[-1:] or [why]
        return f"the probe failed ({why}): {last[0]}"

    def _stop(self, key: tuple[str, int | None]) -> None:
        proc = self._procs.pop(key)
        proc.kill()
        proc.wait()
        self._errs.pop(proc.pid).close()

    def close(self) -> None:
        for key in list(self._procs):
            self._stop(key)


def _memory_allows(meminfo: Path = Path("/proc/meminfo")) -> int:
    """How many probe processes the available memory holds (`PROBE_MEMORY`
    each; 1 where it cannot be read)."""
    for line in _read_text(meminfo).splitlines():
        if line.startswith("MemAvailable:"):
            kb = line.split()[1]
            return max(1, int(kb) * 1024 // PROBE_MEMORY) if kb.isdigit() else 1
    return 1


def probe() -> Probes:
    """A new set of probe processes (`Probes`); the tests put a fake here."""
    return Probes()


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
    cpu: Mapping[str, Any],
    run: Probe | None = None,
    threads: Sequence[int] = (),
    rounds: int = ROUNDS,
) -> Choice:
    """Time every candidate of `cpu` in `rounds` interleaved rounds (`run(flags)`
    times one round; by default the processes of `probe()`), and choose in
    each round on its own (`_best`); then the chosen flags on each of
    `threads` beside its own count (`run(flags, n)`), kept where faster by
    `MARGIN`. The choice holds only if every round made it and the rounds'
    `noise` stays under `MARGIN`: otherwise the default, with source "noisy"
    (a busy machine). A candidate whose probe fails is left out (the
    default's failing fails the measurement)."""
    own = probe() if run is None else None
    try:
        return _measure(cpu, own or run, threads, rounds)  # type: ignore[arg-type]
    finally:
        if own is not None:
            own.close()


def _measure(
    cpu: Mapping[str, Any], run: Probe, threads: Sequence[int], rounds: int
) -> Choice:
    flags = candidates(cpu)
    measured = _interleave(run, {n: (f, None) for n, f in flags.items()}, rounds)
    picks = {_best(_round(measured, i)) for i in range(rounds)}
    if len(picks) > 1 or noise(measured, FALLBACK) >= MARGIN:
        return Choice(FALLBACK, CANDIDATES[FALLBACK], False, measured, "noisy")
    ((name, scan),) = picks
    variants = {f"{name} on {n} threads": (CANDIDATES[name], n) for n in threads}
    if not variants:
        return Choice(name, CANDIDATES[name], scan, measured, "measured")
    more = _interleave(run, {name: (CANDIDATES[name], None), **variants}, rounds)
    picks = {_best(_round(more, i), name) for i in range(rounds)}
    measured.update((k, v) for k, v in more.items() if k != name)
    if len(picks) > 1 or noise(more, name) >= MARGIN:
        return Choice(FALLBACK, CANDIDATES[FALLBACK], False, measured, "noisy")
    ((label, faster_scan),) = picks
    if label == name:
        return Choice(name, CANDIDATES[name], scan, measured, "measured")
    n = variants[label][1]
    return Choice(name, CANDIDATES[name], faster_scan, measured, "measured", n)


def _interleave(
    run: Probe, variants: Mapping[str, tuple[str, int | None]], rounds: int
) -> dict[str, dict[str, list[float]]]:
    """Each variant's times per round, the variants taken in turn within a
    round (their order rotating from round to round). A variant whose probe
    fails is dropped, except the first (the baseline), whose failure raises."""
    names, base = list(variants), next(iter(variants))
    out: dict[str, dict[str, list[float]]] = {}
    for i in range(rounds):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            flags, n = variants[name]
            try:
                times = run(flags) if n is None else run(flags, n)
            except (OSError, RuntimeError, ValueError, subprocess.SubprocessError):
                if name == base:
                    raise
                names.remove(name)
                out.pop(name, None)
                continue
            for form, ms in times.items():
                out.setdefault(name, {}).setdefault(form, []).append(float(ms))
    return out


def noise(measured: Mapping[str, Mapping[str, list[float]]], base: str) -> float:
    """How much the rounds disagree: the widest range, over the rounds, of a
    candidate's time (each form) over `base`'s in the same round (its faster
    form). Taking the ratio within a round cancels what slows every
    candidate alike; what remains is the noise a choice must stand above
    (`MARGIN`)."""
    ref = _rounds_of(measured[base])
    widths = [0.0]
    for m in measured.values():
        for ts in m.values():
            ratios = [t / r for t, r in zip(ts, ref, strict=True)]
            widths.append(max(ratios) - min(ratios))
    return max(widths)


def _round(
    measured: Mapping[str, Mapping[str, list[float]]], i: int
) -> dict[str, dict[str, float]]:
    return {n: {f: ts[i] for f, ts in m.items()} for n, m in measured.items()}


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
