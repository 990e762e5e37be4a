"""The run manifest written with every checkpoint: config, versions, mesh, metrics,
and the states of the hooks that keep one."""

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

from .._hooks import StepInfo
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


def _stop_reason(reason: Any) -> dict[str, Any] | None:
    if reason is None:
        return None
    return {"kind": str(reason.kind), "step": reason.step, "message": reason.message}


def _environment(state: Any) -> dict[str, Any]:
    """Where the step was written: versions, git revision, devices, mesh."""
    return {
        "versions": versions(),
        "git_revision": git_revision(os.getcwd()),
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "mesh": mesh_shape(state),
    }


def _with_extra(manifest: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """`manifest` with the caller's `extra` entries, which may not replace ours."""
    for name, value in extra.items():
        if name in manifest:
            raise ValueError(f"manifest entry {name!r} is eqtrain's own")
        manifest[name] = jsonable(value)
    return manifest


def build(
    info: StepInfo,
    *,
    run_id: str,
    checksums: dict[str, str],
    leaves: dict[str, Any],
    config: Mapping[str, Any] | None,
    final: bool,
    started_from: str | None = None,
    base: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest of the checkpoint of `info.state` at `info.step`."""
    out = {
        "format": FORMAT,
        "run_id": run_id,
        "started_from": started_from,
        "step": int(info.step),
        "time": time.time(),
        "final": final,
        "stop_reason": _stop_reason(info.stop_reason),
        "metrics": jsonable(dict(info.metrics)),
        # plain JSON already (`fit` checks each hook's `state_dict()`)
        "hooks": jsonable(dict(info.hook_states or {})),
        "config": jsonable(dict(config)) if config is not None else None,
        **_environment(info.state),
        "leaves": leaves,
        "checksum": _integrity.ALGORITHM,
        "checksums": checksums,
    }
    if base is not None:
        # Only the trained leaves are stored; the frozen ones are this base's.
        out["base"] = jsonable(dict(base))
    return _with_extra(out, extra or {})
