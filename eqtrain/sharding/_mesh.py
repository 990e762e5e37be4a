"""Named device meshes with eqtrain's five axes, and how batches lie on them.

Every mesh has the axes `data`, `fsdp`, `expert`, `sequence` and `tensor` (unused
ones have size 1), so any `PartitionSpec` may name any of them; all are
`AxisType.Auto`, so XLA propagates shardings through the step on its own.
"""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .._errors import ConfigError


AXES = ("data", "fsdp", "expert", "sequence", "tensor")
"""Mesh axis names, outermost first. `tensor` is innermost: its collectives run
inside every layer, so its devices should be the closest together (consecutive
devices are neighbours on a host). `expert` splits a mixture-of-experts model's
experts (and, like `data`, the batch)."""

BATCH_AXES = ("data", "fsdp", "expert")
"""The mesh axes a batch's leading dimension is split over."""


def _sizes(axes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    _check_known(axes)
    sizes = {name: axes.get(name, 1) for name in AXES}
    _check_sizes(sizes)
    return _filled(sizes, num_devices)


def _check_known(axes: Mapping[str, int]) -> None:
    unknown = sorted(set(axes) - set(AXES))
    if unknown:
        raise ConfigError(
            f"unknown mesh axes {unknown}; the axes are {list(AXES)} (each "
            "defaults to size 1). Example: make_mesh({'data': -1, 'tensor': 2})."
        )


def _check_sizes(sizes: dict[str, Any]) -> None:
    """Positive ints, or -1 for at most one axis."""
    bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v == 0}
    bad |= {k: v for k, v in sizes.items() if isinstance(v, int) and v < -1}
    if bad:
        raise ConfigError(
            f"mesh axis sizes must be positive ints or -1 (the rest); got {bad}."
        )
    rest = [name for name, size in sizes.items() if size == -1]
    if len(rest) > 1:
        raise ConfigError(
            f"at most one mesh axis may be -1 (take the remaining devices); got "
            f"{rest}. Give all but one of them a size."
        )


def _filled(sizes: dict[str, int], num_devices: int) -> dict[str, int]:
    """`sizes` with the -1 axis taking the remaining devices, checked to use all."""
    rest = [name for name, size in sizes.items() if size == -1]
    known = math.prod(size for size in sizes.values() if size != -1)
    if rest:
        if num_devices % known:
            raise ConfigError(_mismatch(sizes, known, num_devices))
        sizes[rest[0]] = num_devices // known
    elif known != num_devices:
        raise ConfigError(_mismatch(sizes, known, num_devices))
    return sizes


def _mismatch(sizes: Mapping[str, int], product: int, num_devices: int) -> str:
    given = {k: v for k, v in sizes.items() if v not in (1, -1)}
    rest = [k for k, v in sizes.items() if v == -1]
    devices = "is 1 device" if num_devices == 1 else f"are {num_devices} devices"
    head = f"mesh axis sizes {given or dict(sizes)} multiply to {product}, but there "
    if rest:  # the advice to set an axis to -1 would be no advice at all
        fits = [d for d in range(1, num_devices + 1) if num_devices % d == 0]
        return (
            head + f"{devices}, which {product} does not divide, so "
            f"{rest[0]}=-1 cannot take the rest. Give the other axes sizes that "
            f"multiply to a divisor of {num_devices} ({', '.join(map(str, fits))})."
        )
    hint = _rest_hint(sizes, num_devices)
    return head + f"{devices}. Make the sizes multiply to {num_devices}{hint}."


def _rest_hint(sizes: Mapping[str, int], num_devices: int) -> str:
    """Advice to let an axis take the rest: one whose others' product divides the
    devices (not `sequence`, which a config cannot set to -1)."""
    takes = [
        k
        for k in sizes
        if k != "sequence"
        and num_devices % math.prod(v for n, v in sizes.items() if n != k) == 0
    ]
    return f", or set {takes[0]}=-1 to take the remaining devices" if takes else ""


