"""`data_parallel_step`: the training step with explicit collectives. Each device
computes the gradients of its own rows inside `jax.shard_map`, and they are
combined with `psum` over the data axes, weighted by tokens — the same result as
the automatic (GSPMD) step on a replicated state, written out by hand."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .._errors import ConfigError
from .._precision import Precision, as_precision
from .._state import TrainState
from .._step import build_step
from ._mesh import BATCH_AXES


def _reducer(axes: tuple[str, ...]) -> Callable[..., Any]:
    def reduce(loss: Any, aux: Any, weight: Any, grads: Any) -> Any:
        total = lax.psum(weight, axes)
        safe = jnp.where(total > 0, total, 1.0)
        # Each device's values are means over its own weight: re-weight, then sum.
        mean = lambda x: (lax.psum(x.astype(jnp.float32) * weight, axes) / safe).astype(
            x.dtype
        )
        return mean(loss), jtu.tree_map(mean, aux), total, jtu.tree_map(mean, grads)

    return reduce


def data_parallel_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axes: Sequence[str] = BATCH_AXES,
    accumulate: int = 1,
    precision: Precision | str | None = None,
    nonfinite: str = "skip",
    ema: float | None = None,
    schedule: optax.Schedule | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, Any]]:
    """`train_step` for data parallelism with explicit collectives.

    The state is replicated on every device of `mesh`; the batch is split over
    `axes` on its leading dimension. Inside `jax.shard_map`, each device runs the
    loss and its gradients on its rows (with `accumulate` micro-batches), then the
    loss, metrics and gradients are averaged across devices with `psum`, weighted
    by each device's tokens (`batch_weight`), so the result equals the automatic
    step's. Every device then applies the same optimizer update. Random keys are
    folded with the device's index along `axes`, so dropout differs per shard.

    Compile it with the shardings of `replicated(mesh)` and `batch_sharding`:

        step = eqtrain.jit(
            data_parallel_step(loss_fn, opt, mesh),
            shardings=(replicated(mesh), batch_sharding(mesh)),
        )

    Args:
        loss_fn, optimizer, accumulate, precision, nonfinite, ema, schedule: as
            for `eqtrain.train_step`.
        mesh: the device mesh (`make_mesh`).
        axes: the mesh axes the batch is split over (default `("data", "fsdp")`).

    Raises:
        ConfigError: an axis not in the mesh, or (at the first call) a state with
            a `model_state` (batch statistics would need their own reduction).
    """
    axes = tuple(axes)
    unknown = [a for a in axes if a not in mesh.shape]
    if unknown:
        raise ConfigError(
            f"data_parallel_step: axes {unknown} are not in the mesh (axes "
            f"{list(mesh.shape)})."
        )
    inner = build_step(
        loss_fn,
        optimizer,
        accumulate=accumulate,
        policy=as_precision(precision),
        nonfinite=nonfinite,
        ema=ema,
        schedule=schedule,
        reduce=_reducer(axes),
        fold_key=lambda key: jr.fold_in(key, _axis_index(axes)),
    )

    def step(state: TrainState, batch: Any) -> tuple[TrainState, Any]:
        if state.model_state is not None:
            raise ConfigError(
                "data_parallel_step does not reduce a `model_state` (e.g. batch "
                "statistics) across devices; use `train_step` (automatic "
                "partitioning) for stateful models."
            )
        arrays, static = eqx.partition(state, eqx.is_array)  # shard_map maps arrays

        def local(arrays: Any, batch: Any) -> Any:
            new, metrics = inner(eqx.combine(arrays, static), batch)
            new_arrays, _ = eqx.partition(new, eqx.is_array)
            return new_arrays, metrics

        mapped = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P(axes)),
            out_specs=(P(), P()),
            check_vma=False,
        )
        new_arrays, metrics = mapped(arrays, batch)
        return eqx.combine(new_arrays, static), metrics

    return step


def _axis_index(axes: tuple[str, ...]) -> Any:
    index = 0
    for a in axes:  # row-major over the axes, as the batch is split
        index = index * lax.axis_size(a) + lax.axis_index(a)
    return index


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding that puts a whole copy on every device of `mesh` (`P()`): the
    state's sharding for `data_parallel_step`."""
    return NamedSharding(mesh, P())
