"""LoRA as a filter: low-rank adapters are more leaves in the model pytree, and
"train only the adapters" is the trainable filter.

    model = lora.apply(model, lora.LoRA(rank=8, alpha=16), key=jr.key(1))
    state = TrainState.create(model, optimizer, key=0, trainable=lora.trainable(model))

`apply` wraps the selected `Linear` layers (a regex searched in each layer's dotted
path, default: the attention and MLP projections) in `LoRALinear`, which keeps the
base `weight`/`bias` under their own names and adds `lora_a [rank, in]` and
`lora_b [out, rank]` (zero at first, so the wrapped model computes exactly what the
base did). Under stacked layers the adapters carry the layer axis too.
`trainable` selects the adapter leaves (plus any leaves matching `also`);
everything else is frozen: no gradient, no optimizer state. `merge` folds the
adapters into plain `Linear` weights; `disable` switches them off without copying
anything (the reference model of preference training); `unwrap` drops them.
"""

import copy
import dataclasses
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
from jaxtyping import PRNGKeyArray, PyTree

from ._errors import ConfigError
from ._quant import dense, is_quantized
from .models import Linear, LoRALinear


__all__ = [
    "DEFAULT_TARGETS",
    "LoRA",
    "LoRALinear",
    "adapter_paths",
    "apply",
    "disable",
    "enable",
    "is_adapter_path",
    "linear_paths",
    "linears",
    "map_linears",
    "merge",
    "num_adapter_params",
    "trainable",
    "unwrap",
]

DEFAULT_TARGETS = r"(^|\.)((q|k|v|o|qkv|gate|up|down|gate_up)_proj|c_attn|c_proj|c_fc)$"
"""The attention and MLP projections of every decoder family and GPT-2 (not the
output head), as PEFT's `all-linear`: q/k/v/o (Phi-3's fused `qkv_proj`),
gate/up/down (Phi-3's `gate_up_proj`, StarCoder2's `c_fc`/`c_proj`), GPT-2's
`c_attn`/`c_proj`/`c_fc`."""

ADAPTER_LEAVES = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class LoRA:
    """What `apply` adds.

    Attributes:
        rank: the adapters' rank `r` (>= 1).
        alpha: `lora_alpha`; the update is scaled by `alpha / rank` (`None`: equal
            to `rank`, a scale of 1).
        dropout: dropout rate on each adapter's input, during training steps only
            (the model's call gets a key then).
        targets: regex searched (`re.search`) in the dotted path of each linear
            layer, e.g. `layers.self_attn.q_proj`; default: attention and MLP
            projections (`DEFAULT_TARGETS`).
        rslora: scale by `alpha / sqrt(rank)` (rank-stabilised LoRA, Kalajdzievski
            2023, arXiv:2312.03732) instead of `alpha / rank`.
    """

    rank: int
    alpha: float | int | None = None
    dropout: float | int = 0.0
    targets: str = DEFAULT_TARGETS
    rslora: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool):
            raise ConfigError(f"LoRA `rank` must be an integer; got {self.rank!r}.")
        if self.rank < 1:
            raise ConfigError(
                f"LoRA `rank` must be >= 1; got {self.rank} (rank 0 means no LoRA: "
                "do not call `lora.apply`)."
            )
        if self.alpha is not None and not self.alpha > 0:
            raise ConfigError(f"LoRA `alpha` must be > 0; got {self.alpha!r}.")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(
                f"LoRA `dropout` must be in [0, 1); got {self.dropout!r}."
            )
        _compile(self.targets, "targets")

    @property
    def scale(self) -> float:
        """The factor on `lora_b @ lora_a`."""
        alpha = float(self.rank if self.alpha is None else self.alpha)
        if self.rslora:
            return alpha / math.sqrt(self.rank)
        return alpha / self.rank


