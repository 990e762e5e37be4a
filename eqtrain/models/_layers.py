"""Building blocks shared by eqtrain's models: batched linear layers in Hugging
Face's weight layouts, norms, rotary embeddings, masked attention, and a stack of
identical layers run with `lax.scan` (optionally rematerialised).

Every layer works on a whole sequence at once (`x: [seq, dim]`, `x @ W`), not on
one token under `vmap`: XLA then sees one matmul per weight.
"""

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._errors import ConfigError


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
        h = x
        if self.dropout > 0 and key is not None:
            keep = jr.bernoulli(key, 1.0 - self.dropout, x.shape)
            h = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        update = _matmul_t(_matmul_t(h, self.lora_a), self.lora_b)
        y = _matmul_t(x, self.weight)
        y = y + (update * self.scale).astype(y.dtype)
        if self.bias is not None:
            y = y + _broadcast_last(self.bias, y.ndim)
        return y


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

    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, "seq dim"]:
        return jnp.take(self.weight, ids, axis=0)

    def attend(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq vocab"]:
        """Logits against the table (a tied output head): `x @ weight.T`."""
        return lax.dot_general(x, self.weight, (((1,), (1,)), ((), ())))


class RMSNorm(eqx.Module):
    """Root-mean-square norm, computed in f32 like Hugging Face's `LlamaRMSNorm`:
    `weight * (x * rsqrt(mean(x**2) + eps)).astype(x.dtype)`."""

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float | int, dtype: Any):
        self.weight = jnp.ones((dim,), dtype)
        self.eps = float(eps)

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        h = x.astype(jnp.float32)
        h = h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        return _broadcast_last(self.weight, x.ndim) * h.astype(x.dtype)


class LayerNorm(eqx.Module):
    """Layer norm with weight and bias (statistics in f32), as `torch.nn.LayerNorm`."""

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
        h = ((h - mean) * lax.rsqrt(var + self.eps)).astype(x.dtype)
        w, b = (_broadcast_last(p, x.ndim) for p in (self.weight, self.bias))
        return h * w + b


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
) -> Float[Array, "seq heads head_dim"]:
    """Causal attention with `jax.nn.dot_product_attention`.

    Query head `h` reads key/value head `h // (heads // kv_heads)` (grouped-query
    attention, heads grouped contiguously as Hugging Face's `repeat_kv`). A position
    attends to earlier-or-same positions with the same segment id, and, with a
    sliding window `w`, only to the last `w` of them (itself included), as Mistral.
    """
    mask = None
    if segment_ids is not None:
        mask = segment_mask(segment_ids)[None]
    window = None if sliding_window is None else (sliding_window - 1, 0)
    return jax.nn.dot_product_attention(
        q,
        k,
        v,
        mask=mask,
        is_causal=True,
        local_window_size=window,
        implementation=implementation,  # pyright: ignore[reportArgumentType]
    )


def segment_mask(segment_ids: Int[Array, " seq"]) -> Bool[Array, "seq seq"]:
    """`mask[i, j]`: query `i` and key `j` belong to the same segment."""
    return segment_ids[:, None] == segment_ids[None, :]


# -- a stack of layers ---------------------------------------------------------------
REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    "none": None,
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
}
"""Per-layer rematerialisation: `"none"` keeps every activation; `"full"` keeps
only each layer's input and recomputes the rest in the backward pass; `"dots"`
keeps matmul outputs; `"dots_no_batch"` keeps matmul outputs without batch
dimensions (the weights' matmuls, not attention's)."""


def check_remat(name: str) -> None:
    if name not in REMAT_POLICIES:
        raise ConfigError(
            f"`remat` must be one of {list(REMAT_POLICIES)}; got {name!r}."
        )


def check_options(*, attention_impl: str | None, remat: str, param_dtype: Any) -> None:
    """Validate the runtime options the model configs share."""
    if attention_impl not in (None, "xla", "cudnn"):
        raise ConfigError(
            f"`attention_impl` must be None, 'xla' or 'cudnn'; got {attention_impl!r}."
        )
    check_remat(remat)
    as_dtype(param_dtype)


LayerT = TypeVar("LayerT", bound=eqx.Module)


def stack_layers(
    make: Callable[[PRNGKeyArray], LayerT], num: int, key: PRNGKeyArray
) -> LayerT:
    """`num` independently initialised layers as one module whose arrays have a
    leading axis of size `num` (built with `eqx.filter_vmap` over the keys)."""
    return eqx.filter_vmap(make)(jr.split(key, num))


def run_layers(
    layers: LayerT,
    x: Array,
    call: Callable[..., Array],
    *,
    scan: bool,
    remat: str,
    key: PRNGKeyArray | None = None,
) -> Array:
    """`x = call(layer_i, x, key_i)` for each layer of a stack, in order.

    With `scan=True` the layer body is traced and compiled once (`lax.scan`), so
    compile time does not grow with depth; `scan=False` unrolls a Python loop (the
    reference). `remat` names a policy in `REMAT_POLICIES`; it applies
    `jax.checkpoint` to each layer. `key` is split into one key per layer when
    the layers use one (`uses_key`); otherwise every `key_i` is None.
    """
    check_remat(remat)
    dynamic, static = eqx.partition(layers, eqx.is_array)
    num = jtu.tree_leaves(dynamic)[0].shape[0]
    keys = jr.split(key, num) if key is not None and uses_key(layers) else None

    def body(h: Array, xs: Any) -> Array:
        params, k = xs
        return call(eqx.combine(params, static), h, k)

    if remat != "none":
        # prevent_cse stops XLA from merging the recomputation with the forward pass
        # (undoing the remat); inside `scan` that cannot happen and it only costs.
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=not scan)
    if scan:
        x, _ = lax.scan(lambda h, p: (body(h, p), None), x, (dynamic, keys))
        return x
    for i in range(num):
        xs = jtu.tree_map(lambda a, i=i: a[i], (dynamic, keys))
        x = body(x, xs)
    return x


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
