"""Shardings for a whole state from partition rules, and placing arrays on them.

Model leaves follow the rules; the optimizer state and the EMA follow the parameters
they track; counters and keys are replicated. Builds on `_rules.py`.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from .._copy import check_not_donated
from .._errors import StructureError
from .._quant import is_quantized
from .._state import TrainState
from ._rules import Rule, Rules, as_rules


def is_arraylike(x: Any) -> bool:
    """An array or an abstract one (`eqx.is_array` is False for ShapeDtypeStruct)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _entry(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_name(path: tuple[Any, ...], prefix: str = "") -> str:
    """A key path as dots: `model.layers.self_attn.q_proj.weight` (the names the
    rules match and the checkpoint manifest uses)."""
    parts = [prefix] if prefix else []
    return ".".join(parts + [_entry(k) for k in path])


def _map_arrays(fn: Callable[[str, Any], Any], tree: Any, prefix: str) -> Any:
    """`tree` with `fn(path, leaf)` at each array leaf and None elsewhere. A
    quantized weight's arrays follow the weight's own sharding (`fn` of the
    weight's path and shape), each on the axes it has in common with it."""

    def one(p: Any, x: Any) -> Any:
        name = path_name(p, prefix)
        if is_quantized(x):
            like = fn(name, jax.ShapeDtypeStruct(x.shape, x.dtype))
            return quantized_shardings(x, like)
        return fn(name, x) if is_arraylike(x) else None

    return jtu.tree_map_with_path(one, tree, is_leaf=is_quantized)


def quantized_shardings(q: Any, weight: NamedSharding) -> Any:
    """Shardings for a `QuantizedWeight`'s arrays from its weight's: the codes
    and block scales (`[*lead, out, in']`) split as the weight is, the
    double-quantization scales and offsets along the leading axes only; a
    dimension the weight's axis does not divide there is not split."""
    entries = list(weight.spec) + [None] * (len(q.shape) - len(weight.spec))
    *lead, out, _ = entries

    def fitted(shape: tuple[int, ...], wanted: list[Any]) -> NamedSharding:
        spec = [
            e if e is None or n % _axis_size(weight.mesh, e) == 0 else None
            for e, n in zip(wanted, shape, strict=True)
        ]
        return NamedSharding(weight.mesh, PartitionSpec(*spec))

    def sharding(name: str, a: Any) -> Any:
        if a is None:
            return None
        rank = len(a.shape)
        if name in ("codes", "scales") and rank >= len(lead) + 1:
            wanted = (entries if rank == len(entries) else [*lead, out])[:rank]
        else:
            wanted = (lead + [None] * rank)[:rank]
        return fitted(tuple(a.shape), list(wanted))

    names = ("codes", "scales", "scales2", "offset")
    arrays = [getattr(q, n) for n in names]
    out_sh = [sharding(n, a) for n, a in zip(names, arrays, strict=True)]
    leaves = [s for s in out_sh if s is not None]
    return jtu.tree_unflatten(jtu.tree_structure(q), leaves)


def _axis_size(mesh: Any, entry: Any) -> int:
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    size = 1
    for name in names:
        size *= int(dict(mesh.shape)[name])
    return size


def _is_hole(x: Any) -> bool:
    """No parameter here: frozen (`None`) or left out by `optax.masked`."""
    return x is None or isinstance(x, optax.MaskedNode)


def _params_like(node: Any, params: Any) -> bool:
    """`node` is shaped like the parameter tree (Adam's `mu`, ...), with holes where
    the parameters are frozen or masked out of the optimizer."""
    flat, treedef = jtu.tree_flatten(node, is_leaf=_is_hole)
    flat_params, params_def = jtu.tree_flatten(params, is_leaf=_is_hole)
    if treedef != params_def or not any(is_arraylike(x) for x in flat):
        return False
    return all(
        _is_hole(x) or (is_arraylike(p) and x.shape == p.shape)
        for x, p in zip(flat, flat_params, strict=True)
    )


def _opt_shardings(
    opt_state: Any,
    params: Any,
    params_sh: Any,
    replicated: NamedSharding,
    optimizer: optax.GradientTransformation | None,
) -> Any:
    """Shardings of an optimizer state: parameter-shaped parts like the parameters,
    everything else (counters, scalars) replicated. Without the optimizer, the
    parameter-shaped subtrees are recognised by their structure."""
    if optimizer is None:
        like = lambda node: _params_like(node, params)
        as_params = lambda node: jtu.tree_map(
            lambda x, sharding: sharding if is_arraylike(x) else None,
            node, params_sh, is_leaf=_is_hole,
        )  # fmt: skip
        return jtu.tree_map(
            lambda node: as_params(node) if like(node) else _if_array(node, replicated),
            opt_state,
            is_leaf=like,
        )
    return optax.tree_map_params(
        optimizer,
        lambda x, sharding: _like_param(x, sharding, replicated),
        opt_state,
        params_sh,
        transform_non_params=lambda x: _if_array(x, replicated),
        is_leaf=_is_hole,
    )


def _if_array(x: Any, sharding: NamedSharding) -> NamedSharding | None:
    return sharding if is_arraylike(x) else None


def _like_param(x: Any, sharding: Any, replicated: NamedSharding) -> Any:
    """The sharding of a leaf in a parameter's place: the parameter's, or
    replicated if it does not fit (Adafactor's factored row/column statistics)."""
    if not is_arraylike(x):
        return None
    return sharding if _fits(sharding, tuple(x.shape)) else replicated


def _fits(sharding: Any, shape: tuple[int, ...]) -> bool:
    """`sharding` can lay out an array of `shape`."""
    if len(sharding.spec) > len(shape):
        return False
    try:
        sharding.shard_shape(shape)
    except (ValueError, TypeError):
        return False
    return True


def state_shardings(
    state: Any,
    mesh: Mesh,
    rules: Rules | list[Rule] | tuple[Rule, ...] | None = None,
    *,
    optimizer: optax.GradientTransformation | None = None,
) -> Any:
    """A `NamedSharding` for every array leaf of `state`, from partition rules.

    For a `TrainState`: `model` leaves follow `rules` (matched on paths such as
    `model.layers.mlp.up_proj.weight`) and the FSDP pass; `opt_state` parts shaped
    like the trainable parameters (Adam's moments, ...) and `ema` are sharded like
    those parameters; other optimizer leaves (counters), `step`, `key` and
    `skipped` are replicated; `model_state` is replicated unless a rule matches
    (no FSDP pass). Any other pytree: every array leaf follows the rules.

    Args:
        state: a `TrainState` or any pytree, concrete or abstract (e.g. from
            `eqx.filter_eval_shape`): nothing is computed.
        mesh: from `make_mesh`.
        rules: from `rules_for`, a list of `(regex, PartitionSpec)` pairs (with
            the default FSDP pass), or None (the FSDP pass alone).
        optimizer: the optax optimizer; its state's parameter-shaped parts are
            then found with `optax.tree_map_params`. Without it they are
            recognised by their structure (the parameters' tree and shapes).

    Returns:
        A pytree like `state` with a `NamedSharding` at each array leaf and None
        elsewhere: pass it to `shard`, `eqtrain.jit(step, shardings=(it, ...))`
        and `eqtrain.checkpoint.restore(..., shardings=it)`.

    Raises:
        ConfigError: a rule does not fit a leaf (see `Rules.spec_for`).
    """
    rules = as_rules(rules)

    def by_rules(fsdp: bool) -> Callable[[str, Any], NamedSharding]:
        spec = lambda path, x: rules.spec_for(path, tuple(x.shape), mesh, fsdp=fsdp)
        return lambda path, x: NamedSharding(mesh, spec(path, x))

    if not isinstance(state, TrainState):
        return _map_arrays(by_rules(fsdp=True), state, "")
    replicated = NamedSharding(mesh, PartitionSpec())
    model_sh = _map_arrays(by_rules(fsdp=True), state.model, "model")
    params_sh = eqx.filter(model_sh, state.trainable)
    fields = {
        "model": model_sh,
        "opt_state": _opt_shardings(
            state.opt_state, state.params, params_sh, replicated, optimizer
        ),
        **dict.fromkeys(("step", "key", "skipped"), replicated),  # counters, key
    }
    if state.model_state is not None:  # the rules alone: no FSDP pass
        by = by_rules(fsdp=False)
        fields["model_state"] = _map_arrays(by, state.model_state, "model_state")
    if state.ema is not None:
        fields["ema"] = params_sh
    names = list(fields)
    get = lambda s: [getattr(s, name) for name in names]
    values = [fields[name] for name in names]
    return eqx.tree_at(get, state, values, is_leaf=lambda x: x is None)


def _flat_shardings(tree: Any, shardings: Any) -> list[Sharding | None]:
    """One sharding (or None) per leaf of `tree`."""
    leaves = jtu.tree_leaves(tree)
    if isinstance(shardings, Sharding):
        return [shardings if is_arraylike(x) else None for x in leaves]
    flat = _shardings_in(shardings)
    arrays = sum(is_arraylike(x) for x in leaves)
    if len(flat) != arrays:
        raise StructureError(
            f"`shardings` has {len(flat)} shardings but the tree has {arrays} array "
            "leaves. Build them from the same tree: "
            "`eqtrain.sharding.state_shardings(tree, mesh, rules)`."
        )
    it = iter(flat)
    return [next(it) if is_arraylike(x) else None for x in leaves]


def _shardings_in(tree: Any) -> list[Sharding]:
    """The `Sharding` leaves of `tree`, in order."""
    is_sharding = lambda x: isinstance(x, Sharding)
    return [s for s in jtu.tree_leaves(tree, is_leaf=is_sharding) if is_sharding(s)]


def shard(tree: Any, shardings: Any) -> Any:
    """Place the arrays of `tree` on `shardings` (a copy: never the same buffers).

    The copy matters with a donating step: `device_put` may otherwise hand back
    the caller's own buffers, which the first step would then delete.

    Args:
        tree: any pytree (e.g. a `TrainState`); non-array leaves are kept.
        shardings: from `state_shardings` (a `Sharding` per array leaf), or one
            `Sharding` for every array.

    Returns:
        `tree` with every array on its sharding.

    Raises:
        DonatedStateError: `tree` holds arrays a donating step consumed.
    """
    check_not_donated(tree, "`eqtrain.sharding.shard`")
    leaves, treedef = jtu.tree_flatten(tree)
    targets = _flat_shardings(tree, shardings)
    index = [i for i, s in enumerate(targets) if s is not None]
    local = [i for i in index if targets[i].is_fully_addressable]
    _put_local(leaves, targets, local)
    for i in index:
        if not targets[i].is_fully_addressable:
            leaves[i] = _global(leaves[i], targets[i])
    return treedef.unflatten(leaves)


def _put_local(leaves: list[Any], targets: list[Any], local: list[int]) -> None:
    """Replace `leaves[i]` for `i` in `local` by copies on their (single-process)
    shardings, in one `device_put`."""
    values = [leaves[i] for i in local]
    placed = jax.device_put(values, [targets[i] for i in local], may_alias=False)
    for i, x, old in zip(local, placed, values, strict=True):
        # `may_alias=False` is not always kept: a replicated placement can hand
        # back the source's own buffer on its device. Copy such a leaf again.
        leaves[i] = jnp.copy(x) if _shares_buffers(old, x) else x


def _shares_buffers(a: Any, b: Any) -> bool:
    """Whether the jax arrays `a` and `b` hold any device buffer in common."""
    if not (isinstance(a, jax.Array) and isinstance(b, jax.Array)):
        return False
    pointers = lambda x: {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
    return bool(pointers(a) & pointers(b))


def _global(x: Any, sharding: Any) -> Any:
    """A multi-process array from a value every process holds in full (e.g. the
    same seeded initialisation): each process places its own shards. Under
    abstract evaluation (`eqx.filter_eval_shape`, as `restore` uses to learn the
    state's structure) the value is returned as it is."""
    if isinstance(x, jax.core.Tracer):
        return x
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _global(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(jax.device_get(x))
    return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
