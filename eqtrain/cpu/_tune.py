"""Settings that make training on the CPU faster (docs/performance.md, "CPU
settings"), applied by `tune_cpu`, and the options the core's compilations
take from them (`step_options`, `generation_options`).

Two settings, both for this process only:

- **glibc's allocator**: XLA's CPU runtime allocates and frees its buffers every
  step; with glibc's defaults large frees go back to the OS (`munmap`, heap trims)
  and come back as page faults on the next step. A fixed mmap threshold and a
  large trim threshold keep them in the heap, as the environment variables
  `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` would at start-up;
  `mallopt` sets the same two parameters in a running process. One arena
  (`MALLOC_ARENA_MAX=1`'s setting): XLA's worker threads allocate a step's
  temporary buffer (hundreds of MB for a small model's step) from their own
  arenas, whose heaps are at most 64 MB, so glibc maps every such buffer
  afresh (`mmap`, whatever the thresholds) and the step pays a page fault for
  each of its pages; in the one main arena it stays in the heap
  (docs/performance.md, "One glibc arena: `benchmarks/page_faults.py`").
- **XLA's flags**, chosen by measurement (`_tuning`): Eigen's products
  (`--xla_cpu_experimental_ynn_fusion_type=`, empty: split over all of XLA's
  threads, where YNNPACK fusions run each product on one thread), XLA's own
  defaults, Eigen's with 512-bit vectors on AVX-512, or oneDNN's products on
  AVX-512, whichever trained a probe step fastest on this processor (measured
  once, cached). They have to be in `XLA_FLAGS` before JAX starts its CPU
  backend, except oneDNN's, which `eqtrain.jit` passes to each step it
  compiles and checks there (`eqtrain.cpu._onednn`).
  The same measurement says whether layers train faster scanned or unrolled
  here (`layers_scanned`, which `model.scan_layers = "auto"` follows).

`tune_cpu()` applies both unless the user chose otherwise (either variable set,
XLA flags of its own for the products or the vector width, or
`EQTRAIN_CPU_TUNING=0`). `EQTRAIN_CPU_TUNING=fixed` applies the settings
without measuring (Eigen's products, unrolled layers). The CLI calls it first;
a script calls it before its first JAX computation.
"""

import contextlib
import ctypes
import ctypes.util
import dataclasses
import datetime
import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from . import _onednn, _tuning


ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
"""The environment variables that set glibc's two thresholds at start-up."""
ARENA_ENV = "MALLOC_ARENA_MAX"
"""The environment variable that sets glibc's number of arenas at start-up."""
XLA_CPU_FLAG = _tuning.EIGEN_DOTS
USER_FLAGS = ("ynn_fusion_type", "prefer_vector_width")
"""Any of these in `XLA_FLAGS`: the user chose XLA's CPU flags (never replaced)."""
OPT_OUT = _tuning.ENV
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # mallopt's
_THRESHOLD = _tuning.ALLOCATOR_THRESHOLD  # the variables' 4e9 in spirit

_state: dict[str, object] = {
    "allocator": False, "arena": False, "choice": None,
}  # fmt: skip


class CPUPerformanceWarning(UserWarning):
    """A CPU run without eqtrain's CPU settings (see `eqtrain.cpu.tune_cpu`).
    Nothing warns with it since `fit` stopped hinting at them; kept for code
    that filters it."""


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None
    except OSError:  # not glibc (musl has no mallopt)
        return None


def _backends_started() -> bool:
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def _choice(
    environ: MutableMapping[str, str], say: Callable[[str], None] | None, measure: bool
) -> _tuning.Choice:
    """This processor's measured (or cached) choice; the one
    `EQTRAIN_CPU_TUNING` names (`_tuning.pinned`; `fixed`: the default), without
    measuring (ConfigError for a value that names none)."""
    try:
        named = _tuning.pinned(environ.get(OPT_OUT, ""))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if named is not None:
        return named
    return choose(say=say, measure_now=measure, threads=_tuning.thread_counts(environ))


def layers_scanned() -> bool:
    """Whether `model.scan_layers = "auto"` scans the layers on the CPU: as this
    process's measured choice says (`tune_cpu`), else unrolled."""
    choice = _state["choice"]
    return isinstance(choice, _tuning.Choice) and choice.scan_layers


