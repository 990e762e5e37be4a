"""The decoder every Llama-like family is built from: embeddings, a stack of
blocks (norms, grouped-query attention with rotary embeddings, an MLP) and a
head, with the switches that tell the families apart (`DecoderConfig`).

Parameter paths are Hugging Face's names (without the `model.` prefix), so import
and export are plain renames: `embed_tokens`, `layers.self_attn.{q,k,v,o}_proj`
(or Phi-3's fused `qkv_proj`), `layers.self_attn.{q,k}_norm`,
`layers.mlp.{gate,up,down}_proj` (Phi-3's `gate_up_proj`, StarCoder2's
`c_fc`/`c_proj`), `layers.{input,post_attention,pre_feedforward,
post_feedforward}_layernorm`, `norm`, `lm_head`. The families' Hugging Face
mappings live in `eqtrain.models.archs`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._errors import ConfigError
from .._rows import vmap_rows
from ._attention import (
    default_positions,
)
from ._cache import (
    KVCache,
    cache_attention,
    empty_cache,
    layer_of,
    slot_positions,
    write,
)
from ._layers import (
    ACTIVATIONS,
    AnyLinear,
    Embedding,
    LayerNorm,
    Linear,
    RMSNorm,
    as_dtype,
    fused_linears,
    head_weight,
    split_key,
    tiled,
)
from ._moe import (
    AUX_KEYS,
    MOE_IMPLS as MOE_IMPLS,
    MoEOptions,
    SparseMoE,
    check_moe_options,
    empty_aux,
    router_terms,
)
from ._options import (
    RUNTIME_OPTIONS,
    RuntimeFields,
    RuntimeOptions,
    check_runtime,
    with_config_options,
)
from ._rope import Rope, apply_rope, rope_cos_sin
from ._sequence import attend
from ._stack import (
    Numbered,
    name_activation,
    run_layers,
    stack_layers,
)


NORMS = ("rms", "rms_one", "layer")
"""`DecoderConfig.norm`: RMSNorm (`w * x`), Gemma's RMSNorm (`(1 + w) * x`), or
LayerNorm with a bias (StarCoder2)."""
BLOCKS = ("pre", "sandwich", "post")
"""`DecoderConfig.block`: where the norms sit (see `DecoderConfig`)."""
MLPS = ("gated", "fused_gated", "plain")
QK_NORMS = (None, "head", "full")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True)
class DecoderConfig(RuntimeFields):
    """Shape, architecture switches and runtime options of a `Decoder`. Field
    names follow Hugging Face's configs; the defaults are Llama's (Llama-2-7B's
    shape), so `DecoderConfig()` with sizes is a Llama.

    Attributes:
        vocab_size, hidden_size, intermediate_size, num_hidden_layers,
            num_attention_heads: the sizes.
        num_key_value_heads: key/value heads (`None`: as many as query heads).
        head_dim: width of one head (`None`: `hidden_size // num_attention_heads`).
        rms_norm_eps: epsilon of every norm.
        rope_theta: base of the rotary frequencies when `rope` is `None`.
        attention_bias: biases on the q, k, v (and o) projections.
        o_proj_bias: bias on the o projection (`None`: as `attention_bias`).
        mlp_bias: biases on the MLP projections.
        tie_word_embeddings: the output head is the input embedding.
        sliding_window: span of windowed attention (itself included); which
            layers use it: `layer_types` (`None`: every layer).
        max_position_embeddings: longest sequence the model is meant for.
        initializer_range: standard deviation of the normal initialisation.
        param_dtype: dtype of the parameters.
        model_type: the Hugging Face architecture the config came from and
            exports as (`None`: the simplest one that expresses it).
        norm: one of `NORMS`.
        block: `"pre"`: `x + attn(norm1(x))`, `x + mlp(norm2(x))` (Llama);
            `"sandwich"`: the sublayers' outputs normed too, four norms (Gemma 2
            and 3); `"post"`: only the outputs normed,
            `x + norm1(attn(x))` (OLMo 2).
        qk_norm: norms on queries and keys before the rotary embedding:
            `"head"` over each head (Qwen3, Gemma 3), `"full"` over the whole
            projection (OLMo 2), `None`.
        hidden_act: the MLP's activation (a name of `ACTIVATIONS`).
        mlp: `"gated"` (`down(act(gate(x)) * up(x))`), `"fused_gated"` (the same
            with `gate_up_proj` in one matrix, Phi-3) or `"plain"`
            (`c_proj(act(c_fc(x)))`, StarCoder2).
        fused_qkv: one `qkv_proj` instead of three (Phi-3).
        attention_scale: scores' scale (`None`: `head_dim ** -0.5`; Gemma 2:
            `query_pre_attn_scalar ** -0.5`; Granite: `attention_multiplier`).
        attn_logit_softcapping: scores capped at `c * tanh(s / c)` (Gemma 2).
        final_logit_softcapping: logits capped the same way (Gemma 2 and 3).
        embedding_multiplier: embeddings scaled by this (Gemma: `sqrt(hidden)`
            in the compute dtype; Granite).
        residual_multiplier: each sublayer's output scaled before the residual
            add (Granite).
        logits_scaling: logits divided by this (Granite).
        layer_types: per layer, `"full_attention"` or `"sliding_attention"`.
        rope: the rotary embedding (`None`: `Rope(theta=rope_theta)` over
            `partial_rotary_factor` of each head).
        local_rope: the sliding layers' rotary embedding (Gemma 3's local base
            frequency); `None`: `rope`.
        partial_rotary_factor: the fraction of each head that rotates (Phi-4-mini).
        no_rope_layers: per layer, 1 if it uses rotary embeddings, 0 if not
            (SmolLM3); `None`: all do.
        num_experts: experts of each sparse MLP (0: every MLP dense). With
            experts, every layer's MLP is a `SparseMoE` (Mixtral, Qwen-MoE).
        num_experts_per_tok: experts each token is routed to (top-k).
        moe_intermediate_size: width of one expert (`None`: `intermediate_size`,
            as Mixtral).
        norm_topk_prob: the top-k routing weights renormalised to sum to 1
            (Mixtral: always; Qwen-MoE: its config's `norm_topk_prob`).
        shared_expert_intermediate_size: width of Qwen2-MoE's shared expert
            (`None`: none).
        router_aux_loss_coef: coefficient of the load-balancing loss the LM
            losses add (`eqtrain.models.load_balancing_loss`; 0: off).
        remat, remat_save, remat_offload, mlp_chunks, attention_chunk,
            scan_layers, attention_impl, sequence_parallel, sequence_layout:
            runtime options, which `Decoder.with_options` may change (see
            `RuntimeOptions`).
        moe_impl, capacity_factor, router_z_loss_coef: the sparse MLPs' runtime
            options (`Decoder.with_options` may change them too): the dispatch
            (`eqtrain.models.MOE_IMPLS`), a capacity per expert for the
            dropping variant (`None`: dropless), and the router z-loss's
            coefficient (0: off).
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float | int = 1e-6
    rope_theta: float | int = 10000.0
    attention_bias: bool = False
    o_proj_bias: bool | None = None
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    max_position_embeddings: int = 2048
    initializer_range: float | int = 0.02
    param_dtype: str = "float32"
    model_type: str | None = None
    norm: str = "rms"
    block: str = "pre"
    qk_norm: str | None = None
    hidden_act: str = "silu"
    mlp: str = "gated"
    fused_qkv: bool = False
    attention_scale: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_scaling: float | None = None
    layer_types: tuple[str, ...] | None = None
    rope: Rope | None = None
    local_rope: Rope | None = None
    partial_rotary_factor: float = 1.0
    no_rope_layers: tuple[int, ...] | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int | None = None
    router_aux_loss_coef: float | int = 0.001
    moe_impl: str = "auto"
    capacity_factor: float | int | None = None
    router_z_loss_coef: float | int = 0.0

    def __post_init__(self) -> None:
        check_runtime(self)
        heads, kv = self.num_attention_heads, self.kv_heads
        if heads % kv:
            raise ConfigError(
                f"`num_key_value_heads` must divide `num_attention_heads`; got "
                f"{kv} and {heads}. Use e.g. num_key_value_heads=1 (MQA) or a "
                f"divisor of {heads} (GQA)."
            )
        if self.rotary_dim % 2:
            raise ConfigError(
                f"rotary embeddings need an even `head_dim` (an even number of "
                f"rotary dimensions); got {self.rotary_dim} (head_dim "
                f"{self.head_size}, partial_rotary_factor "
                f"{self.partial_rotary_factor})."
            )
        if self.head_dim is None and self.hidden_size % heads:
            raise ConfigError(
                f"`hidden_size` {self.hidden_size} is not a multiple of "
                f"`num_attention_heads` {heads}; set `head_dim` explicitly."
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(
                f"`sliding_window` must be >= 1 or None; got {self.sliding_window}."
            )
        for field, value, options in (
            ("norm", self.norm, NORMS),
            ("block", self.block, BLOCKS),
            ("qk_norm", self.qk_norm, QK_NORMS),
            ("mlp", self.mlp, MLPS),
            ("hidden_act", self.hidden_act, tuple(ACTIVATIONS)),
        ):
            if value not in options:
                raise ConfigError(f"`{field}` must be one of {options}; got {value!r}.")
        layers = self.num_hidden_layers
        for field, value in (
            ("layer_types", self.layer_types),
            ("no_rope_layers", self.no_rope_layers),
        ):
            if value is not None and len(value) != layers:
                raise ConfigError(
                    f"`{field}` has {len(value)} entries for {layers} layers; give "
                    "one per layer."
                )
        self._check_experts()
        bad = sorted(set(self.layer_types or ()) - set(LAYER_TYPES))
        if bad:
            raise ConfigError(
                f"`layer_types` holds {bad}; each entry must be one of {LAYER_TYPES}."
            )

    def _check_experts(self) -> None:
        check_moe_options(self.moe_impl, self.capacity_factor)
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(f"`{name}` must be >= 0; got {getattr(self, name)}.")
        if not self.num_experts:
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"`num_experts_per_tok` must be between 1 and num_experts "
                f"({self.num_experts}); got {self.num_experts_per_tok}."
            )
        if self.mlp != "gated":
            raise ConfigError(
                f"experts are gated MLPs; `mlp` must be 'gated' with num_experts "
                f"> 0, got {self.mlp!r}."
            )
        if self.sequence_parallel is not None:
            raise ConfigError(
                "sequence parallelism is not supported with mixture-of-experts "
                "layers yet; unset model.sequence_parallel (use mesh.expert, "
                "data or fsdp instead)."
            )

    @property
    def expert_size(self) -> int:
        """One expert's width (`moe_intermediate_size`, resolved)."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def moe_options(self) -> MoEOptions:
        return MoEOptions(self.moe_impl, self.capacity_factor)

    @property
    def kv_heads(self) -> int:
        """`num_key_value_heads`, resolved."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        """`head_dim`, resolved."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """The rotating features of each head."""
        if self.rope is not None:
            return self.rope.dim
        return int(self.head_size * self.partial_rotary_factor)

    @property
    def global_rope(self) -> Rope:
        """`rope`, resolved."""
        if self.rope is not None:
            return self.rope
        return Rope(theta=float(self.rope_theta), dim=self.rotary_dim)

    def window(self, layer: int) -> int | None:
        """The attention window of layer `layer` (`None`: full causal)."""
        if self.layer_types is not None and self.layer_types[layer] != LAYER_TYPES[1]:
            return None
        return self.sliding_window

    def layer_kinds(self) -> tuple[tuple[int | None, str], ...]:
        """Per layer, `(window, rotary table)`: the table `"global"`, `"local"`
        (sliding layers with a `local_rope`) or `"none"` (`no_rope_layers`)."""
        out = []
        for i in range(self.num_hidden_layers):
            window = self.window(i)
            table = "global"
            if self.no_rope_layers is not None and not self.no_rope_layers[i]:
                table = "none"
            elif self.local_rope is not None and self.layer_types is not None:
                table = "local" if self.layer_types[i] == LAYER_TYPES[1] else table
            out.append((window, table))
        return tuple(out)


LlamaConfig = DecoderConfig
MOE_OPTIONS = frozenset(
    {"moe_impl", "capacity_factor", "router_z_loss_coef", "router_aux_loss_coef"}
)
"""`DecoderConfig` fields that `Decoder.with_options` may change besides
`RUNTIME_OPTIONS`."""


def _norm(config: DecoderConfig, dim: int) -> RMSNorm | LayerNorm:
    dtype, eps = as_dtype(config.param_dtype), config.rms_norm_eps
    if config.norm == "layer":
        return LayerNorm(dim, eps=eps, dtype=dtype)
    return RMSNorm(dim, eps=eps, dtype=dtype, plus_one=config.norm == "rms_one")


def _linear(config: DecoderConfig, d_in: int, d_out: int, bias: bool, key: Any):
    return Linear(
        d_in,
        d_out,
        use_bias=bias,
        std=config.initializer_range,
        dtype=as_dtype(config.param_dtype),
        key=key,
    )


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
        kq, kk, kv, ko = jr.split(key, 4)
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.kv_heads
        self.head_dim, self.qk_norm = config.head_size, config.qk_norm
        self.scale = config.attention_scale
        self.softcap = config.attn_logit_softcapping
        d, bias = config.hidden_size, config.attention_bias
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        o_bias = bias if config.o_proj_bias is None else config.o_proj_bias
        self.q_proj = self.k_proj = self.v_proj = self.qkv_proj = None
        if config.fused_qkv:
            self.qkv_proj = _linear(config, d, q_out + 2 * kv_out, bias, kq)
        else:
            self.q_proj = _linear(config, d, q_out, bias, kq)
            self.k_proj = _linear(config, d, kv_out, bias, kk)
            self.v_proj = _linear(config, d, kv_out, bias, kv)
        self.o_proj = _linear(config, q_out, d, o_bias, ko)
        self.q_norm = self.k_norm = None
        if config.qk_norm == "head":
            self.q_norm = _norm(config, self.head_dim)
            self.k_norm = _norm(config, self.head_dim)
        elif config.qk_norm == "full":
            self.q_norm, self.k_norm = _norm(config, q_out), _norm(config, kv_out)

    def _qkv(self, x: Array, keys: list[Any]) -> tuple[Array, Array, Array]:
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x, key=keys[0])
            q_out = self.num_heads * self.head_dim
            kv_out = self.num_kv_heads * self.head_dim
            return qkv[:, :q_out], qkv[:, q_out : q_out + kv_out], qkv[:, -kv_out:]
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = fused_linears(projections, x, keys)
        return q, k, v

    def project(
        self,
        x: Float[Array, "seq hidden"],
        rope: tuple[Array, Array] | None,
        keys: list[Any],
    ) -> tuple[Array, Array, Array]:
        """`(q [seq, heads, head_dim], k, v [seq, kv_heads, head_dim])`: the
        projections with their norms and rotary embedding applied."""
        seq = x.shape[0]
        q, k, v = self._qkv(x, keys)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)  # pyright: ignore
        q = q.reshape(seq, self.num_heads, self.head_dim)
        k = k.reshape(seq, self.num_kv_heads, self.head_dim)
        v = v.reshape(seq, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)  # pyright: ignore
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

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
    ) -> Float[Array, "seq hidden"]:
        """`rope`: the `(cos, sin)` tables of this layer (`None`: no rotation)."""
        kq, kk, kv, ko = split_key(key, 4)
        q, k, v = self.project(x, rope, [kq, kk, kv])
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


class GatedMLP(eqx.Module):
    """`down_proj(act(gate_proj(x)) * up_proj(x))` (SwiGLU with `silu`)."""

    gate_proj: AnyLinear
    up_proj: AnyLinear
    down_proj: AnyLinear
    act: str = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, key: PRNGKeyArray):
        kg, ku, kd = jr.split(key, 3)
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = _linear(config, d, f, bias, kg)
        self.up_proj = _linear(config, d, f, bias, ku)
        self.down_proj = _linear(config, f, d, bias, kd)
        self.act = config.hidden_act

    @jax.named_scope("mlp")
    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        kg, ku, kd = split_key(key, 3)
        gate, up = fused_linears((self.gate_proj, self.up_proj), x, (kg, ku))
        return self.down_proj(ACTIVATIONS[self.act](gate) * up, key=kd)


class FusedGatedMLP(eqx.Module):
    """The gated MLP with gate and up in one `gate_up_proj` (gate first: Phi-3)."""

    gate_up_proj: AnyLinear
    down_proj: AnyLinear
    act: str = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, key: PRNGKeyArray):
        ku, kd = jr.split(key)
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = _linear(config, d, 2 * f, bias, ku)
        self.down_proj = _linear(config, f, d, bias, kd)
        self.act = config.hidden_act

    @jax.named_scope("mlp")
    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        ku, kd = split_key(key, 2)
        gate, up = jnp.split(self.gate_up_proj(x, key=ku), 2, axis=-1)
        return self.down_proj(ACTIVATIONS[self.act](gate) * up, key=kd)


class PlainMLP(eqx.Module):
    """`c_proj(act(c_fc(x)))` (StarCoder2)."""

    c_fc: AnyLinear
    c_proj: AnyLinear
    act: str = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, key: PRNGKeyArray):
        ku, kd = jr.split(key)
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.c_fc = _linear(config, d, f, bias, ku)
        self.c_proj = _linear(config, f, d, bias, kd)
        self.act = config.hidden_act

    @jax.named_scope("mlp")
    def __call__(self, x: Array, *, key: PRNGKeyArray | None = None) -> Array:
        ku, kd = split_key(key, 2)
        return self.c_proj(ACTIVATIONS[self.act](self.c_fc(x, key=ku)), key=kd)


_MLPS = {"gated": GatedMLP, "fused_gated": FusedGatedMLP, "plain": PlainMLP}
AnyNorm = RMSNorm | LayerNorm


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
        norm = lambda: _norm(config, config.hidden_size)
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
        attn: Callable[[Array], tuple[Array, Any]],
        mlp: Callable[[Array], tuple[Array, Any]],
    ) -> tuple[Array, Any, Any]:
        """The block around its two sublayers: `attn` (which returns its output
        and anything else, e.g. an updated cache) and `mlp` (its output and its
        router statistics, or None). Returns `(x, mlp's extra, attn's extra)`."""
        attn_in = x if self.input_layernorm is None else self.input_layernorm(x)
        h, attn_extra = attn(attn_in)
        if self.block != "pre":
            h = self.post_attention_layernorm(h)  # pyright: ignore
        x = self._add(x, h)
        if self.block == "pre":
            h = self.post_attention_layernorm(x)  # pyright: ignore
        elif self.block == "sandwich":
            h = self.pre_feedforward_layernorm(x)  # pyright: ignore
        else:
            h = x
        h = name_activation(h, "mlp_in")
        h, aux = mlp(h)
        if self.post_feedforward_layernorm is not None:
            h = self.post_feedforward_layernorm(h)
        return self._add(x, name_activation(h, "mlp_out")), aux, attn_extra

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
        attn = lambda a: (
            self.self_attn(
                a,
                rope,
                window=window,
                options=options,
                segment_ids=segment_ids,
                positions=positions,
                key=ka,
            ),
            None,
        )

        def mlp(h: Array) -> tuple[Array, None]:
            if isinstance(self.mlp, SparseMoE):
                return self.mlp(h, options=options.moe, key=km)[0], None
            return tiled(
                lambda c, k: self.mlp(c, key=k), h, options.mlp_chunks, km
            ), None

        return self._forward(x, attn, mlp)[0]

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
        rows, seq, _ = x.shape
        ka, km = split_key(key, 2)
        row_keys = None if ka is None else jr.split(ka, rows)

        def attn(a: Array) -> tuple[Array, None]:
            one = lambda xi, ri, si, pi, ki: self.self_attn(
                xi,
                ri,
                window=window,
                options=options,
                segment_ids=si,
                positions=pi,
                key=ki,
            )
            return vmap_rows(one)(a, rope, segment_ids, positions, row_keys), None

        x, aux, _ = self._forward(x, attn, self._flat_mlp(options, segment_ids, km))
        return x, aux

    def _flat_mlp(
        self, options: RuntimeOptions, segment_ids: Array | None, key: Any
    ) -> Callable[[Array], tuple[Array, Any]]:
        """The MLP over every token of `[rows, seq, hidden]` at once; with
        experts it also returns the router statistics (padding left out)."""

        def mlp(h: Array) -> tuple[Array, Any]:
            flat = h.reshape(-1, h.shape[-1])
            if isinstance(self.mlp, SparseMoE):
                valid = None if segment_ids is None else segment_ids.reshape(-1) > 0
                y, aux = self.mlp(flat, valid=valid, options=options.moe, key=key)
                return y.reshape(h.shape), aux
            return self.mlp(flat, key=key).reshape(h.shape), None

        return mlp

    def cached(
        self,
        x: Float[Array, "rows t hidden"],
        rope: tuple[Array, Array] | None,
        cache: tuple[Array, Array],
        *,
        layer: Int[Array, ""],
        slot: Int[Array, ""] | int,
        pads: Int[Array, " rows"],
        segment_ids: Int[Array, "rows t"],
        window: int | None,
        options: RuntimeOptions,
        prefill: bool,
    ) -> tuple[Array, tuple[Array, Array]]:
        """The block on `t` new tokens per row that writes their keys and values
        into `cache` (every layer's, this one is `layer`) at `slot` (see
        `eqtrain.models.KVCache`). `prefill`: the tokens are the whole prompt
        and attend among themselves; else they attend to the cache."""
        attn = self.self_attn

        def attend_cached(a: Array) -> tuple[Array, tuple[Array, Array]]:
            q, k, v = jax.vmap(lambda xi, ri: attn.project(xi, ri, [None] * 3))(a, rope)
            new = write(cache, layer, slot, k, v)
            if prefill:
                one = lambda qi, ki, vi, si: attend(
                    qi, ki, vi, options, segment_ids=si, positions=None,
                    sliding_window=window, scale=attn.scale, softcap=attn.softcap,
                )  # fmt: skip
                out = jax.vmap(one)(q, k, v, segment_ids)
            else:
                keys, values = layer_of(new, layer)
                out = cache_attention(
                    q, keys, values, pads=pads, slot=slot, window=window,
                    scale=attn.scale, softcap=attn.softcap,
                )  # fmt: skip
            return jax.vmap(attn.output)(out), new

        x, _, new = self._forward(x, attend_cached, self._flat_mlp(options, None, None))
        return x, new


class Decoder(eqx.Module):
    """A decoder over one sequence: `tokens [seq] -> logits [seq, vocab]`.

    Parameter paths mirror Hugging Face's `*ForCausalLM` (without its `model.`
    prefix); the layers are one stacked module: every array under `layers` has
    a leading axis of size `num_hidden_layers`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from eqtrain.models import Llama, LlamaConfig
        >>> config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...                      num_hidden_layers=2, num_attention_heads=4,
        ...                      num_key_value_heads=2)
        >>> model = Llama(config, jax.random.key(0))
        >>> model(jnp.arange(5)).shape
        (5, 32)
    """

    embed_tokens: Embedding
    layers: DecoderLayer
    norm: AnyNorm
    lm_head: AnyLinear | None
    config: DecoderConfig = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, key: PRNGKeyArray):
        ke, kl, kh = jr.split(key, 3)
        dtype = as_dtype(config.param_dtype)
        d, std = config.hidden_size, config.initializer_range
        self.embed_tokens = Embedding(
            config.vocab_size, d, std=std, dtype=dtype, key=ke
        )
        self.layers = stack_layers(
            lambda k: DecoderLayer(config, k), config.num_hidden_layers, kl
        )
        self.norm = _norm(config, d)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = _linear(config, d, config.vocab_size, False, kh)
        self.config = config

    def __call__(
        self,
        tokens: Int[Array, " seq"],
        *,
        segment_ids: Int[Array, " seq"] | None = None,
        positions: Int[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq vocab"]:
        """Logits for every position of one sequence (`jax.vmap` for a batch).

        Args:
            tokens: token ids.
            segment_ids: for packed rows, the example each token belongs to (1, 2,
                3, ...; padding 0). A position attends only to earlier-or-same
                positions of its own segment, and rotary positions restart at 0
                in every segment, so each example's logits equal those of the
                example alone.
            positions: explicit rotary positions (default: as described above).
            key: randomness for dropout, which only LoRA adapters have
                (`eqtrain.lora`); without adapter dropout it is unused.
        """
        x = self.features(tokens, segment_ids=segment_ids, positions=positions, key=key)
        with jax.named_scope("head"):
            if self.lm_head is None:
                logits = self.embed_tokens.attend(x)
            else:
                logits = self.lm_head(x)
            return transform_logits(logits, **self.logit_options())

    def features(
        self,
        tokens: Int[Array, " seq"],
        *,
        segment_ids: Int[Array, " seq"] | None = None,
        positions: Int[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq hidden"]:
        """The final-normed hidden states that `__call__` feeds its head (arguments
        as for `__call__`). With `head_weight()` and `logit_options()`, what
        `losses.chunked_causal_lm_loss_fn` needs to skip the full logits.

        A model with experts runs `batch_features` on this one row."""
        config = self.config
        if config.num_experts:
            add_row = lambda a: None if a is None else a[None]
            hidden, _ = self.batch_features(
                tokens[None],
                segment_ids=add_row(segment_ids),
                positions=add_row(positions),
                key=key,
            )
            return hidden[0]
        positions = default_positions(tokens.shape[0], segment_ids, positions)
        tables = rope_tables(config, positions)
        options = RuntimeOptions.of(config, tokens.shape[0], config.hidden_size)
        x = self._embed(self.embed_tokens(tokens))

        def call(layer: DecoderLayer, h: Array, k: Any, kind: Any) -> Array:
            window, table = kind
            return layer(
                h,
                tables[table],
                window=window,
                options=options,
                segment_ids=segment_ids,
                positions=positions,
                key=k,
            )

        return self.norm(self._run_layers(x, call, key))

    def batch_features(
        self,
        tokens: Int[Array, "rows seq"],
        *,
        segment_ids: Int[Array, "rows seq"] | None = None,
        positions: Int[Array, "rows seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "rows seq hidden"], dict[str, Array]]:
        """`features` of a batch of rows at once, and the router statistics of
        its sparse layers (`eqtrain.models.AUX_KEYS`, summed over the layers;
        `{}` without experts). The losses call this for a model with experts
        (`routes_batch`): the experts see every token of the batch together.
        Attention stays per row (`segment_ids`, `positions` as for `features`);
        padding (segment id 0) does not count in the statistics."""
        config = self.config
        rows, seq = tokens.shape
        positions = _batch_positions(rows, seq, segment_ids, positions)
        tables = jax.vmap(lambda p: rope_tables(config, p))(positions)
        options = RuntimeOptions.of(config, seq, config.hidden_size)
        x = self._embed(jax.vmap(self.embed_tokens)(tokens))
        start = empty_aux(config.num_experts) if config.num_experts else {}

        def call(layer: DecoderLayer, carry: Any, k: Any, kind: Any) -> Any:
            h, acc = carry
            window, table = kind
            h, aux = layer.batched(
                h,
                tables[table],
                window=window,
                options=options,
                segment_ids=segment_ids,
                positions=positions,
                key=k,
            )
            if aux is not None:
                acc = {name: acc[name] + aux[name] for name in AUX_KEYS}
            return h, acc

        x, aux = self._run_layers((x, start), call, key)
        return self.norm(x), aux

    def init_cache(self, rows: int, length: int, pads: Int[Array, " rows"]) -> KVCache:
        """An empty `KVCache` of `length` slots for `rows` rows left-padded by
        `pads` tokens, in the parameters' dtype."""
        c = self.config
        return empty_cache(
            layers=c.num_hidden_layers,
            rows=rows,
            length=length,
            kv_heads=c.kv_heads,
            head_dim=c.head_size,
            dtype=self.embed_tokens.weight.dtype,
            pads=pads,
        )

    def cached_features(
        self,
        tokens: Int[Array, "rows t"],
        cache: KVCache,
        slot: Int[Array, ""] | int,
        *,
        prefill: bool = False,
        last: Int[Array, ""] | None = None,
    ) -> tuple[Float[Array, "rows t hidden"], KVCache]:
        """`features` of `t` new tokens per row written at `slot` of `cache`,
        attending to what the cache holds (`prefill`: the whole left-padded
        prompt at slot 0, attending among itself with the training attention).
        Returns the final-normed hidden states and the filled cache. No
        dropout; router statistics are dropped. `last`: with `prefill`, the
        last real slot (tokens after it are placeholders, whose positions are
        capped at it, so that length-dependent ropes see the real length)."""
        config = self.config
        rows, t = tokens.shape
        positions, segments = slot_positions(cache.pads, slot, t)
        if last is not None:
            positions = jnp.minimum(positions, (last - cache.pads)[:, None])
        tables = jax.vmap(lambda p: rope_tables(config, p))(positions)
        options = RuntimeOptions.of(config, t, config.hidden_size)
        options = dataclasses.replace(options, sequence_parallel=None)
        x = self._embed(jax.vmap(self.embed_tokens)(tokens))

        def call(layer: Numbered, carry: Any, k: Any, kind: Any) -> Any:
            h, kv = carry
            window, table = kind
            return layer.block.cached(
                h, tables[table], kv, layer=layer.index, slot=slot,
                pads=cache.pads, segment_ids=segments, window=window,
                options=options, prefill=prefill,
            )  # fmt: skip

        layers = Numbered(self.layers, jnp.arange(config.num_hidden_layers))
        x, (k, v) = run_layers(
            layers,
            (x, (cache.k, cache.v)),
            call,
            scan=config.scan_layers,
            remat="none",
            kinds=config.layer_kinds(),
        )
        return self.norm(x), KVCache(k=k, v=v, pads=cache.pads)

    @property
    def rope_switch(self) -> int | None:
        """The position from which a longrope model's rotary embedding switches to
        its long factors for every position (`None`: no such switch). At that
        position generation recomputes the cache, as transformers' Phi-3 does,
        so that the tokens equal those of a full forward."""
        rope = self.config.global_rope
        if rope.rope_type != "longrope":
            return None
        return rope.original_max_position_embeddings

    def head(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch vocab"]:
        """Logits of final-normed hidden states (the head and its transforms)."""
        if self.lm_head is None:
            w = self.embed_tokens.weight
            logits = jnp.einsum("...d,vd->...v", x, w)
        else:
            logits = self.lm_head(x)
        return transform_logits(logits, **self.logit_options())

    def _embed(self, x: Array) -> Array:
        """Looked-up embeddings, scaled by `embedding_multiplier` if set."""
        m = self.config.embedding_multiplier
        return x if m is None else x * m

    def _run_layers(self, x: Any, call: Any, key: PRNGKeyArray | None) -> Any:
        """`run_layers` over the stack with the config's scan, remat and layer
        kinds (`x`: the activations, or a tuple carrying statistics along)."""
        c = self.config
        return run_layers(
            self.layers,
            x,
            call,
            scan=c.scan_layers,
            remat=c.remat,
            key=key,
            remat_save=c.remat_save,
            remat_offload=c.remat_offload,
            kinds=c.layer_kinds(),
        )

    @property
    def routes_batch(self) -> bool:
        """Whether the losses should call `batch_features` (a model with
        experts) rather than `features` row by row."""
        return bool(self.config.num_experts)

    def router_terms(self, aux: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
        """`(penalty, metrics)` of `batch_features`' router statistics (see
        `eqtrain.models.router_terms`); `(0, {})` without experts."""
        if not aux:
            return jnp.zeros((), jnp.float32), {}
        return router_terms(self.config, aux)

    def head_weight(
        self, *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "vocab hidden"]:
        """The output head as one matrix: `logits = features @ head_weight().T`,
        before `logit_options()`'s transforms. See `head_weight`."""
        return head_weight(self.embed_tokens, self.lm_head, key=key)

    def logit_options(self) -> dict[str, Any]:
        """`{"logit_scale", "softcap"}`: what the head does after its product
        (Granite's `1 / logits_scaling`, Gemma 2's final soft-cap)."""
        c = self.config
        scale = 1.0 if c.logits_scaling is None else 1.0 / c.logits_scaling
        return {"logit_scale": scale, "softcap": c.final_logit_softcapping}

    def with_options(self, **changes: Any) -> "Decoder":
        """The same parameters with other runtime options (`remat`, `remat_save`,
        `remat_offload`, `mlp_chunks`, `attention_chunk`, `scan_layers`,
        `attention_impl`, `sequence_parallel`, `sequence_layout`; with experts
        also `moe_impl`, `capacity_factor`, `router_z_loss_coef`,
        `router_aux_loss_coef`), e.g.
        `model.with_options(remat="full")`."""
        return with_config_options(self, RUNTIME_OPTIONS | MOE_OPTIONS, **changes)


Llama = Decoder


def transform_logits(
    logits: Array, *, logit_scale: float = 1.0, softcap: float | None = None
) -> Array:
    """`logits * logit_scale`, then soft-capped at `softcap * tanh(z / softcap)`
    (in f32 when capped, as Hugging Face), in the order the chunked losses use."""
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if softcap is not None:
        z = logits.astype(jnp.float32) / softcap
        logits = (jnp.tanh(z) * softcap).astype(logits.dtype)
    return logits


def _batch_positions(
    rows: int, seq: int, segment_ids: Array | None, positions: Array | None
) -> Int[Array, "rows seq"]:
    """Each row's positions, as `default_positions` gives them."""
    if segment_ids is None and positions is None:
        return jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq))
    return jax.vmap(lambda s, p: default_positions(seq, s, p))(segment_ids, positions)


