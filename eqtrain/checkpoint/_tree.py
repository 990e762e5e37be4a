"""The on-disk form of a `TrainState`: its array leaves as a nested dict of plain
arrays keyed by their path (typed PRNG keys stored as their raw `key_data`)."""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from ._errors import IncompatibleCheckpointError


def is_arraylike(x: Any) -> bool:
    """An array or an abstract one (`eqx.is_array` is False for ShapeDtypeStruct)."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def is_key(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _entry(key: Any) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def array_leaves(tree: Any) -> tuple[list[tuple[str, ...]], list[Any]]:
    """Paths (tuples of strings) and array leaves (concrete or abstract) of `tree`."""
    flat, _ = jtu.tree_flatten_with_path(tree)
    paths, leaves = [], []
    for path, leaf in flat:
        if is_arraylike(leaf):
            paths.append(tuple(_entry(k) for k in path))
            leaves.append(leaf)
    return paths, leaves


def path_name(path: tuple[str, ...]) -> str:
    return ".".join(path)


def nest(paths: list[tuple[str, ...]], values: list[Any]) -> dict[str, Any]:
    """`{"model": {"layers": {"0": {"weight": w}}}, ...}` from paths and values."""
    out: dict[str, Any] = {}
    for path, value in zip(paths, values, strict=True):
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def unnest(tree: dict[str, Any], paths: list[tuple[str, ...]]) -> list[Any]:
    out = []
    for path in paths:
        node: Any = tree
        for part in path:
            node = node[part]
        out.append(node)
    return out


def describe(paths: list[tuple[str, ...]], leaves: list[Any]) -> dict[str, Any]:
    """`{path: {"shape": [...], "dtype": "float32"}}`, as written to the manifest."""
    return {
        path_name(p): {"shape": list(x.shape), "dtype": str(x.dtype)}
        for p, x in zip(paths, leaves, strict=True)
    }


def trained_part(state: Any) -> Any:
    """`state` without its frozen model leaves (`None` there): what a checkpoint
    that references its base (a LoRA run) stores."""
    trainable = getattr(state, "trainable", None)
    if trainable is None:
        return state
    kept = eqx.filter(state.model, trainable)
    return eqx.tree_at(lambda s: s.model, state, kept, is_leaf=lambda x: x is None)


def with_frozen(partial: Any, full: Any) -> Any:
    """`partial` (restored trained part) completed by `full`'s frozen leaves."""
    model = eqx.combine(partial.model, full.model)
    return eqx.tree_at(lambda s: s.model, partial, model, is_leaf=lambda x: x is None)


def to_disk(state: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The nested dict of arrays to save, and the leaf description for the manifest."""
    paths, leaves = array_leaves(state)
    stored = [jax.random.key_data(x) if is_key(x) else x for x in leaves]
    return nest(paths, stored), describe(paths, leaves)


def _mismatch(name: str, got: Any, want: Any) -> str | None:
    """One line on leaf `name`, if the checkpoint's (`got`) and the model's
    (`want`) descriptions differ."""
    if want is None:
        return f"  {name}: in the checkpoint ({_fmt(got)}) but not in the model"
    if got is None:
        return f"  {name}: missing in the checkpoint (expected {_fmt(want)})"
    if got != want:
        return f"  {name}: checkpoint has {_fmt(got)}, model expects {_fmt(want)}"
    return None


def _mismatches(saved: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """The model's leaves first, then those only the checkpoint has."""
    names = [*expected, *(name for name in saved if name not in expected)]
    found = (_mismatch(n, saved.get(n), expected.get(n)) for n in names)
    return [line for line in found if line is not None]


def check_compatible(saved: dict[str, Any], template: Any, where: str) -> None:
    """Raise `IncompatibleCheckpointError` naming the first mismatched leaves."""
    problems = _mismatches(saved, describe(*array_leaves(template)))
    if problems:
        shown = "\n".join(problems[:5])
        more = f"\n  ... and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise IncompatibleCheckpointError(
            f"the checkpoint {where} does not match the state to restore into "
            f"({len(problems)} mismatched leaves):\n{shown}{more}\n"
            "Build the state with the same model config, optimizer and options "
            "(trainable filter, EMA, model state) as the run that wrote it, or start "
            "a new run directory."
        )


