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

This module holds the model (`Decoder`) and its tensor-parallel rules; the
config is `_decoder_config`'s, one block `_decoder_blocks`'.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._cache import CacheStep, KVCache, empty_cache, slot_positions
from ._decoder_blocks import (
    Attention as Attention,
    DecoderLayer as DecoderLayer,
    config_norm,
)
from ._decoder_config import (
    BLOCKS as BLOCKS,
    LAYER_TYPES as LAYER_TYPES,
    MLPS as MLPS,
    MOE_OPTIONS as MOE_OPTIONS,
    NORMS as NORMS,
    QK_NORMS as QK_NORMS,
    DecoderConfig as DecoderConfig,
    LlamaConfig as LlamaConfig,
    flops_per_token as flops_per_token,
)
from ._decoder_mlps import (
    AnyNorm,
    FusedGatedMLP as FusedGatedMLP,
    GatedMLP as GatedMLP,
    PlainMLP as PlainMLP,
    config_linear,
)
from ._layers import AnyLinear, Embedding, as_dtype, head_weight
from ._masks import default_positions
from ._moe import AUX_KEYS, MOE_IMPLS as MOE_IMPLS, empty_aux, router_terms
from ._options import (
    RUNTIME_OPTIONS as RUNTIME_OPTIONS,
    RuntimeOptions,
    with_config_options,
)
from ._rope import rope_cos_sin
from ._stack import Numbered, run_configured, run_layers, stack_layers


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
        self.norm = config_norm(config, d)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = config_linear(config, d, config.vocab_size, False, kh)
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
            return self._one_row_batch(tokens, segment_ids, positions, key)
        positions = default_positions(tokens.shape[0], segment_ids, positions)
        options = RuntimeOptions.of(config, tokens.shape[0], config.hidden_size)
        call = _by_kind(
            DecoderLayer.__call__, rope_tables(config, positions),
            options=options, segment_ids=segment_ids, positions=positions,
        )  # fmt: skip
        x = self._embed(self.embed_tokens(tokens))
        return self.norm(self._run_layers(x, call, key))

    def _one_row_batch(
        self,
        tokens: Array,
        segment_ids: Array | None,
        positions: Array | None,
        key: Any,
    ) -> Array:
        """`features` of one row through `batch_features` (a model with experts)."""
        add_row = lambda a: None if a is None else a[None]
        hidden, _ = self.batch_features(
            tokens[None], segment_ids=add_row(segment_ids),
            positions=add_row(positions), key=key,
        )  # fmt: skip
        return hidden[0]

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
        layer_call = _by_kind(
            DecoderLayer.batched, tables,
            options=options, segment_ids=segment_ids, positions=positions,
        )  # fmt: skip
        x = self._embed(jax.vmap(self.embed_tokens)(tokens))
        start = empty_aux(config.num_experts) if config.num_experts else {}
        x, aux = self._run_layers((x, start), _summing_aux(layer_call), key)
        return self.norm(x), aux

    def init_cache(self, rows: int, length: int, pads: Int[Array, " rows"]) -> KVCache:
        """An empty `KVCache` of `length` slots for `rows` rows left-padded by
        `pads` tokens, in the parameters' dtype."""
        c = self.config
        return empty_cache(
            layers=c.num_hidden_layers, rows=rows, length=length, kv_heads=c.kv_heads,
            head_dim=c.head_size, dtype=self.embed_tokens.weight.dtype, pads=pads,
        )  # fmt: skip

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
        positions, segments = _cached_positions(cache.pads, slot, tokens.shape[1], last)
        tables = jax.vmap(lambda p: rope_tables(config, p))(positions)
        options = RuntimeOptions.of(config, tokens.shape[1], config.hidden_size)
        step = CacheStep(slot, cache.pads, segments, options.on_one_device(), prefill)

        def call(layer: Numbered, carry: Any, k: Any, kind: Any) -> Any:
            h, kv = carry
            window, table = kind
            return layer.block.cached(
                h, tables[table], kv, layer=layer.index, window=window, step=step
            )

        x = self._embed(jax.vmap(self.embed_tokens)(tokens))
        layers = Numbered(self.layers, jnp.arange(config.num_hidden_layers))
        x, (k, v) = run_layers(
            layers, (x, (cache.k, cache.v)), call,
            scan=config.scan_layers, remat="none", kinds=config.layer_kinds(),
        )  # fmt: skip
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
        kinds = self.config.layer_kinds()
        return run_configured(self.layers, x, call, self.config, key=key, kinds=kinds)

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


def _by_kind(
    method: Callable[..., Any], tables: dict[str, Any], **context: Any
) -> Callable[..., Any]:
    """`call(layer, h, key, kind)` for `run_layers`: `method(layer, h, rope,
    ...)` with the rotary table and the window of the layer's kind
    (`DecoderConfig.layer_kinds`), and `context`'s keywords."""

    def call(layer: DecoderLayer, h: Any, k: Any, kind: Any) -> Any:
        window, table = kind
        return method(layer, h, tables[table], window=window, key=k, **context)

    return call


def _summing_aux(layer_call: Callable[..., Any]) -> Callable[..., Any]:
    """`layer_call` over `(h, router statistics)`: each sparse layer's
    statistics added to the running sums."""

    def call(layer: DecoderLayer, carry: Any, k: Any, kind: Any) -> Any:
        h, acc = carry
        h, aux = layer_call(layer, h, k, kind)
        if aux is not None:
            acc = {name: acc[name] + aux[name] for name in AUX_KEYS}
        return h, acc

    return call


def _cached_positions(
    pads: Array, slot: Int[Array, ""] | int, count: int, last: Array | None
) -> tuple[Array, Array]:
    """`slot_positions` of `count` new tokens, the positions capped at `last`'s
    (see `Decoder.cached_features`)."""
    positions, segments = slot_positions(pads, slot, count)
    if last is not None:
        positions = jnp.minimum(positions, (last - pads)[:, None])
    return positions, segments


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
    the batch's `fsdp`: XLA then reshuffles activations, far more communication).
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
