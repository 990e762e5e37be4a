"""The layer modules shared by eqtrain's models: batched linear layers in Hugging
Face's weight layouts (plain or LoRA-wrapped), embeddings, norms, activations,
the plain rotary embedding and a sequence-tiled position-wise function.

Attention kernels and masks live in `_attention`, rematerialisation and layer
stacks in `_stack`, the configs' runtime options in `_options`.

Every layer works on a whole sequence at once (`x: [seq, dim]`, `x @ W`), not on
one token under `vmap`: XLA then sees one matmul per weight.
"""

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._errors import ConfigError
from .._quant import QuantizedWeight, dense, matmul_t as _quantized_matmul_t
from .._reduce import row_sum


_DTYPES = {
    "float32": jnp.float32,
    "f32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float16": jnp.float16,
    "f16": jnp.float16,
}


def as_dtype(name: Any, *, field: str = "param_dtype") -> Any:
    """`"float32"`, `"bfloat16"`, `"float16"` (or a dtype) as a numpy dtype."""
    if isinstance(name, str):
        if name.lower() not in _DTYPES:
            raise ConfigError(
                f"`{field}` must be one of {sorted(set(_DTYPES))}; got {name!r}."
            )
        return jnp.dtype(_DTYPES[name.lower()])
    return jnp.dtype(name)


def _normal(key: PRNGKeyArray, shape: tuple[int, ...], std: float, dtype: Any) -> Array:
    # Draw in f32 and cast, so a bf16 model starts from the f32 model's rounding.
    return (std * jr.normal(key, shape, jnp.float32)).astype(dtype)


def _broadcast_last(v: Array, ndim: int) -> Array:
    """`v: [n]` reshaped to broadcast against an array of rank `ndim` (explicit,
    so that `jax_numpy_rank_promotion="raise"` is respected)."""
    return v.reshape((1,) * (ndim - 1) + v.shape)


