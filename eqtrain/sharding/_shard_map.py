"""`data_parallel_step`: the training step with explicit collectives. Each device
computes the gradients of its own rows inside `jax.shard_map`, and they are
combined with `psum` over the data axes, weighted by tokens — the same result as
the automatic (GSPMD) step on a replicated state, written out by hand."""

import math
from collections.abc import Callable, Sequence
from typing import Any

import optax
from jax import shard_map
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import step as steps
from .._errors import ConfigError
from .._precision import Precision
from ._mesh import AXES, BATCH_AXES


def data_parallel(
    grad_fn: steps.GradFn, mesh: Mesh, axes: Sequence[str] | None = None
) -> steps.GradFn:
    """Run a gradient function data-parallel, with explicit collectives.

    Inside `jax.shard_map`, each device of `mesh` runs `grad_fn` on its rows of
    the batch (split over `axes` on the leading dimension) with the replicated
    parameters; `eqtrain.step.psum_grads` then averages loss, metrics and
    gradients across devices, weighted by tokens. The result is replicated.

    Args:
        grad_fn: a gradient function (`eqtrain.step.value_and_grad`, ...).
        mesh: any `jax.sharding.Mesh`: `make_mesh`'s, or `jax.make_mesh`'s.
        axes: the mesh axes the batch is split over. Default: those of
            `BATCH_AXES` (`data`, `fsdp`, `expert`) the mesh has, as in
            `batch_sharding(mesh)`.

    Raises:
        ConfigError: an axis of `axes` not in the mesh, or (by default) a mesh
            with none of the batch axes (at once); a model state (when traced:
            batch statistics would need their own reduction).
    """
    return _data_parallel(grad_fn, mesh, axes, "data_parallel")


def _data_parallel(
    grad_fn: steps.GradFn, mesh: Mesh, axes: Sequence[str] | None, caller: str
) -> steps.GradFn:
    """`data_parallel`, its errors naming `caller` (the function the user called)."""
    split = split_axes(mesh, axes, caller)
    local = steps.psum_grads(grad_fn, split)

    def parallel(params, static, batch, key, model_state) -> steps.Grads:
        _refuse_model_state(model_state, caller)
        mapped = shard_map(
            lambda p, b, k: local(p, static, b, k, None),
            mesh=mesh,
            in_specs=(P(), P(split), P()),
            out_specs=P(),
            check_vma=False,
        )
        return mapped(params, batch, key)

    return parallel


def split_axes(mesh: Mesh, axes: Sequence[str] | None, caller: str) -> tuple[str, ...]:
    """The mesh axes a batch is split over: `axes`, each one the mesh's, or by
    default the batch axes the mesh has (those it lacks count as size 1)."""
    if axes is None:
        found = tuple(name for name in BATCH_AXES if name in mesh.shape)
        if not found:
            raise ConfigError(_no_batch_axis(mesh, caller))
        return found
    axes = tuple(axes)
    missing = [name for name in axes if name not in mesh.shape]
    if missing:
        raise ConfigError(_missing_axes(missing, mesh, caller))
    return axes


def _no_batch_axis(mesh: Mesh, caller: str) -> str:
    first = str(mesh.axis_names[0])
    sizes = {
        ("data" if str(k) == first else str(k)): int(v) for k, v in mesh.shape.items()
    }
    return (
        f"{caller}: the mesh has none of the batch axes {list(BATCH_AXES)} (its "
        f"axes: {list(mesh.shape)}), so nothing says which axis splits the batch. "
        f"Name it: `{caller}(..., axes=({first!r},))`, or build the mesh with a "
        f"`data` axis: {_mesh_fix(sizes)}."
    )


def _missing_axes(missing: list[str], mesh: Mesh, caller: str) -> str:
    which = "axis" if len(missing) == 1 else "axes"
    names = ", ".join(repr(name) for name in missing)
    verb = "is" if len(missing) == 1 else "are"
    sizes = {str(k): int(v) for k, v in mesh.shape.items()} | dict.fromkeys(missing, 1)
    return (
        f"{caller}: {which} {names} {verb} not in the mesh (its axes: "
        f"{list(mesh.shape)}). Pass `axes=` with the mesh's own axes, or build the "
        f"mesh with {which} {names}: {_mesh_fix(sizes)}."
    )


def _mesh_fix(sizes: dict[str, int]) -> str:
    """How to build a mesh of these axis sizes: `make_mesh` (when eqtrain's axes
    alone hold every device) or `jax.make_mesh`."""
    names, shape = tuple(sizes), tuple(sizes.values())
    built = (
        f"`jax.make_mesh({shape}, axis_names={names}, "
        f"axis_types=(jax.sharding.AxisType.Auto,) * {len(names)})`"
    )
    ours = {k: v for k, v in sizes.items() if k in AXES and v > 1}
    if math.prod(ours.values()) != math.prod(shape):
        return built
    return f"`eqtrain.sharding.make_mesh({ours or {'data': -1}})`, or {built}"


def _refuse_model_state(model_state: Any, caller: str) -> None:
    if model_state is not None:
        raise ConfigError(
            f"{caller} does not reduce a `model_state` (e.g. batch "
            "statistics) across devices; use `train_step` (automatic "
            "partitioning) for stateful models."
        )


def data_parallel_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axes: Sequence[str] | None = None,
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
        mesh: any `jax.sharding.Mesh` (`make_mesh`'s, or `jax.make_mesh`'s).
        axes: the mesh axes the batch is split over. Default: those of
            `BATCH_AXES` (`data`, `fsdp`, `expert`) the mesh has, which is how
            `batch_sharding(mesh)` splits it.

    Raises:
        ConfigError: a bad argument, an axis of `axes` not in the mesh, or (by
            default) a mesh with none of the batch axes (at once); or (at the
            first call) a state with a `model_state`.
    """
    caller = "data_parallel_step"  # errors name it, and its keywords
    steps.check_nonfinite(nonfinite, caller)
    grads = steps.recipe_grads(
        loss_fn, accumulate=accumulate, precision=precision, caller=caller
    )
    return steps.finish_step(
        _data_parallel(grads, mesh, axes, caller),
        optimizer,
        nonfinite=nonfinite,
        ema=ema,
        schedule=schedule,
        caller=caller,
    )


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding that puts a whole copy on every device of `mesh` (`P()`): the
    state's sharding for `data_parallel_step`."""
    return NamedSharding(mesh, P())
