"""The run manifest written with every checkpoint: config, versions, mesh, metrics."""

import functools
import importlib.metadata
import math
import os
import subprocess
import time
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding

from . import _integrity
from ._tree import array_leaves


FORMAT = 2  # 2: run_id and per-array checksums
_PACKAGES = ("jax", "jaxlib", "equinox", "optax", "orbax-checkpoint", "numpy")


@functools.cache
def versions() -> dict[str, str | None]:
    from .. import __version__

    out: dict[str, str | None] = {"eqtrain": __version__}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


@functools.cache
def git_revision(cwd: str) -> str | None:
    """`git rev-parse HEAD` of the working directory, or None (no git, no repo)."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def mesh_shape(state: Any) -> dict[str, int] | None:
    """The named mesh of the first `NamedSharding` leaf; None when unsharded."""
    _, leaves = array_leaves(state)
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return {str(k): int(v) for k, v in sharding.mesh.shape.items()}
    return None


def jsonable(value: Any) -> Any:
    """Plain JSON: non-finite floats become None, unknown objects their str."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    try:
        return jsonable(float(value))
    except (TypeError, ValueError):
        return str(value)


def build(
    *,
    step: int,
    state: Any,
    leaves: dict[str, Any],
    metrics: Mapping[str, Any],
    config: Mapping[str, Any] | None,
    stop_reason: Any,
    final: bool,
    run_id: str,
    checksums: dict[str, str],
    started_from: str | None = None,
    base: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    out = {
        "format": FORMAT,
        "run_id": run_id,
        "started_from": started_from,
        "step": step,
        "time": time.time(),
        "final": final,
        "stop_reason": None
        if stop_reason is None
        else {
            "kind": str(stop_reason.kind),
            "step": stop_reason.step,
            "message": stop_reason.message,
        },
        "metrics": jsonable(dict(metrics)),
        "config": jsonable(dict(config)) if config is not None else None,
        "versions": versions(),
        "git_revision": git_revision(os.getcwd()),
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "mesh": mesh_shape(state),
        "leaves": leaves,
        "checksum": _integrity.ALGORITHM,
        "checksums": checksums,
    }
    if base is not None:
        # Only the trained leaves are stored; the frozen ones are this base's.
        out["base"] = jsonable(dict(base))
    for name, value in (extra or {}).items():
        if name in out:
            raise ValueError(f"manifest entry {name!r} is eqtrain's own")
        out[name] = jsonable(value)
    return out