class Linear(eqx.Module):
    """`y = x @ weight.T + bias`, with `weight: [out, in]` as in `torch.nn.Linear`.

    Storing PyTorch's layout makes a Hugging Face export an identity map, and
    XLA:CPU trains it faster than `[in, out]` (docs/models.md, "Performance").
    """

    weight: Float[Array, "out_features in_features"] | QuantizedWeight
    bias: Float[Array, " out_features"] | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool,
        std: float | int,
        dtype: Any,
        key: PRNGKeyArray,
    ):
        self.weight = _normal(key, (out_features, in_features), std, dtype)
        self.bias = jnp.zeros((out_features,), dtype) if use_bias else None

    def __call__(
        self, x: Float[Array, "*batch in_features"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*batch out_features"]:
        """`x @ weight.T + bias`; `key` is unused (a `LoRALinear` takes one)."""
        del key
        return _affine(x, self.weight, self.bias)


def _splits_weights() -> bool:
    """Whether the mesh the model is traced under splits weights (an `fsdp` or
    `tensor` axis larger than 1)."""
    mesh = jax.sharding.get_abstract_mesh()
    shape = dict(getattr(mesh, "shape", {}) or {})
    return shape.get("fsdp", 1) > 1 or shape.get("tensor", 1) > 1


def fused_linears(
    layers: Sequence[Any], x: Array, keys: Sequence[PRNGKeyArray | None]
) -> list[Array]:
    """`[layer(x, key=k) for layer, k in zip(layers, keys)]` with the base products
    `x @ weight.T` of all layers as one matrix product over their concatenated
    weights (then each layer's LoRA update, if any, and bias), when the weights
    share a dtype and the mesh does not split weights (concatenating split
    weights would move them).

    One product instead of two or three is faster on the CPU, and more than that
    at power-of-two widths: XLA:CPU writes the separate products' gradient
    transposed for their weight gradients, a pass over the hidden layer each
    (docs/performance.md, "CPU throughput"). A layer gives the
    same result fused or not whether it is a `Linear` or a `LoRALinear` (so an
    adapted model with its adapters off equals its base model bit for bit).
    Quantized weights (`QuantizedWeight`) are never concatenated: each is
    dequantized beside its own product."""
    dtypes = {layer.weight.dtype for layer in layers}
    quantized = any(isinstance(layer.weight, QuantizedWeight) for layer in layers)
    if len(layers) < 2 or len(dtypes) > 1 or quantized or _splits_weights():
        return [layer(x, key=k) for layer, k in zip(layers, keys, strict=True)]
    weight = jnp.concatenate([layer.weight for layer in layers], axis=0)
    cuts = list(itertools.accumulate(layer.weight.shape[0] for layer in layers))
    products = jnp.split(_matmul_t(x, weight), cuts[:-1], axis=-1)
    return [
        _completed(layer, x, y, k)
        for layer, y, k in zip(layers, products, keys, strict=True)
    ]


def _completed(layer: Any, x: Array, y: Array, key: PRNGKeyArray | None) -> Array:
    """A layer's output from its base product `y = x @ weight.T`: with its
    adapter's update (a `LoRALinear`) and its bias."""
    if isinstance(layer, LoRALinear):
        y = layer.adapted(x, y, key=key)
    return _add_bias(y, layer.bias)


def _matmul_t(x: Array, w: Any) -> Array:
    """`x @ w.T` over the last dimension of `x` (a `QuantizedWeight` `w`
    dequantized beside the product, in `x`'s dtype)."""
    if isinstance(w, QuantizedWeight):
        return _quantized_matmul_t(x, w)
    return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def _affine(x: Array, weight: Any, bias: Array | None) -> Array:
    return _add_bias(_matmul_t(x, weight), bias)


def _add_bias(y: Array, bias: Array | None) -> Array:
    """`y + bias` over the last dimension (`y` without a bias)."""
    return y if bias is None else y + _broadcast_last(bias, y.ndim)


class LoRALinear(eqx.Module):
    """A `Linear` with a low-rank adapter (LoRA, Hu et al. 2021, arXiv:2106.09685):
    `y = x @ weight.T + bias + scale * (dropout(x) @ lora_a.T) @ lora_b.T`.

    `weight` and `bias` are the base layer's arrays, under the same names, so a
    wrapped model keeps every base path (`...q_proj.weight`) and adds two
    (`...q_proj.lora_a`, `...q_proj.lora_b`). `lora_a` is `[rank, in]`, `lora_b`
    `[out, rank]` (PEFT's `lora_A.weight` / `lora_B.weight`); under stacked
    layers all four carry the leading layer axis. Build them with
    `eqtrain.lora.apply`, not by hand.

    Attributes:
        scale: `alpha / rank` (or `alpha / sqrt(rank)` for rsLoRA).
        dropout: dropout rate on the adapter's input; applied only when the
            call gets a `key` (training steps pass one, evaluation does not).
        enabled: `False` computes the base layer alone (`eqtrain.lora.disable`:
            the same arrays, no copy).
    """

    weight: Float[Array, "*layers out_features in_features"] | QuantizedWeight
    bias: Float[Array, "*layers out_features"] | None
    lora_a: Float[Array, "*layers rank in_features"]
    lora_b: Float[Array, "*layers out_features rank"]
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True)
    enabled: bool = eqx.field(static=True, default=True)

    def __call__(
        self, x: Float[Array, "*batch in_features"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "*batch out_features"]:
        if not self.enabled:
            return _affine(x, self.weight, self.bias)
        y = self.adapted(x, _matmul_t(x, self.weight), key=key)
        return _add_bias(y, self.bias)

    def adapted(self, x: Array, y: Array, *, key: PRNGKeyArray | None) -> Array:
        """`y` (the base product `x @ weight.T`, without bias) plus the adapter's
        update of `x` (nothing when disabled)."""
        if not self.enabled:
            return y
        h = x
        if self.dropout > 0 and key is not None:
            keep = jr.bernoulli(key, 1.0 - self.dropout, x.shape)
            h = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        update = _matmul_t(_matmul_t(h, self.lora_a), self.lora_b)
        return y + (update * self.scale).astype(y.dtype)


AnyLinear = Linear | LoRALinear
"""A model's projection: a plain `Linear`, or one wrapped by `eqtrain.lora`."""


def uses_key(module: Any) -> bool:
    """Whether calling `module` consumes a PRNG key (an enabled LoRA adapter with
    dropout somewhere inside). Models split their key per layer only then, so a
    model without one compiles exactly as before."""
    found = jtu.tree_leaves(module, is_leaf=lambda x: isinstance(x, LoRALinear))
    return any(isinstance(x, LoRALinear) and x.enabled and x.dropout > 0 for x in found)


def split_key(key: PRNGKeyArray | None, num: int) -> Any:
    """`num` keys from `key`, or `num` Nones without one."""
    if key is None:
        return [None] * num
    return list(jr.split(key, num))


class Embedding(eqx.Module):
    """A lookup table `weight: [vocab, dim]` (`torch.nn.Embedding`'s layout)."""

    weight: Float[Array, "vocab dim"]

    def __init__(
        self, num: int, dim: int, *, std: float | int, dtype: Any, key: PRNGKeyArray
    ):
        self.weight = _normal(key, (num, dim), std, dtype)

    @jax.named_scope("embed")
    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, "seq dim"]:
        return jnp.take(self.weight, ids, axis=0)

    def attend(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq vocab"]:
        """Logits against the table (a tied output head): `x @ weight.T`."""
        return lax.dot_general(x, self.weight, (((1,), (1,)), ((), ())))


class RMSNorm(eqx.Module):
    """Root-mean-square norm, computed in f32 like Hugging Face's `LlamaRMSNorm`:
    `weight * (x * rsqrt(mean(x**2) + eps)).astype(x.dtype)`.

    `plus_one=True` is Gemma's variant: the gain is `1 + weight` (zeros at
    init), applied in f32 before the cast: `(h * (1 + weight)).astype(x.dtype)`.
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)
    plus_one: bool = eqx.field(static=True, default=False)

    def __init__(
        self, dim: int, *, eps: float | int, dtype: Any, plus_one: bool = False
    ):
        init = jnp.zeros if plus_one else jnp.ones
        self.weight = init((dim,), dtype)
        self.eps = float(eps)
        self.plus_one = plus_one

    @jax.named_scope("norm")
    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        h = x.astype(jnp.float32)
        h = h * lax.rsqrt(row_sum(h * h) / h.shape[-1] + self.eps)
        w = _broadcast_last(self.weight, x.ndim)
        if self.plus_one:
            return (h * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
        return w * h.astype(x.dtype)


class LayerNorm(eqx.Module):
    """Layer norm with weight and bias, in f32 and rounded once to the input's
    dtype, as `torch.nn.LayerNorm`."""

    weight: Float[Array, " dim"]
    bias: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float | int, dtype: Any):
        self.weight = jnp.ones((dim,), dtype)
        self.bias = jnp.zeros((dim,), dtype)
        self.eps = float(eps)

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        h = x.astype(jnp.float32)
        mean = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
        h = (h - mean) * lax.rsqrt(var + self.eps)
        w, b = (_broadcast_last(p, x.ndim) for p in (self.weight, self.bias))
        # gain and bias in f32, rounded once, as torch's LayerNorm for bfloat16
        return (h * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def _gelu_tanh(x: Array) -> Array:
    return jax.nn.gelu(x, approximate=True)


def _gelu_erf(x: Array) -> Array:
    return jax.nn.gelu(x, approximate=False)


LAPLACE_SCALE = 0.282095 * math.sqrt(2.0)  # transformers' LaplaceActivation
ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    # The tanh approximation under its names (`gelu_fast` writes sqrt(2/pi) as
    # 0.7978845608, the same float32 number).
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_python_tanh": _gelu_tanh,
    "gelu_accurate": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    # The exact (erf) GELU.
    "gelu": _gelu_erf,
    "gelu_python": _gelu_erf,
    "gelu_10": lambda x: jnp.clip(_gelu_erf(x), -10, 10),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu": jax.nn.relu,
    "relu2": lambda x: jnp.square(jax.nn.relu(x)),
    "relu6": jax.nn.relu6,
    "leaky_relu": jax.nn.leaky_relu,  # torch's default slope, 0.01
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "hardswish": jax.nn.hard_swish,
    "mish": jax.nn.mish,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "linear": lambda x: x,
    "laplace": lambda x: 0.5 * (1.0 + jax.lax.erf((x - 0.707107) / LAPLACE_SCALE)),
    "sqrtsoftplus": lambda x: jnp.sqrt(jax.nn.softplus(x)),
}


def gated(act: str, gate: Array, up: Array) -> Array:
    """`ACTIVATIONS[act](gate) * up`, a gated MLP's hidden layer; with `silu`
    (SwiGLU) through `_silu_gate`, whose gradient keeps only `gate` and `up`."""
    if ACTIVATIONS[act] is jax.nn.silu:  # "silu" and its aliases
        return _silu_gate(gate, up)
    return ACTIVATIONS[act](gate) * up


@jax.custom_vjp
def _silu_gate(gate: Array, up: Array) -> Array:
    """`silu(gate) * up` with a gradient of its own: autodiff keeps the sigmoid
    and `silu(gate)` for the backward pass, so the forward writes the hidden
    layer's size three times (`[tokens, intermediate]` each); this one keeps
    only `gate` and `up`, as PyTorch's `silu_backward` does (XLA still writes
    the sigmoid once, shared by both passes)."""
    return gate * jax.nn.sigmoid(gate) * up


def _silu_gate_fwd(gate: Array, up: Array) -> tuple[Array, tuple[Array, Array]]:
    return _silu_gate(gate, up), (gate, up)


def _silu_gate_bwd(res: tuple[Array, Array], dout: Array) -> tuple[Array, Array]:
    gate, up = res
    sig = jax.nn.sigmoid(gate)
    # d silu(g) / dg = sig + g * sig * (1 - sig) = sig * (1 + g * (1 - sig))
    dgate = dout * up * sig * (1 + gate * (1 - sig))
    return dgate.astype(gate.dtype), (dout * gate * sig).astype(up.dtype)


_silu_gate.defvjp(_silu_gate_fwd, _silu_gate_bwd)


def head_weight(
    embedding: Embedding, lm_head: AnyLinear | None, *, key: PRNGKeyArray | None = None
) -> Float[Array, "vocab hidden"]:
    """The `[vocab, hidden]` matrix of a decoder's head: the tied embedding, the
    `lm_head` weight, or, for a head wrapped by `eqtrain.lora`, the merged
    `weight + scale * lora_b @ lora_a` (f32, in the weight's dtype; as
    `lora.merged_weight`), so the adapter's gradient flows through it.

    `key` says the caller is in a training step (adapter dropout active): dropout
    on the head's input cannot be folded into a matrix, so that case is refused.

    Raises:
        ConfigError: the head has a bias, or an enabled adapter with dropout and a
            `key` was given.
    """
    if lm_head is None:
        return embedding.weight
    if lm_head.bias is not None:
        raise ConfigError(
            "`head_weight` needs a head without bias (logits = x @ W.T); this "
            "`lm_head` has one. Use the model's `__call__` for its logits."
        )
    if not isinstance(lm_head, LoRALinear) or not lm_head.enabled:
        return dense(lm_head.weight)
    if lm_head.dropout > 0 and key is not None:
        raise ConfigError(
            f"the `lm_head` LoRA adapter has dropout {lm_head.dropout}, which a "
            "chunked head (one matrix) cannot apply. Leave `lm_head` out of the "
            "LoRA `targets`, set the LoRA dropout to 0, or use the plain loss."
        )
    b, a = lm_head.lora_b.astype(jnp.float32), lm_head.lora_a.astype(jnp.float32)
    w = dense(lm_head.weight, jnp.float32) + lm_head.scale * (b @ a)
    return w.astype(lm_head.weight.dtype)


# -- the plain rotary embedding (the reference of `_rope`) -------------------------
def rope_cos_sin(
    positions: Int[Array, " seq"], head_dim: int, theta: float | int
) -> tuple[Float[Array, "seq head_dim"], Float[Array, "seq head_dim"]]:
    """cos and sin tables of rotary embeddings in f32, Hugging Face's layout: the
    frequencies `theta ** (-2i / head_dim)` repeated for both halves."""
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (jnp.float32(theta) ** exponents)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: Float[Array, "seq heads head_dim"],
    cos: Float[Array, "seq head_dim"],
    sin: Float[Array, "seq head_dim"],
) -> Float[Array, "seq heads head_dim"]:
    """`x * cos + rotate_half(x) * sin`: feature `i` pairs with `i + head_dim/2`
    (Hugging Face's `apply_rotary_pos_emb`, not the interleaved GPT-J layout)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos.astype(x.dtype)[:, None, :], sin.astype(x.dtype)[:, None, :]
    return x * cos + rotated * sin


def tiled(
    fn: Callable[[Array, PRNGKeyArray | None], Array],
    x: Float[Array, "seq dim"],
    chunks: int,
    key: PRNGKeyArray | None = None,
) -> Array:
    """`fn(x, key)` for a position-wise `fn`, computed over `chunks` pieces of the
    sequence in turn (`lax.map` of a rematerialised `fn`), so that `fn`'s
    intermediates (the MLP's `[seq, intermediate]`) exist for one piece at a time,
    in the backward pass too. The sequence is zero-padded to a multiple of
    `chunks` and cut back. `chunks <= 1` calls `fn` once."""
    seq = x.shape[0]
    chunks = min(chunks, seq)
    if chunks <= 1:
        return fn(x, key)
    size = -(-seq // chunks)
    pad = size * chunks - seq
    xs = jnp.pad(x, [(0, pad), (0, 0)]).reshape(chunks, size, x.shape[-1])
    keys = None if key is None else jr.split(key, chunks)
    piece = jax.checkpoint(lambda c, k: fn(c, k), prevent_cse=False)
    ys = lax.map(lambda a: piece(*a), (xs, keys))
    return ys.reshape(chunks * size, ys.shape[-1])[:seq]


def residual_scale(num_layers: int) -> float:
    """GPT-2's scaling of residual output projections at init: 1/sqrt(2 * layers)."""
    return 1.0 / math.sqrt(2 * num_layers)


def num_params(model: Any) -> int:
    """Number of parameters (elements of every array leaf) of a model, concrete
    or abstract (`jax.ShapeDtypeStruct` leaves from `eqx.filter_eval_shape`); a
    quantized weight counts the weight's elements, not its codes'."""
    leaves = jtu.tree_leaves(model, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    counted = [
        x
        for x in leaves
        if _is_array_like(x) or (isinstance(x, QuantizedWeight) and x.codes is not None)
    ]
    return int(sum(math.prod(x.shape) for x in counted))


def _is_array_like(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
