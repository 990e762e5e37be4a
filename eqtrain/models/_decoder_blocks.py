"""One block of the decoder (`DecoderLayer`, `self_attn` and `mlp` in Hugging
Face's names): grouped-query attention with rotary embeddings, a dense MLP in
one of three shapes or a `SparseMoE`, and the norms around them, built from a
`DecoderConfig`. The model that stacks them: `decoder.Decoder`; the dense MLPs
and the norm folded into a sublayer (`normed`): `_decoder_mlps`.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.random as jr
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._rows import vmap_rows
from ._cache import CacheStep, cached_attention, write
from ._decoder_config import DecoderConfig
from ._decoder_mlps import (
    _MLPS,
    AnyNorm,
    FusedGatedMLP,
    GatedMLP,
    PlainMLP,
    config_linear,
    normed,
)
from ._layers import (
    AnyLinear,
    LayerNorm,
    RMSNorm,
    as_dtype,
    fused_linears,
    split_key,
    tiled,
)
from ._moe import SparseMoE
from ._options import RuntimeOptions
from ._rope import apply_rope
from ._sequence import attend
from ._stack import name_activation


def config_norm(config: DecoderConfig, dim: int) -> RMSNorm | LayerNorm:
    dtype, eps = as_dtype(config.param_dtype), config.rms_norm_eps
    if config.norm == "layer":
        return LayerNorm(dim, eps=eps, dtype=dtype)
    return RMSNorm(dim, eps=eps, dtype=dtype, plus_one=config.norm == "rms_one")


class Attention(eqx.Module):
    """Grouped-query self-attention with rotary embeddings (`self_attn` in HF)."""

    q_proj: AnyLinear | None
    k_proj: AnyLinear | None
    v_proj: AnyLinear | None
    qkv_proj: AnyLinear | None
    o_proj: AnyLinear
    q_norm: RMSNorm | LayerNorm | None
    k_norm: RMSNorm | LayerNorm | None
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    qk_norm: str | None = eqx.field(static=True)
    scale: float | None = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, key: PRNGKeyArray):
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.kv_heads
        self.head_dim, self.qk_norm = config.head_size, config.qk_norm
        self.scale, self.softcap = config.attention_scale, config.attn_logit_softcapping
        projections = _attention_projections(config, key)
        self.q_proj, self.k_proj, self.v_proj, self.qkv_proj, self.o_proj = projections
        self.q_norm, self.k_norm = _qk_norms(config)

    def _qkv(self, x: Array, keys: list[Any]) -> tuple[Array, Array, Array]:
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x, key=keys[0])
            q_out, kv_out = _widths(self.num_heads, self.num_kv_heads, self.head_dim)
            return qkv[:, :q_out], qkv[:, q_out : q_out + kv_out], qkv[:, -kv_out:]
        q, k, v = fused_linears((self.q_proj, self.k_proj, self.v_proj), x, keys)
        return q, k, v

    def project(
        self,
        x: Float[Array, "seq hidden"],
        rope: tuple[Array, Array] | None,
        keys: list[Any],
        norm: AnyNorm | None = None,
    ) -> tuple[Array, Array, Array]:
        """`(q [seq, heads, head_dim], k, v [seq, kv_heads, head_dim])`: the
        projections with their norms and rotary embedding applied (`norm`:
        the block's input norm, applied to `x` first, see `normed`)."""
        q, k, v = normed(norm, lambda y, attn, ks: attn._qkv(y, ks), x, self, keys)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)  # pyright: ignore
        q, k, v = self._split_heads(q, k, v)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)  # pyright: ignore
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def _split_heads(self, q: Array, k: Array, v: Array) -> tuple[Array, Array, Array]:
        """`[seq, heads * head_dim]` projections as `[seq, heads, head_dim]`."""
        seq, d = q.shape[0], self.head_dim
        kv = (seq, self.num_kv_heads, d)
        return q.reshape(seq, self.num_heads, d), k.reshape(kv), v.reshape(kv)

    def output(
        self, out: Float[Array, "seq heads head_dim"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq hidden"]:
        """`o_proj` over the heads' outputs."""
        out = self.o_proj(out.reshape(out.shape[0], -1), key=key)
        return name_activation(out, "attn_out")

    @jax.named_scope("attention")
    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        rope: tuple[Array, Array] | None,
        *,
        window: int | None,
        options: RuntimeOptions,
        segment_ids: Int[Array, " seq"] | None,
        positions: Int[Array, " seq"] | None,
        key: PRNGKeyArray | None = None,
        norm: AnyNorm | None = None,
    ) -> Float[Array, "seq hidden"]:
        """`rope`: the `(cos, sin)` tables of this layer (`None`: no rotation).
        `norm`: the block's input norm, to apply to `x` first (`normed`)."""
        kq, kk, kv, ko = split_key(key, 4)
        q, k, v = self.project(x, rope, [kq, kk, kv], norm)
        q, k = name_activation(q, "query"), name_activation(k, "key")
        v = name_activation(v, "value")
        out = attend(
            q,
            k,
            v,
            options,
            segment_ids=segment_ids,
            positions=positions,
            sliding_window=window,
            scale=self.scale,
            softcap=self.softcap,
        )
        return self.output(out, ko)


def _widths(heads: int, kv_heads: int, head_dim: int) -> tuple[int, int]:
    """The widths of the query and of the key (or value) projection."""
    return heads * head_dim, kv_heads * head_dim


def _attention_projections(config: DecoderConfig, key: PRNGKeyArray) -> tuple:
    """`(q_proj, k_proj, v_proj, qkv_proj, o_proj)`: three projections for q, k
    and v, or one fused `qkv_proj` (Phi-3), and the output projection."""
    kq, kk, kv, ko = jr.split(key, 4)
    d, bias = config.hidden_size, config.attention_bias
    q_out, kv_out = _widths(
        config.num_attention_heads, config.kv_heads, config.head_size
    )
    o_bias = bias if config.o_proj_bias is None else config.o_proj_bias
    o_proj = config_linear(config, q_out, d, o_bias, ko)
    if config.fused_qkv:
        return (
            None,
            None,
            None,
            config_linear(config, d, q_out + 2 * kv_out, bias, kq),
            o_proj,
        )
    q_proj = config_linear(config, d, q_out, bias, kq)
    k_proj = config_linear(config, d, kv_out, bias, kk)
    v_proj = config_linear(config, d, kv_out, bias, kv)
    return q_proj, k_proj, v_proj, None, o_proj


def _qk_norms(config: DecoderConfig) -> tuple[Any, Any]:
    """`(q_norm, k_norm)` of `config.qk_norm`: over each head, over the whole
    projection, or none."""
    if config.qk_norm == "head":
        size = config.head_size
        return config_norm(config, size), config_norm(config, size)
    if config.qk_norm == "full":
        q_out, kv_out = _widths(
            config.num_attention_heads, config.kv_heads, config.head_size
        )
        return config_norm(config, q_out), config_norm(config, kv_out)
    return None, None


def _sparse_mlp(config: DecoderConfig, key: PRNGKeyArray) -> SparseMoE:
    shared = None
    if config.shared_expert_intermediate_size is not None:
        size = config.shared_expert_intermediate_size
        shared_config = dataclasses.replace(config, intermediate_size=size)
        shared = lambda k: GatedMLP(shared_config, k)
    return SparseMoE(
        hidden=config.hidden_size,
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        ff=config.expert_size,
        norm_topk_prob=config.norm_topk_prob,
        act=config.hidden_act,
        std=config.initializer_range,
        dtype=config.param_dtype,
        shared=shared,
        key=key,
    )


class DecoderLayer(eqx.Module):
    """One block; which norms it has depends on `DecoderConfig.block`."""

    input_layernorm: AnyNorm | None
    self_attn: Attention
    post_attention_layernorm: AnyNorm | None
    pre_feedforward_layernorm: AnyNorm | None
    post_feedforward_layernorm: AnyNorm | None
    mlp: GatedMLP | FusedGatedMLP | PlainMLP | SparseMoE
    block: str = eqx.field(static=True)
    residual_multiplier: float | None = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, key: PRNGKeyArray):
        ka, km = jr.split(key)
        norm = lambda: config_norm(config, config.hidden_size)
        self.block, self.residual_multiplier = config.block, config.residual_multiplier
        self.input_layernorm = None if config.block == "post" else norm()
        self.self_attn = Attention(config, ka)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm() if config.block == "sandwich" else None
        self.post_feedforward_layernorm = None
        if config.block != "pre":
            self.post_feedforward_layernorm = norm()
        if config.num_experts:
            self.mlp = _sparse_mlp(config, km)
        else:
            self.mlp = _MLPS[config.mlp](config, km)

    def _add(self, x: Array, h: Array) -> Array:
        if self.residual_multiplier is not None:
            h = h * self.residual_multiplier
        return x + h

    def _forward(
        self,
        x: Array,
        attn: Callable[[Array, Any], tuple[Array, Any]],
        mlp: Callable[[Array, Any], tuple[Array, Any]],
        fold: bool = False,
    ) -> tuple[Array, Any, Any]:
        """The block around its two sublayers: `attn` (which returns its output
        and anything else, e.g. an updated cache) and `mlp` (its output and its
        router statistics, or None). Returns `(x, mlp's extra, attn's extra)`.

        Each sublayer is called as `(input, norm)`: with `fold`, the residual
        stream and the norm for the sublayer to apply inside its first
        projections (`normed`); else the normed input and None. A `SparseMoE`
        always gets its input normed (its router and experts share it)."""
        pre = self.input_layernorm
        if fold and pre is not None:
            h, attn_extra = attn(x, pre)
        else:
            h, attn_extra = attn(x if pre is None else pre(x), None)
        if self.block != "pre":
            h = self.post_attention_layernorm(h)  # pyright: ignore
        x = self._add(x, h)
        norm = self._mlp_norm()
        if fold and norm is not None and not isinstance(self.mlp, SparseMoE):
            h, aux = mlp(x, norm)
        else:
            h, aux = mlp(
                name_activation(x if norm is None else norm(x), "mlp_in"), None
            )
        if self.post_feedforward_layernorm is not None:
            h = self.post_feedforward_layernorm(h)
        return self._add(x, name_activation(h, "mlp_out")), aux, attn_extra

    def _mlp_norm(self) -> AnyNorm | None:
        """The norm before the MLP (`post_attention_layernorm` in a pre-norm
        block, `pre_feedforward_layernorm` in a sandwich), or None."""
        if self.block == "pre":
            return self.post_attention_layernorm
        if self.block == "sandwich":
            return self.pre_feedforward_layernorm
        return None

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        rope: tuple[Array, Array] | None,
        *,
        window: int | None,
        options: RuntimeOptions,
        segment_ids: Int[Array, " seq"] | None,
        positions: Int[Array, " seq"] | None,
        key: PRNGKeyArray | None = None,
    ) -> Array:
        ka, km = split_key(key, 2)
        context = dict(segment_ids=segment_ids, positions=positions, key=ka)
        attention = functools.partial(self.self_attn, window=window, options=options)
        attn = lambda a, norm: (attention(a, rope, **context, norm=norm), None)
        mlp = self._row_mlp(options, km)
        return self._forward(x, attn, mlp, options.fold_norms)[0]

    def _row_mlp(
        self, options: RuntimeOptions, key: Any
    ) -> Callable[[Array], tuple[Array, None]]:
        """The MLP over one row: tiled over the sequence (`options.mlp_chunks`),
        or a `SparseMoE` (its router statistics dropped)."""

        def mlp(h: Array, norm: Any) -> tuple[Array, None]:
            if isinstance(self.mlp, SparseMoE):
                return self.mlp(h, options=options.moe, key=key)[0], None
            dense = lambda c, k: self.mlp(c, key=k, norm=norm)  # pyright: ignore
            return tiled(dense, h, options.mlp_chunks, key), None

        return mlp

    def batched(
        self,
        x: Float[Array, "rows seq hidden"],
        rope: tuple[Array, Array] | None,
        *,
        window: int | None,
        options: RuntimeOptions,
        segment_ids: Int[Array, "rows seq"] | None,
        positions: Int[Array, "rows seq"],
        key: PRNGKeyArray | None = None,
    ) -> tuple[Array, dict[str, Array] | None]:
        """The block over a batch of rows (`rope`: per-row tables): attention
        row by row, the MLP over every token of the batch at once (a
        `SparseMoE` routes the whole batch). Returns the output and the
        layer's router statistics (None for a dense MLP)."""
        ka, km = split_key(key, 2)
        row_keys = None if ka is None else jr.split(ka, x.shape[0])
        attention = functools.partial(self.self_attn, window=window, options=options)

        def attn(a: Array, norm: Any) -> tuple[Array, None]:
            one = lambda xi, ri, si, pi, ki: attention(
                xi, ri, segment_ids=si, positions=pi, key=ki, norm=norm
            )
            return vmap_rows(one)(a, rope, segment_ids, positions, row_keys), None

        mlp = self._flat_mlp(options, segment_ids, km)
        x, aux, _ = self._forward(x, attn, mlp, options.fold_norms)
        return x, aux

    def _flat_mlp(
        self, options: RuntimeOptions, segment_ids: Array | None, key: Any
    ) -> Callable[[Array], tuple[Array, Any]]:
        """The MLP over every token of `[rows, seq, hidden]` at once; with
        experts it also returns the router statistics (padding left out)."""

        def mlp(h: Array, norm: Any) -> tuple[Array, Any]:
            flat = h.reshape(-1, h.shape[-1])
            if isinstance(self.mlp, SparseMoE):
                valid = None if segment_ids is None else segment_ids.reshape(-1) > 0
                y, aux = self.mlp(flat, valid=valid, options=options.moe, key=key)
                return y.reshape(h.shape), aux
            return self.mlp(flat, key=key, norm=norm).reshape(h.shape), None

        return mlp

    def cached(
        self,
        x: Float[Array, "rows t hidden"],
        rope: tuple[Array, Array] | None,
        cache: tuple[Array, Array],
        *,
        layer: Int[Array, ""],
        window: int | None,
        step: CacheStep,
    ) -> tuple[Array, tuple[Array, Array]]:
        """The block on `t` new tokens per row that writes their keys and values
        into `cache` (every layer's, this one is `layer`) at `step.slot` (see
        `eqtrain.models.KVCache`). `step.prefill`: the tokens are the whole
        prompt and attend among themselves; else they attend to the cache."""
        attn = self.self_attn
        scores = dict(window=window, scale=attn.scale, softcap=attn.softcap)

        def attend_cached(a: Array, _: None) -> tuple[Array, tuple[Array, Array]]:
            q, k, v = jax.vmap(lambda xi, ri: attn.project(xi, ri, [None] * 3))(a, rope)
            new = write(cache, layer, step.slot, k, v)
            out = cached_attention(q, k, v, new, layer=layer, step=step, **scores)
            return jax.vmap(attn.output)(out), new

        mlp = self._flat_mlp(step.options, None, None)
        x, _, new = self._forward(x, attend_cached, mlp)
        return x, new
