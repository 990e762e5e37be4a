"""GPT-2: learned positions, LayerNorm, fused-qkv attention and a GELU MLP, with a
head tied to the token embedding (or its own `lm_head`); Hugging Face's math,
options and parameter names.

Builds on the layers in `eqtrain.models._layers`.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._errors import ConfigError
from ._cache import (
    CacheStep,
    KVCache,
    cached_attention,
    empty_cache,
    slot_positions,
    write,
)
from ._layers import (
    ACTIVATIONS,
    AnyLinear,
    Embedding,
    LayerNorm,
    Linear,
    as_dtype,
    head_weight,
    residual_scale,
    split_key,
    tiled,
)
from ._masks import default_positions
from ._options import (
    RUNTIME_OPTIONS,
    RuntimeFields,
    RuntimeOptions,
    check_runtime,
    with_config_options,
)
from ._sequence import attend
from ._stack import (
    Numbered,
    name_activation,
    run_configured,
    run_layers,
    stack_layers,
)


"""Every parameter-free `activation_function` of transformers' `ACT2FN`, as
`GPT2MLP` applies it (`prelu` and `xielu` learn parameters a GPT-2 checkpoint
has no tensors for)."""


@dataclasses.dataclass(frozen=True)
class GPT2Config(RuntimeFields):
    """Shape and options of a `GPT2`. Field names and defaults follow Hugging Face's
    `GPT2Config` (GPT-2 small); there is no dropout.

    Attributes:
        vocab_size: number of token ids.
        n_positions: number of learned positions (longest sequence).
        n_embd: width of the residual stream.
        n_layer: number of blocks.
        n_head: attention heads (`n_embd` must be a multiple).
        n_inner: MLP width (`None`: `4 * n_embd`).
        layer_norm_epsilon: epsilon of every LayerNorm.
        initializer_range: standard deviation of the normal initialisation
            (residual output projections get `/ sqrt(2 * n_layer)`, as GPT-2).
        activation_function: the MLP's activation, a name in `ACTIVATIONS`:
            `"gelu_new"` (tanh GELU, GPT-2's), `"gelu"` (exact erf GELU), ...
        scale_attn_weights: divide attention scores by `sqrt(head_dim)`.
        scale_attn_by_inverse_layer_idx: also divide the scores of block `i`
            (from 0) by `i + 1`.
        reorder_and_upcast_attn: Hugging Face computes `q @ k.T` and the softmax
            in float32 with this; eqtrain's attention always does, so it only
            round-trips (the same logits in float32).
        tie_word_embeddings: the head is `wte` (`lm_head` is `None`); `False`
            gives the model its own `lm_head` (`[vocab, n_embd]`).
        param_dtype, remat, remat_save, remat_offload, mlp_chunks,
            attention_chunk, scan_layers, attention_impl, sequence_parallel,
            sequence_layout: as in `LlamaConfig` (`mlp_chunks="auto"`:
            `ceil(seq / n_embd)`).
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    layer_norm_epsilon: float | int = 1e-5
    initializer_range: float | int = 0.02
    activation_function: str = "gelu_new"
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    reorder_and_upcast_attn: bool = False
    tie_word_embeddings: bool = True
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        check_runtime(self)
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"`n_embd` {self.n_embd} must be a multiple of `n_head` {self.n_head}."
            )
        if self.activation_function not in ACTIVATIONS:
            raise ConfigError(
                f"`activation_function` must be one of {sorted(ACTIVATIONS)}; got "
                f"{self.activation_function!r}."
            )

    @property
    def inner_size(self) -> int:
        """`n_inner`, resolved."""
        return self.n_inner or 4 * self.n_embd


def _linear(
    config: GPT2Config,
    d_in: int,
    d_out: int,
    key: PRNGKeyArray,
    *,
    residual: bool = False,
) -> Linear:
    """A block's projection (with a bias); a `residual` output projection
    starts smaller (`residual_scale`), as GPT-2's."""
    std = config.initializer_range
    if residual:
        std = std * residual_scale(config.n_layer)
    dtype = as_dtype(config.param_dtype)
    return Linear(d_in, d_out, use_bias=True, std=std, dtype=dtype, key=key)


