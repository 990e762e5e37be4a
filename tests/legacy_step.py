"""REFERENCE ORACLE, frozen: the step implementation before the step pieces
(eqtrain.step) replaced it, kept only so that tests/test_step_pieces.py can check the
new recipes give bit-identical states. Do not import it from eqtrain.

Step builders: `train_step` and `eval_step` return pure functions of
`(TrainState, batch)`. They close over their configuration and never jit; see
`eqtrain.jit` (in `_jit.py`) for compilation.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import optax
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float

from eqtrain._errors import ConfigError
from eqtrain._precision import Precision, as_precision
from eqtrain._state import TrainState
from eqtrain._types import Batch, LossFn, Metrics


NonFinite = Literal["skip", "stop", "ignore"]

WEIGHT_KEYS = ("loss_mask", "weights")
"""Batch entries whose sum is a micro-batch's weight (see `batch_weight`)."""


def batch_weight(batch: Batch, aux: Mapping[str, Array]) -> Float[Array, ""]:
    """The weight of one (micro-)batch when averaging losses and metrics.

    In order of preference: `aux["weight"]` if the loss reports one (the number of
    tokens or examples its loss averaged over); else the sum of the batch's
    `loss_mask` or `weights` entry when the batch is a mapping; else the batch's
    leading size (every example counts once).

    With these weights, a weighted mean of micro-batch means equals the mean over the
    whole batch, which is what makes gradient accumulation exact.
    """
    if "weight" in aux:
        return jnp.asarray(aux["weight"], jnp.float32)
    if isinstance(batch, Mapping):
        for name in WEIGHT_KEYS:
            if name in batch:
                return jnp.sum(jnp.asarray(batch[name], jnp.float32))
    leaves = jtu.tree_leaves(batch)
    if not leaves or jnp.ndim(leaves[0]) == 0:
        return jnp.ones((), jnp.float32)
    return jnp.asarray(jnp.shape(leaves[0])[0], jnp.float32)


def _split_microbatches(batch: Batch, n: int) -> Batch:
    """Reshape every leaf from `(B, ...)` to `(n, B // n, ...)`."""

    def split(x: Any) -> Any:
        x = jnp.asarray(x)
        if x.ndim == 0 or x.shape[0] % n:
            size = "a scalar" if x.ndim == 0 else f"leading size {x.shape[0]}"
            raise ConfigError(
                f"`accumulate={n}` must divide the batch size, but a batch leaf of "
                f"shape {x.shape} has {size}. Use a batch size that is a multiple "
                f"of {n}, or change `accumulate`."
            )
        return x.reshape(n, x.shape[0] // n, *x.shape[1:])

    return jtu.tree_map(split, batch)


def _learning_rate(opt_state: Any) -> Array | None:
    """The learning rate an `optax.inject_hyperparams` optimizer used, if any."""
    kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
    nodes = jtu.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds))
    for node in nodes:
        if isinstance(node, kinds):
            for name in ("learning_rate", "lr"):
                if name in node.hyperparams:
                    return jnp.asarray(node.hyperparams[name], jnp.float32)
    return None


def _select(pred: Array, new: Any, old: Any) -> Any:
    """`new` where `pred` else `old` for array leaves (both trees share a structure);
    non-array leaves (functions, ints) are the same in both and kept."""
    pick = lambda a, b: jnp.where(pred, a, b) if eqx.is_array(a) else a
    return jtu.tree_map(pick, new, old)


class _Grads(NamedTuple):
    """What one pass of the loss over a (micro-)batch produces (a pytree)."""

    loss: Array
    aux: dict[str, Array]
    weight: Array
    grads: Any
    model_state: Any


def _loss_and_grad(
    loss_fn: LossFn, policy: Precision | None, stateful: bool
) -> Callable[..., _Grads]:
    """`(params, static, batch, key, model_state) -> _Grads` for one micro-batch."""

    def compute(params, static, batch, key, model_state):
        def objective(p):
            model = eqx.combine(p, static)
            inputs = batch
            if policy is not None:
                model, inputs = policy.cast_model(model), policy.cast_inputs(batch)
            if stateful:
                loss, aux, new_state = loss_fn(
                    model, inputs, key, model_state=model_state
                )
            else:
                loss, aux = loss_fn(model, inputs, key)
                new_state = None
            out_dtype = jnp.float32 if policy is None else policy.output_dtype
            aux = {k: jnp.asarray(v).astype(out_dtype) for k, v in dict(aux).items()}
            return jnp.asarray(loss).astype(out_dtype), (aux, new_state)

        (loss, (aux, new_state)), grads = jax.value_and_grad(objective, has_aux=True)(
            params
        )
        weight = batch_weight(batch, aux)
        aux.pop("weight", None)
        return _Grads(loss, aux, weight, grads, new_state)

    return compute


