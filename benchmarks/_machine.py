"""The machine a benchmark ran on, for every benchmark's output.

Figures measured on one processor do not hold on another (docs/performance.md
keeps its tables per processor), so each benchmark prints this first, as one
JSON line `{"machine": {...}}`: the CPU's model name, family and model, its
cores, the instruction-set extensions that change XLA's and torch's kernels,
the library versions, and the CPU settings in force (`XLA_FLAGS`, glibc's
allocator thresholds, oneDNN's ISA cap, XLA's thread count, `EQTRAIN_CPU_TUNING`, what
`eqtrain.cpu.tune_cpu` chose) and the load when it started.

    from _machine import print_machine
    print_machine()  # first thing in main(), after the CPU settings are chosen
"""

import importlib.metadata
import json
import os
from typing import Any

from eqtrain.cpu._tune import cpu_settings
from eqtrain.cpu._tuning import processor


LIBRARIES = ("jax", "jaxlib", "equinox", "torch", "transformers")


def cpuinfo(text: str | None = None) -> dict[str, Any]:
    """Model name, family, model and ISA flags from `/proc/cpuinfo` (or `text`),
    as `eqtrain.cpu.tune_cpu` keys its choices."""
    return processor(text)


def versions() -> dict[str, str]:
    """Installed versions of the libraries a benchmark may compare."""
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def settings() -> dict[str, str]:
    """The CPU settings in force: environment variables eqtrain and XLA read."""
    names = (
        "XLA_FLAGS",
        "EQTRAIN_CPU_TUNING",
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TRIM_THRESHOLD_",
        "MALLOC_ARENA_MAX",
        "ONEDNN_MAX_CPU_ISA",
        "DNNL_MAX_CPU_ISA",
        "PJRT_NPROC",
    )
    found = {n: os.environ[n] for n in names if n in os.environ}
    return found | {"tune_cpu": cpu_settings()}


def machine() -> dict[str, Any]:
    """Everything above, plus the core count and the load average at the call."""
    return {
        **cpuinfo(),
        "cores": os.cpu_count(),
        "versions": versions(),
        "settings": settings(),
        "load": [round(x, 2) for x in os.getloadavg()],
    }


def print_machine() -> dict[str, Any]:
    """Print `{"machine": machine()}` as one JSON line and return the dict."""
    found = machine()
    print(json.dumps({"machine": found}), flush=True)
    return found
