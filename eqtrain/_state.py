"""`TrainState`: the one immutable pytree that carries a run from step to step.

Everything that changes during training lives here as arrays (model, optimizer state,
step, key, model state, EMA, skip counter). What is trained is decided once, by a
filter, and stored as a static boolean mask.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import optax
from jaxtyping import Array, Int, PRNGKeyArray, PyTree

from ._errors import ConfigError, DonatedStateError


def _is_inexact(x: Any) -> bool:
    """True for floating/complex arrays, concrete or abstract (`ShapeDtypeStruct`)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jnp.issubdtype(x.dtype, jnp.inexact)
    return eqx.is_inexact_array(x)


def trainable_mask(model: PyTree, filter_spec: Any = True) -> PyTree[bool]:
    """Resolve a filter spec into a pytree of Python bools shaped like `model`.

    A leaf is trainable when the filter says so (a bool, or a callable returning a
    bool, at or above that leaf, exactly as `eqx.partition` reads filter specs) *and*
    it is an inexact (floating) array. Integer arrays, functions and other static
    leaves are never trained.

    Args:
        model: any pytree, typically an `eqx.Module`.
        filter_spec: `True` (train every floating array), `False`, a callable
            `leaf -> bool`, or a pytree prefix of `model` made of those.

    Returns:
        A pytree of bools with one bool per leaf of `model` (`None` leaves get `False`).
    """

    try:
        return jtu.tree_map(_resolve, filter_spec, model)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(
            "`trainable` is not a pytree prefix of the model: its structure does not "
            f"line up with the model's ({e}). Build it from the model, e.g. "
            "`jax.tree.map(lambda _: False, model)` then `eqx.tree_at` to set True."
        ) from e


def _resolve(spec: Any, subtree: Any) -> Any:
    """One filter-spec leaf applied to the part of the model it covers."""
    want = _predicate(spec)
    return jtu.tree_map(
        lambda x: bool(want(x)) and _is_inexact(x), subtree, is_leaf=lambda x: x is None
    )


def _predicate(spec: Any) -> Callable[[Any], Any]:
    """A filter-spec leaf (a bool, or a callable `leaf -> bool`) as a callable."""
    if isinstance(spec, bool):
        return lambda _: spec
    if callable(spec):
        return spec
    raise ConfigError(
        "`trainable` must be a bool, a callable `leaf -> bool`, or a pytree "
        f"prefix of the model made of those; found a leaf {spec!r} of type "
        f"{type(spec).__name__}. Example: trainable=eqx.is_inexact_array."
    )


def _check_live_model(model: Any) -> None:
    """Refuse a model whose arrays a donating step deleted, by the first one's path
    (not with JAX's "Array has been deleted" from deep inside the optimizer)."""
    for path, leaf in jtu.tree_flatten_with_path(model)[0]:
        if _is_deleted(leaf):
            raise DonatedStateError(
                "the model given to `TrainState.create` has deleted arrays (first: "
                f"`model{jtu.keystr(path)}`): it belongs to a state that a step "
                "compiled with donate=True consumed. Use the model of the state that "
                "step returned (`new_state.model`), or keep this one alive with "
                "`eqtrain.copy(state.model)` before the step."
            )


def _is_deleted(x: Any) -> bool:
    concrete = isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
    return concrete and x.is_deleted()


def _as_key(key: PRNGKeyArray | int) -> PRNGKeyArray:
    if isinstance(key, int):
        return jr.key(key)
    return key


class TrainState(eqx.Module):
    """Everything that changes during training, as one immutable pytree.

    Build it with `TrainState.create`. Advance it with a step from `train_step`;
    never mutate it. Arrays are the model, the optimizer state (for trainable leaves
    only), the step counter, the PRNG key, the optional `eqx.nn.State`, the optional
    EMA of the trainable weights, and the count of skipped non-finite steps.
    The trainable mask is static (part of the tree structure, not an array).

    Attributes:
        model: the model (any pytree; usually an `eqx.Module`).
        opt_state: optax state for the trainable leaves.
        step: number of completed steps, an int32 scalar array.
        key: PRNG key; split once per step.
        model_state: optional `eqx.nn.State` (e.g. batch-norm statistics).
        ema: optional exponential moving average of the trainable leaves (a tree
            shaped like `eqx.filter(model, trainable)`, `None` where frozen).
        skipped: number of steps whose update was skipped because the loss or the
            gradients were not finite.
        trainable: static pytree of bools, one per model leaf.
    """

    model: Any
    opt_state: Any
    step: Int[Array, ""]
    key: PRNGKeyArray
    model_state: eqx.nn.State | None
    ema: Any
    skipped: Int[Array, ""]
    trainable: Any = eqx.field(static=True)

    @classmethod
    def create(
        cls,
        model: Any,
        optimizer: optax.GradientTransformation,
        *,
        key: PRNGKeyArray | int,
        trainable: Any = True,
        model_state: eqx.nn.State | None = None,
        ema: bool = False,
    ) -> "TrainState":
        """Build the initial state.

        Args:
            model: the model to train.
            optimizer: an optax transformation; it is only used here to initialise
                its state, and must be passed again to `train_step`.
            key: a PRNG key (or an int seed) for the per-step randomness
                (dropout etc.). The data order has its own seed.
            trainable: filter spec choosing the trained leaves (see
                `trainable_mask`). Frozen leaves get no optimizer state and no
                gradients.
            model_state: an `eqx.nn.State`, for models with mutable state.
            ema: keep an exponential moving average of the trainable weights
                (needed by `train_step(..., ema=decay)`).

        Raises:
            DonatedStateError: `model` holds arrays a donating step consumed.

        Example:
            >>> import equinox as eqx, jax.random as jr, optax
            >>> model = eqx.nn.MLP(2, 1, 8, 1, key=jr.key(0))
            >>> state = TrainState.create(model, optax.adam(1e-3), key=0)
            >>> int(state.step)
            0
        """
        _check_live_model(model)
        mask = trainable_mask(model, trainable)
        params = eqx.filter(model, mask)
        return cls(
            model=model,
            opt_state=optimizer.init(params),
            step=jnp.zeros((), jnp.int32),
            key=_as_key(key),
            model_state=model_state,
            ema=jtu.tree_map(jnp.copy, params) if ema else None,
            skipped=jnp.zeros((), jnp.int32),
            trainable=mask,
        )

    @property
    def params(self) -> Any:
        """The trainable leaves of the model (`None` elsewhere)."""
        return eqx.filter(self.model, self.trainable)

    @property
    def ema_model(self) -> Any:
        """The model with its trainable leaves replaced by their EMA."""
        if self.ema is None:
            raise ConfigError(
                "this TrainState keeps no EMA; create it with "
                "`TrainState.create(..., ema=True)`."
            )
        frozen = eqx.filter(self.model, self.trainable, inverse=True)
        return eqx.combine(self.ema, frozen)
