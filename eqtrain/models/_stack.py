"""A stack of identical layers: built with one leading layer axis
(`stack_layers`), run in order with `lax.scan` or unrolled (`run_layers`), each
layer optionally rematerialised under a policy from `REMAT_PRESETS` over the
activations the layers name (`CHECKPOINT_NAMES`).
"""

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.lax as lax
import jax.random as jr
import jax.tree_util as jtu
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Int, PRNGKeyArray

from .._errors import ConfigError
from .._names import did_you_mean
from ._layers import uses_key


CHECKPOINT_NAMES: dict[str, str] = {
    "layer_input": "each layer's input (the residual stream entering the block)",
    "query": "the query projection (after the rotary embedding)",
    "key": "the key projection (after the rotary embedding)",
    "value": "the value projection",
    "attn_out": "the attention block's output (after its output projection)",
    "mlp_in": "the MLP's input (after the norm)",
    "mlp_out": "the MLP's output (after its down projection)",
}
"""The names eqtrain's layers give their activations with
`jax.ad_checkpoint.checkpoint_name`, which remat policies save or offload."""

REMAT_PRESETS: dict[str, str] = {
    "none": "no rematerialisation: every activation is kept for the backward pass "
    "(scanned layers make their norms' outputs again: `_decoder_mlps.normed`)",
    "full": "keep only each layer's input; recompute the rest in the backward pass",
    "dots": "keep the outputs of matmuls (projections and attention's)",
    "dots_no_batch": "keep the outputs of matmuls without batch dimensions (the "
    "projections, not attention's scores)",
    "nothing_saveable": "as `full`",
    "save_qkv": "keep the q/k/v projections, recompute the rest",
    "save_out": "keep each attention block's output (after o_proj), recompute the rest",
    "offload_layer_input": "as `full`, with each layer's input moved to host memory "
    "(pinned_host) until the backward pass needs it",
    "custom": "keep the activations named in `remat_save`, offload those in "
    "`remat_offload` (names: CHECKPOINT_NAMES)",
}
"""Per-layer rematerialisation presets (`remat=` of the model configs)."""

_PRESET_NAMES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # preset: (names saved on device, names offloaded to host)
    "save_qkv": (("query", "key", "value"), ()),
    "save_out": (("attn_out",), ()),
    "offload_layer_input": ((), ("layer_input",)),
}


def names(
    value: str | Sequence[str] | None, *, field: str, prefix: str = ""
) -> tuple[str, ...]:
    """Checkpoint names from a comma-separated string or a sequence, checked
    against `CHECKPOINT_NAMES`."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    out = tuple(str(n).strip() for n in items if str(n).strip())
    for n in out:
        if n not in CHECKPOINT_NAMES:
            raise ConfigError(
                f"`{prefix}{field}` names {n!r}, which no layer marks; the names are "
                f"{', '.join(CHECKPOINT_NAMES)}.{did_you_mean(n, CHECKPOINT_NAMES)}"
            )
    return out


def check_remat(
    name: str,
    save: Sequence[str] = (),
    offload: Sequence[str] = (),
    *,
    prefix: str = "",
) -> None:
    """Validate a remat setting: a preset of `REMAT_PRESETS`; `save`/`offload`
    names (only with `"custom"`, which needs at least one); offloading needs a
    device with a `pinned_host` memory. `prefix` goes before the field names in
    messages (`"model."` for the run config)."""
    p = prefix
    if name not in REMAT_PRESETS:
        raise ConfigError(
            f"`{p}remat` must be one of {list(REMAT_PRESETS)}; got {name!r}."
            + did_you_mean(str(name), REMAT_PRESETS)
        )
    save = names(save, field="remat_save", prefix=p)
    offload = names(offload, field="remat_offload", prefix=p)
    _check_named(name, save, offload, p)
    if offload or name == "offload_layer_input":
        check_offload()


def _check_named(
    name: str, save: tuple[str, ...], offload: tuple[str, ...], p: str
) -> None:
    """Names saved or offloaded with `"custom"` only (and at least one there),
    none both saved and offloaded."""
    if name != "custom" and (save or offload):
        raise ConfigError(
            f"`{p}remat_save` / `{p}remat_offload` apply only to {p}remat = "
            f"'custom'; {p}remat is {name!r}. Set it to 'custom', or clear them."
        )
    if name == "custom" and not (save or offload):
        raise ConfigError(
            f"{p}remat = 'custom' needs `{p}remat_save` and/or `{p}remat_offload` "
            f"(names from {', '.join(CHECKPOINT_NAMES)}); with neither it is "
            "'full'."
        )
    both = sorted(set(save) & set(offload))
    if both:
        raise ConfigError(
            f"{both} are both saved (`{p}remat_save`) and offloaded "
            f"(`{p}remat_offload`); name each activation in one of them."
        )


def check_offload() -> None:
    """Raise unless the default device has a `pinned_host` memory to offload to."""
    device = jax.devices()[0]
    kinds = _memory_kinds(device)
    if "pinned_host" not in kinds:
        raise ConfigError(
            f"activation offloading needs a device with host memory ('pinned_host'); "
            f"this {device.platform} backend has {sorted(kinds) or 'no memory kinds'}."
            " Use a remat preset without offload (e.g. 'full')."
        )


def _memory_kinds(device: Any) -> set[str]:
    """The kinds of memory `device` addresses (none known without the API)."""
    try:
        return {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 -- a backend without memories API
        return set()


def remat_policy(
    name: str, save: Sequence[str] = (), offload: Sequence[str] = ()
) -> tuple[bool, Callable[..., Any] | None]:
    """`(checkpoint the layer?, jax.checkpoint policy)` of a remat setting."""
    check_remat(name, save, offload)
    if name == "none":
        return False, None
    if name in ("full", "nothing_saveable"):
        return True, None
    if name in _DOTS_POLICIES:
        return True, getattr(jax.checkpoint_policies, _DOTS_POLICIES[name])
    if name == "custom":
        keep = names(save, field="remat_save")
        move = names(offload, field="remat_offload")
    else:
        keep, move = _PRESET_NAMES[name]
    return True, _names_policy(keep, move)


_DOTS_POLICIES = {
    "dots": "checkpoint_dots",
    "dots_no_batch": "checkpoint_dots_with_no_batch_dims",
}
"""The presets that are one of `jax.checkpoint_policies`' (by its name)."""


