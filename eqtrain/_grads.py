"""The gradient phase of a training step (see `eqtrain.step`, which re-exports it): a
*gradient function* `grad_fn(params, static, batch, key, model_state) -> Grads` runs
the loss and differentiates it. `value_and_grad(loss_fn)` makes one; `microbatched`
and `psum_grads` wrap one and return another."""

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
from jaxtyping import Array, Float

from ._errors import ConfigError, StructureError
from ._precision import Precision, as_precision
from ._types import Batch, Key, LossFn


WEIGHT_KEYS = ("loss_mask", "weights")
"""Batch entries whose sum is a micro-batch's weight (see `batch_weight`)."""


class Grads(NamedTuple):
    """What a gradient function returns for a (micro-)batch.

    Attributes:
        loss: the loss, a scalar (the weighted mean over the batch).
        aux: the loss's other metrics (scalars), without `"weight"`.
        weight: the batch's weight (`batch_weight`): tokens or examples.
        grads: the gradients, shaped like the trainable parameters.
        model_state: the updated model state (`None` for stateless models).
        grad_norm: the global norm of `grads`; filled in by `TrainStep` after the
            gradient phase (so wrappers of the update phase share one norm).
    """

    loss: Array
    aux: dict[str, Array]
    weight: Array
    grads: Any
    model_state: Any
    grad_norm: Array | None = None


GradFn = Callable[[Any, Any, Batch, Key, Any], Grads]
"""`grad_fn(params, static, batch, key, model_state) -> Grads`, where
`params, static = eqx.partition(model, trainable)`."""


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


# -- running a loss -------------------------------------------------------------------
def cast(policy: Precision | None, model: Any, batch: Batch) -> tuple[Any, Any]:
    """The model and the batch in `policy`'s compute dtype (as they are without one)."""
    if policy is None:
        return model, batch
    return policy.cast_model(model), policy.cast_inputs(batch)


LOSS_CONTRACT = """\
    def loss_fn(model, batch, key) -> (loss, metrics_dict):
        ...
        return loss, {}  # the loss a scalar; the metrics a dict of scalars"""

STATEFUL_LOSS_CONTRACT = """\
    def loss_fn(model, batch, key, *, model_state):  # -> (loss, metrics, new_state)
        ...
        return loss, {}, new_model_state"""


def call_loss(
    loss_fn: LossFn,
    model: Any,
    batch: Any,
    key: Key,
    model_state: Any,
    caller: str = "value_and_grad",
) -> tuple[Any, Mapping[str, Any], Any]:
    """`(loss, aux, new_model_state)` of one batch. A stateless model (no
    `model_state`) is called as `loss_fn(model, batch, key)`, its new state `None`.
    What the loss returns is checked (while tracing: no cost at run time), and an
    error names `caller`, the function the user gave `loss_fn` to."""
    if model_state is None:
        loss, aux = _checked(loss_fn(model, batch, key), 2, loss_fn, caller)
        return loss, aux, None
    _check_takes_model_state(loss_fn, caller)
    out = loss_fn(model, batch, key, model_state=model_state)
    loss, aux, new_state = _checked(out, 3, loss_fn, caller)
    return loss, aux, new_state


def _loss_name(loss_fn: Any) -> str:
    name = getattr(loss_fn, "__name__", "<lambda>")
    return "the loss function" if name == "<lambda>" else f"`{name}`"


