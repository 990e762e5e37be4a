"""Settings that make training on the CPU faster, measured in docs/performance.md
("CPU settings"), and the one-time hint when a CPU run lacks them.

Two settings, both for this process only:

- **glibc's allocator**: XLA's CPU runtime allocates and frees its buffers every
  step; with glibc's defaults large frees go back to the OS (`munmap`, heap trims)
  and come back as page faults on the next step. A fixed mmap threshold and a
  large trim threshold keep them in the heap, as the environment variables
  `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` would at start-up;
  `mallopt` sets the same two parameters in a running process.
- **XLA's dot library**: `--xla_cpu_experimental_ynn_fusion_type=` (empty) makes
  XLA:CPU run matrix products with Eigen, split over all of its threads, instead of
  YNNPACK fusions that run each product on one thread. It has to be in `XLA_FLAGS`
  before JAX starts its CPU backend.

`tune_cpu()` applies both unless the user chose otherwise (either variable set,
any `ynn_fusion_type` in `XLA_FLAGS`, or `EQTRAIN_CPU_TUNING=0`). The CLI calls it
first; a script calls it before its first JAX computation.
"""

import ctypes
import ctypes.util
import os
import sys
import warnings
from collections.abc import MutableMapping


ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
"""The environment variables that set glibc's two thresholds at start-up."""
XLA_CPU_FLAG = "--xla_cpu_experimental_ynn_fusion_type="
OPT_OUT = "EQTRAIN_CPU_TUNING"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_THRESHOLD = 2**31 - 1  # mallopt takes an int: ~2 GB (the variables' 4e9 in spirit)

_state = {"allocator": False, "hinted": False}


class CPUPerformanceWarning(UserWarning):
    """A CPU run without eqtrain's CPU settings (see `eqtrain.tune_cpu`)."""


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


def _opted_out(environ: MutableMapping[str, str]) -> bool:
    return environ.get(OPT_OUT, "1").strip().lower() in ("0", "false", "no", "off")


def allocator_tuned(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether glibc's thresholds were set: by `tune_cpu` or in the environment."""
    environ = os.environ if environ is None else environ
    return _state["allocator"] or all(name in environ for name in ALLOCATOR_ENV)


def tune_cpu(
    environ: MutableMapping[str, str] | None = None, *, dots: bool = True
) -> list[str]:
    """Apply eqtrain's CPU settings to this process; return what was applied.

    Sets glibc's mmap and trim thresholds with `mallopt` (unless
    `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_` is set: the user's
    choice stands) and appends `--xla_cpu_experimental_ynn_fusion_type=` to
    `XLA_FLAGS` (unless the flags already name `ynn_fusion_type`, or JAX's
    backends have started, when it could no longer take effect).
    `EQTRAIN_CPU_TUNING=0` turns both off. Both settings only speed up the CPU
    backend; on a GPU or TPU host they change nothing the device runs.
    Products computed by Eigen round differently from YNNPACK's (within f32
    tolerances), so a CPU result changes in its last bits with the flag.
    `dots=False` leaves XLA's dots alone (the allocator only): generation's
    one-row-per-prompt products ran 3x faster with YNNPACK than with Eigen
    (docs/generation.md), so `eqtrain generate` does so.

    Example:
        >>> import eqtrain
        >>> applied = eqtrain.tune_cpu()  # first thing in a CPU training script
    """
    environ = os.environ if environ is None else environ
    if _opted_out(environ):
        return []
    applied = []
    if not _state["allocator"] and not any(n in environ for n in ALLOCATOR_ENV):
        libc = _glibc()
        if libc is not None:
            ok = libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)
            ok &= libc.mallopt(_M_TRIM_THRESHOLD, _THRESHOLD)
            if ok:
                _state["allocator"] = True
                applied.append("allocator")
    flags = environ.get("XLA_FLAGS", "")
    if dots and "ynn_fusion_type" not in flags and not _backends_started():
        environ["XLA_FLAGS"] = f"{flags} {XLA_CPU_FLAG}".strip()
        applied.append("xla_flags")
    return applied


def hint_cpu_settings() -> None:
    """Warn once per process when training runs on the CPU without the allocator
    settings (not after `EQTRAIN_CPU_TUNING=0`: the user chose)."""
    if _state["hinted"] or allocator_tuned() or _opted_out(os.environ):
        return
    if _glibc() is None:
        return
    import jax

    if jax.default_backend() != "cpu":
        return
    _state["hinted"] = True
    warnings.warn(
        "training on the CPU with glibc's default allocator thresholds: call "
        "`eqtrain.tune_cpu()` at the start of the script (before any JAX "
        "computation), or set MALLOC_MMAP_THRESHOLD_=4000000000 "
        "MALLOC_TRIM_THRESHOLD_=4000000000: up to 25-30% faster steps for models "
        "with many small arrays (docs/performance.md, 'CPU settings'). The "
        "`eqtrain` command does it itself.",
        CPUPerformanceWarning,
        stacklevel=3,
    )