def _accumulated(
    compute: Callable[..., _Grads], n: int
) -> Callable[..., tuple[Array, dict[str, Array], Array, Any, Any]]:
    """Average `compute` over `n` micro-batches with `lax.scan`, weighted by tokens.

    Returns `(loss, aux, total_weight, grads, model_state)`; with `n == 1` it calls
    `compute` once on the whole batch.
    """

    def single(params, static, batch, key, model_state):
        g = compute(params, static, batch, key, model_state)
        return g.loss, g.aux, g.weight, g.grads, g.model_state

    if n == 1:
        return single

    def accumulate(params, static, batch, key, model_state):
        micro = _split_microbatches(batch, n)
        keys = jr.split(key, n)
        first = jtu.tree_map(lambda x: x[0], micro)
        shapes = eqx.filter_eval_shape(
            compute, params, static, first, keys[0], model_state
        )
        f32 = lambda s: jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32))
        zeros = jtu.tree_map(
            f32, (shapes.loss, shapes.aux, shapes.weight, shapes.grads)
        )

        def body(carry, xs):
            (loss_sum, aux_sum, w_sum, g_sum), mstate = carry
            mb, k = xs
            g = compute(params, static, mb, k, mstate)
            w = g.weight
            add = lambda acc, v: acc + w * v.astype(acc.dtype)
            loss_sum = add(loss_sum, g.loss)
            aux_sum = jtu.tree_map(add, aux_sum, g.aux)
            g_sum = jtu.tree_map(add, g_sum, g.grads)
            return ((loss_sum, aux_sum, w_sum + w, g_sum), g.model_state), None

        ((loss_sum, aux_sum, w_sum, g_sum), mstate), _ = lax.scan(
            body, (zeros, model_state), (micro, keys)
        )
        # A batch whose weights are all zero contributes nothing (not NaN).
        safe = jnp.where(w_sum > 0, w_sum, 1.0)
        mean = lambda v: v / safe
        grads = jtu.tree_map(lambda g, p: mean(g).astype(p.dtype), g_sum, shapes.grads)
        aux = jtu.tree_map(mean, aux_sum)
        return mean(loss_sum), aux, w_sum, grads, mstate

    return accumulate


def train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    accumulate: int = 1,
    precision: Precision | str | None = None,
    nonfinite: str = "skip",
    ema: float | None = None,
    schedule: optax.Schedule | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """Build the pure training step `step(state, batch) -> (state, metrics)`.

    Args:
        loss_fn: `loss_fn(model, batch, key) -> (loss, aux)`, `aux` a dict of scalar
            metrics. If the state has a `model_state`, the step calls
            `loss_fn(model, batch, key, model_state=s) -> (loss, aux, new_s)`.
            `aux` may hold `"weight"`: the number of tokens/examples the loss
            averaged over (see `batch_weight`).
        optimizer: the optax transformation the state was created with.
        accumulate: number of micro-batches each batch is split into (a `lax.scan`
            over them); the result equals the full-batch step up to rounding,
            weighted by tokens when the batch carries a `loss_mask`/`weights`.
        precision: `None` (compute in the parameters' dtype), `"bf16"`, or a
            `Precision`. Casts happen inside the differentiated function, so
            gradients and optimizer state keep the parameters' dtype.
        nonfinite: what to do when the loss or the gradient norm is NaN/inf:
            `"skip"` leaves the model and optimizer unchanged for that step (the
            step counter still advances) and counts it in `metrics["skipped"]`;
            `"stop"` leaves the *whole* state unchanged from then on, so that
            `fit` stops with `StopReason.kind == "nonfinite"` and returns the last
            good state; `"ignore"` applies the update anyway.
        ema: decay of an exponential moving average of the trainable weights
            (e.g. `0.999`); needs `TrainState.create(..., ema=True)`.
        schedule: the learning-rate schedule, used only to report
            `metrics["learning_rate"]` when the optimizer does not expose it
            itself (optimizers built with `optax.inject_hyperparams` do).

    Returns:
        `step(state, batch) -> (state, metrics)`. `metrics` holds `loss`,
        `grad_norm` (before any clipping inside the optimizer), `learning_rate`
        (when known), `skipped` (cumulative count of non-finite steps), `weight`
        (tokens or examples in the batch), with `nonfinite="stop"` also `halted`
        (1 once the state is frozen), and every entry of `aux`, all as device
        scalars.
    """
    if not isinstance(accumulate, int) or accumulate < 1:
        raise ConfigError(f"`accumulate` must be an int >= 1; got {accumulate!r}.")
    if nonfinite not in ("skip", "stop", "ignore"):
        raise ConfigError(
            f"`nonfinite` must be 'skip', 'stop' or 'ignore'; got {nonfinite!r}."
        )
    if ema is not None and not 0.0 <= ema < 1.0:
        raise ConfigError(f"`ema` is a decay in [0, 1), e.g. 0.999; got {ema!r}.")
    return build_step(
        loss_fn,
        optimizer,
        accumulate=accumulate,
        policy=as_precision(precision),
        nonfinite=nonfinite,
        ema=ema,
        schedule=schedule,
    )


# (loss, aux, weight, grads) of this device's data -> the same over all the data.
Reduce = Callable[[Array, dict[str, Array], Array, Any], tuple[Any, Any, Any, Any]]