def _described(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array of shape {tuple(value.shape)}"
    if isinstance(value, tuple | list):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def _checked(out: Any, n: int, loss_fn: Any, caller: str) -> Any:
    """`out` if it is the `n`-tuple of the loss contract; else a `StructureError`
    that shows the contract."""
    name, contract = _loss_name(loss_fn), (LOSS_CONTRACT, STATEFUL_LOSS_CONTRACT)[n - 2]
    if not isinstance(out, tuple | list) or len(out) != n:
        expected = ("(loss, metrics)", "(loss, metrics, new_model_state)")[n - 2]
        raise StructureError(
            f"{caller}: {name} returned {_described(out)}, not `{expected}`. A "
            f"loss function returns the loss and a dict of metrics:\n\n{contract}"
        )
    if jnp.ndim(out[0]) != 0:
        raise StructureError(
            f"{caller}: the loss {name} returned is {_described(out[0])}; it must "
            "be a scalar: reduce it over the batch (e.g. `.mean()`), and report "
            f"per-example values as metrics if you need them:\n\n{contract}"
        )
    if not isinstance(out[1], Mapping):
        raise StructureError(
            f"{caller}: the metrics {name} returned must be a dict of scalars "
            f"(`{{}}` for none); got {_described(out[1])}:\n\n{contract}"
        )
    return out


def _check_takes_model_state(loss_fn: Any, caller: str) -> None:
    try:
        parameters = inspect.signature(loss_fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read: let the call tell
        return
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    for p in parameters:
        if p.kind == inspect.Parameter.VAR_KEYWORD or (
            p.name == "model_state" and p.kind in kinds
        ):
            return
    raise StructureError(
        f"{caller}: the state has a `model_state` (e.g. batch statistics), so the "
        f"loss is called as `loss_fn(model, batch, key, model_state=...)`, but "
        f"{_loss_name(loss_fn)} takes no `model_state` keyword. A stateful loss "
        f"returns the new state too:\n\n{STATEFUL_LOSS_CONTRACT}"
    )


def as_dtype(aux: Mapping[str, Any], dtype: Any) -> dict[str, Array]:
    """The loss's metrics as arrays of `dtype`."""
    return {k: jnp.asarray(v).astype(dtype) for k, v in dict(aux).items()}


def split_weight(
    batch: Batch, aux: dict[str, Array]
) -> tuple[dict[str, Array], Float[Array, ""]]:
    """The metrics without `"weight"`, and the batch's weight (`batch_weight`)."""
    weight = batch_weight(batch, aux)
    aux.pop("weight", None)
    return aux, weight


# -- gradient functions ---------------------------------------------------------------
def value_and_grad(
    loss_fn: LossFn, *, precision: Precision | str | None = None
) -> GradFn:
    """The gradient function of `loss_fn`.

    Args:
        loss_fn: `loss_fn(model, batch, key) -> (loss, aux)`; called as
            `loss_fn(model, batch, key, model_state=s) -> (loss, aux, new_s)` when
            the gradient function receives a model state. `aux` may hold
            `"weight"` (see `batch_weight`).
        precision: `None`, `"bf16"`, `"f16"` or a `Precision`: the model and the
            floating batch leaves are cast *inside* the differentiated function,
            so gradients keep the parameters' dtype.

    Returns:
        `grad_fn(params, static, batch, key, model_state) -> Grads`.

    Raises:
        ConfigError: an unknown `precision` (at once).
        StructureError: `loss_fn` does not return `(loss, aux)` with a scalar loss
            and a dict `aux` (when traced).
    """
    return loss_grad(loss_fn, precision, caller="value_and_grad")


def loss_grad(
    loss_fn: LossFn, precision: Precision | str | None, *, caller: str
) -> GradFn:
    """`value_and_grad(loss_fn, precision=precision)`, its errors naming `caller`
    (the function the user gave `loss_fn` to: a recipe shares this piece)."""
    policy = as_precision(precision, caller)
    out_dtype = jnp.float32 if policy is None else policy.output_dtype

    def grad_fn(params, static, batch, key, model_state) -> Grads:
        def objective(p):
            model, inputs = cast(policy, eqx.combine(p, static), batch)
            out = call_loss(loss_fn, model, inputs, key, model_state, caller)
            loss, aux, new_state = out
            loss = jnp.asarray(loss).astype(out_dtype)
            return loss, (as_dtype(aux, out_dtype), new_state)

        differentiated = jax.value_and_grad(objective, has_aux=True)
        (loss, (aux, new_state)), grads = differentiated(params)
        aux, weight = split_weight(batch, aux)
        return Grads(loss, aux, weight, grads, new_state)

    return grad_fn


def _split_microbatches(batch: Batch, n: int, call: str) -> Batch:
    """Reshape every leaf from `(B, ...)` to `(n, B // n, ...)`."""

    def split(x: Any) -> Any:
        x = jnp.asarray(x)
        if x.ndim == 0 or x.shape[0] % n:
            size = "a scalar" if x.ndim == 0 else f"leading size {x.shape[0]}"
            raise ConfigError(
                f"{call}: {n} micro-batches must divide the batch size, but a batch "
                f"leaf of shape {x.shape} has {size}. Use a batch size that is a "
                f"multiple of {n}, or another number of micro-batches."
            )
        return x.reshape(n, x.shape[0] // n, *x.shape[1:])

    return jtu.tree_map(split, batch)


def check_count(n: Any, name: str, caller: str) -> None:
    """Raise `ConfigError` (naming `caller` and its argument `name`) unless `n` is
    an int >= 1."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"{caller}: `{name}` must be an int >= 1; got {n!r}.")


def microbatched(grad_fn: GradFn, n: int) -> GradFn:
    """Run `grad_fn` over `n` micro-batches with `lax.scan`, weighted by tokens.

    Every batch leaf is split from `(B, ...)` into `(n, B / n, ...)`; the loss,
    metrics and gradients of the micro-batches are summed weighted by each one's
    `weight` and divided by the total, so the result equals the full-batch one (up
    to rounding) even when micro-batches hold different numbers of real tokens.
    Activation memory falls by about `n`. Each micro-batch gets its own key (the
    key split `n` ways). With `n == 1`, `grad_fn` itself is returned.

    Raises:
        ConfigError: `n` is not an int >= 1 (at once), or does not divide the
            batch size (when traced).
    """
    check_count(n, "n", "microbatched")
    return microbatched_as(grad_fn, n, call=f"microbatched(grad_fn, {n})")


def microbatched_as(grad_fn: GradFn, n: int, *, call: str) -> GradFn:
    """`microbatched(grad_fn, n)` for a checked `n`; a batch that `n` does not
    divide is refused naming `call`, the user's call (`train_step(...,
    accumulate=3)`: a recipe shares this piece)."""
    if n == 1:
        return grad_fn

    def accumulated(params, static, batch, key, model_state) -> Grads:
        micro, keys = _split_microbatches(batch, n, call), jr.split(key, n)
        first = jtu.tree_map(lambda x: x[0], micro)
        shapes = eqx.filter_eval_shape(
            grad_fn, params, static, first, keys[0], model_state
        )

        def body(carry, xs):
            sums, mstate = carry
            mb, k = xs
            g = grad_fn(params, static, mb, k, mstate)
            return (_accumulate(sums, g), g.model_state), None

        start = (_zero_sums(shapes), model_state)
        (sums, mstate), _ = lax.scan(body, start, (micro, keys))
        return _weighted_mean(sums, shapes.grads, mstate)

    return accumulated


def _zero_sums(shapes: Grads) -> tuple[Any, Any, Any, Any]:
    """Zeros (float32 at least) for the running sums of loss, aux, weight and grads."""
    f32 = lambda s: jnp.zeros(s.shape, jnp.promote_types(s.dtype, jnp.float32))
    return jtu.tree_map(f32, (shapes.loss, shapes.aux, shapes.weight, shapes.grads))


def _accumulate(sums: tuple[Any, Any, Any, Any], g: Grads) -> tuple[Any, Any, Any, Any]:
    """The running sums with one micro-batch's results added, times its weight."""
    loss_sum, aux_sum, w_sum, g_sum = sums
    w = g.weight
    add = lambda acc, v: acc + w * v.astype(acc.dtype)
    aux_sum, g_sum = (
        jtu.tree_map(add, aux_sum, g.aux),
        jtu.tree_map(add, g_sum, g.grads),
    )
    return add(loss_sum, g.loss), aux_sum, w_sum + w, g_sum


def _weighted_mean(
    sums: tuple[Any, Any, Any, Any], grad_shapes: Any, model_state: Any
) -> Grads:
    """The micro-batches' weighted means; the gradients back in their own dtypes."""
    loss_sum, aux_sum, w_sum, g_sum = sums
    # A batch whose weights are all zero contributes nothing (not NaN).
    safe = jnp.where(w_sum > 0, w_sum, 1.0)
    mean = lambda v: v / safe
    grads = jtu.tree_map(lambda g, p: mean(g).astype(p.dtype), g_sum, grad_shapes)
    aux = jtu.tree_map(mean, aux_sum)
    return Grads(mean(loss_sum), aux, w_sum, grads, model_state)


def psum_grads(grad_fn: GradFn, axes: str | Sequence[str]) -> GradFn:
    """Combine `grad_fn`'s results across the devices of mapped `axes`.

    For use inside `jax.shard_map` (see `eqtrain.sharding.data_parallel`, which
    does the mapping): each device computes the loss and gradients of its own rows,
    then loss, metrics and gradients are averaged over all devices with `psum`,
    weighted by each device's `weight`, so the result equals the gradient function
    on the whole batch. Each device's key is first folded with its index along
    `axes` (so dropout differs per shard).
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)

    def reduced(params, static, batch, key, model_state) -> Grads:
        key = jr.fold_in(key, _device_index(axes))
        g = grad_fn(params, static, batch, key, model_state)
        total = lax.psum(g.weight, axes)
        safe = jnp.where(total > 0, total, 1.0)
        # Each device's values are means over its own weight: re-weight, then sum.
        mean = lambda x: (
            lax.psum(x.astype(jnp.float32) * g.weight, axes) / safe
        ).astype(x.dtype)
        aux, grads = jtu.tree_map(mean, g.aux), jtu.tree_map(mean, g.grads)
        return Grads(mean(g.loss), aux, total, grads, g.model_state)

    return reduced


def _device_index(axes: tuple[str, ...]) -> Any:
    """This device's index over the mapped `axes`, row-major (as the batch is split)."""
    index = 0
    for a in axes:
        index = index * lax.axis_size(a) + lax.axis_index(a)
    return index