def rope_tables(
    config: DecoderConfig, positions: Int[Array, " seq"]
) -> dict[str, tuple[Array, Array] | None]:
    """The `(cos, sin)` tables each layer kind reads (`DecoderConfig.layer_kinds`)."""
    kinds = {table for _, table in config.layer_kinds()}
    out: dict[str, tuple[Array, Array] | None] = {"none": None}
    if "global" in kinds:
        out["global"] = rope_cos_sin(config.global_rope, positions)
    if "local" in kinds and config.local_rope is not None:
        out["local"] = rope_cos_sin(config.local_rope, positions)
    return out


def flops_per_token(config: DecoderConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward) for sequences of `seq_len`.

    `6 * N + 12 * sum_l H * d_head * T_l`, the convention of PaLM (appendix B)
    and nanoGPT: `N` counts the weights of every matmul (the layers' projections
    and the output head, tied or not; not the embedding lookup, norms or biases),
    each costing 2 FLOPs per token forward and 4 backward. The attention term
    counts `q @ k.T` and `probs @ v` over `T_l = min(seq_len, window_l)` keys of
    each layer, without halving for causality, as MFU is usually reported.

    A mixture-of-experts MLP counts its active weights only: the router, the
    `num_experts_per_tok` experts a token goes through and the shared expert
    (so MFU stays honest for sparse models).
    """
    d, f = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_size
    kv = config.kv_heads * config.head_size
    mlp = 2 * d * f if config.mlp == "plain" else 3 * d * f
    if config.num_experts:
        mlp = d * config.num_experts
        mlp += 3 * d * config.expert_size * config.num_experts_per_tok
        if config.shared_expert_intermediate_size is not None:
            mlp += 3 * d * config.shared_expert_intermediate_size + d
    per_layer = d * q + 2 * d * kv + q * d + mlp
    n = config.num_hidden_layers * per_layer + config.vocab_size * d
    spans = 0
    for window, _ in config.layer_kinds():
        spans += seq_len if window is None else min(seq_len, window)
    return float(6 * n + 12 * q * spans)


def tensor_parallel_rules() -> list[tuple[str, PartitionSpec]]:
    """Megatron-style tensor-parallel rules for `eqtrain.sharding` (the decoder's
    paths).

    Weights are `[out, in]` with a leading stacked-layer axis (`"layers"`, never
    sharded). Column-parallel q/k/v/gate/up/c_fc split their `out` dimension over
    `tensor` (whole heads when `tensor` divides the head counts); row-parallel
    o/down/c_proj split their `in` dimension, so each layer needs one all-reduce
    after attention and one after the MLP. Phi-3's fused `qkv_proj` and
    `gate_up_proj` are split over `fsdp` only (a `tensor` split would cut across
    q/k/v and gate/up). The embedding and the head split the vocab. Every other
    leaf under `layers` (norms, q/k norms) is only marked as stacked. A
    mixture-of-experts layer's experts (`[layers, experts, ...]`) split their
    expert axis over `expert` (the FSDP pass may split another dimension);
    Qwen2-MoE's shared expert splits as the MLP does; the router is replicated.

    `fsdp` marks where FSDP goes when it applies (see `eqtrain.sharding.Rules`):
    the other dimension of each matrix, and for the embedding and the head the
    vocab too (on `hidden`, the lookup's output would inherit `fsdp` and clash with
    the batch's `fsdp`: XLA then reshuffles activations, ~3x the communication).
    """
    col, row = (
        PartitionSpec("layers", "tensor", "fsdp"),
        PartitionSpec("layers", "fsdp", "tensor"),
    )
    layer = r"(^|\.)layers\."
    return [
        (layer + r"self_attn\.[qkv]_proj\.weight$", col),
        (layer + r"self_attn\.[qkv]_proj\.bias$", PartitionSpec("layers", "tensor")),
        (layer + r"self_attn\.o_proj\.weight$", row),
        (layer + r"mlp\.(gate|up)_proj\.weight$", col),
        (layer + r"mlp\.(gate|up)_proj\.bias$", PartitionSpec("layers", "tensor")),
        (layer + r"mlp\.down_proj\.weight$", row),
        (layer + r"mlp\.c_fc\.weight$", col),
        (layer + r"mlp\.c_fc\.bias$", PartitionSpec("layers", "tensor")),
        (layer + r"mlp\.c_proj\.weight$", row),
        (layer + r"mlp\.shared_expert\.(gate|up)_proj\.weight$", col),
        (layer + r"mlp\.shared_expert\.down_proj\.weight$", row),
        (layer + r"mlp\.experts\.", PartitionSpec("layers", "expert")),
        (
            layer + r"(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight$",
            PartitionSpec("layers", None, "fsdp"),
        ),
        (layer, PartitionSpec("layers")),  # norms, o/down biases: replicated
        (
            r"(^|\.)(embed_tokens|lm_head)\.weight$",
            PartitionSpec(("tensor", "fsdp"), None),
        ),
    ]
