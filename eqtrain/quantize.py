"""Frozen base weights in 4 or 8 bits, for QLoRA: quantize a model's linear
layers (and its experts' stacked weights), then train LoRA adapters on top.

    model = quantize.apply(model, quantize.Quantize("nf4"))
    model = lora.apply(model, lora.LoRA(rank=16), key=jr.key(1))
    state = TrainState.create(model, optimizer, key=0, trainable=lora.trainable(model))

`apply` replaces each selected weight array by a `QuantizedWeight` (packed codes
and block scales, as bitsandbytes lays them out; `eqtrain._quant`). The layers
take it where they took the array: the weight is dequantized beside each product
in the compute dtype, and again in the backward pass rather than kept. It never
trains; gradients reach the adapters through it. `dequantize` gives the plain
model back (what a merged export writes).

`eqtrain.hf.load(..., quantize=Quantize(...))` quantizes while it reads, one
stored tensor at a time: host memory stays the quantized model and one tensor.
"""

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from ._errors import ConfigError
from ._quant import (
    BLOCK,
    KINDS,
    QuantizedWeight,
    abstract,
    is_quantized,
    quantizable,
    quantize as quantize_array,
)
from .models import Experts, Linear, LoRALinear


__all__ = [
    "DEFAULT_SKIP",
    "KINDS",
    "Quantize",
    "QuantizedWeight",
    "apply",
    "dequantize",
    "is_quantized",
    "quantize_array",
    "quantized_bytes",
    "quantized_paths",
]

DEFAULT_SKIP = r"(^|\.)(lm_head|mlp\.gate|mlp\.shared_expert_gate)$"
"""Modules left in full precision by default: the output head (as transformers'
bitsandbytes integration leaves it) and the mixture-of-experts routers (small,
and every token's choice of experts goes through them). Embeddings and norms
are not linear layers and are never quantized."""

EXPERT_WEIGHTS = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class Quantize:
    """What `apply` quantizes, and how.

    Attributes:
        kind: `"nf4"` (QLoRA's NormalFloat4), `"fp4"` (4-bit float) or `"int8"`
            (per output row).
        skip: regex searched (`re.search`) in the dotted path of each linear
            layer (`layers.self_attn.q_proj`, `lm_head`) or experts' weight
            (`layers.mlp.experts.gate_proj`); those it finds stay as they are
            (default `DEFAULT_SKIP`: the head and the routers).
        double: quantize the 4-bit kinds' block scales too (QLoRA's double
            quantization: 8-bit scales in blocks of 256; about 0.37 bits per
            weight saved).
    """

    kind: str
    skip: str | None = DEFAULT_SKIP
    double: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(
                f"quantize `kind` must be one of {', '.join(KINDS)}; got {self.kind!r}."
            )
        if self.skip is not None:
            try:
                re.compile(self.skip)
            except (re.error, TypeError) as e:
                raise ConfigError(
                    f"quantize `skip` is not a valid regex: {self.skip!r} ({e})."
                ) from None

    def skips(self, path: str) -> bool:
        return self.skip is not None and re.search(self.skip, path) is not None


def _is_site(x: Any) -> bool:
    return isinstance(x, (Linear, LoRALinear, Experts))


def _dotted(keys: Any) -> str:
    return jtu.keystr(keys, simple=True, separator=".")


def _weights(model: Any) -> list[tuple[str, Any]]:
    """`(dotted path, weight)` of every linear layer's and experts' weight."""
    found: list[tuple[str, Any]] = []
    _replace_weights(model, lambda path, w: found.append((path, w)) or w)
    return found