def build_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    accumulate: int,
    policy: Precision | None,
    nonfinite: str,
    ema: float | None,
    schedule: optax.Schedule | None,
    reduce: Reduce | None = None,
    fold_key: Callable[[Array], Array] | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """`train_step`'s step, with two seams for explicit-collective variants
    (`eqtrain.sharding.data_parallel_step`): `reduce` combines the gradients of
    this device's shard of the batch with the others', and `fold_key` derives
    this device's random key."""

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        if ema is not None and state.ema is None:
            raise ConfigError(
                "`train_step(..., ema=...)` needs a state that keeps an EMA; create "
                "it with `TrainState.create(..., ema=True)`."
            )
        stateful = state.model_state is not None
        grad_fn = _accumulated(_loss_and_grad(loss_fn, policy, stateful), accumulate)
        key, step_key = jr.split(state.key)
        if fold_key is not None:
            step_key = fold_key(step_key)
        params, static = eqx.partition(state.model, state.trainable)
        loss, aux, weight, grads, model_state = grad_fn(
            params, static, batch, step_key, state.model_state
        )
        if reduce is not None:
            loss, aux, weight, grads = reduce(loss, aux, weight, grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        new = dataclasses.replace(
            state,
            model=eqx.combine(new_params, static),
            opt_state=opt_state,
            step=state.step + 1,
            key=key,
            model_state=model_state,
        )
        if ema is not None:
            new = dataclasses.replace(
                new,
                ema=optax.incremental_update(new_params, state.ema, 1.0 - ema),
            )
        new, skipped = _guard(new, state, loss, grad_norm, nonfinite)
        metrics = {"loss": loss, "grad_norm": grad_norm, "skipped": skipped}
        learning_rate = _learning_rate(new.opt_state)
        if learning_rate is None and schedule is not None:
            learning_rate = jnp.asarray(schedule(state.step), jnp.float32)
        if learning_rate is not None:
            metrics["learning_rate"] = learning_rate
        metrics["weight"] = weight
        if nonfinite == "stop":  # `fit` stops at the first step reporting this
            metrics["halted"] = (new.skipped > 0).astype(jnp.int32)
        return new, {**metrics, **aux}

    return step


def _guard(
    new: TrainState, old: TrainState, loss: Array, grad_norm: Array, mode: NonFinite
) -> tuple[TrainState, Array]:
    """Apply the non-finite policy; returns the state to keep and the skip count."""
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if mode == "ignore":
        return new, old.skipped
    skipped = old.skipped + jnp.where(finite, 0, 1).astype(old.skipped.dtype)
    if mode == "skip":
        kept = dataclasses.replace(
            new,
            model=_select(finite, new.model, old.model),
            opt_state=_select(finite, new.opt_state, old.opt_state),
            model_state=_select(finite, new.model_state, old.model_state),
            ema=_select(finite, new.ema, old.ema),
            skipped=skipped,
        )
        return kept, skipped
    # "stop": once anything was non-finite the state is frozen, so the step that was
    # already dispatched when the host notices does not move it either.
    ok = finite & (old.skipped == 0)
    skipped = old.skipped + jnp.where(ok | (old.skipped > 0), 0, 1).astype(
        old.skipped.dtype
    )
    kept = _select(ok, new, old)
    return dataclasses.replace(kept, skipped=skipped), skipped


def eval_step(
    loss_fn: LossFn,
    *,
    precision: Precision | str | None = None,
    use_ema: bool = False,
) -> Callable[[TrainState, Batch], Metrics]:
    """Build the pure evaluation step `evaluate(state, batch) -> metrics`.

    The model is put in inference mode (`eqx.nn.inference_mode`: dropout off,
    batch norm uses its running statistics) and evaluated with the state's key,
    which is not advanced. A model state, if any, is read but not updated.

    Args:
        loss_fn: the same loss function as for training.
        precision: as in `train_step`.
        use_ema: evaluate the EMA weights instead of the live ones.

    Returns:
        `evaluate(state, batch) -> metrics` with `loss`, `weight` and the `aux`
        entries. `fit` averages these over the eval data, weighted by `weight`.
    """
    policy = as_precision(precision)

    def evaluate(state: TrainState, batch: Batch) -> Metrics:
        model = state.ema_model if use_ema else state.model
        model = eqx.nn.inference_mode(model)
        inputs = batch
        if policy is not None:
            model, inputs = policy.cast_model(model), policy.cast_inputs(batch)
        if state.model_state is not None:
            loss, aux, _ = loss_fn(
                model, inputs, state.key, model_state=state.model_state
            )
        else:
            loss, aux = loss_fn(model, inputs, state.key)
        aux = {k: jnp.asarray(v, jnp.float32) for k, v in dict(aux).items()}
        weight = batch_weight(batch, aux)
        aux.pop("weight", None)
        return {"loss": jnp.asarray(loss, jnp.float32), **aux, "weight": weight}

    return evaluate


# -- the data-parallel step, as it was in eqtrain/sharding/_shard_map.py --
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


def legacy_data_parallel_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axes: Sequence[str] = ("data", "fsdp"),
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
