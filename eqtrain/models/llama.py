"""The Llama family of decoders (Llama, Mistral, Qwen2 by configuration): RMSNorm,
rotary embeddings, grouped-query attention and a SwiGLU MLP, with Hugging Face's
math and parameter names so that import and export are plain renames.

Builds on the layers in `eqtrain.models._layers`.
"""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._errors import ConfigError
from ._layers import (
    AnyLinear,
    Embedding,
    Linear,
    LoRALinear,
    RMSNorm,
    apply_rope,
    as_dtype,
    check_options,
    default_positions,
    fused_linears,
    mlp_chunk_count,
    name_activation,
    rope_cos_sin,
    run_layers,
    split_key,
    stack_layers,
    tiled,
    with_config_options,
)
from ._sequence import attend, check_scheme


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape and options of a `Llama`. Field names follow Hugging Face's
    `LlamaConfig`; the defaults are Hugging Face's (Llama-2-7B's shape).

    Mistral: set `sliding_window`. Qwen2: `attention_bias=True, o_proj_bias=False`
    and `tie_word_embeddings` as the checkpoint says.

    Attributes:
        vocab_size: number of token ids.
        hidden_size: width of the residual stream.
        intermediate_size: width of the SwiGLU MLP.
        num_hidden_layers: number of decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (`None`: as many as query heads; 1:
            multi-query attention). Must divide `num_attention_heads`.
        head_dim: width of one head (`None`: `hidden_size // num_attention_heads`);
            may differ from that.
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: base of the rotary frequencies.
        attention_bias: biases on the q, k, v and o projections (HF Llama).
        o_proj_bias: bias on the o projection (`None`: as `attention_bias`; Qwen2
            has q/k/v biases only, i.e. `False`).
        mlp_bias: biases on the MLP projections.
        tie_word_embeddings: the output head is the input embedding (no `lm_head`).
        sliding_window: each position attends to at most this many positions,
            itself included (Mistral); `None` for full causal attention.
        max_position_embeddings: longest sequence the model is meant for (recorded
            for export; RoPE itself has no table).
        initializer_range: standard deviation of the normal initialisation.
        param_dtype: dtype of the parameters (`"float32"`, `"bfloat16"`, ...).
            Compute dtype is the precision policy's business (`train_step`).
        remat: per-layer rematerialisation, a preset of `REMAT_PRESETS`:
            `"none"`, `"full"`, `"dots"`, `"dots_no_batch"`, `"save_qkv"`,
            `"save_out"`, `"offload_layer_input"`, or `"custom"`.
        remat_save: with `remat="custom"`, activations kept for the backward
            pass, by name (`CHECKPOINT_NAMES`: `"query"`, `"attn_out"`, ...).
        remat_offload: with `remat="custom"`, activations moved to host memory
            until the backward pass (e.g. `("layer_input",)`).
        mlp_chunks: run the MLP over this many pieces of the sequence, each
            rematerialised (a tiled MLP: `[seq / chunks, intermediate]` at a
            time); `"auto"`: `ceil(seq / hidden_size)`; 1: untiled.
        attention_chunk: queries per block of a blocked attention (the
            `[heads, seq, seq]` scores never exist at once; for backends
            without a fused kernel); 0: off. Ignored with `"cudnn"`.
        scan_layers: run the layers with `lax.scan` (compile time flat in depth);
            `False` unrolls a Python loop.
        attention_impl: `implementation` for `jax.nn.dot_product_attention`:
            `None` (XLA), `"xla"` or `"cudnn"` (the fused GPU kernel; bf16/f16).
        sequence_parallel: attention over a sequence split on the mesh's
            `sequence` axis: `"ulysses"`, `"ring"` or `"all_gather"` (see
            `eqtrain.models.sequence_attention`); `None`: plain attention.
        sequence_layout: `"contiguous"` or `"zigzag"`: how the rows' tokens are
            laid out (`eqtrain.models.sequence_rows` permutes them).
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
    remat: str = "none"
    scan_layers: bool = True
    attention_impl: str | None = None
    remat_save: tuple[str, ...] = ()
    remat_offload: tuple[str, ...] = ()
    mlp_chunks: int | str = 1
    attention_chunk: int = 0
    sequence_parallel: str | None = None
    sequence_layout: str = "contiguous"

    def __post_init__(self) -> None:
        check_scheme(self.sequence_parallel, self.sequence_layout)
        heads, kv = self.num_attention_heads, self.kv_heads
        if heads % kv:
            raise ConfigError(
                f"`num_key_value_heads` must divide `num_attention_heads`; got "
                f"{kv} and {heads}. Use e.g. num_key_value_heads=1 (MQA) or a "
                f"divisor of {heads} (GQA)."
            )
        if self.head_size % 2:
            raise ConfigError(
                f"rotary embeddings need an even `head_dim`; got {self.head_size}."
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
        check_options(
            attention_impl=self.attention_impl,
            remat=self.remat,
            param_dtype=self.param_dtype,
            remat_save=self.remat_save,
            remat_offload=self.remat_offload,
            mlp_chunks=self.mlp_chunks,
            attention_chunk=self.attention_chunk,
        )

    @property
    def kv_heads(self) -> int:
        """`num_key_value_heads`, resolved."""
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        """`head_dim`, resolved."""
        return self.head_dim or self.hidden_size // self.num_attention_heads


RUNTIME_OPTIONS = frozenset(
    {"remat", "scan_layers", "attention_impl", "remat_save", "remat_offload"}
    | {"mlp_chunks", "attention_chunk", "sequence_parallel", "sequence_layout"}
)
"""Config fields that `Llama.with_options` may change on an existing model."""


class LlamaAttention(eqx.Module):
    """Grouped-query self-attention with rotary embeddings (`self_attn` in HF)."""

    q_proj: AnyLinear
    k_proj: AnyLinear
    v_proj: AnyLinear
    o_proj: AnyLinear
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, key: PRNGKeyArray):
        kq, kk, kv, ko = jr.split(key, 4)
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.kv_heads
        self.head_dim = config.head_size
        d = config.hidden_size
        q_out = self.num_heads * self.head_dim
        kv_out = self.num_kv_heads * self.head_dim
        o_bias = config.attention_bias
        if config.o_proj_bias is not None:
            o_bias = config.o_proj_bias
        opts = dict(std=config.initializer_range, dtype=as_dtype(config.param_dtype))
        bias = config.attention_bias
        self.q_proj = Linear(d, q_out, use_bias=bias, key=kq, **opts)
        self.k_proj = Linear(d, kv_out, use_bias=bias, key=kk, **opts)
        self.v_proj = Linear(d, kv_out, use_bias=bias, key=kv, **opts)
        self.o_proj = Linear(q_out, d, use_bias=o_bias, key=ko, **opts)

    @jax.named_scope("attention")
    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        cos: Float[Array, "seq head_dim"],
        sin: Float[Array, "seq head_dim"],
        *,
        segment_ids: Int[Array, " seq"] | None,
        sliding_window: int | None,
        implementation: str | None,
        query_chunk: int = 0,
        positions: Int[Array, " seq"] | None = None,
        sequence_parallel: str | None = None,
        sequence_layout: str = "contiguous",
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq hidden"]:
        seq = x.shape[0]
        kq, kk, kv, ko = split_key(key, 4)
        q, k, v = fused_linears(
            (self.q_proj, self.k_proj, self.v_proj), x, (kq, kk, kv)
        )
        q = q.reshape(seq, self.num_heads, self.head_dim)
        k = k.reshape(seq, self.num_kv_heads, self.head_dim)
        v = v.reshape(seq, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k = name_activation(q, "query"), name_activation(k, "key")
        v = name_activation(v, "value")
        out = attend(
            q,
            k,
            v,
            segment_ids=segment_ids,
            positions=positions,
            sliding_window=sliding_window,
            implementation=implementation,
            query_chunk=query_chunk,
            sequence_parallel=sequence_parallel,
            sequence_layout=sequence_layout,
        )
        out = self.o_proj(out.reshape(seq, self.num_heads * self.head_dim), key=ko)
        return name_activation(out, "attn_out")


class LlamaMLP(eqx.Module):
    """SwiGLU: `down_proj(silu(gate_proj(x)) * up_proj(x))`."""

    gate_proj: AnyLinear
    up_proj: AnyLinear
    down_proj: AnyLinear

    def __init__(self, config: LlamaConfig, key: PRNGKeyArray):
        kg, ku, kd = jr.split(key, 3)
        d, f = config.hidden_size, config.intermediate_size
        opts = dict(
            use_bias=config.mlp_bias,
            std=config.initializer_range,
            dtype=as_dtype(config.param_dtype),
        )
        self.gate_proj = Linear(d, f, key=kg, **opts)
        self.up_proj = Linear(d, f, key=ku, **opts)
        self.down_proj = Linear(f, d, key=kd, **opts)

    @jax.named_scope("mlp")
    def __call__(
        self, x: Float[Array, "seq hidden"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq hidden"]:
        kg, ku, kd = split_key(key, 3)
        gate, up = fused_linears((self.gate_proj, self.up_proj), x, (kg, ku))
        return self.down_proj(jax.nn.silu(gate) * up, key=kd)


class LlamaDecoderLayer(eqx.Module):
    """Pre-norm block: `x + attn(norm(x))`, then `x + mlp(norm(x))`."""

    input_layernorm: RMSNorm
    self_attn: LlamaAttention
    post_attention_layernorm: RMSNorm
    mlp: LlamaMLP

    def __init__(self, config: LlamaConfig, key: PRNGKeyArray):
        ka, km = jr.split(key)
        dtype = as_dtype(config.param_dtype)
        norm = lambda: RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype)
        self.input_layernorm = norm()
        self.self_attn = LlamaAttention(config, ka)
        self.post_attention_layernorm = norm()
        self.mlp = LlamaMLP(config, km)

    def __call__(
        self,
        x: Float[Array, "seq hidden"],
        *,
        key: PRNGKeyArray | None = None,
        mlp_chunks: int = 1,
        **attn: Any,
    ) -> Array:
        """`mlp_chunks > 1`: the MLP runs tiled over the sequence (`tiled`)."""
        ka, km = split_key(key, 2)
        x = x + self.self_attn(self.input_layernorm(x), key=ka, **attn)
        h = name_activation(self.post_attention_layernorm(x), "mlp_in")
        h = tiled(lambda c, k: self.mlp(c, key=k), h, mlp_chunks, km)
        return x + name_activation(h, "mlp_out")


class Llama(eqx.Module):
    """A Llama-family decoder over one sequence: `tokens [seq] -> logits [seq, vocab]`.

    Parameter paths mirror Hugging Face's `LlamaForCausalLM` (without its `model.`
    prefix): `embed_tokens.weight`, `layers.self_attn.{q,k,v,o}_proj.weight`,
    `layers.mlp.{gate,up,down}_proj.weight`, `layers.input_layernorm.weight`,
    `layers.post_attention_layernorm.weight`, `norm.weight`, `lm_head.weight`
    (`None` when tied). Linear weights are `[out, in]` as in PyTorch. The layers
    are one stacked module: every array under `layers` has a leading axis of size
    `num_hidden_layers` (layer `i` is `layers.*[i]`).

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
    layers: LlamaDecoderLayer
    norm: RMSNorm
    lm_head: AnyLinear | None
    config: LlamaConfig = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, key: PRNGKeyArray):
        ke, kl, kh = jr.split(key, 3)
        dtype = as_dtype(config.param_dtype)
        d, std = config.hidden_size, config.initializer_range
        self.embed_tokens = Embedding(
            config.vocab_size, d, std=std, dtype=dtype, key=ke
        )
        self.layers = stack_layers(
            lambda k: LlamaDecoderLayer(config, k), config.num_hidden_layers, kl
        )
        self.norm = RMSNorm(d, eps=config.rms_norm_eps, dtype=dtype)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(
                d, config.vocab_size, use_bias=False, std=std, dtype=dtype, key=kh
            )
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
                return self.embed_tokens.attend(x)
            return self.lm_head(x)

    def features(
        self,
        tokens: Int[Array, " seq"],
        *,
        segment_ids: Int[Array, " seq"] | None = None,
        positions: Int[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq hidden"]:
        """The final-normed hidden states that `__call__` feeds its head (arguments
        as for `__call__`). With `head_weight()`, what
        `losses.chunked_causal_lm_loss_fn` needs to skip the full logits."""
        config = self.config
        positions = default_positions(tokens.shape[0], segment_ids, positions)
        cos, sin = rope_cos_sin(positions, config.head_size, config.rope_theta)
        attn = dict(
            segment_ids=segment_ids,
            sliding_window=config.sliding_window,
            implementation=config.attention_impl,
            query_chunk=config.attention_chunk,
            mlp_chunks=mlp_chunk_count(
                config.mlp_chunks, tokens.shape[0], config.hidden_size
            ),
            positions=positions,
            sequence_parallel=config.sequence_parallel,
            sequence_layout=config.sequence_layout,
        )
        x = self.embed_tokens(tokens)
        x = run_layers(
            self.layers,
            x,
            lambda layer, h, k: layer(h, key=k, cos=cos, sin=sin, **attn),
            scan=config.scan_layers,
            remat=config.remat,
            key=key,
            remat_save=config.remat_save,
            remat_offload=config.remat_offload,
        )
        return self.norm(x)

    def head_weight(
        self, *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "vocab hidden"]:
        """The output head as one matrix: `logits = features @ head_weight().T`.
        See `head_weight`."""
        return head_weight(self.embed_tokens, self.lm_head, key=key)

    def with_options(self, **changes: Any) -> "Llama":
        """The same parameters with other runtime options (`remat`, `remat_save`,
        `remat_offload`, `mlp_chunks`, `attention_chunk`, `scan_layers`,
        `attention_impl`, `sequence_parallel`, `sequence_layout`), e.g.
        `model.with_options(remat="full")`."""
        return with_config_options(self, RUNTIME_OPTIONS, **changes)


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


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward and backward) for sequences of `seq_len`.

    `6 * N + 12 * L * H * d_head * T`, the convention of PaLM (appendix B) and
    nanoGPT: `N` counts the weights of every matmul (the layers' projections and
    the output head, tied or not; not the embedding lookup, norms or biases), each
    costing 2 FLOPs per token forward and 4 backward. The attention term counts
    `q @ k.T` and `probs @ v` (2 * 2 * H * d_head * T forward, times 3) over
    `T = min(seq_len, sliding_window)` keys, without halving for causality, as
    MFU is usually reported.
    """
    d, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_size, config.kv_heads
    kv *= config.head_size
    per_layer = d * q + 2 * d * kv + q * d + 3 * d * f
    n = config.num_hidden_layers * per_layer + config.vocab_size * d
    span = seq_len
    if config.sliding_window is not None:
        span = min(seq_len, config.sliding_window)
    return float(6 * n + 12 * config.num_hidden_layers * q * span)


def tensor_parallel_rules() -> list[tuple[str, PartitionSpec]]:
    """Megatron-style tensor-parallel rules for `eqtrain.sharding` (Llama's paths).

    Weights are `[out, in]` with a leading stacked-layer axis (`"layers"`, never
    sharded). Column-parallel q/k/v/gate/up split their `out` dimension over
    `tensor` (whole heads when `tensor` divides the head counts); row-parallel
    o/down split their `in` dimension, so each layer needs one all-reduce after
    attention and one after the MLP. The embedding and the head split the vocab.
    Every other leaf under `layers` is only marked as stacked.

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
        (layer, PartitionSpec("layers")),  # norms, o/down biases: replicated
        (
            r"(^|\.)(embed_tokens|lm_head)\.weight$",
            PartitionSpec(("tensor", "fsdp"), None),
        ),
    ]
