"""The key/value cache of autoregressive generation, and attention against it.

A `KVCache` holds every layer's keys and values for a batch of rows in
preallocated arrays `[layers, rows, kv_heads, length, head_dim]`: the shapes
never change while tokens are added, so a decode loop compiles once. Each head's
slots are contiguous, so attention reads them in place (with the slots before
the heads, every decode step transposed each layer's cache). Rows are
left-padded: row `r`'s first `pads[r]` slots hold padding, and every row writes
its next token into the same slot, whose rotary (or learned) position is
`slot - pads[r]`.

The models fill it in two ways (`Decoder.cached_features`, `GPT2.cached_features`):
- prefill: the prompt's keys and values are written at slots `[0, prompt)`, and
  the prompt attends to itself with the models' own attention (blocked on long
  prompts), the padding in a segment of its own;
- decode: `t` new tokens (usually one) are written at `[slot, slot + t)` and
  attend to every filled slot of their row (`cache_attention`).
"""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from ._attention import _MASKED
from ._masks import position_mask
from ._sequence import attend


class KVCache(eqx.Module):
    """Keys and values of every layer (`[layers, rows, kv_heads, length,
    head_dim]`, in the model's dtype) and each row's left padding (`pads`)."""

    k: Float[Array, "layers rows kv_heads length head_dim"]
    v: Float[Array, "layers rows kv_heads length head_dim"]
    pads: Int[Array, " rows"]

    @property
    def length(self) -> int:
        return self.k.shape[3]


def empty_cache(
    *,
    layers: int,
    rows: int,
    length: int,
    kv_heads: int,
    head_dim: int,
    dtype: Any,
    pads: Int[Array, " rows"],
) -> KVCache:
    """A zeroed cache of `length` slots per row."""
    shape = (layers, rows, kv_heads, length, head_dim)
    zeros = jnp.zeros(shape, dtype)
    return KVCache(k=zeros, v=zeros, pads=jnp.asarray(pads, jnp.int32))


def slot_positions(
    pads: Int[Array, " rows"], slot: Int[Array, ""] | int, count: int
) -> tuple[Int[Array, "rows count"], Int[Array, "rows count"]]:
    """`(positions, segment_ids)` of `count` tokens written from `slot` on:
    position `slot + i - pads[r]` (0 for padding) and segment 1 for real
    tokens, 0 for padding."""
    slots = slot + jnp.arange(count, dtype=jnp.int32)
    rel = slots[None, :] - pads[:, None]
    return jnp.maximum(rel, 0), (rel >= 0).astype(jnp.int32)


def write(
    cache: tuple[Array, Array],
    layer: Int[Array, ""] | int,
    slot: Int[Array, ""] | int,
    k: Float[Array, "rows t kv_heads head_dim"],
    v: Float[Array, "rows t kv_heads head_dim"],
) -> tuple[Array, Array]:
    """`cache` (the full `(k, v)` arrays) with `k`, `v` written into `layer` at
    slots `[slot, slot + t)` (in place inside a loop)."""
    ck, cv = cache
    at = (layer, 0, 0, slot, 0)
    put = lambda c, x: lax.dynamic_update_slice(
        c, jnp.swapaxes(x, 1, 2)[None].astype(c.dtype), at
    )
    return put(ck, k), put(cv, v)


def layer_of(cache: tuple[Array, Array], layer: Int[Array, ""] | int) -> Any:
    """One layer's `(k, v)`, each `[rows, kv_heads, length, head_dim]`."""
    return tuple(lax.dynamic_index_in_dim(a, layer, 0, keepdims=False) for a in cache)


def cache_mask(
    pad: Int[Array, ""],
    slot: Int[Array, ""] | int,
    count: int,
    length: int,
    window: int | None,
) -> Bool[Array, "count length"]:
    """Which slots each of `count` queries (at `slot + i`) sees: its row's real
    tokens up to itself, within the last `window` of them."""
    q_slots = slot + jnp.arange(count, dtype=jnp.int32)
    k_slots = jnp.arange(length, dtype=jnp.int32)
    k_seg = (k_slots >= pad).astype(jnp.int32)
    return position_mask(q_slots, jnp.ones((count,), jnp.int32), k_slots, k_seg, window)


def cache_attention(
    q: Float[Array, "rows t heads head_dim"],
    keys: Float[Array, "rows kv_heads length head_dim"],
    values: Float[Array, "rows kv_heads length head_dim"],
    *,
    pads: Int[Array, " rows"],
    slot: Int[Array, ""] | int,
    window: int | None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Float[Array, "rows t heads head_dim"]:
    """Each row's queries against its cached keys and values (written up to
    `slot + t`), with the models' score computation (`dot_attention`'s: f32
    scores times `scale`, soft-capped, masked, f32 softmax cast to q's dtype,
    times v; query head `h` reads key/value head `h // (heads // kv_heads)`)."""
    rows, t, heads, d = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    scale = d**-0.5 if scale is None else scale
    qg = q.reshape(rows, t, kv_heads, heads // kv_heads, d)
    k, v = keys.astype(q.dtype), values.astype(q.dtype)
    scores = _scores(qg, k, scale, softcap)
    mask = jax.vmap(lambda pad: cache_mask(pad, slot, t, length, window))(pads)
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("rkgtl,rkld->rtkgd", probs, v)
    return out.reshape(rows, t, heads, d)


def _scores(qg: Array, k: Array, scale: float, softcap: float | None) -> Array:
    """f32 scores `[rows, kv_heads, group, t, length]` of grouped queries
    against the cached keys, scaled and soft-capped."""
    scores = jnp.einsum("rtkgd,rkld->rkgtl", qg, k, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(scale)
    if softcap is not None:
        scores = jnp.float32(softcap) * jnp.tanh(scores / jnp.float32(softcap))
    return scores


def cached_attention(
    q: Float[Array, "rows t heads head_dim"],
    k: Float[Array, "rows t kv_heads head_dim"],
    v: Float[Array, "rows t kv_heads head_dim"],
    cache: tuple[Array, Array],
    *,
    layer: Int[Array, ""],
    step: "CacheStep",
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Float[Array, "rows t heads head_dim"]:
    """The attention of `t` new tokens per row (queries `q`; keys `k` and
    values `v`, already written into `cache`): with `step.prefill`, the prompt
    among itself with the models' training attention (`attend`), else against
    every filled slot of layer `layer` of `cache` (`cache_attention`)."""
    if step.prefill:
        one = lambda qi, ki, vi, si: attend(
            qi, ki, vi, step.options, segment_ids=si, positions=None,
            sliding_window=window, scale=scale, softcap=softcap,
        )  # fmt: skip
        return jax.vmap(one)(q, k, v, step.segment_ids)
    keys, values = layer_of(cache, layer)
    return cache_attention(
        q, keys, values, pads=step.pads, slot=step.slot, window=window,
        scale=scale, softcap=softcap,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CacheStep:
    """What every layer of one cached forward pass shares (the models'
    `cached_features`): the slot the new tokens go to, the rows' left padding,
    the new tokens' segment ids (0: padding), the runtime options and whether
    it is the prefill."""

    slot: Int[Array, ""] | int
    pads: Int[Array, " rows"]
    segment_ids: Int[Array, "rows t"]
    options: Any
    prefill: bool