def _compile(pattern: str, field: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except (re.error, TypeError) as e:
        raise ConfigError(
            f"LoRA `{field}` is not a valid regex: {pattern!r} ({e})."
        ) from None


def _is_linear(x: Any) -> bool:
    return isinstance(x, (Linear, LoRALinear))


def _path(keys: Any) -> str:
    return jtu.keystr(keys, simple=True, separator=".")


def linears(model: Any) -> Iterator[tuple[str, Any]]:
    """`(dotted path, layer)` for every linear layer of `model` (`Linear` or
    `LoRALinear`), in pytree order."""
    flat, _ = jtu.tree_flatten_with_path(model, is_leaf=_is_linear)
    for keys, leaf in flat:
        if _is_linear(leaf):
            yield _path(keys), leaf


def linear_paths(model: Any) -> list[str]:
    """Dotted paths of the model's linear layers, wrapped or not
    (`layers.self_attn.q_proj`, ..., `lm_head`)."""
    return [path for path, _ in linears(model)]


def adapter_paths(model: Any) -> list[str]:
    """Dotted paths of the linear layers that carry an adapter."""
    return [path for path, x in linears(model) if isinstance(x, LoRALinear)]


def is_adapter_path(path: str) -> bool:
    """Whether a dotted leaf path names an adapter array (`...lora_a`/`lora_b`)."""
    return path.rsplit(".", 1)[-1] in ADAPTER_LEAVES


def map_linears(model: PyTree, fn: Callable[[str, Any], Any]) -> PyTree:
    """`model` with each linear layer replaced by `fn(dotted path, layer)`."""
    flat, treedef = jtu.tree_flatten_with_path(model, is_leaf=_is_linear)
    leaves = [fn(_path(k), x) if _is_linear(x) else x for k, x in flat]
    return jtu.tree_unflatten(treedef, leaves)


def _dims(weight: Any) -> tuple[tuple[int, ...], int, int]:
    *lead, out, inp = weight.shape
    return tuple(lead), out, inp


def apply(model: PyTree, spec: LoRA, *, key: PRNGKeyArray) -> PyTree:
    """`model` with a LoRA adapter on every linear layer `spec.targets` selects.

    `lora_a` is drawn uniformly from `±1/sqrt(in)` (PEFT's default, Kaiming-uniform
    with `a = sqrt(5)`), `lora_b` is zero, both in the base weight's dtype. The
    base arrays are shared, not copied.

    Raises:
        ConfigError: the model has no linear layer, already has adapters, the
            regex selects none of them, or `rank` exceeds a target's smaller
            dimension (each names what it found).
    """
    found = list(linears(model))
    _check_wrappable(model, found)
    pattern = _compile(spec.targets, "targets")
    _refuse_experts(model, spec, pattern)
    chosen = _targets(found, spec, pattern)
    keys = dict(zip([p for p, _ in chosen], jr.split(key, len(chosen)), strict=True))

    def wrap(path: str, layer: Any) -> Any:
        return _adapted(layer, spec, keys[path]) if path in keys else layer

    return map_linears(model, wrap)


def _check_wrappable(model: Any, found: list[tuple[str, Any]]) -> None:
    """The model has linear layers (`found`), none of them adapted yet."""
    if not found:
        raise ConfigError(
            f"LoRA needs linear layers (eqtrain `Linear`), and "
            f"{type(model).__name__} has none."
        )
    if any(isinstance(x, LoRALinear) for _, x in found):
        raise ConfigError(
            "this model already carries LoRA adapters; `lora.merge` or "
            "`lora.unwrap` it first."
        )


def _targets(
    found: list[tuple[str, Any]], spec: LoRA, pattern: re.Pattern[str]
) -> list[tuple[str, Any]]:
    """The `(path, layer)` of `found` that `pattern` selects (at least one), each
    large enough for `spec.rank`."""
    chosen = [(p, x) for p, x in found if pattern.search(p)]
    if not chosen:
        shown = ", ".join(p for p, _ in found[:8])
        raise ConfigError(
            f"LoRA `targets` {spec.targets!r} matches none of the model's linear "
            f"layers ({shown}{', ...' if len(found) > 8 else ''}); the regex is "
            "searched in these dotted paths."
        )
    for path, layer in chosen:
        _check_rank(spec.rank, path, layer)
    return chosen


def _check_rank(rank: int, path: str, layer: Any) -> None:
    _, out, inp = _dims(layer.weight)
    if rank > min(out, inp):
        raise ConfigError(
            f"LoRA `rank` {rank} exceeds the smaller dimension of "
            f"`{path}` ({out} x {inp}); use rank <= {min(out, inp)} or leave "
            "that layer out of `targets`."
        )


def _adapted(layer: Any, spec: LoRA, key: PRNGKeyArray) -> LoRALinear:
    """`layer` with a new adapter: `lora_a` uniform in `±1/sqrt(in)`, `lora_b`
    zero, both in the weight's dtype."""
    lead, out, inp = _dims(layer.weight)
    dtype = layer.weight.dtype
    bound = 1.0 / math.sqrt(inp)
    a = jr.uniform(key, (*lead, spec.rank, inp), jnp.float32, -bound, bound)
    return LoRALinear(
        weight=layer.weight,
        bias=layer.bias,
        lora_a=a.astype(dtype),
        lora_b=jnp.zeros((*lead, out, spec.rank), dtype),
        scale=spec.scale,
        dropout=float(spec.dropout),
    )


def _refuse_experts(model: Any, spec: LoRA, pattern: re.Pattern[str]) -> None:
    """Explicit `targets` that select a mixture-of-experts model's experts are
    refused: their stacked `[layers, experts, out, in]` weights take no
    adapters. (The default targets adapt the linear layers such a model has:
    attention, the shared expert.)"""
    if spec.targets == DEFAULT_TARGETS:
        return
    experts = [p for p in _leaf_paths(model) if ".experts." in f".{p}"]
    hit = [p for p in experts if pattern.search(p)]
    if hit:
        raise ConfigError(
            f"LoRA `targets` {spec.targets!r} selects the experts' weights "
            f"({', '.join(hit[:3])}), and LoRA on a mixture-of-experts model's "
            "experts is not supported. Target the attention projections "
            "(`self_attn\\.(q|k|v|o)_proj$`), the router (`mlp\\.gate$`) or a "
            "shared expert (`shared_expert\\.`) instead."
        )


def _leaf_paths(model: Any) -> list[str]:
    flat, _ = jtu.tree_flatten_with_path(model, is_leaf=lambda x: x is None)
    return [_path(k) for k, _ in flat]


def trainable(model: PyTree, also: str | None = None) -> PyTree[bool]:
    """The trainable filter of a LoRA model: the adapter leaves, and every leaf
    whose dotted path matches `also` (`re.search`, e.g. `r"norm"` for the norms,
    `r"^lm_head\\."` for the head). Pass it as `TrainState.create(...,
    trainable=...)`.

    Raises:
        ConfigError: the model has no adapters, or `also` matches no leaf.
    """
    if not adapter_paths(model):
        raise ConfigError(
            "the model has no LoRA adapters; wrap it with `lora.apply` first."
        )
    extra = None if also is None else _compile(also, "train_also")
    paths = _leaf_paths(model)
    frozen = _quantized_prefixes(model)
    flags = [_trained(p, extra) and not p.startswith(frozen) for p in paths]
    if extra is not None:
        _check_also(also, extra, paths, frozen)
    treedef = jtu.tree_structure(model, is_leaf=lambda x: x is None)
    return jtu.tree_unflatten(treedef, flags)


def _trained(path: str, extra: re.Pattern[str] | None) -> bool:
    """An adapter leaf, or one that `extra` (`train_also`) selects."""
    return is_adapter_path(path) or (extra is not None and bool(extra.search(path)))


def _quantized_prefixes(model: Any) -> tuple[str, ...]:
    """`"<path>."` of each quantized weight: its arrays never train."""
    flat, _ = jtu.tree_flatten_with_path(model, is_leaf=is_quantized)
    return tuple(_path(k) + "." for k, x in flat if is_quantized(x))


def _check_also(
    also: Any, extra: re.Pattern[str], paths: list[str], frozen: tuple[str, ...]
) -> None:
    """`train_also` must select some parameter besides the adapters, and no
    quantized weight."""
    hit = [
        p.rsplit(".", 1)[0] for p in paths if p.startswith(frozen) and extra.search(p)
    ]
    if hit:
        raise ConfigError(
            f"LoRA `train_also` {also!r} selects quantized weights "
            f"({', '.join(sorted(set(hit))[:3])}), which stay frozen: a 4- or "
            "8-bit weight takes no update. Narrow `train_also`, or leave those "
            "layers unquantized (`model.quantize_skip`)."
        )
    if not any(extra.search(p) and not is_adapter_path(p) for p in paths):
        raise ConfigError(
            f"LoRA `train_also` {also!r} matches no parameter of the model; it is "
            f"searched in dotted paths such as {paths[0]!r} or {paths[-1]!r}."
        )


def num_adapter_params(model: Any) -> int:
    """Number of elements in the adapter arrays."""
    total = 0
    for _, x in linears(model):
        if isinstance(x, LoRALinear):
            total += math.prod(x.lora_a.shape) + math.prod(x.lora_b.shape)
    return int(total)


def _plain(weight: Any, bias: Any) -> Linear:
    """A `Linear` holding these arrays (built as Equinox rebuilds modules)."""
    out = object.__new__(Linear)
    object.__setattr__(out, "weight", weight)
    object.__setattr__(out, "bias", bias)
    return out


def merged_weight(layer: LoRALinear) -> jax.Array:
    """`weight + scale * lora_b @ lora_a`, computed in float32, in the weight's
    dtype (a quantized weight dequantized first)."""
    update = jnp.einsum(
        "...or,...ri->...oi",
        layer.lora_b.astype(jnp.float32),
        layer.lora_a.astype(jnp.float32),
    )
    w = dense(layer.weight, jnp.float32) + layer.scale * update
    return w.astype(layer.weight.dtype)


def merge(model: PyTree) -> PyTree:
    """The plain model with every adapter folded in: `weight + scale * B @ A`
    (an enabled adapter; a disabled one is dropped). The result exports to
    Hugging Face like any model."""
    return map_linears(model, _folded)


def _folded(path: str, layer: Any) -> Any:
    """`layer` as a plain `Linear`, its adapter folded in when enabled."""
    if not isinstance(layer, LoRALinear):
        return layer
    weight = merged_weight(layer) if layer.enabled else layer.weight
    return _plain(weight, layer.bias)


def unwrap(model: PyTree) -> PyTree:
    """The base model: adapters dropped, base arrays shared (no copy)."""
    return map_linears(
        model,
        lambda _, x: _plain(x.weight, x.bias) if isinstance(x, LoRALinear) else x,
    )


def _switch(model: PyTree, enabled: bool) -> PyTree:
    return map_linears(model, lambda _, layer: _switched(layer, enabled))


def _switched(layer: Any, enabled: bool) -> Any:
    """`layer` with its adapter on or off (a plain layer unchanged)."""
    if not isinstance(layer, LoRALinear) or layer.enabled == enabled:
        return layer
    out = copy.copy(layer)
    object.__setattr__(out, "enabled", enabled)  # a static field; arrays shared
    return out


def disable(model: PyTree) -> PyTree:
    """The same model computing as its base: every adapter switched off. No array
    is copied, so inside a jitted step this is the reference model of preference
    training at no memory cost (`enable` switches them back)."""
    return _switch(model, False)


def enable(model: PyTree) -> PyTree:
    """Every adapter switched on (undoes `disable`)."""
    return _switch(model, True)
