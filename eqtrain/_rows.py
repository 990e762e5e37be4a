"""`vmap_rows`: the `jax.vmap` that losses run one-sequence models under, which
keeps a batch's rows on their devices when sequence-parallel attention (a
`shard_map` over the whole mesh) runs inside the model."""

from collections.abc import Callable
from typing import Any

import jax


BATCH_AXES = ("data", "fsdp", "expert")  # = eqtrain.sharding.BATCH_AXES (a layer above)


def row_axes() -> tuple[str, ...] | None:
    """The mesh axes a batch's rows lie on, when the mesh in context has a
    `sequence` axis larger than 1 (else None: a plain `vmap`)."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    if sizes.get("sequence", 1) == 1:
        return None
    return tuple(a for a in BATCH_AXES if a in sizes) or None


def vmap_rows(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`jax.vmap(fn)` over rows; under a sequence-parallel mesh, with
    `spmd_axis_name` set to the batch axes, so that a `shard_map` inside `fn`
    gets each device's own rows instead of gathering the batch."""
    return jax.vmap(fn, spmd_axis_name=row_axes())
