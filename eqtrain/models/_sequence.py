"""Sequence parallelism: exact attention over a sequence split across the mesh's
`sequence` axis, in three schemes (Ulysses, ring, all-gather K/V), each a
`jax.shard_map` that moves data over that axis only.

Models call `sequence_attention` on one sequence (`[seq, heads, head_dim]`) and
the losses `jax.vmap` them over the batch with the rows mapped onto the batch axes
(`eqtrain._rows.vmap_rows`), so each device keeps its own rows. The mesh is the
one in context (`jax.set_mesh(mesh)`, or `under_mesh(step, mesh)`); without a
`sequence` axis larger than 1 the plain attention runs. Masks come from global
positions and segment ids, so any token layout is exact: `zigzag` is a
permutation of the rows' tokens (and their positions), applied to the data by
`sequence_rows`.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from .._errors import ConfigError
from .._reduce import row_max, row_sum
from ._attention import attention, dot_attention, tensor_heads
from ._masks import position_mask, segment_positions


SCHEMES = ("ulysses", "ring", "all_gather")
"""The sequence-parallel attention schemes (`sequence_parallel=`)."""

LAYOUTS = ("contiguous", "zigzag")
"""How a row's tokens lie on the `sequence` axis: in order, or zigzag (device `i`
holds chunks `i` and `2n - 1 - i` of `2n`, which balances causal work)."""

AXIS = "sequence"
_NEG = -1e30  # a masked score: finite, so fully masked rows never make inf - inf


def check_scheme(scheme: str | None, layout: str = "contiguous") -> None:
    """Raise `ConfigError` for an unknown scheme or layout."""
    if scheme is not None and scheme not in SCHEMES:
        raise ConfigError(
            f"`sequence_parallel` must be None or one of {list(SCHEMES)}; got "
            f"{scheme!r}."
        )
    if layout not in LAYOUTS:
        raise ConfigError(
            f"`sequence_layout` must be one of {list(LAYOUTS)}; got {layout!r}."
        )


def check_sequence(
    *,
    seq_len: int,
    ways: int,
    scheme: str | None,
    layout: str = "contiguous",
    heads: int | None = None,
    tensor: int = 1,
) -> None:
    """Raise `ConfigError` (naming the config fields) unless `seq_len` tokens and
    `heads` query heads (split `tensor` ways first) fit `ways` sequence devices."""
    check_scheme(scheme, layout)
    if ways == 1:
        return
    if scheme is None:
        raise ConfigError(
            f"mesh.sequence is {ways} but model.sequence_parallel is unset; set it "
            f"to one of {list(SCHEMES)} (or mesh.sequence = 1)."
        )
    _check_seq_len(seq_len, ways, layout)
    if scheme == "ulysses" and heads is not None:
        _check_ulysses_heads(heads, ways, tensor)


def _check_seq_len(seq_len: int, ways: int, layout: str) -> None:
    """`seq_len` splits into the layout's equal chunks over `ways` devices."""
    chunks = 2 * ways if layout == "zigzag" else ways
    if seq_len % chunks:
        twice = " (twice mesh.sequence for the zigzag layout)" if chunks > ways else ""
        raise ConfigError(
            f"data.seq_len {seq_len} does not split into {chunks} equal chunks"
            f"{twice} over mesh.sequence = {ways}; use a data.seq_len that is a "
            f"multiple of {chunks}."
        )