class GPT2Attention(eqx.Module):
    """Causal self-attention with fused q/k/v (`attn` in HF)."""

    c_attn: AnyLinear
    c_proj: AnyLinear
    n_head: int = eqx.field(static=True)

    def __init__(self, config: GPT2Config, key: PRNGKeyArray):
        ka, kp = jr.split(key)
        d = config.n_embd
        self.c_attn = _linear(config, d, 3 * d, ka)
        self.c_proj = _linear(config, d, d, kp, residual=True)
        self.n_head = config.n_head

    def __call__(
        self,
        x: Float[Array, "seq embd"],
        *,
        options: RuntimeOptions,
        segment_ids: Int[Array, " seq"] | None,
        positions: Int[Array, " seq"] | None,
        query_scale: Array | float | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq embd"]:
        """`query_scale` multiplies q, and so the scores, on top of attention's
        `1 / sqrt(head_dim)` (see `query_scale`)."""
        ka, kp = split_key(key, 2)
        q, k, v = self.project(x, query_scale, ka)
        q = name_activation(q, "query")
        k, v = name_activation(k, "key"), name_activation(v, "value")
        out = attend(q, k, v, options, segment_ids=segment_ids, positions=positions)
        return self.output(out, kp)

    def project(
        self,
        x: Float[Array, "seq embd"],
        query_scale: Array | float | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Array, Array, Array]:
        """`(q, k, v)`, each `[seq, heads, head_dim]` (q scaled)."""
        seq, d = x.shape
        qkv = self.c_attn(x, key=key).reshape(seq, 3, self.n_head, d // self.n_head)
        q = qkv[:, 0]
        if query_scale is not None:
            q = q * jnp.asarray(query_scale).astype(q.dtype)
        return q, qkv[:, 1], qkv[:, 2]

    def output(
        self, out: Float[Array, "seq heads head_dim"], key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq embd"]:
        out = self.c_proj(out.reshape(out.shape[0], -1), key=key)
        return name_activation(out, "attn_out")


class GPT2MLP(eqx.Module):
    """`c_proj(act(c_fc(x)))`, `act` one of `ACTIVATIONS` (GPT-2's: tanh GELU)."""

    c_fc: AnyLinear
    c_proj: AnyLinear
    activation: str = eqx.field(static=True)

    def __init__(self, config: GPT2Config, key: PRNGKeyArray):
        kf, kp = jr.split(key)
        d, f = config.n_embd, config.inner_size
        self.c_fc = _linear(config, d, f, kf)
        self.c_proj = _linear(config, f, d, kp, residual=True)
        self.activation = config.activation_function

    def __call__(
        self, x: Float[Array, "seq embd"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq embd"]:
        kf, kp = split_key(key, 2)
        h = ACTIVATIONS[self.activation](self.c_fc(x, key=kf))
        return self.c_proj(h, key=kp)


class GPT2Block(eqx.Module):
    """Pre-norm block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`."""

    ln_1: LayerNorm
    attn: GPT2Attention
    ln_2: LayerNorm
    mlp: GPT2MLP

    def __init__(self, config: GPT2Config, key: PRNGKeyArray):
        ka, km = jr.split(key)
        dtype = as_dtype(config.param_dtype)
        norm = lambda: LayerNorm(
            config.n_embd, eps=config.layer_norm_epsilon, dtype=dtype
        )
        self.ln_1 = norm()
        self.attn = GPT2Attention(config, ka)
        self.ln_2 = norm()
        self.mlp = GPT2MLP(config, km)

    def __call__(
        self,
        x: Float[Array, "seq embd"],
        *,
        options: RuntimeOptions,
        key: PRNGKeyArray | None = None,
        **attn: Any,
    ) -> Array:
        """`options.mlp_chunks > 1`: the MLP runs tiled over the sequence
        (`tiled`); `attn`: `segment_ids`, `positions`, `query_scale`."""
        ka, km = split_key(key, 2)
        x = x + self.attn(self.ln_1(x), options=options, key=ka, **attn)
        h = name_activation(self.ln_2(x), "mlp_in")
        h = tiled(lambda c, k: self.mlp(c, key=k), h, options.mlp_chunks, km)
        return x + name_activation(h, "mlp_out")

    def cached(
        self,
        x: Float[Array, "rows t embd"],
        cache: tuple[Array, Array],
        *,
        layer: Int[Array, ""],
        step: CacheStep,
        query_scale: Array | float | None,
    ) -> tuple[Array, tuple[Array, Array]]:
        """The block on `t` new tokens per row, writing their keys and values
        into `cache` (as `DecoderLayer.cached`)."""
        attn = self.attn
        h = jax.vmap(self.ln_1)(x)
        q, k, v = jax.vmap(lambda a: attn.project(a, query_scale))(h)
        new = write(cache, layer, step.slot, k, v)
        out = cached_attention(q, k, v, new, layer=layer, step=step)
        x = x + jax.vmap(attn.output)(out)
        h = self.mlp(self.ln_2(x).reshape(-1, x.shape[-1])).reshape(x.shape)
        return x + h, new


class GPT2(eqx.Module):
    """GPT-2 over one sequence: `tokens: [seq] -> logits: [seq, vocab]`.

    Parameter paths mirror Hugging Face's `GPT2LMHeadModel` (without its
    `transformer.` prefix): `wte.weight`, `wpe.weight`, `h.ln_1.{weight,bias}`,
    `h.attn.c_attn.{weight,bias}`, `h.attn.c_proj`, `h.ln_2`, `h.mlp.c_fc`,
    `h.mlp.c_proj`, `ln_f` and `lm_head.weight` (HF's name too; `None` when the
    head is tied to `wte`). Every array under `h` has a leading axis of size
    `n_layer`. Linear weights are `[out, in]` (PyTorch's `nn.Linear`), so an
    export transposes those under `h` into HF's `Conv1D` `[in, out]`.
    """

    wte: Embedding
    wpe: Embedding
    h: GPT2Block
    ln_f: LayerNorm
    lm_head: AnyLinear | None
    config: GPT2Config = eqx.field(static=True)

    def __init__(self, config: GPT2Config, key: PRNGKeyArray):
        kt, kp, kh = jr.split(key, 3)
        dtype = as_dtype(config.param_dtype)
        d, std = config.n_embd, config.initializer_range
        self.wte = Embedding(config.vocab_size, d, std=std, dtype=dtype, key=kt)
        self.wpe = Embedding(config.n_positions, d, std=std, dtype=dtype, key=kp)
        self.h = stack_layers(lambda k: GPT2Block(config, k), config.n_layer, kh)
        self.ln_f = LayerNorm(d, eps=config.layer_norm_epsilon, dtype=dtype)
        self.lm_head = None
        if not config.tie_word_embeddings:
            # Its own key, so that the other arrays are those of the tied model.
            kl = jr.fold_in(key, 3)
            self.lm_head = Linear(
                d, config.vocab_size, use_bias=False, std=std, dtype=dtype, key=kl
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

        Arguments as for `Llama.__call__`: with `segment_ids`, attention stays
        within each segment and learned positions restart at 0 per segment;
        `key` feeds LoRA adapter dropout (`eqtrain.lora`), if any.
        """
        x = self.features(tokens, segment_ids=segment_ids, positions=positions, key=key)
        if self.lm_head is None:
            return self.wte.attend(x)
        return self.lm_head(x)

    def features(
        self,
        tokens: Int[Array, " seq"],
        *,
        segment_ids: Int[Array, " seq"] | None = None,
        positions: Int[Array, " seq"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "seq hidden"]:
        """The final-normed hidden states (`ln_f`'s output) that `__call__` feeds
        its head; arguments as for `__call__`."""
        config = self.config
        if segment_ids is None and positions is None:
            _check_length(tokens.shape[0], config)
        positions = default_positions(tokens.shape[0], segment_ids, positions)
        x = self.wte(tokens) + self.wpe(positions)
        options = RuntimeOptions.of(config, tokens.shape[0], config.n_embd)
        attn = dict(options=options, segment_ids=segment_ids, positions=positions)
        layers, call = self._layer_calls(attn)
        return self.ln_f(run_configured(layers, x, call, config, key=key))

    def _layer_calls(self, attn: dict[str, Any]) -> tuple[Any, Callable[..., Any]]:
        """The stack `run_layers` goes over and the call of one block (`attn`:
        its attention's keywords), with each block's query scale."""
        config = self.config
        if config.scale_attn_by_inverse_layer_idx:
            # The layer index travels with the layers, so `lax.scan` slices it too.
            call = lambda layer, h, k: layer.block(
                h, key=k, query_scale=query_scale(config, layer.index), **attn
            )
            return Numbered(self.h, jnp.arange(config.n_layer)), call
        scale = query_scale(config, None)
        return self.h, lambda block, h, k: block(h, key=k, query_scale=scale, **attn)

    def init_cache(self, rows: int, length: int, pads: Int[Array, " rows"]) -> KVCache:
        """An empty `KVCache` (see `Decoder.init_cache`)."""
        c = self.config
        if length > c.n_positions:
            raise ConfigError(
                f"generating up to {length} tokens (prompt and new ones) is more "
                f"than GPT-2's {c.n_positions} learned positions (`n_positions`); "
                "shorten the prompt or `max_new_tokens`."
            )
        return empty_cache(
            layers=c.n_layer, rows=rows, length=length, kv_heads=c.n_head,
            head_dim=c.n_embd // c.n_head, dtype=self.wte.weight.dtype, pads=pads,
        )  # fmt: skip

    def cached_features(
        self,
        tokens: Int[Array, "rows t"],
        cache: KVCache,
        slot: Int[Array, ""] | int,
        *,
        prefill: bool = False,
    ) -> tuple[Float[Array, "rows t hidden"], KVCache]:
        """`features` of `t` new tokens per row through `cache` (see
        `Decoder.cached_features`)."""
        config = self.config
        positions, segments = slot_positions(cache.pads, slot, tokens.shape[1])
        x = jax.vmap(self.wte)(tokens) + jax.vmap(self.wpe)(positions)
        options = RuntimeOptions.of(config, tokens.shape[1], config.n_embd)
        step = CacheStep(slot, cache.pads, segments, options.on_one_device(), prefill)
        index = config.scale_attn_by_inverse_layer_idx

        def call(layer: Numbered, carry: Any, k: Any) -> Any:
            h, kv = carry
            scale = query_scale(config, layer.index if index else None)
            return layer.block.cached(
                h, kv, layer=layer.index, step=step, query_scale=scale
            )

        layers = Numbered(self.h, jnp.arange(config.n_layer))
        x, (k, v) = run_layers(
            layers, (x, (cache.k, cache.v)), call, scan=config.scan_layers, remat="none"
        )
        return self.ln_f(x), KVCache(k=k, v=v, pads=cache.pads)

    def head(self, x: Float[Array, "*batch hidden"]) -> Float[Array, "*batch vocab"]:
        """Logits of final-normed hidden states."""
        if self.lm_head is None:
            return jnp.einsum("...d,vd->...v", x, self.wte.weight)
        return self.lm_head(x)

    def head_weight(
        self, *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "vocab hidden"]:
        """The output head as one matrix (`wte` when tied); see
        `eqtrain.models.llama.head_weight`."""
        return head_weight(self.wte, self.lm_head, key=key)

    def with_options(self, **changes: Any) -> "GPT2":
        """The same parameters with other runtime options (`remat`, `remat_save`,
        `remat_offload`, `mlp_chunks`, `attention_chunk`, `scan_layers`,
        `attention_impl`, `sequence_parallel`, `sequence_layout`)."""
        return with_config_options(self, RUNTIME_OPTIONS, **changes)


def _check_length(seq: int, config: GPT2Config) -> None:
    """A sequence no longer than the learned positions."""
    if seq > config.n_positions:
        raise ConfigError(
            f"a sequence of {seq} tokens is longer than GPT-2's "
            f"{config.n_positions} learned positions (`n_positions`). Truncate "
            "it, or build the model with a larger `n_positions`."
        )


def query_scale(config: GPT2Config, layer: Array | None) -> Array | float | None:
    """What `GPT2Attention` multiplies q by so that the scores get Hugging Face's
    scaling: `dot_product_attention` divides them by `sqrt(head_dim)`, which
    `scale_attn_weights=False` undoes, and `scale_attn_by_inverse_layer_idx`
    divides them by `layer + 1` (`layer`: the block's index, traced under scan).
    `None`: nothing to change (GPT-2's default)."""
    scale = 1.0
    if not config.scale_attn_weights:
        scale = math.sqrt(config.n_embd // config.n_head)
    if layer is not None:
        return scale / (layer + 1)
    return None if scale == 1.0 else scale


def flops_per_token(config: GPT2Config, seq_len: int) -> float:
    """Training FLOPs per token: `6 * N + 12 * L * d * T`, as for
    `eqtrain.models.llama.flops_per_token` (`N`: the blocks' matmul weights plus the
    head `vocab * d`, tied or not; `T = seq_len`)."""
    d, f = config.n_embd, config.inner_size
    per_layer = 4 * d * d + 2 * d * f
    n = config.n_layer * per_layer + config.vocab_size * d
    return float(6 * n + 12 * config.n_layer * d * seq_len)


def tensor_parallel_rules() -> list[tuple[str, PartitionSpec]]:
    """Tensor-parallel rules for `eqtrain.sharding` (GPT-2's paths).

    Weights are `[out, in]` with a leading stacked-layer axis (`"layers"`, never
    sharded). `c_fc` is column-parallel (its `out` dimension over `tensor`), both
    `c_proj` are row-parallel (their `in` dimension), and `wte` (also the tied
    head) and an untied `lm_head` split the vocab, which `tensor` must divide
    (pad 50257 to 50304). `fsdp` marks where FSDP goes when it applies: the other
    dimension of each matrix, the vocab for `wte` and `lm_head` (as for Llama's
    embedding and head).

    `c_attn` packs q, k and v along `out` (`[q | k | v]`), so splitting that
    dimension contiguously does not give each device whole heads of each of q, k
    and v: XLA regathers the q/k/v activations once per layer (exact, at the cost
    of an all-gather). It is split anyway: replicating it over `tensor` instead
    repeats its FLOPs on every `tensor` device and keeps its weights and optimizer state
    whole on every `tensor` device (see docs/sharding.md). To replicate it, pass
    `extra=[(r"attn\\.c_attn\\.", PartitionSpec("layers"))]` to `rules_for`.
    """
    layer = r"(^|\.)h\."
    col, row = (
        PartitionSpec("layers", "tensor", "fsdp"),
        PartitionSpec("layers", "fsdp", "tensor"),
    )
    return [
        (layer + r"(attn\.c_attn|mlp\.c_fc)\.weight$", col),
        (layer + r"(attn\.c_attn|mlp\.c_fc)\.bias$", PartitionSpec("layers", "tensor")),
        (layer + r"(attn|mlp)\.c_proj\.weight$", row),
        (layer, PartitionSpec("layers")),  # norms, c_proj biases: replicated
        (
            r"(^|\.)(wte|lm_head)\.weight$",
            PartitionSpec(("tensor", "fsdp"), None),
        ),
    ]
