"""Which keys a query sees: positions within packed segments, and the causal
(and windowed) masks within a segment that every attention kernel applies."""

import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


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


def segment_mask(segment_ids: Int[Array, " seq"]) -> Bool[Array, "seq seq"]:
    """`mask[i, j]`: query `i` and key `j` belong to the same segment."""
    return segment_ids[:, None] == segment_ids[None, :]