def _check_ulysses_heads(heads: int, ways: int, tensor: int) -> None:
    """Each `tensor` device's heads split over the `ways` sequence devices."""
    if (heads // tensor) % ways:
        raise ConfigError(
            f"model.sequence_parallel = 'ulysses' splits the heads over "
            f"mesh.sequence = {ways}, but model.num_heads {heads} gives "
            f"{heads // tensor} heads per mesh.tensor device ({tensor} of them), "
            f"not a multiple of {ways}; use 'ring' or 'all_gather', or a head "
            f"count divisible by {ways * tensor}."
        )


def sequence_ways(mesh: Any = None) -> int:
    """The size of the `sequence` axis of `mesh` (default: the mesh in context)."""
    return _size(jax.sharding.get_abstract_mesh() if mesh is None else mesh, AXIS)


def under_mesh(fn: Callable[..., Any], mesh: Any) -> Callable[..., Any]:
    """`fn` traced with `mesh` as the mesh in context, so that the sequence-parallel
    attention inside it finds the `sequence` axis. Wrap a step with it before
    `eqtrain.jit` (or trace the step inside `with jax.set_mesh(mesh):`)."""

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return wrapped


def _dense(q, k, v, q_pos, q_seg, k_pos, k_seg, window, implementation, **score):
    """Attention of local queries over the given keys, masked by positions
    (`score`: `scale` and `softcap`, as `dot_attention`)."""
    mask = position_mask(q_pos, q_seg, k_pos, k_seg, window)
    return dot_attention(
        q, k, v, mask=mask[None], implementation=implementation, **score
    )


def sequence_attention(
    q: Float[Array, "seq heads head_dim"],
    k: Float[Array, "seq kv_heads head_dim"],
    v: Float[Array, "seq kv_heads head_dim"],
    *,
    scheme: str,
    positions: Int[Array, " seq"] | None,
    segment_ids: Int[Array, " seq"] | None,
    sliding_window: int | None = None,
    layout: str = "contiguous",
    implementation: str | None = None,
    mesh: Any = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Float[Array, "seq heads head_dim"]:
    """Causal attention of one sequence split over the mesh's `sequence` axis.

    The result equals `eqtrain.models._layers.attention` on the whole sequence
    (with rows in their original order) up to float rounding:

    - `"ulysses"` (DeepSpeed-Ulysses, Jacobs et al. 2023, arXiv:2309.14509): an
      all-to-all turns `[seq/n, heads]` into `[seq, heads/n]`, any local kernel
      runs (`implementation`: XLA or cuDNN), and the inverse all-to-all returns
      the sequence split. Heads must divide by `n`; key/value heads that do not
      are repeated first.
    - `"ring"` (ring attention, Liu et al. 2023, arXiv:2310.01889): key/value
      blocks, with their positions and segment ids, travel round the ring by
      `ppermute` in a `lax.scan` and merge by online softmax; each block's body
      is rematerialised, and blocks that causality masks entirely are skipped
      (from the layout, not the data).
    - `"all_gather"`: keys and values, with their positions and segment ids,
      are gathered in one collective; queries stay split. The local queries go
      over the gathered blocks as the ring's do (online softmax, each block
      rematerialised, masked blocks skipped), or, with `implementation="cudnn"`,
      through one fused kernel call over all keys.

    Args:
        q, k, v: one sequence's heads (a batch under `jax.vmap`), in the token
            layout of the rows (`layout`).
        scheme: one of `SCHEMES`.
        positions: each token's position in its segment (None: from
            `segment_ids`, or `arange`); must increase along the original row.
        segment_ids: packed examples (None: one segment).
        sliding_window: attend to at most this many positions, itself included.
        layout: `"contiguous"` or `"zigzag"` (rows permuted by `zigzag_order`).
        implementation: the local kernel of `jax.nn.dot_product_attention`.
        mesh: default the mesh in context; without a `sequence` axis > 1 the
            plain attention runs (on rows in contiguous layout).
        scale, softcap: of the scores, as `eqtrain.models._layers.attention`.
    """
    score = dict(scale=scale, softcap=softcap)
    check_scheme(scheme, layout)
    seq = q.shape[0]
    segs = jnp.zeros((seq,), jnp.int32) if segment_ids is None else segment_ids
    if positions is None:
        positions = segment_positions(segs)
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    n = sequence_ways(mesh)
    if n == 1 and layout == "contiguous":
        return attention(
            q, k, v, segment_ids=segment_ids, sliding_window=sliding_window,
            implementation=implementation, **score,
        )  # fmt: skip
    if n == 1:
        return _dense(
            q, k, v, positions, segs, positions, segs, sliding_window, None, **score
        )
    _check_chunks(seq, n, layout)
    local = functools.partial(
        _BODIES[scheme], n=n, window=sliding_window, layout=layout,
        implementation=implementation, score=score,
    )  # fmt: skip
    return _over_sequence(local, mesh, q, k, v, positions, segs)


def _check_chunks(seq: int, n: int, layout: str) -> None:
    """A sequence of `seq` tokens splits into the layout's chunks over `n`."""
    chunks = 2 * n if layout == "zigzag" else n
    if seq % chunks:
        raise ConfigError(
            f"a sequence of {seq} tokens does not split into {chunks} equal chunks "
            f"over the `sequence` axis of size {n}; use a multiple of {chunks}."
        )


def _over_sequence(
    local: Callable[..., Array],
    mesh: Any,
    q: Array,
    k: Array,
    v: Array,
    positions: Array,
    segs: Array,
) -> Array:
    """`local(q, k, v, positions, segs)` on each device's block of the sequence
    (a `shard_map` over every mesh axis)."""
    # Every mesh axis is manual: the rows' axes come from the `vmap` around the
    # model (`spmd_axis_name`, see `eqtrain._rows.vmap_rows`), whole heads lie on
    # `tensor` as the tensor-parallel rules put them, and `sequence` is ours.
    # (With only `sequence` manual, XLA gathered the rows of Ulysses and
    # all-gather across `data`.)
    k, v, heads = _tensor_heads(_size(mesh, "tensor"), q, k, v)
    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(heads, heads, heads, P(AXIS), P(AXIS)),
        out_specs=heads,
        axis_names=set(mesh.axis_names),
        check_vma=False,
    )
    return mapped(q, k, v, positions.astype(jnp.int32), segs.astype(jnp.int32))


def _tensor_heads(
    tensor: int, q: Array, k: Array, v: Array
) -> tuple[Array, Array, Any]:
    """`(k, v, spec)`: the heads' partition spec beside the sequence's
    (`tensor_heads`)."""
    k, v, axis = tensor_heads(tensor, q, k, v)
    return k, v, P(AXIS, axis)


def _size(mesh: Any, axis: str) -> int:
    if mesh is None or axis not in mesh.axis_names:
        return 1
    return int(dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[axis])


# -- the schemes, on one device's block ---------------------------------------------
def _gather(x: Array) -> Array:
    return lax.all_gather(x, AXIS, axis=0, tiled=True)


def _ulysses(q, k, v, pos, seg, *, n, window, layout, implementation, score):
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % n:
        raise ConfigError(
            f"Ulysses splits the {heads} heads over the `sequence` axis of size "
            f"{n}; use a head count divisible by {n}, or the ring scheme."
        )
    if kv_heads % n:  # too few kv heads to split: repeat them (as GQA groups them)
        k, v = (jnp.repeat(x, heads // kv_heads, axis=1) for x in (k, v))
    to_heads = lambda x: lax.all_to_all(x, AXIS, 1, 0, tiled=True)
    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    pos, seg = _gather(pos), _gather(seg)
    kernel = dict(implementation=implementation, **score)
    if layout == "contiguous":  # rows in order: the kernel's own causal mask
        out = attention(q, k, v, segment_ids=seg, sliding_window=window, **kernel)
    else:
        out = _dense(q, k, v, pos, seg, pos, seg, window, implementation, **score)
    return lax.all_to_all(out, AXIS, 0, 1, tiled=True)


def _merge(acc, q, q_pos, q_seg, k, v, k_pos, k_seg, window, softcap=None):
    """Online softmax: fold one key block into the accumulators of `q`'s rows.

    `acc = (out [q, kv, group, d], max [q, kv, group], sum [q, kv, group])` in f32;
    `q: [q, kv, group, d]` already scaled. The running max is only a shift that
    cancels in `out / sum`, so no gradient flows through it."""
    out, top, total = acc
    scores = jnp.einsum("qhgd,khd->qhgk", q, k, preferred_element_type=jnp.float32)
    if softcap is not None:
        scores = jnp.float32(softcap) * jnp.tanh(scores / jnp.float32(softcap))
    mask = position_mask(q_pos, q_seg, k_pos, k_seg, window)[:, None, None, :]
    scores = jnp.where(mask, scores, _NEG)
    new_top = lax.stop_gradient(jnp.maximum(top, row_max(scores)[..., 0]))
    probs = jnp.where(mask, jnp.exp(scores - new_top[..., None]), 0.0)
    scale = jnp.exp(top - new_top)
    total = total * scale + row_sum(probs)[..., 0]
    pv = jnp.einsum("qhgk,khd->qhgd", probs, v, preferred_element_type=jnp.float32)
    return out * scale[..., None] + pv, new_top, total


def _ring(q, k, v, pos, seg, *, n, window, layout, implementation, score):
    del implementation  # the blocks are computed here, not by a kernel
    perm = [(i, (i + 1) % n) for i in range(n)]
    block = lambda kv, src: tuple(lax.ppermute(x, AXIS, perm) for x in kv)
    return _blocks(
        q, (k, v, pos, seg), block, n=n, window=window, layout=layout, **score
    )


def _all_gather(q, k, v, pos, seg, *, n, window, layout, implementation, score):
    whole = tuple(_gather(x) for x in (k, v, pos, seg))
    if implementation == "cudnn":  # a fused kernel never holds the scores
        return _dense(
            q, *whole[:2], pos, seg, *whole[2:], window, implementation, **score
        )
    # Otherwise block by block, as the ring (same skips, same online softmax),
    # each device's block cut from the gathered K/V instead of passed round. One
    # XLA attention of the local queries over all keys (the earlier form) kept
    # `[heads, S/n, S]` scores for the backward, the half that causality masks
    # included: twice Ulysses' memory, whose local `attention` skips masked
    # blocks (n = 4, 2k tokens: docs/sharding.md, "What it saves").
    s = k.shape[0]
    block = lambda kv, src: tuple(
        lax.dynamic_slice_in_dim(x, src * s, s) for x in whole
    )
    return _blocks(
        q, (k, v, pos, seg), block, n=n, window=window, layout=layout, **score
    )


def _blocks(q, kv, block, *, n, window, layout, scale=None, softcap=None):
    """Attention of the local queries over the `n` devices' key/value blocks, one
    block at a time, merged by online softmax: the local `kv = (k, v, pos, seg)`
    first, then `block(kv, src)` (the previous block and the source device's
    index) gives the block of device `src` for `src = me - 1, me - 2, ...`."""
    s, heads, d = q.shape
    k, _, pos, seg = kv  # the local block: the queries' own positions
    kv_heads = k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = (q * scale).astype(q.dtype)
    qg = qg.reshape(s, kv_heads, heads // kv_heads, d)
    local = _LocalQueries(qg, pos, seg, window, softcap, lax.axis_index(AXIS))
    # Rematerialise each block: the backward keeps only its inputs (accumulators
    # and the travelling block), not the [q, heads, k] scores and probabilities.
    # With `lax.cond` (contiguous) the branch is checkpointed too: with either
    # checkpoint alone, a step's temp memory measured twice as large.
    diagonal = jax.checkpoint(local.diagonal, prevent_cse=False)
    other = jax.checkpoint(
        local.zigzag if layout == "zigzag" else local.contiguous, prevent_cse=False
    )

    def step(carry, t):
        acc, kv = carry
        src = (local.me - t) % n
        kv = block(kv, src)
        return (other(acc, kv, src), kv), None

    acc = diagonal(_no_keys((s, kv_heads, heads // kv_heads), d), kv)
    (acc, _), _ = lax.scan(step, (acc, kv), jnp.arange(1, n))
    out, _, total = acc
    out = out / total[..., None]
    return out.reshape(s, heads, d).astype(q.dtype)


def _no_keys(shape: tuple[int, ...], d: int) -> tuple[Array, Array, Array]:
    """The online softmax's accumulators before any key block (`_merge`)."""
    return (
        jnp.zeros((*shape, d), jnp.float32),
        jnp.full(shape, _NEG, jnp.float32),
        jnp.zeros(shape, jnp.float32),
    )


@dataclasses.dataclass(frozen=True)
class _LocalQueries:
    """One device's queries in `_blocks` (scaled, grouped by key/value head:
    `[s, kv_heads, group, d]`) with their positions and segment ids, and the
    ways a key block folds into their accumulators."""

    q: Array
    pos: Array
    seg: Array
    window: int | None
    softcap: float | None
    me: Array  # this device's index on the sequence axis

    def merge(self, acc: Any, lo: Any, size: int, kv: Any, k_lo: Any, k_size: int):
        """Fold keys `[k_lo, k_lo + k_size)` of `kv` into query rows `[lo, lo +
        size)` (offsets may be traced)."""
        cut = lambda x, at, n: lax.dynamic_slice_in_dim(x, at, n)
        rows = tuple(cut(a, lo, size) for a in acc)
        keys = tuple(cut(x, k_lo, k_size) for x in kv)
        q_, p_, s_ = (
            cut(self.q, lo, size),
            cut(self.pos, lo, size),
            cut(self.seg, lo, size),
        )
        part = _merge(rows, q_, p_, s_, *keys, self.window, self.softcap)
        return tuple(
            lax.dynamic_update_slice_in_dim(a, b, lo, 0)
            for a, b in zip(acc, part, strict=True)
        )

    def diagonal(self, acc: Any, kv: Any):
        """My own block: every query against every key."""
        s = self.q.shape[0]
        return self.merge(acc, 0, s, kv, 0, s)

    def contiguous(self, acc: Any, kv: Any, src: Any):
        """A block from after me is masked by causality."""
        seen = jax.checkpoint(self.diagonal, prevent_cse=False)
        return lax.cond(src < self.me, seen, lambda a, kv: a, acc, kv)

    def zigzag(self, acc: Any, kv: Any, src: Any):
        """Device i holds chunks (i, 2n-1-i). A source before me: both my query
        halves see its first key half. After me: my second query half sees
        both of its key halves. Both cases are two quarter blocks, one of them
        (second query half, first key half) common: no branch at all."""
        half = self.q.shape[0] // 2
        acc = self.merge(acc, half, half, kv, 0, half)
        h = jnp.where(src > self.me, half, 0)
        return self.merge(acc, h, half, kv, h, half)


_BODIES = {"ulysses": _ulysses, "ring": _ring, "all_gather": _all_gather}


def attend(
    q: Float[Array, "seq heads head_dim"],
    k: Float[Array, "seq kv_heads head_dim"],
    v: Float[Array, "seq kv_heads head_dim"],
    options: Any,
    *,
    segment_ids: Int[Array, " seq"] | None,
    positions: Int[Array, " seq"] | None,
    sliding_window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Float[Array, "seq heads head_dim"]:
    """The models' attention under their `RuntimeOptions` (`options`): `attention`
    (one device's whole sequence, rows in order; `options.query_chunk`: blocked,
    see `attention`), or `sequence_attention` with a `sequence_parallel` scheme."""
    common = dict(
        segment_ids=segment_ids, sliding_window=sliding_window,
        implementation=options.implementation, scale=scale, softcap=softcap,
    )  # fmt: skip
    if options.sequence_parallel is None:
        return attention(q, k, v, query_chunk=options.query_chunk, **common)
    return sequence_attention(
        q, k, v, scheme=options.sequence_parallel, positions=positions,
        layout=options.sequence_layout, **common,
    )  # fmt: skip