def _fmt(desc: dict[str, Any]) -> str:
    return f"{desc['dtype']}{tuple(desc['shape'])}"


ShardingsArg = Sharding | Callable[[str, Any], Sharding] | Any | None


def leaf_shardings(
    shardings: ShardingsArg, paths: list[tuple[str, ...]], leaves: list[Any]
) -> list[Sharding]:
    """One target sharding per array leaf of the template.

    `shardings` is `None` (every leaf on the first local device), one `Sharding`
    for all leaves, a callable `(path, abstract_leaf) -> Sharding`, or a pytree
    shaped like the state with a `Sharding` at each array leaf.
    """
    if shardings is None:
        return [SingleDeviceSharding(jax.local_devices()[0])] * len(leaves)
    if isinstance(shardings, Sharding):
        return [shardings] * len(leaves)
    if callable(shardings) and not isinstance(shardings, eqx.Module):
        return [
            _called(shardings, path_name(p), x)
            for p, x in zip(paths, leaves, strict=True)
        ]
    flat = jtu.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, Sharding))
    flat = [s for s in flat if isinstance(s, Sharding)]
    if len(flat) != len(leaves):
        raise IncompatibleCheckpointError(
            f"`shardings` has {len(flat)} shardings but the state has {len(leaves)} "
            "array leaves; pass a pytree shaped like the state (a Sharding at each "
            "array leaf), one Sharding, or a callable (path, leaf) -> Sharding."
        )
    return flat


def _called(shardings: Callable[[str, Any], Any], path: str, leaf: Any) -> Sharding:
    """The `shardings` callable's answer for one leaf; its own failure is the
    caller's code, said as such (not a damaged checkpoint)."""
    try:
        out = shardings(path, leaf)
    except Exception as e:
        raise IncompatibleCheckpointError(
            f"the `shardings` callable raised {type(e).__name__}: {e} (for the "
            f"leaf `{path}`, {getattr(leaf, 'shape', '?')}); it is called as "
            "`shardings(path, abstract_leaf) -> Sharding` for every array leaf. "
            "The checkpoints were not read."
        ) from e
    if not isinstance(out, Sharding):
        raise IncompatibleCheckpointError(
            f"the `shardings` callable returned {type(out).__name__} for the leaf "
            f"`{path}`; it must return a jax.sharding.Sharding."
        )
    return out


def _data_sharding(sharding: Sharding) -> Sharding:
    """The sharding of a key's raw data (one more, trailing, dimension)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec))
    return sharding


def abstract_on_disk(
    template: Any, shardings: ShardingsArg
) -> tuple[dict[str, Any], list[tuple[str, ...]], list[Any], list[Sharding]]:
    """The restore target (nested `ShapeDtypeStruct`s with shardings) for `template`."""
    paths, leaves = array_leaves(template)
    targets = leaf_shardings(shardings, paths, leaves)
    abstract = []
    for x, sharding in zip(leaves, targets, strict=True):
        if is_key(x):
            data = jax.eval_shape(jax.random.key_data, x)
            abstract.append(
                jax.ShapeDtypeStruct(
                    data.shape, data.dtype, sharding=_data_sharding(sharding)
                )
            )
        else:
            abstract.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding))
    return nest(paths, abstract), paths, leaves, targets


def from_disk(
    template: Any, restored: dict[str, Any], shardings: list[Sharding]
) -> Any:
    """Put restored arrays back into `template`'s structure (static parts kept)."""
    paths, leaves = array_leaves(template)
    values = unnest(restored, paths)
    out = []
    for x, value, sharding in zip(leaves, values, shardings, strict=True):
        if is_key(x):
            value = jax.device_put(
                jax.random.wrap_key_data(value, impl=x.dtype._impl), sharding
            )
        out.append(value)
    it = iter(out)
    return jtu.tree_map(lambda leaf: next(it) if is_arraylike(leaf) else leaf, template)