def _names_policy(keep: tuple[str, ...], move: tuple[str, ...]) -> Callable[..., Any]:
    """The policy that saves the activations named `keep` on the device and
    offloads those named `move` to host memory."""
    if not move:
        return jax.checkpoint_policies.save_only_these_names(*keep)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(keep),
        names_which_can_be_offloaded=list(move),
        offload_src="device",
        offload_dst="pinned_host",
    )


def name_activation(x: Array, name: str) -> Array:
    """`x` marked as `name` (one of `CHECKPOINT_NAMES`) for remat policies."""
    return checkpoint_name(x, name)


LayerT = TypeVar("LayerT", bound=eqx.Module)


def stack_layers(
    make: Callable[[PRNGKeyArray], LayerT], num: int, key: PRNGKeyArray
) -> LayerT:
    """`num` independently initialised layers as one module whose arrays have a
    leading axis of size `num` (built with `eqx.filter_vmap` over the keys)."""
    return eqx.filter_vmap(make)(jr.split(key, num))


def run_layers(
    layers: LayerT,
    x: Any,
    call: Callable[..., Any],
    *,
    scan: bool,
    remat: str,
    key: PRNGKeyArray | None = None,
    remat_save: Sequence[str] = (),
    remat_offload: Sequence[str] = (),
    kinds: Sequence[Any] | None = None,
) -> Any:
    """`x = call(layer_i, x, key_i)` for each layer of a stack, in order.

    With `scan=True` the layer body is traced and compiled once (`lax.scan`), so
    compile time does not grow with depth; `scan=False` unrolls a Python loop (the
    reference). `remat` names a preset of `REMAT_PRESETS` (with `"custom"`,
    `remat_save` and `remat_offload` name the activations, see
    `CHECKPOINT_NAMES`); it applies `jax.checkpoint` to each layer, whose input
    is named `"layer_input"`. `key` is split into one key per layer when the
    layers use one (`uses_key`); otherwise every `key_i` is None.

    `kinds`: one static value per layer (hashable: e.g. its attention window and
    rotary table), passed on as `call(layer_i, x, key_i, kinds[i])`. Layers
    whose kinds differ cannot share one traced body; when the kinds repeat with
    a period `p` (Gemma 2's alternation: 2; Gemma 3's 5:1 pattern: 6), `scan`
    runs over groups of `p` layers, each group unrolled inside, and the layers
    after the last whole group unrolled after it.
    """
    remat_on = remat_policy(remat, remat_save, remat_offload)
    dynamic, static = eqx.partition(layers, eqx.is_array)
    num = jtu.tree_leaves(dynamic)[0].shape[0]
    keys = jr.split(key, num) if key is not None and uses_key(layers) else None
    kinds = _checked_kinds(kinds, num)
    body = _layer_body(static, call, kinds is not None)
    unrolled, scanned = _rematerialised(body, *remat_on)
    period = 1 if kinds is None else _period(kinds)
    xs = (dynamic, keys)
    if scan and period == 1:
        first = None if kinds is None else kinds[0]
        return lax.scan(lambda h, p: (scanned(h, p, first), None), x, xs)[0]
    groups = num // period if scan else 0
    done = 0
    if groups > 1:
        x = _scan_groups(scanned, x, xs, kinds, groups, period)
        done = groups * period
    for i in range(done, num):
        layer_xs = jtu.tree_map(lambda a, i=i: a[i], xs)
        x = unrolled(x, layer_xs, None if kinds is None else kinds[i])
    return x