def apply(model: PyTree, spec: Quantize, *, abstract_only: bool = False) -> PyTree:
    """`model` with the weights `spec` selects quantized (`QuantizedWeight`).

    Each stored tensor (a layer's weight; under stacked layers each layer's;
    for experts each expert's) is quantized on its own, on the host, and the
    result placed where the weight was (its sharding kept). A weight whose rows
    are not whole blocks of 64 values (4-bit kinds) stays as it is.

    Args:
        model: a model with eqtrain `Linear` layers (LoRA-wrapped or not) and/or
            `Experts`; arrays or `ShapeDtypeStruct`s.
        spec: what and how.
        abstract_only: give arrays of the right shapes and dtypes without
            computing codes (inside `eqx.filter_eval_shape`, for dry runs and
            templates). `ShapeDtypeStruct` weights are always made abstract.

    Raises:
        ConfigError: nothing is left to quantize (no linear layer, or `skip`
            keeps them all), or a weight is quantized already.
    """
    chosen = [(p, w) for p, w in _weights(model) if not spec.skips(p)]
    if any(is_quantized(w) for _, w in chosen):
        raise ConfigError(
            "this model is quantized already; `quantize.dequantize` it first."
        )
    if not any(quantizable(w.shape, spec.kind) for _, w in chosen):
        raise ConfigError(
            f"`quantize` {spec.kind} finds no weight to quantize in "
            f"{type(model).__name__}: no linear layer outside `skip` "
            f"({spec.skip!r}) has rows of whole blocks of {BLOCK} values."
        )

    def quantized(path: str, w: Any) -> Any:
        if spec.skips(path) or not quantizable(w.shape, spec.kind):
            return w
        if abstract_only or isinstance(w, jax.ShapeDtypeStruct):
            q = abstract(tuple(w.shape), w.dtype, spec.kind, double=spec.double)
            if isinstance(w, jax.ShapeDtypeStruct):
                return q
            return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), q)
        return _placed(quantize_array(w, spec.kind, double=spec.double), w)

    return _replace_weights(model, quantized)


def _replace_weights(model: Any, fn: Callable[[str, Any], Any]) -> Any:
    """`model` with each linear or experts' weight `w` at dotted path `p`
    (`layers.mlp.up_proj`, `layers.mlp.experts.up_proj`) replaced by
    `fn(p, w)`."""

    def site(keys: Any, x: Any) -> Any:
        path = _dotted(keys)
        if isinstance(x, (Linear, LoRALinear)):
            return eqx.tree_at(lambda m: m.weight, x, fn(path, x.weight))
        if isinstance(x, Experts):
            new = [fn(f"{path}.{f}", getattr(x, f)) for f in EXPERT_WEIGHTS]
            get = lambda m: [getattr(m, f) for f in EXPERT_WEIGHTS]
            return eqx.tree_at(get, x, new)
        return x

    return jtu.tree_map_with_path(site, model, is_leaf=_is_site)


def _placed(q: QuantizedWeight, like: Any) -> QuantizedWeight:
    """`q`'s numpy arrays put on `like`'s devices: sharded along its leading
    axes as `like` is, replicated on the rest."""
    sharding = getattr(like, "sharding", None)
    if sharding is None or not hasattr(sharding, "mesh"):
        return jtu.tree_map(jnp.asarray, q)
    lead = len(like.shape) - 2
    spec = tuple(sharding.spec) + (None,) * (len(like.shape) - len(sharding.spec))

    def put(a: np.ndarray) -> Any:
        entries = spec[: min(lead, a.ndim)]
        target = jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*entries)
        )
        return jax.device_put(a, target)

    return jtu.tree_map(put, q)


def dequantize(model: PyTree, dtype: Any = None) -> PyTree:
    """`model` with every `QuantizedWeight` back as a plain array (in `dtype`,
    default the weight's own)."""
    return jtu.tree_map(
        lambda x: x.dequantize(dtype) if is_quantized(x) else x,
        model,
        is_leaf=is_quantized,
    )


def quantized_paths(model: Any) -> list[str]:
    """Dotted paths of the model's quantized weights (`layers.mlp.up_proj.weight`)."""
    flat, _ = jtu.tree_flatten_with_path(model, is_leaf=is_quantized)
    return [_dotted(k) for k, x in flat if is_quantized(x)]


def quantized_bytes(model: Any) -> tuple[int, int]:
    """`(bytes of the quantized weights, their parameter count)`."""
    flat = jtu.tree_leaves(model, is_leaf=is_quantized)
    qs = [x for x in flat if is_quantized(x)]
    return sum(q.nbytes for q in qs), sum(int(np.prod(q.shape)) for q in qs)