def make_mesh(
    axes: Mapping[str, int] | None = None,
    *,
    devices: Sequence[Any] | None = None,
) -> Mesh:
    """A device mesh with the named axes `data`, `fsdp`, `expert`, `sequence`,
    `tensor`.

    Args:
        axes: size of each axis, e.g. `{"data": -1, "tensor": 2}`. Missing axes
            have size 1; one axis may be -1 to take the remaining devices. The
            sizes must multiply to the number of devices. Default: all devices
            on `data`.
        devices: the devices to lay out (default: `jax.devices()`).

    Returns:
        A `jax.sharding.Mesh` with all five axes, of type `AxisType.Auto` (XLA
        propagates shardings automatically inside `jit`).

    Raises:
        ConfigError: an unknown axis name, or sizes that do not fit the devices.

    Example:
        >>> mesh = make_mesh({"data": -1})
        >>> mesh.axis_names
        ('data', 'fsdp', 'expert', 'sequence', 'tensor')
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = _sizes({"data": -1} if axes is None else axes, len(devices))
    return _laid_out(tuple(sizes[name] for name in AXES), devices)


def _laid_out(shape: tuple[int, ...], devices: list[Any]) -> Mesh:
    """The mesh of `shape` over `devices`, with all axes `Auto`."""
    types = (AxisType.Auto,) * len(AXES)
    try:
        return jax.make_mesh(shape, AXES, axis_types=types, devices=devices)
    except (ValueError, NotImplementedError):
        # A device subset that `make_mesh` cannot lay out physically: in order.
        grid = np.asarray(devices, dtype=object).reshape(shape)
        return Mesh(grid, AXES, axis_types=types)


def axis_sizes(mesh: Mesh) -> dict[str, int]:
    """`{axis: size}` of a mesh (axes it lacks count as size 1)."""
    return {name: int(mesh.shape.get(name, 1)) for name in AXES} | {
        str(k): int(v) for k, v in mesh.shape.items()
    }


def _batch_axes(mesh: Mesh) -> tuple[str, ...]:
    return tuple(name for name in BATCH_AXES if name in mesh.shape)


def batch_sharding(mesh: Mesh, *, sequence: bool = False) -> NamedSharding:
    """The sharding of `[batch, ...]` arrays: the batch over `data`, `fsdp` and
    `expert`.

    Args:
        mesh: any `jax.sharding.Mesh` (from `make_mesh`, or `jax.make_mesh`);
            the batch axes it lacks count as size 1.
        sequence: also split dimension 1 (`[batch, seq, ...]`) over the `sequence`
            axis. Every batch entry then needs at least two dimensions; give
            the loader a dict of shardings if some entries are `[batch]`.

    Returns:
        `NamedSharding(mesh, P(("data", "fsdp", "expert")))` (the axes the mesh
        has), or `P(("data", "fsdp", "expert"), "sequence")` with `sequence=True`.

    Raises:
        ConfigError: `sequence=True` on a mesh without a `sequence` axis.
    """
    if sequence:
        if "sequence" not in mesh.shape:
            raise ConfigError(_no_sequence_axis(mesh))
        return NamedSharding(mesh, PartitionSpec(_batch_axes(mesh), "sequence"))
    return NamedSharding(mesh, PartitionSpec(_batch_axes(mesh)))


def _no_sequence_axis(mesh: Mesh) -> str:
    names = (*map(str, mesh.axis_names), "sequence")
    return (
        "batch_sharding(mesh, sequence=True): the mesh has no axis 'sequence' "
        f"(its axes: {list(mesh.shape)}) to split dimension 1 over. Build it with "
        "one of n devices: `eqtrain.sharding.make_mesh({'data': -1, 'sequence': "
        f"n}})`, or `jax.make_mesh((..., n), axis_names={names}, "
        f"axis_types=(jax.sharding.AxisType.Auto,) * {len(names)})`; or leave "
        "out sequence=True."
    )


def batch_divisor(mesh: Mesh) -> int:
    """How many ways a batch is split: the product of the `data`, `fsdp` and
    `expert` sizes."""
    return math.prod(int(mesh.shape[name]) for name in _batch_axes(mesh))


def check_batch(
    batch_size: int,
    mesh: Mesh,
    *,
    seq_len: int | None = None,
    accumulate: int = 1,
) -> None:
    """Raise `ConfigError` unless a global batch fits `batch_sharding(mesh)`.

    Args:
        batch_size: the global batch size (all processes, all micro-batches).
        mesh: the mesh.
        seq_len: with a `sequence` axis > 1, the sequence length to check too.
        accumulate: micro-batches per step: each micro-batch must split evenly.
    """
    _check_batch_size(batch_size, mesh, accumulate)
    if seq_len is not None:
        _check_seq_len(seq_len, mesh)


def _check_seq_len(seq_len: int, mesh: Mesh) -> None:
    seq_ways = int(mesh.shape.get("sequence", 1))
    if seq_len % seq_ways:
        raise ConfigError(
            f"the sequence length {seq_len} does not split over the mesh's "
            f"sequence axis of size {seq_ways}. Use a multiple of {seq_ways}."
        )


def _micro(batch_size: int, accumulate: int) -> str:
    """`" in 4 micro-batches of 8"` (nothing without accumulation)."""
    if accumulate > 1:
        return f" in {accumulate} micro-batches of {batch_size / accumulate:g}"
    return ""


def _check_batch_size(batch_size: int, mesh: Mesh, accumulate: int) -> None:
    """Each micro-batch splits evenly over the batch axes."""
    ways = batch_divisor(mesh)
    if batch_size % accumulate or (batch_size // accumulate) % ways:
        raise ConfigError(
            f"the batch of {batch_size}{_micro(batch_size, accumulate)} does not "
            f"split over the mesh's data x fsdp x expert = {ways} devices (mesh "
            f"{axis_sizes(mesh)}). Use a batch size that is a multiple of "
            f"{ways * accumulate}, or fewer data/fsdp/expert devices."
        )