def _checked_kinds(kinds: Sequence[Any] | None, num: int) -> tuple[Any, ...] | None:
    """`kinds` as a tuple of one per layer (or None)."""
    kinds = None if kinds is None else tuple(kinds)
    if kinds is not None and len(kinds) != num:
        raise ConfigError(f"{len(kinds)} layer kinds for {num} layers.")
    return kinds


def _layer_body(
    static: Any, call: Callable[..., Any], with_kinds: bool
) -> Callable[..., Any]:
    """`body(h, (params, key), kind)`: `call` on one layer, with its input
    named `"layer_input"` (the activations, first of `h` when it is a tuple)."""

    def body(h: Any, xs: Any, kind: Any = None) -> Any:
        params, k = xs
        layer = eqx.combine(params, static)
        h = _named_input(h)
        return call(layer, h, k, kind) if with_kinds else call(layer, h, k)

    return body


def _named_input(h: Any) -> Any:
    """`h` named `"layer_input"` (its activations, when it is a tuple of them
    and statistics carried along)."""
    if isinstance(h, tuple):
        return (name_activation(h[0], "layer_input"), *h[1:])
    return name_activation(h, "layer_input")


def _rematerialised(
    body: Callable[..., Any], on: bool, policy: Callable[..., Any] | None
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """`(unrolled, scanned)`: `body` under `jax.checkpoint` with `policy` for
    an unrolled layer and for one inside `scan` (or `body` itself, remat off)."""
    if not on:
        return body, body
    # prevent_cse stops XLA from merging the recomputation with the forward pass
    # (undoing the remat); inside `scan` that cannot happen and it only costs.
    remat_ = lambda cse: jax.checkpoint(
        body, policy=policy, prevent_cse=cse, static_argnums=(2,)
    )
    return remat_(True), remat_(False)


def _scan_groups(
    scanned: Callable[..., Any],
    x: Any,
    xs: Any,
    kinds: Any,
    groups: int,
    period: int,
) -> Any:
    """`x` through the first `groups * period` layers of `xs`: a `scan` over
    groups of `period` layers, each group unrolled with the kinds' pattern."""
    cut = lambda a: a[: groups * period].reshape(groups, period, *a.shape[1:])

    def group(h: Any, xs: Any) -> tuple[Any, None]:
        for j in range(period):
            h = scanned(h, jtu.tree_map(lambda a, j=j: a[j], xs), kinds[j])
        return h, None

    return lax.scan(group, x, jtu.tree_map(cut, xs))[0]


def run_configured(
    layers: LayerT,
    x: Any,
    call: Callable[..., Any],
    config: Any,
    *,
    key: PRNGKeyArray | None = None,
    kinds: Sequence[Any] | None = None,
) -> Any:
    """`run_layers` with a model config's `scan_layers`, `remat`, `remat_save`
    and `remat_offload`."""
    return run_layers(
        layers, x, call, scan=config.scan_layers, remat=config.remat, key=key,
        remat_save=config.remat_save, remat_offload=config.remat_offload,
        kinds=kinds,
    )  # fmt: skip


class Numbered(eqx.Module):
    """A stack of layers with each one's index (`index: [layers]`), for
    `run_layers`: under `lax.scan` the index is a scanned input like the weights."""

    block: Any
    index: Int[Array, " layers"]


def _period(kinds: tuple[Any, ...]) -> int:
    """The smallest `p` with `kinds[i] == kinds[i % p]` for every `i`."""
    for p in range(1, len(kinds) + 1):
        if all(kinds[i] == kinds[i % p] for i in range(len(kinds))):
            return p
    return len(kinds)
