"""Building blocks shared by eqtrain's models: batched linear layers in Hugging
Face's weight layouts, norms, rotary embeddings, masked attention, and a stack of
identical layers run with `lax.scan` (optionally rematerialised).

Every layer works on a whole sequence at once (`x: [seq, dim]`, `x @ W`), not on
one token under `vmap`: XLA then sees one matmul per weight.
"""

import copy
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._errors import ConfigError
from .._names import did_you_mean


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

    Storing PyTorch's layout makes a Hugging Face export an identity map, and on CPU
    it measured ~8% faster for a full training step than `[in, out]` (see the
    models documentation, "Performance").
    """

    weight: Float[Array, "out_features in_features"]
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
        self,
        x: Float[Array, "*batch in_features"],
        *,
        key: PRNGKeyArray | None = None,
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
    transposed for their weight gradients, which at widths like 1024 cost 2x the
    MLP's backward pass (docs/performance.md, "CPU throughput"). A layer gives the
    same result fused or not whether it is a `Linear` or a `LoRALinear` (so an
    adapted model with its adapters off equals its base model bit for bit)."""
    dtypes = {layer.weight.dtype for layer in layers}
    if len(layers) < 2 or len(dtypes) > 1 or _splits_weights():
        return [layer(x, key=k) for layer, k in zip(layers, keys, strict=True)]
    weight = jnp.concatenate([layer.weight for layer in layers], axis=0)
    cuts = list(itertools.accumulate(layer.weight.shape[0] for layer in layers))
    outs = []
    for layer, y, k in zip(
        layers, jnp.split(_matmul_t(x, weight), cuts[:-1], axis=-1), keys, strict=True
    ):
        if isinstance(layer, LoRALinear):
            y = layer.adapted(x, y, key=k)
        if layer.bias is not None:
            y = y + _broadcast_last(layer.bias, y.ndim)
        outs.append(y)
    return outs