XLA_OWN_PRODUCTS = {
    "xla_cpu_experimental_ynn_fusion_type": (
        "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE"
    ),
}
"""XLA's default YNNPACK fusions in jaxlib 0.10 (products and reductions), as
one compilation's options: they undo `EIGEN_DOTS` for that compilation
(`tests/test_generate_cpu.py` compiles generation both ways and compares)."""


def generation_options() -> dict[str, str]:
    """XLA options for compiling generation on the CPU: XLA's own products
    (`XLA_OWN_PRODUCTS`) where `tune_cpu` put Eigen's into `XLA_FLAGS`, else
    none. `tune_cpu` measured a training step; a decode step multiplies one
    row per prompt, and there YNNPACK's products are faster than Eigen's
    (docs/generation.md). Flags the user set stand (`tune_cpu` then chose
    nothing)."""
    choice = _state["choice"]
    if not isinstance(choice, _tuning.Choice):
        return {}
    if XLA_CPU_FLAG not in choice.process_flags.split():
        return {}
    import jax

    return dict(XLA_OWN_PRODUCTS) if jax.default_backend() == "cpu" else {}


def step_options() -> _onednn.StepOptions:
    """The checked XLA options for one step compiled with `eqtrain.jit`
    (`compiler_options=`): oneDNN's products where `tune_cpu` chose them
    (each compiled step checked before it runs), else none."""
    return _onednn.StepOptions(_onednn.compiler_options())


def cpu_settings() -> str:
    """What `tune_cpu` chose for XLA in this process, in one line."""
    choice = _state["choice"]
    if isinstance(choice, _tuning.Choice):
        return choice.describe()
    return str(choice or "none (eqtrain.cpu.tune_cpu was not called)")


def shared_setting() -> dict[str, str]:
    """`EQTRAIN_CPU_TUNING` for other processes of this run (the Ray
    launcher's workers), so that they apply this process's choice without
    measuring it again: every process then computes alike (processes equal
    devices bit for bit only under one setting). {} where this process
    chose nothing (tuning not called, or the user's own XLA flags, which
    the user passes on)."""
    choice = _state["choice"]
    if isinstance(choice, _tuning.Choice):
        return {OPT_OUT: choice.spec}
    if isinstance(choice, str) and choice.startswith("off"):
        return {OPT_OUT: "0"}
    return {}


