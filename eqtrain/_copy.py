"""`eqtrain.copy`: new buffers for every array of a pytree (a model, a `TrainState`),
to keep a value alive past a step that donates it. Builds on `_jit.check_live`."""

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ._jit import check_live


T = TypeVar("T")


def _is_concrete(x: Any) -> bool:
    """A JAX array with buffers (not a tracer under `jit` or `eval_shape`)."""
    return isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def check_not_donated(tree: Any, user: str) -> None:
    """Raise `DonatedStateError` naming the first array of `tree` that a donating
    step deleted; `user` is the function the caller called (in backticks).
    Tracers are skipped: they have no buffers to lose."""
    check_live(jtu.tree_map(lambda x: x if _is_concrete(x) else None, tree), user)


def copy(tree: T) -> T:
    """A copy of `tree` with new buffers for every array, each on its own sharding.

    A step compiled with `eqtrain.jit` donates the state by default: the arrays
    of the state passed in are deleted (their memory is reused). Copy what must
    outlive the step first, e.g. the weights before fine-tuning or a reference
    model. Unlike `jax.tree.map(jnp.copy, tree)`, this works on any Equinox
    module: non-array leaves (an `eqx.nn.MLP`'s activation, ints, strings) are
    kept as they are.

    Args:
        tree: any pytree: a model, a `TrainState`, a dict of arrays.

    Returns:
        `tree` with every JAX array copied onto its own sharding (one
        `jax.device_put` for all of them; under `jit`, `jnp.copy`), every NumPy
        array copied, and every other leaf the same object.

    Raises:
        DonatedStateError: `tree` holds an array that a donating step consumed
            (the message names the first one's path).

    Example:
        >>> import equinox as eqx, jax.random as jr
        >>> model = eqx.nn.MLP(2, 1, 4, 1, key=jr.key(0))
        >>> kept = copy(model)
        >>> kept.layers[0].weight is model.layers[0].weight
        False
    """
    check_not_donated(tree, "`eqtrain.copy`")
    leaves, treedef = jtu.tree_flatten(tree)
    index = [i for i, x in enumerate(leaves) if _is_concrete(x)]
    placed = jax.device_put(
        [leaves[i] for i in index],
        [leaves[i].sharding for i in index],
        may_alias=False,
    )
    copied = [_copied(x) for x in leaves]
    for i, x in zip(index, placed, strict=True):
        copied[i] = x
    return treedef.unflatten(copied)


def _copied(x: Any) -> Any:
    """A leaf other than a concrete JAX array, copied if it is an array."""
    if isinstance(x, jax.core.Tracer):
        return jnp.copy(x)
    if isinstance(x, np.ndarray):
        return np.array(x, copy=True)
    return x
