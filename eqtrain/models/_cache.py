"""The key/value cache of autoregressive generation, and attention against it.

A `KVCache` holds every layer's keys and values for a batch of rows in
preallocated arrays `[layers, rows, length, kv_heads, head_dim]`: the shapes
never change while tokens are added, so a decode loop compiles once. Rows are
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

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from ._layers import dot_attention, position_mask


class KVCache(eqx.Module):
    """Keys and values of every layer (`[layers, rows, length, kv_heads,
    head_dim]`, in the model's dtype) and each row's left padding (`pads`)."""

    k: Float[Array, "layers rows length kv_heads head_dim"]
    v: Float[Array, "layers rows length kv_heads head_dim"]
    pads: Int[Array, " rows"]

    @property
    def length(self) -> int:
        return self.k.shape[2]


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
    shape = (layers, rows, length, kv_heads, head_dim)
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
    at = (layer, 0, slot, 0, 0)
    ck = lax.dynamic_update_slice(ck, k[None].astype(ck.dtype), at)
    cv = lax.dynamic_update_slice(cv, v[None].astype(cv.dtype), at)
    return ck, cv


def layer_of(cache: tuple[Array, Array], layer: Int[Array, ""] | int) -> Any:
    """One layer's `(k, v)`, each `[rows, length, kv_heads, head_dim]`."""
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
    keys: Float[Array, "rows length kv_heads head_dim"],
    values: Float[Array, "rows length kv_heads head_dim"],
    *,
    pads: Int[Array, " rows"],
    slot: Int[Array, ""] | int,
    window: int | None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Float[Array, "rows t heads head_dim"]:
    """Each row's queries against its cached keys and values (written up to
    `slot + t`), with the models' score computation (`dot_attention`: scale,
    soft-cap, f32 softmax, grouped-query heads)."""
    t, length = q.shape[1], keys.shape[1]

    def row(qr: Array, kr: Array, vr: Array, pad: Array) -> Array:
        mask = cache_mask(pad, slot, t, length, window)
        return dot_attention(
            qr, kr.astype(qr.dtype), vr.astype(qr.dtype), mask=mask[None],
            implementation="xla", scale=scale, softcap=softcap,
        )  # fmt: skip

    return jax.vmap(row)(q, keys, values, pads)