def setting_code() -> int:
    """A number that differs between processes applying different CPU
    settings (`cpu_settings()`'s setting, without how it was found), for
    `eqtrain.distributed.agree`."""
    import zlib

    choice = _state["choice"]
    what = choice.spec if isinstance(choice, _tuning.Choice) else str(choice)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]  # fmt: skip
    threads = os.environ.get(_tuning.THREADS_ENV, "")
    text = "|".join([what, *flags, threads])
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def allocator_tuned(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether glibc's thresholds were set: by `tune_cpu` or in the environment."""
    environ = os.environ if environ is None else environ
    return _state["allocator"] or all(name in environ for name in ALLOCATOR_ENV)


def tune_cpu(
    environ: MutableMapping[str, str] | None = None,
    *,
    dots: bool = True,
    say: Callable[[str], None] | None = None,
    measure: bool = True,
) -> list[str]:
    """Apply eqtrain's CPU settings to this process; return what was applied.

    Sets glibc's mmap and trim thresholds with `mallopt` (unless
    `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_` is set: the user's
    choice stands) and its arenas to one (unless `MALLOC_ARENA_MAX` is set),
    and appends this processor's XLA flags to `XLA_FLAGS`:
    the fastest of `_tuning.CANDIDATES` on a probe training step, measured
    the first time this processor and JAX version are met (a minute or two, said
    through `say`) and cached in the user's cache directory
    (`_tuning.cache_path`). Not when the flags already set the products or
    the vector width (the user's choice stands), nor once JAX's backends have
    started (too late to take effect). `EQTRAIN_CPU_TUNING=fixed` applies
    Eigen's products without measuring; `EQTRAIN_CPU_TUNING=0` turns
    everything off. `measure=False` uses a cached choice but never probes
    (the default flags until one is cached). `cpu_settings()` says what was
    chosen. Where fewer XLA threads than schedulable CPUs measured faster (a
    container's CPU quota, two threads per core), `PJRT_NPROC` is set to
    that count unless the user set it. Where oneDNN's products are chosen,
    `ONEDNN_MAX_CPU_ISA` is set to
    the kernels verified (`_tuning.ONEDNN_ISA_CAP`) unless the user set
    it or `DNNL_MAX_CPU_ISA`. The settings only speed
    up the CPU backend; on a GPU or TPU host they change nothing the device
    runs. Products computed by Eigen round differently from YNNPACK's (within
    f32 tolerances), so a CPU result changes in its last bits with the flags.
    `dots=False` leaves XLA's dots alone (the allocator only), as `eqtrain
    generate` does. Generation compiles with XLA's own products whatever was
    chosen here (`generation_options`): its one-row-per-prompt products are
    faster with YNNPACK than with Eigen (docs/generation.md).

    Example:
        >>> import eqtrain
        >>> applied = eqtrain.cpu.tune_cpu()  # first thing in a CPU training script
    """
    environ = os.environ if environ is None else environ
    if environ.get(OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off"):
        _state["choice"] = f"off ({OPT_OUT}=0)"
        _onednn.activate({})
        return []
    applied = _tune_allocator(environ)
    if dots and _set_xla_flags(environ, say, measure):
        applied.append("xla_flags")
    return applied


def _tune_allocator(environ: MutableMapping[str, str]) -> list[str]:
    """glibc's thresholds and one arena by `mallopt`, each unless the
    environment sets it (the user's choice stands)."""
    libc = _glibc()
    if libc is None:
        return []
    applied = []
    if not _state["allocator"] and not any(n in environ for n in ALLOCATOR_ENV):
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)
        if ok & libc.mallopt(_M_TRIM_THRESHOLD, _THRESHOLD):
            _state["allocator"] = True
            applied.append("allocator")
    if not _state["arena"] and ARENA_ENV not in environ:
        # Threads that already have an arena keep it: before JAX starts, none has.
        if libc.mallopt(_M_ARENA_MAX, 1):
            _state["arena"] = True
            applied.append("arena")
    return applied


def _set_xla_flags(
    environ: MutableMapping[str, str], say: Callable[[str], None] | None, measure: bool
) -> bool:
    """Add the chosen XLA flags to `XLA_FLAGS`, unless the user set their own
    or JAX's backends have started (too late to take effect)."""
    flags = environ.get("XLA_FLAGS", "")
    if any(name in flags for name in USER_FLAGS):
        _state["choice"] = "yours (XLA_FLAGS sets the CPU's products)"
        _onednn.activate({})
        return False
    if _backends_started():
        _state["choice"] = "none (JAX had started: call tune_cpu first)"
        return False
    choice = _choice(environ, say, measure)
    _state["choice"] = choice
    _onednn.activate(choice.compiler_options)  # eqtrain.jit's, per compilation
    if choice.compiler_options:
        _tuning.cap_onednn(environ)  # the kernels verified
    if choice.threads and not environ.get(_tuning.THREADS_ENV):
        environ[_tuning.THREADS_ENV] = str(choice.threads)
    if choice.process_flags:
        environ["XLA_FLAGS"] = f"{flags} {choice.process_flags}".strip()
    return True


RETRY_AFTER_DAYS = 7
"""A probe that failed (a crash, a timeout on a loaded machine) is tried again
this many days later; until then the default (`FALLBACK`) applies at once."""
NOISY_RETRY_DAYS = 1
"""A measurement whose rounds disagreed (a busy machine) is tried again this
many days later; until then the default applies at once."""
LOCK_WAIT_S = 900
"""How long a process waits for another one of the same machine measuring
(`_measuring`): the probes' own timeouts end a measurement before."""


def _default(reason: str) -> _tuning.Choice:
    name = _tuning.FALLBACK
    return _tuning.Choice(name, _tuning.CANDIDATES[name], False, {}, reason)


def _failed(entry: Mapping[str, Any], path: Path) -> _tuning.Choice | None:
    """`FALLBACK` for a cached failure of the probe younger than
    `RETRY_AFTER_DAYS`, or a cached disagreement of its rounds younger than
    `NOISY_RETRY_DAYS` (else None: measure again)."""
    try:
        day = datetime.date.fromisoformat(str(entry.get("measured_at")))
    except ValueError:
        return None
    noisy = "noisy" in entry and "failed" not in entry
    days = NOISY_RETRY_DAYS if noisy else RETRY_AFTER_DAYS
    retry = day + datetime.timedelta(days=days)
    if not ("failed" in entry or noisy) or datetime.date.today() >= retry:
        return None
    what = (
        f"the probe's rounds disagreed on {day} (a busy machine?): {entry['noisy']}"
        if noisy
        else f"the probe failed on {day}: {entry['failed']}"
    )
    return _default(
        f"{what}; measured again from {retry}, or delete {path} to measure at "
        "the next `eqtrain fit`"
    )


def _cached(path: Path, key: str) -> _tuning.Choice | None:
    """The cache's choice (or cached failure) for `key`, if any."""
    cached = _tuning.read_cache(path).get(key) or {}
    return _failed(cached, path) or _tuning.from_entry(cached, "cached")


@contextlib.contextmanager
def _measuring(
    path: Path, key: str, say: Callable[[str], None] | None
) -> Iterator[bool]:
    """Hold a lock file for `key` beside the cache while measuring, so that
    the processes of one machine starting together (a launch of several
    `eqtrain fit`) do not all probe at once, each timing the others' load:
    one measures, the others wait for it and read the cache (machines of
    another processor sharing the cache directory measure meanwhile: the
    lock is the key's). Yields False if the lock was not had within
    `LOCK_WAIT_S`; True without `fcntl` or a writable directory (measure
    unlocked, as before)."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    try:
        import fcntl

        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.parent / f"cpu_tuning-{digest}.lock", "a+b")  # noqa: SIM115
    except (ImportError, OSError):
        yield True
        return
    with f:
        deadline, told = time.monotonic() + LOCK_WAIT_S, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    yield False
                    return
                if say is not None and not told:
                    told = True
                    say("eqtrain: another process is measuring this processor's "
                        "CPU settings; waiting for its choice")  # fmt: skip
                time.sleep(0.2)
        try:
            yield True
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def choose(
    *,
    run: _tuning.Probe | None = None,
    say: Callable[[str], None] | None = None,
    measure_now: bool = True,
    threads: Sequence[int] = (),
) -> _tuning.Choice:
    """The cached choice for this processor, or a new one measured (`run`;
    `threads`: thread counts to measure too, `_tuning.thread_counts`) and cached;
    `FALLBACK` if measuring fails (the failure is cached too, so that a probe
    that cannot run here is not paid for at every start: it is tried again
    after `RETRY_AFTER_DAYS`), or without a cached choice when `measure_now`
    is False (a command that trains nothing should not wait for the probe).
    One process of a machine measures at a time (`_measuring`)."""
    path, cpu = _tuning.cache_path(), _tuning.processor()
    key = _tuning.cache_key(cpu, threads=threads)
    found = _cached(path, key)
    if found is not None:
        return found
    if not measure_now:
        return _default("not measured yet: the first `eqtrain fit` measures")
    with _measuring(path, key, say) as locked:
        if not locked:
            return _default("another process on this machine was still measuring")
        found = _cached(path, key)  # measured by the process waited for
        if found is not None:
            return found
        return _measure_and_cache(path, key, cpu, run, say, threads)


def _measure_and_cache(
    path: Path,
    key: str,
    cpu: Mapping[str, Any],
    run: _tuning.Probe | None,
    say: Callable[[str], None] | None,
    threads: Sequence[int],
) -> _tuning.Choice:
    if say is not None:
        say(f"eqtrain: measuring the CPU settings for this processor, once "
            f"(a minute or two; cached in {path})")  # fmt: skip
    today = time.strftime("%Y-%m-%d")
    try:
        choice = _tuning.measure(cpu, run, threads)
    except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
        # cached too: not measured again at every start
        _tuning.write_cache(path, key, {"failed": str(e)[:300], "measured_at": today})
        return _default(f"the probe failed: {e}")
    if choice.source == "noisy":  # nothing chosen: tried again later
        times = _tuning.spreads(choice.measured)
        noisy = {"noisy": times, "measured": choice.measured, "measured_at": today}
        _tuning.write_cache(path, key, noisy)
        return _failed(noisy, path) or _default(
            f"the probe's rounds disagreed: {times}"
        )
    entry = dataclasses.asdict(choice) | {"measured_at": today}
    _tuning.write_cache(path, key, {k: v for k, v in entry.items() if k != "source"})
    return choice
