"""Training steps from small pieces, the way optax builds optimizers.

A training step has two phases, and each piece works on one of them:

- **the gradient phase**: a *gradient function* `grad_fn(params, static, batch,
  key, model_state) -> Grads` runs the loss and differentiates it.
  `value_and_grad(loss_fn)` makes one; `microbatched`, `psum_grads` (and
  `eqtrain.sharding.data_parallel`) wrap one and return another;
- **the update phase**: `gradient_step(grad_fn, optimizer)` makes a `TrainStep`
  whose `apply` feeds the gradients to the optimizer; `skip_nonfinite`,
  `halt_nonfinite` and `with_ema` wrap a `TrainStep` and return another.

A `TrainStep` is called like any step, `step(state, batch) -> (state, metrics)`, and
compiled with `eqtrain.jit`. `train_step(loss_fn, optimizer, ...)` is the usual
recipe over these pieces:

    >>> import optax, eqtrain
    >>> from eqtrain import step as S
    >>> def loss_fn(model, batch, key):
    ...     return ((model(batch["x"]) - batch["y"]) ** 2).mean(), {}
    >>> opt = optax.adamw(1e-3)
    >>> grads = S.microbatched(S.value_and_grad(loss_fn), 4)
    >>> step = S.skip_nonfinite(S.gradient_step(grads, opt))
    >>> # the same as eqtrain.train_step(loss_fn, opt, accumulate=4)

None of the builders jits; see `eqtrain.jit`. The gradient-phase pieces live in
`eqtrain._grads` and are re-exported here.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import optax
from jaxtyping import Array

from ._errors import ConfigError
from ._grads import (
    WEIGHT_KEYS as WEIGHT_KEYS,
    GradFn as GradFn,
    Grads as Grads,
    as_dtype,
    batch_weight as batch_weight,
    call_loss,
    cast,
    check_count,
    loss_grad,
    microbatched as microbatched,
    microbatched_as,
    psum_grads as psum_grads,
    split_weight,
    value_and_grad as value_and_grad,
)
from ._precision import Precision, as_precision
from ._state import TrainState
from ._types import Batch, Key, LossFn, Metrics


NONFINITE = ("skip", "stop", "ignore")

Apply = Callable[[TrainState, Grads, Key], tuple[TrainState, Metrics]]
"""`apply(state, grads, next_key) -> (new_state, metrics)`: the update phase."""


# -- the update phase ---------------------------------------------------------------
SMALL_LEAF = 1 << 16
"""Leaves with at most this many elements are summed together in `global_norm`."""


def _magnitude(x: Array) -> Array:
    if jnp.iscomplexobj(x):
        return jnp.abs(x).astype(jnp.float32)
    return x.astype(jnp.float32)


def global_norm(tree: Any) -> Array:
    """The L2 norm of all the array leaves of `tree`, in float32.

    The same value as `optax.tree.norm` up to rounding, computed with fewer
    kernels: the squares of the small leaves (at most `SMALL_LEAF` elements:
    norms, biases, small matrices) are summed as one concatenated vector, and each
    large leaf is reduced on its own (where the sharding of a large leaf matters,
    nothing is gathered). One reduction per leaf is one more small kernel per
    leaf, which adds up on a model with hundreds of small leaves.
    """
    leaves = [_magnitude(x) for x in jtu.tree_leaves(tree) if eqx.is_array(x)]
    small = [x.ravel() for x in leaves if x.size <= SMALL_LEAF]
    parts = [jnp.sum(jnp.square(x)) for x in leaves if x.size > SMALL_LEAF]
    if small:
        parts.append(jnp.sum(jnp.square(jnp.concatenate(small))))
    if not parts:
        return jnp.zeros((), jnp.float32)
    return jnp.sqrt(sum(parts[1:], parts[0]))


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """A training step in two phases: `step(state, batch) -> (state, metrics)`.

    Calling it splits the state's key, runs `grad(state, batch, key)` (the
    gradient phase), adds the gradients' global norm, then runs
    `apply(state, grads, next_key)` (the update phase), which returns the new state
    (with `step + 1` and `key = next_key`) and the metrics. Step wrappers
    (`skip_nonfinite`, `with_ema`, your own) replace `apply`; build one with
    `dataclasses.replace(step, apply=new_apply)`.

    Attributes:
        grad: `grad(state, batch, key) -> Grads`.
        apply: `apply(state, grads, next_key) -> (state, metrics)`.
    """

    grad: Callable[[TrainState, Batch, Key], Grads]
    apply: Apply

    def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        key, step_key = jr.split(state.key)
        g = self.grad(state, batch, step_key)
        g = g._replace(grad_norm=global_norm(g.grads))
        return self.apply(state, g, key)


def learning_rate(opt_state: Any) -> Array | None:
    """The learning rate an `optax.inject_hyperparams` optimizer (anywhere in
    `opt_state`, e.g. inside a chain) used last, or `None`."""
    kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
    nodes = jtu.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, kinds))
    for node in nodes:
        if isinstance(node, kinds):
            for name in ("learning_rate", "lr"):
                if name in node.hyperparams:
                    return jnp.asarray(node.hyperparams[name], jnp.float32)
    return None


def gradient_step(
    grad_fn: GradFn,
    optimizer: optax.GradientTransformation,
    *,
    schedule: optax.Schedule | None = None,
) -> TrainStep:
    """The training step that feeds `grad_fn`'s gradients to `optimizer`.

    The gradient phase partitions the model by the state's trainable mask and
    calls `grad_fn(params, static, batch, key, model_state)`. The update phase
    runs `optimizer.update`, applies the updates, stores the new model state and
    advances `step` and `key`.

    Args:
        grad_fn: a gradient function (`value_and_grad(loss_fn)`, possibly wrapped).
        optimizer: the optax transformation the state was created with.
        schedule: only to *report* `metrics["learning_rate"]` when the optimizer
            does not expose it (optimizers built with `optax.inject_hyperparams`
            do).

    Returns:
        A `TrainStep`. Its metrics: `loss`, `grad_norm` (before any clipping in
        the optimizer), `skipped` (the state's count of skipped steps),
        `learning_rate` (when known), `weight`, and the loss's `aux` entries.
    """

    def grad(state: TrainState, batch: Batch, key: Key) -> Grads:
        params, static = eqx.partition(state.model, state.trainable)
        return grad_fn(params, static, batch, key, state.model_state)

    def apply(state: TrainState, g: Grads, key: Key) -> tuple[TrainState, Metrics]:
        params, static = eqx.partition(state.model, state.trainable)
        updates, opt_state = optimizer.update(g.grads, state.opt_state, params)
        new = dataclasses.replace(
            state,
            model=eqx.combine(optax.apply_updates(params, updates), static),
            opt_state=opt_state,
            step=state.step + 1,
            key=key,
            model_state=g.model_state,
        )
        lr = _reported_lr(opt_state, schedule, state.step)
        return new, _update_metrics(g, new, lr)

    return TrainStep(grad, apply)


def _reported_lr(
    opt_state: Any, schedule: optax.Schedule | None, step: Any
) -> Array | None:
    """The learning rate to report: the optimizer's own, else the schedule's."""
    lr = learning_rate(opt_state)
    if lr is None and schedule is not None:
        lr = jnp.asarray(schedule(step), jnp.float32)
    return lr


def _update_metrics(g: Grads, new: TrainState, lr: Array | None) -> Metrics:
    """A step's metrics: loss, grad norm, skips, learning rate, weight, then aux."""
    metrics = {"loss": g.loss, "grad_norm": g.grad_norm, "skipped": new.skipped}
    if lr is not None:
        metrics["learning_rate"] = lr
    metrics["weight"] = g.weight
    return {**metrics, **g.aux}


def filter_cond(
    pred: Array,
    true_fn: Callable,
    false_fn: Callable,
    *operands: Any,
    caller: str = "filter_cond",
) -> Any:
    """`lax.cond` over pytrees that also hold non-array leaves (functions, ints in
    an Equinox module): only the arrays go through the branches; the rest is
    closed over, and must come out the same from both branches (else an error
    naming `caller`)."""
    dynamic, static = eqx.partition(operands, eqx.is_array)
    statics: list[Any] = []
    true_branch = _array_branch(true_fn, static, statics)
    out = lax.cond(pred, true_branch, _array_branch(false_fn, static, statics), dynamic)
    first = statics[0]
    if any(not eqx.tree_equal(first, other) for other in statics[1:]):
        raise ConfigError(
            f"{caller}: the two branches of a non-finite guard returned "
            "differently shaped states or metrics; a step wrapper's update phase "
            "must return the same structure whether it applies the update or keeps "
            "the state."
        )
    return eqx.combine(out, first)


def _array_branch(fn: Callable, static: Any, statics: list[Any]) -> Callable:
    """`fn` over the array leaves only: the rest of its operands is `static`, and
    the rest of its result is appended to `statics` (compared by `filter_cond`)."""

    def run(dyn: Any) -> Any:
        out = fn(*eqx.combine(dyn, static))
        out_dyn, out_static = eqx.partition(out, eqx.is_array)
        statics.append(out_static)
        return out_dyn

    return run


def _finite(g: Grads) -> Array:
    return jnp.isfinite(g.loss) & jnp.isfinite(g.grad_norm)


def _kept_metrics(
    step: TrainStep, state: TrainState, g: Grads, key: Key, skipped: Array
) -> Metrics:
    """The metrics `step` reports, for a step whose update is discarded: the
    same entries, with the kept state's skip count and learning rate."""
    _, metrics = step.apply(state, g, key)
    metrics = {**metrics, "skipped": skipped}
    lr = learning_rate(state.opt_state)
    if "learning_rate" in metrics and lr is not None:
        metrics["learning_rate"] = lr
    return metrics


def skip_nonfinite(step: TrainStep) -> TrainStep:
    """Skip updates whose loss or gradient norm is NaN/inf.

    On such a step the model, optimizer state, model state and EMA stay as they
    were; `step` and `key` still advance, and the state's `skipped` counter (and
    `metrics["skipped"]`) counts it. The choice is one `lax.cond` over the whole
    update phase, so a finite step costs what the unguarded step costs.
    """

    def keep(state: TrainState, g: Grads, key: Key) -> tuple[TrainState, Metrics]:
        kept = dataclasses.replace(
            state, step=state.step + 1, key=key, skipped=state.skipped + 1
        )
        return kept, _kept_metrics(step, state, g, key, kept.skipped)

    def apply(state: TrainState, g: Grads, key: Key) -> tuple[TrainState, Metrics]:
        ok = _finite(g)
        return filter_cond(ok, step.apply, keep, state, g, key, caller="skip_nonfinite")

    return dataclasses.replace(step, apply=apply)


def halt_nonfinite(step: TrainStep) -> TrainStep:
    """Freeze the whole state at the first non-finite loss or gradient norm.

    From that step on, every call returns the state unchanged (`step` and `key`
    included), so the step that was already dispatched when the host notices does
    not move it either; `metrics["halted"]` is 1 from then on, and `fit` stops with
    `StopReason(kind="nonfinite")`, returning the last finite state.
    """

    def keep(state: TrainState, g: Grads, key: Key) -> tuple[TrainState, Metrics]:
        first = jnp.where(state.skipped > 0, 0, 1).astype(state.skipped.dtype)
        kept = dataclasses.replace(state, skipped=state.skipped + first)
        return kept, _kept_metrics(step, state, g, key, kept.skipped)

    def apply(state: TrainState, g: Grads, key: Key) -> tuple[TrainState, Metrics]:
        ok = _finite(g) & (state.skipped == 0)
        guard = "halt_nonfinite"
        new, metrics = filter_cond(ok, step.apply, keep, state, g, key, caller=guard)
        return new, {**metrics, "halted": (new.skipped > 0).astype(jnp.int32)}

    return dataclasses.replace(step, apply=apply)


def _check_decay(decay: Any, name: str, caller: str) -> None:
    number = not isinstance(decay, bool) and isinstance(decay, int | float)
    if not number or not 0.0 <= decay < 1.0:
        raise ConfigError(
            f"{caller}: `{name}` must be a decay in [0, 1), e.g. 0.999; got {decay!r}."
        )


def with_ema(step: TrainStep, decay: float) -> TrainStep:
    """Also keep an exponential moving average of the trainable weights:
    `ema = decay * ema + (1 - decay) * params` after every update. Needs a state
    created with `TrainState.create(..., ema=True)`; evaluate it with
    `eval_step(..., use_ema=True)` or read `state.ema_model`."""
    _check_decay(decay, "decay", "with_ema")
    return _with_ema(step, decay, call=f"with_ema(step, {decay!r})")


def _with_ema(step: TrainStep, decay: float, *, call: str) -> TrainStep:
    """`with_ema(step, decay)` for a checked `decay`; a state without an EMA is
    refused naming `call`, the user's call (a recipe shares this piece)."""

    def apply(state: TrainState, g: Grads, key: Key) -> tuple[TrainState, Metrics]:
        if state.ema is None:
            raise ConfigError(
                f"{call} needs a state that keeps an EMA; create it with "
                "`TrainState.create(..., ema=True)`."
            )
        new, metrics = step.apply(state, g, key)
        params, _ = eqx.partition(new.model, new.trainable)
        ema = optax.incremental_update(params, state.ema, 1.0 - decay)
        return dataclasses.replace(new, ema=ema), metrics

    return dataclasses.replace(step, apply=apply)


def check_nonfinite(nonfinite: Any, caller: str) -> None:
    """Raise `ConfigError` (naming `caller`) unless `nonfinite` is a policy."""
    if nonfinite not in NONFINITE:
        raise ConfigError(
            f"{caller}: `nonfinite` must be 'skip', 'stop' or 'ignore'; got "
            f"{nonfinite!r}."
        )


def finish_step(
    grad_fn: GradFn,
    optimizer: optax.GradientTransformation,
    *,
    nonfinite: str = "skip",
    ema: float | None = None,
    schedule: optax.Schedule | None = None,
    caller: str = "finish_step",
) -> TrainStep:
    """`gradient_step`, then `with_ema` (if `ema`), then the non-finite policy:
    the update phase every recipe shares (`train_step`,
    `eqtrain.sharding.data_parallel_step`). Errors name `caller`, the recipe the
    user called, and its keywords."""
    check_nonfinite(nonfinite, caller)
    if ema is not None:
        _check_decay(ema, "ema", caller)
    step = gradient_step(grad_fn, optimizer, schedule=schedule)
    if ema is not None:
        step = _with_ema(step, ema, call=f"{caller}(..., ema={ema!r})")
    if nonfinite == "skip":
        step = skip_nonfinite(step)
    elif nonfinite == "stop":
        step = halt_nonfinite(step)
    return step


def recipe_grads(
    loss_fn: LossFn,
    *,
    accumulate: int,
    precision: Precision | str | None,
    caller: str,
) -> GradFn:
    """`microbatched(value_and_grad(loss_fn, precision=precision), accumulate)`:
    the gradient phase every recipe shares, its errors naming `caller` (the
    recipe the user called) and its keywords."""
    check_count(accumulate, "accumulate", caller)
    grads = loss_grad(loss_fn, precision, caller=caller)
    return microbatched_as(
        grads, accumulate, call=f"{caller}(..., accumulate={accumulate})"
    )


# -- the recipes --------------------------------------------------------------------
def train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    accumulate: int = 1,
    precision: Precision | str | None = None,
    nonfinite: str = "skip",
    ema: float | None = None,
    schedule: optax.Schedule | None = None,
) -> TrainStep:
    """Build the training step `step(state, batch) -> (state, metrics)`.

    A recipe over this module's pieces:

        grads = microbatched(value_and_grad(loss_fn, precision=precision), accumulate)
        step = gradient_step(grads, optimizer, schedule=schedule)
        step = with_ema(step, ema)         # if ema
        step = skip_nonfinite(step)        # nonfinite="skip"; halt_nonfinite: "stop"

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
        A `TrainStep`. `metrics` holds `loss`, `grad_norm` (before any clipping
        inside the optimizer), `learning_rate` (when known), `skipped` (cumulative
        count of non-finite steps), `weight` (tokens or examples in the batch),
        with `nonfinite="stop"` also `halted` (1 once the state is frozen), and
        every entry of `aux`, all as device scalars.
    """
    grads = recipe_grads(
        loss_fn, accumulate=accumulate, precision=precision, caller="train_step"
    )
    return finish_step(
        grads,
        optimizer,
        nonfinite=nonfinite,
        ema=ema,
        schedule=schedule,
        caller="train_step",
    )


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
    policy = as_precision(precision, "eval_step")

    def evaluate(state: TrainState, batch: Batch) -> Metrics:
        model = state.ema_model if use_ema else state.model
        model, inputs = cast(policy, eqx.nn.inference_mode(model), batch)
        mstate = state.model_state
        loss, aux, _ = call_loss(loss_fn, model, inputs, state.key, mstate, "eval_step")
        aux, weight = split_weight(batch, as_dtype(aux, jnp.float32))
        return {"loss": jnp.asarray(loss, jnp.float32), **aux, "weight": weight}

    return evaluate
