"""The decoder's config (`DecoderConfig`): its sizes, the switches that tell
the Llama-like families apart, and the runtime options; with the FLOPs per token
a config costs. The modules built from it: `_decoder_blocks` (one block) and
`decoder` (the model).
"""

import dataclasses

from .._errors import ConfigError
from ._layers import ACTIVATIONS
from ._moe import MoEOptions, check_moe_options
from ._options import RuntimeFields, check_runtime
from ._rope import Rope


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
        self._check_heads()
        self._check_window()
        self._check_choices()
        self._check_per_layer()
        self._check_experts()
        self._check_layer_types()

    def _check_heads(self) -> None:
        """Query heads in whole groups of key/value heads, each head an even
        number of rotary dimensions, and a `hidden_size` the heads split."""
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

    def _check_window(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(
                f"`sliding_window` must be >= 1 or None; got {self.sliding_window}."
            )

    def _check_choices(self) -> None:
        """Each switch one of its options."""
        for field, value, options in (
            ("norm", self.norm, NORMS),
            ("block", self.block, BLOCKS),
            ("qk_norm", self.qk_norm, QK_NORMS),
            ("mlp", self.mlp, MLPS),
            ("hidden_act", self.hidden_act, tuple(ACTIVATIONS)),
        ):
            if value not in options:
                raise ConfigError(f"`{field}` must be one of {options}; got {value!r}.")

    def _check_per_layer(self) -> None:
        """One entry per layer in the per-layer fields."""
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

    def _check_layer_types(self) -> None:
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
        if self.num_experts:
            self._check_sparse_layers()

    def _check_sparse_layers(self) -> None:
        """A top-k within the experts, gated experts, no sequence parallelism."""
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
        layers = range(self.num_hidden_layers)
        return tuple((self.window(i), self._rope_table(i)) for i in layers)

    def _rope_table(self, layer: int) -> str:
        """The rotary table of layer `layer` (see `layer_kinds`)."""
        if self.no_rope_layers is not None and not self.no_rope_layers[layer]:
            return "none"
        sliding = (
            self.layer_types is not None and self.layer_types[layer] == LAYER_TYPES[1]
        )
        if self.local_rope is not None and sliding:
            return "local"
        return "global"


LlamaConfig = DecoderConfig
MOE_OPTIONS = frozenset(
    {"moe_impl", "capacity_factor", "router_z_loss_coef", "router_aux_loss_coef"}
)
"""`DecoderConfig` fields that `Decoder.with_options` may change besides
`RUNTIME_OPTIONS`."""


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
