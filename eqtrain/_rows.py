"""`vmap_rows`: the `jax.vmap` that losses run one-sequence models under. Under
a mesh it keeps a batch's rows on their devices when a `shard_map` inside the
model (sequence-parallel attention, the Pallas attention kernels) maps over the
whole mesh, and says so to the model (`rows_follow_mesh`)."""

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax


BATCH_AXES = ("data", "fsdp", "expert")  # = eqtrain.sharding.BATCH_AXES (a layer above)

# Whether the rows' `vmap` in progress follows the mesh (`rows_follow_mesh`):
# set while `vmap_rows` traces its function, read by the kernels inside it.
_FOLLOW: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "eqtrain_rows_follow_mesh", default=False
)


def row_axes(rows: int | None = None) -> tuple[str, ...] | None:
    """The mesh axes a batch of `rows` rows lies on, for `jax.vmap`'s
    `spmd_axis_name`: the batch axes of the mesh in context when it has a
    `sequence` axis larger than 1, or when XLA splits the batch axes over
    several devices and `rows` divides evenly over them; else None (a plain
    `vmap`)."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    axes = tuple(a for a in BATCH_AXES if a in sizes)
    if sizes.get("sequence", 1) > 1:
        return axes or None
    manual = set(getattr(mesh, "manual_axes", ()))
    split = tuple(a for a in axes if a not in manual)
    ways = math.prod(sizes[a] for a in split)
    if ways > 1 and rows is not None and rows % ways == 0:
        return split
    return None


def rows_follow_mesh() -> bool:
    """Whether the rows in progress are mapped by `vmap_rows` as the mesh holds
    them: each device's own rows reach a `shard_map` inside the model without
    a gather (the batch axes split them, or XLA splits no batch axis). False
    outside `vmap_rows`, and when the rows do not divide over the batch axes."""
    return _FOLLOW.get()


@contextlib.contextmanager
def _following(value: bool) -> Iterator[None]:
    token = _FOLLOW.set(value)
    try:
        yield
    finally:
        _FOLLOW.reset(token)


def _batch_ways() -> int:
    """How many ways XLA splits the batch axes of the mesh in context."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    manual = set(getattr(mesh, "manual_axes", ()))
    return math.prod(
        size for a, size in sizes.items() if a in BATCH_AXES and a not in manual
    )


def vmap_rows(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`jax.vmap(fn)` over the leading axis of every argument (the rows); under
    a mesh, with `spmd_axis_name` set to the batch axes (`row_axes`), so that a
    `shard_map` inside `fn` gets each device's own rows instead of gathering
    the batch."""

    @functools.wraps(fn)
    def mapped(*args: Any) -> Any:
        leaves = [x for x in jax.tree.leaves(args) if getattr(x, "ndim", 0)]
        rows = leaves[0].shape[0] if leaves else None
        axes = row_axes(rows)
        follow = axes is not None or _batch_ways() == 1

        def traced(*a: Any) -> Any:
            with _following(follow):
                return fn(*a)

        return jax.vmap(traced, spmd_axis_name=axes)(*args)

    return mapped
