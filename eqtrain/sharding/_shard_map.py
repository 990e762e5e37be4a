"""`data_parallel_step`: the training step with explicit collectives. Each device
computes the gradients of its own rows inside `jax.shard_map`, and they are
combined with `psum` over the data axes, weighted by tokens — the same result as
the automatic (GSPMD) step on a replicated state, written out by hand."""

from collections.abc import Callable, Sequence
from typing import Any

import optax
from jax import shard_map
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import step as steps
from .._errors import ConfigError
from .._precision import Precision
from ._mesh import BATCH_AXES


def data_parallel(
    grad_fn: steps.GradFn, mesh: Mesh, axes: Sequence[str] = BATCH_AXES
) -> steps.GradFn:
    """Run a gradient function data-parallel, with explicit collectives.

    Inside `jax.shard_map`, each device of `mesh` runs `grad_fn` on its rows of
    the batch (split over `axes` on the leading dimension) with the replicated
    parameters; `eqtrain.step.psum_grads` then averages loss, metrics and
    gradients across devices, weighted by tokens. The result is replicated.

    Raises:
        ConfigError: an axis not in the mesh (at once), or a model state (when
            traced: batch statistics would need their own reduction).
    """
    axes = tuple(axes)
    _check_axes(axes, mesh)
    local = steps.psum_grads(grad_fn, axes)

    def parallel(params, static, batch, key, model_state) -> steps.Grads:
        _refuse_model_state(model_state)
        mapped = shard_map(
            lambda p, b, k: local(p, static, b, k, None),
            mesh=mesh,
            in_specs=(P(), P(axes), P()),
            out_specs=P(),
            check_vma=False,
        )
        return mapped(params, batch, key)

    return parallel


def _check_axes(axes: tuple[str, ...], mesh: Mesh) -> None:
    unknown = [a for a in axes if a not in mesh.shape]
    if unknown:
        raise ConfigError(
            f"data_parallel_step: axes {unknown} are not in the mesh (axes "
            f"{list(mesh.shape)})."
        )


def _refuse_model_state(model_state: Any) -> None:
    if model_state is not None:
        raise ConfigError(
            "data_parallel_step does not reduce a `model_state` (e.g. batch "
            "statistics) across devices; use `train_step` (automatic "
            "partitioning) for stateful models."
        )


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
) -> steps.TrainStep:
    """`train_step` for data parallelism with explicit collectives.

    The state is replicated on every device of `mesh`; the batch is split over
    `axes` on its leading dimension. Each device runs the loss and its gradients
    on its rows (with `accumulate` micro-batches), then the loss, metrics and
    gradients are averaged across devices with `psum`, weighted by each device's
    tokens (`batch_weight`), so the result equals the automatic step's; the
    optimizer update then runs once on the replicated state. Random keys are
    folded with the device's index along `axes`, so dropout differs per shard.
    A recipe over `eqtrain.step`'s pieces:

        grads = microbatched(value_and_grad(loss_fn, precision=...), accumulate)
        step = finish_step(data_parallel(grads, mesh, axes), optimizer, ...)

    Compile it with the shardings of `replicated(mesh)` and `batch_sharding`:

        step = eqtrain.jit(
            data_parallel_step(loss_fn, opt, mesh),
            shardings=(replicated(mesh), batch_sharding(mesh)),
        )

    Args:
        loss_fn, optimizer, accumulate, precision, nonfinite, ema, schedule: as
            for `eqtrain.train_step` (checked the same way, at once).
        mesh: the device mesh (`make_mesh`).
        axes: the mesh axes the batch is split over (default `("data", "fsdp")`).

    Raises:
        ConfigError: a bad argument or an axis not in the mesh (at once), or (at
            the first call) a state with a `model_state`.
    """
    steps.check_nonfinite(nonfinite)
    grads = steps.microbatched(
        steps.value_and_grad(loss_fn, precision=precision), accumulate
    )
    return steps.finish_step(
        data_parallel(grads, mesh, axes),
        optimizer,
        nonfinite=nonfinite,
        ema=ema,
        schedule=schedule,
    )


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding that puts a whole copy on every device of `mesh` (`P()`): the
    state's sharding for `data_parallel_step`."""
    return NamedSharding(mesh, P())