def _matmul_t(x: Array, w: Array) -> Array:
    """`x @ w.T` over the last dimension of `x`."""
    return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def _affine(x: Array, weight: Array, bias: Array | None) -> Array:
    y = _matmul_t(x, weight)
    if bias is not None:
        y = y + _broadcast_last(bias, y.ndim)
    return y


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

    weight: Float[Array, "*layers out_features in_features"]
    bias: Float[Array, "*layers out_features"] | None
    lora_a: Float[Array, "*layers rank in_features"]
    lora_b: Float[Array, "*layers out_features rank"]
    scale: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True)
    enabled: bool = eqx.field(static=True, default=True)

    def __call__(
        self,
        x: Float[Array, "*batch in_features"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "*batch out_features"]:
        if not self.enabled:
            return _affine(x, self.weight, self.bias)
        y = self.adapted(x, _matmul_t(x, self.weight), key=key)
        if self.bias is not None:
            y = y + _broadcast_last(self.bias, y.ndim)
        return y

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
        h = h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
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
        return lm_head.weight
    if lm_head.dropout > 0 and key is not None:
        raise ConfigError(
            f"the `lm_head` LoRA adapter has dropout {lm_head.dropout}, which a "
            "chunked head (one matrix) cannot apply. Leave `lm_head` out of the "
            "LoRA `targets`, set the LoRA dropout to 0, or use the plain loss."
        )
    b, a = lm_head.lora_b.astype(jnp.float32), lm_head.lora_a.astype(jnp.float32)
    w = lm_head.weight.astype(jnp.float32) + lm_head.scale * (b @ a)
    return w.astype(lm_head.weight.dtype)


# -- positions, rotary embeddings and attention ------------------------------------
def segment_positions(segment_ids: Int[Array, " seq"]) -> Int[Array, " seq"]:
    """Position of each token within its segment: 0 at every segment's first token.

    Segments are runs of equal ids (packed examples 1, 2, 3, ...; padding 0).
    """
    index = jnp.arange(segment_ids.shape[0], dtype=jnp.int32)
    starts = jnp.concatenate(
        [jnp.ones((1,), bool), segment_ids[1:] != segment_ids[:-1]]
    )
    first = lax.cummax(jnp.where(starts, index, 0), axis=0)
    return index - first


def default_positions(
    seq_len: int,
    segment_ids: Int[Array, " seq"] | None,
    positions: Int[Array, " seq"] | None,
) -> Int[Array, " seq"]:
    """Explicit `positions`, else positions restarting per segment, else `arange`."""
    if positions is not None:
        return positions
    if segment_ids is not None:
        return segment_positions(segment_ids)
    return jnp.arange(seq_len, dtype=jnp.int32)


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


def attention(
    q: Float[Array, "seq heads head_dim"],
    k: Float[Array, "seq kv_heads head_dim"],
    v: Float[Array, "seq kv_heads head_dim"],
    *,
    segment_ids: Int[Array, " seq"] | None,
    sliding_window: int | None,
    implementation: str | None,
    query_chunk: int = 0,
    scale: float | None = None,
    softcap: float | None = None,
) -> Float[Array, "seq heads head_dim"]:
    """Causal attention with `jax.nn.dot_product_attention` (`dot_attention`).

    Query head `h` reads key/value head `h // (heads // kv_heads)` (grouped-query
    attention, heads grouped contiguously as Hugging Face's `repeat_kv`). A position
    attends to earlier-or-same positions with the same segment id, and, with a
    sliding window `w`, only to the last `w` of them (itself included), as Mistral.

    `query_chunk > 0` (and shorter than the sequence): the queries go through in
    blocks of that many (`blocked_attention`), so that the `[heads, seq, seq]`
    scores never exist at once, in the backward pass either.

    `scale` multiplies the scores (default `head_dim ** -0.5`); `softcap` caps
    them as `softcap * tanh(scores / softcap)` before the mask (Gemma 2).
    """
    extra = dict(scale=scale, softcap=softcap)
    if 0 < query_chunk < q.shape[0] and implementation != "cudnn":
        return blocked_attention(
            q,
            k,
            v,
            segment_ids=segment_ids,
            sliding_window=sliding_window,
            implementation=implementation,
            query_chunk=query_chunk,
            **extra,
        )
    if implementation != "cudnn" and q.shape[0] > CAUSAL_BLOCK_MIN:
        return causal_blocks(
            q,
            k,
            v,
            segment_ids=segment_ids,
            sliding_window=sliding_window,
            implementation=implementation,
            **extra,
        )
    mask = None
    if segment_ids is not None:
        mask = segment_mask(segment_ids)[None]
    window = None if sliding_window is None else (sliding_window - 1, 0)
    return dot_attention(
        q,
        k,
        v,
        mask=mask,
        is_causal=True,
        local_window_size=window,
        implementation=implementation,
        **extra,
    )


_MASKED = -1e30  # a masked score: finite, so a fully masked row never gives NaN


def dot_attention(
    q: Float[Array, "q heads head_dim"],
    k: Float[Array, "k kv_heads head_dim"],
    v: Float[Array, "k kv_heads head_dim"],
    *,
    mask: Bool[Array, "#heads q k"] | None = None,
    is_causal: bool = False,
    local_window_size: tuple[int, int] | None = None,
    implementation: str | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Float[Array, "q heads head_dim"]:
    """`jax.nn.dot_product_attention`, or, with a `softcap`, the same computation
    written out (no fused kernel caps scores): f32 scores `q . k * scale`,
    `softcap * tanh(scores / softcap)`, masked, softmax in f32, cast to `q`'s
    dtype, times `v`. Grouped-query heads as `attention`."""
    if softcap is None:
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            is_causal=is_causal,
            local_window_size=local_window_size,
            implementation=implementation,  # pyright: ignore[reportArgumentType]
            scale=scale,
        )
    if implementation == "cudnn":
        raise ConfigError(
            "attention soft-capping (attn_logit_softcapping, Gemma 2) has no "
            "cuDNN kernel; use attention_impl = None or 'xla'."
        )
    t, heads, d = q.shape
    s, kv_heads = k.shape[0], k.shape[1]
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(t, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(scale)
    scores = jnp.float32(softcap) * jnp.tanh(scores / jnp.float32(softcap))
    keep = jnp.ones((t, s), bool)
    if is_causal or local_window_size is not None:
        diff = jnp.arange(t)[:, None] - jnp.arange(s)[None, :]
        if is_causal:
            keep = keep & (diff >= 0)
        if local_window_size is not None:
            left, right = local_window_size
            keep = keep & (diff <= left) & (-diff <= right)
    full = keep[None, None]
    if mask is not None:  # [1 or heads, q, k]
        m = jnp.broadcast_to(mask, (mask.shape[0], t, s))
        groups = (kv_heads, heads // kv_heads) if m.shape[0] > 1 else (1, 1)
        full = full & m.reshape(*groups, t, s)
    scores = jnp.where(full, scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("kgts,skd->tkgd", probs, v)
    return out.reshape(t, heads, d)


CAUSAL_BLOCK_MIN = 128
"""`attention` splits longer sequences into causal blocks (`causal_blocks`)."""
CAUSAL_BLOCKS_MAX = 16


def causal_block_size(seq: int) -> int:
    """Queries per block of `causal_blocks`: 128, or `seq / 16` (rounded up to a
    multiple of 8) for sequences longer than 2048, so that a layer has at most 16
    blocks (its compiled size grows with their number)."""
    per_block = -(-seq // CAUSAL_BLOCKS_MAX)
    return max(CAUSAL_BLOCK_MIN, -(-per_block // 8) * 8)


def causal_blocks(
    q: Float[Array, "seq heads head_dim"],
    k: Float[Array, "seq kv_heads head_dim"],
    v: Float[Array, "seq kv_heads head_dim"],
    *,
    segment_ids: Int[Array, " seq"] | None,
    sliding_window: int | None,
    implementation: str | None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Float[Array, "seq heads head_dim"]:
    """Causal attention as `attention`, block by block of queries, each against
    only the keys it can see: block `[i, j)` attends to keys `[0, j)` (from
    `i - sliding_window + 1` with a window). The keys after a block, masked out
    anyway, are never multiplied, so the work (scores, softmax and their
    backward) is about half of the full `[seq, seq]` one, in pieces that stay in
    cache: on the CPU a layer's attention runs 1.3x (256 tokens) to 3x (4096)
    faster (docs/performance.md). Plain autodiff, nothing recomputed; the blocks
    are unrolled (`causal_block_size`)."""
    seq = q.shape[0]
    size = causal_block_size(seq)
    segs = jnp.zeros((seq,), jnp.int32) if segment_ids is None else segment_ids
    pos = jnp.arange(seq, dtype=jnp.int32)
    outs = []
    for start in range(0, seq, size):
        end = min(start + size, seq)
        first = 0 if sliding_window is None else max(0, start - sliding_window + 1)
        mask = position_mask(
            pos[start:end], segs[start:end], pos[first:end], segs[first:end],
            sliding_window,
        )  # fmt: skip
        outs.append(
            dot_attention(
                q[start:end],
                k[first:end],
                v[first:end],
                mask=mask[None],
                implementation=implementation,
                scale=scale,
                softcap=softcap,
            )
        )
    return jnp.concatenate(outs, axis=0)


def position_mask(
    q_pos: Int[Array, " q"],
    q_seg: Int[Array, " q"],
    k_pos: Int[Array, " k"],
    k_seg: Int[Array, " k"],
    sliding_window: int | None,
) -> Bool[Array, "q k"]:
    """Causal (and windowed) attention within a segment, from global positions:
    query `i` sees key `j` of its segment with `pos[j] <= pos[i]` (and
    `pos[i] - pos[j] < sliding_window`). Positions must increase along a row
    within each segment, as `segment_positions` (or `arange`) gives them."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = (q_seg[:, None] == k_seg[None, :]) & (diff >= 0)
    if sliding_window is not None:
        mask = mask & (diff < sliding_window)
    return mask


def blocked_attention(
    q: Float[Array, "seq heads head_dim"],
    k: Float[Array, "seq kv_heads head_dim"],
    v: Float[Array, "seq kv_heads head_dim"],
    *,
    segment_ids: Int[Array, " seq"] | None,
    sliding_window: int | None,
    implementation: str | None,
    query_chunk: int,
    scale: float | None = None,
    softcap: float | None = None,
) -> Float[Array, "seq heads head_dim"]:
    """`attention`, one block of `query_chunk` queries at a time against all keys
    (a `lax.map` of a rematerialised block), each block's mask built from the
    queries' and keys' positions and segment ids: the scores held at once are
    `[heads, query_chunk, seq]`, forward and backward, for the price of
    recomputing each block's scores in the backward pass. The sequence is padded
    to a multiple of `query_chunk` (the padded queries are cut off)."""
    seq = q.shape[0]
    blocks = -(-seq // query_chunk)
    pad = blocks * query_chunk - seq
    qs = jnp.pad(q, [(0, pad), (0, 0), (0, 0)]).reshape(
        blocks, query_chunk, *q.shape[1:]
    )
    q_pos = jnp.arange(blocks * query_chunk, dtype=jnp.int32).reshape(blocks, -1)
    k_pos = jnp.arange(seq, dtype=jnp.int32)
    segs = jnp.zeros((seq,), jnp.int32) if segment_ids is None else segment_ids
    # padded queries join the last segment (then are cut off)
    q_segs = jnp.pad(segs, (0, pad), mode="edge").reshape(blocks, -1)

    def block(qb: Array, qp: Array, qs_: Array) -> Array:
        mask = position_mask(qp, qs_, k_pos, segs, sliding_window)
        return dot_attention(
            qb,
            k,
            v,
            mask=mask[None],
            implementation=implementation,
            scale=scale,
            softcap=softcap,
        )

    run = jax.checkpoint(block, prevent_cse=False)
    out = lax.map(lambda xs: run(*xs), (qs, q_pos, q_segs))
    return out.reshape(blocks * query_chunk, *q.shape[1:])[:seq]


def segment_mask(segment_ids: Int[Array, " seq"]) -> Bool[Array, "seq seq"]:
    """`mask[i, j]`: query `i` and key `j` belong to the same segment."""
    return segment_ids[:, None] == segment_ids[None, :]


# -- a stack of layers ---------------------------------------------------------------
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
    "none": "no rematerialisation: every activation is kept for the backward pass",
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
    if offload or name == "offload_layer_input":
        check_offload()


def check_offload() -> None:
    """Raise unless the default device has a `pinned_host` memory to offload to."""
    device = jax.devices()[0]
    try:
        kinds = {m.kind for m in device.addressable_memories()}
    except Exception:  # noqa: BLE001 -- a backend without memories API
        kinds = set()
    if "pinned_host" not in kinds:
        raise ConfigError(
            f"activation offloading needs a device with host memory ('pinned_host'); "
            f"this {device.platform} backend has {sorted(kinds) or 'no memory kinds'}."
            " Use a remat preset without offload (e.g. 'full')."
        )


def remat_policy(
    name: str, save: Sequence[str] = (), offload: Sequence[str] = ()
) -> tuple[bool, Callable[..., Any] | None]:
    """`(checkpoint the layer?, jax.checkpoint policy)` of a remat setting."""
    check_remat(name, save, offload)
    if name == "none":
        return False, None
    if name in ("full", "nothing_saveable"):
        return True, None
    if name == "dots":
        return True, jax.checkpoint_policies.checkpoint_dots
    if name == "dots_no_batch":
        return True, jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims
    if name == "custom":
        keep = names(save, field="remat_save")
        move = names(offload, field="remat_offload")
    else:
        keep, move = _PRESET_NAMES[name]
    if not move:
        return True, jax.checkpoint_policies.save_only_these_names(*keep)
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=list(keep),
        names_which_can_be_offloaded=list(move),
        offload_src="device",
        offload_dst="pinned_host",
    )
    return True, policy


def name_activation(x: Array, name: str) -> Array:
    """`x` marked as `name` (one of `CHECKPOINT_NAMES`) for remat policies."""
    return checkpoint_name(x, name)


def mlp_chunk_count(chunks: int | str, seq: int, hidden: int) -> int:
    """The number of sequence chunks of a tiled MLP: `chunks`, or for `"auto"`
    `ceil(seq / hidden)` (1 unless the sequence is longer than the width)."""
    if chunks == "auto":
        return max(1, -(-seq // hidden))
    return int(chunks)


def check_mlp_chunks(chunks: Any) -> None:
    if chunks == "auto":
        return
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ConfigError(
            f"`mlp_chunks` must be a positive int or 'auto'; got {chunks!r}."
        )


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


def check_options(
    *,
    attention_impl: str | None,
    remat: str,
    param_dtype: Any,
    remat_save: Sequence[str] = (),
    remat_offload: Sequence[str] = (),
    mlp_chunks: Any = 1,
    attention_chunk: Any = 0,
) -> None:
    """Validate the runtime options the model configs share."""
    if (
        not isinstance(attention_chunk, int)
        or isinstance(attention_chunk, bool)
        or attention_chunk < 0
    ):
        raise ConfigError(
            f"`attention_chunk` must be an int >= 0 (queries per block; 0: off); "
            f"got {attention_chunk!r}."
        )
    if attention_impl not in (None, "xla", "cudnn"):
        raise ConfigError(
            f"`attention_impl` must be None, 'xla' or 'cudnn'; got {attention_impl!r}."
        )
    check_remat(remat, remat_save, remat_offload)
    check_mlp_chunks(mlp_chunks)
    as_dtype(param_dtype)


@dataclasses.dataclass(frozen=True)
class RuntimeFields:
    """The runtime options every language-model config holds (`RUNTIME_OPTIONS`;
    documented in `DecoderConfig`): how the model computes, never its arrays."""

    remat: str = "none"
    scan_layers: bool = True
    attention_impl: str | None = None
    remat_save: tuple[str, ...] = ()
    remat_offload: tuple[str, ...] = ()
    mlp_chunks: int | str = 1
    attention_chunk: int = 0
    sequence_parallel: str | None = None
    sequence_layout: str = "contiguous"


RUNTIME_OPTIONS = frozenset(f.name for f in dataclasses.fields(RuntimeFields))
"""Config fields of the language models that `with_options` may change on an
existing model (none changes an array's shape)."""


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    """How a block computes, the same for every layer (one object instead of
    loose keywords): the attention kernel, its query chunks, sequence
    parallelism, and the MLP's sequence chunks (resolved for the sequence)."""

    implementation: str | None
    query_chunk: int
    sequence_parallel: str | None
    sequence_layout: str
    mlp_chunks: int
    moe: Any = None

    @classmethod
    def of(cls, config: Any, seq: int, hidden: int) -> "RuntimeOptions":
        """The options of a model config (its `RUNTIME_OPTIONS` fields) for a
        sequence of `seq` tokens and a residual stream `hidden` wide."""
        return cls(
            implementation=config.attention_impl,
            query_chunk=config.attention_chunk,
            sequence_parallel=config.sequence_parallel,
            sequence_layout=config.sequence_layout,
            mlp_chunks=mlp_chunk_count(config.mlp_chunks, seq, hidden),
            moe=getattr(config, "moe_options", None),
        )


def check_runtime(config: Any) -> None:
    """Validate a model config's runtime options (`RUNTIME_OPTIONS`)."""
    from ._sequence import check_scheme

    check_scheme(config.sequence_parallel, config.sequence_layout)
    check_options(
        attention_impl=config.attention_impl,
        remat=config.remat,
        param_dtype=config.param_dtype,
        remat_save=config.remat_save,
        remat_offload=config.remat_offload,
        mlp_chunks=config.mlp_chunks,
        attention_chunk=config.attention_chunk,
    )


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
    on, policy = remat_policy(remat, remat_save, remat_offload)
    dynamic, static = eqx.partition(layers, eqx.is_array)
    num = jtu.tree_leaves(dynamic)[0].shape[0]
    keys = jr.split(key, num) if key is not None and uses_key(layers) else None
    kinds = None if kinds is None else tuple(kinds)
    if kinds is not None and len(kinds) != num:
        raise ConfigError(f"{len(kinds)} layer kinds for {num} layers.")

    def body(h: Any, xs: Any, kind: Any = None) -> Any:
        params, k = xs
        layer = eqx.combine(params, static)
        if isinstance(h, tuple):  # (activations, statistics carried along)
            h = (name_activation(h[0], "layer_input"), *h[1:])
        else:
            h = name_activation(h, "layer_input")
        return call(layer, h, k) if kinds is None else call(layer, h, k, kind)

    unrolled = scanned = body
    if on:
        # prevent_cse stops XLA from merging the recomputation with the forward pass
        # (undoing the remat); inside `scan` that cannot happen and it only costs.
        remat_ = lambda cse: jax.checkpoint(
            body, policy=policy, prevent_cse=cse, static_argnums=(2,)
        )
        unrolled, scanned = remat_(True), remat_(False)
    period = 1 if kinds is None else _period(kinds)
    first = None if kinds is None else kinds[0]
    if scan and period == 1:
        step = lambda h, p: (scanned(h, p, first), None)
        x, _ = lax.scan(step, x, (dynamic, keys))
        return x
    groups = num // period if scan else 0
    done = 0
    if groups > 1:
        cut = lambda a: a[: groups * period].reshape(groups, period, *a.shape[1:])

        def group(h: Any, xs: Any) -> tuple[Any, None]:
            for j in range(period):
                h = scanned(h, jtu.tree_map(lambda a, j=j: a[j], xs), kinds[j])
            return h, None

        x, _ = lax.scan(group, x, jtu.tree_map(cut, (dynamic, keys)))
        done = groups * period
    for i in range(done, num):
        xs = jtu.tree_map(lambda a, i=i: a[i], (dynamic, keys))
        x = unrolled(x, xs, None if kinds is None else kinds[i])
    return x


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


# -- configuration helpers -------------------------------------------------------------
ModuleT = TypeVar("ModuleT", bound=eqx.Module)


def with_config_options(
    model: ModuleT, allowed: frozenset[str], **changes: Any
) -> ModuleT:
    """A copy of `model` (same arrays) whose `config` has `changes` applied; only
    options that do not change any array's shape may change."""
    bad = sorted(set(changes) - allowed)
    if bad:
        raise ConfigError(
            f"`with_options` changes only {sorted(allowed)}; got {bad}. Options that "
            "change parameter shapes need a new model: `type(model)(config, key)`."
        )
    config = dataclasses.replace(model.config, **changes)  # type: ignore[attr-defined]
    new = copy.copy(model)
    object.__setattr__(new, "config", config)  # a static field; arrays are shared
    return new


def residual_scale(num_layers: int) -> float:
    """GPT-2's scaling of residual output projections at init: 1/sqrt(2 * layers)."""
    return 1.0 / math.sqrt(2 * num_layers)


def num_params(model: Any) -> int:
    """Number of parameters (elements of every array leaf) of a model, concrete
    or abstract (`jax.ShapeDtypeStruct` leaves from `eqx.filter_eval_shape`)."""
    leaves = jtu.tree_leaves(model)
    return int(sum(math.prod(x.shape) for x in leaves if _is_array_like(x)))


def _is_array_like(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
