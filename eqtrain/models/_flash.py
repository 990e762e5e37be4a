"""Flash attention in JAX: causal attention by blocks of queries, each folding in
the key blocks it can see by an online softmax, with a custom VJP that
recomputes each block pair's probabilities from the saved log-sum-exp instead
of storing them. Only one `[heads, block, block]` piece of scores exists at a
time, forward and backward; what the backward keeps is the output and one
log-sum-exp per query and head.

The same masks as `attention` (causal, segments, a sliding window) and the same
score options (`scale`, Gemma 2's `softcap`); grouped-query heads as
Hugging Face's `repeat_kv`. Blocks after a query block (masked by causality)
and before its window are never computed. Query blocks are unrolled; the key
blocks of each are a `lax.scan`, so the compiled size grows with the number of
query blocks only.
"""

import dataclasses

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from .._reduce import row_max, row_sum
from ._masks import position_mask


FLASH_BLOCK = 128
"""Queries (and keys) per block of `flash_attention`."""

_NEG = -1e30  # a masked score: finite, so a row without keys yet never gives NaN
_F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The static part of a call (hashable: the custom VJP's first argument)."""

    block: int
    window: int | None
    scale: float
    softcap: float | None

    def first_block(self, i: int) -> int:
        """The first key block query block `i` can see (its window's start)."""
        if self.window is None:
            return 0
        return max(0, i * self.block - self.window + 1) // self.block


def flash_attention(
    q: Float[Array, "seq heads head_dim"],
    k: Float[Array, "seq kv_heads head_dim"],
    v: Float[Array, "seq kv_heads head_dim"],
    *,
    segment_ids: Int[Array, " seq"] | None = None,
    sliding_window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    block: int = FLASH_BLOCK,
) -> Float[Array, "seq heads head_dim"]:
    """Causal self-attention as `attention` computes it, by flash blocks of
    `block` queries and keys (the sequence padded to whole blocks; the padded
    keys come after every real query, so causality hides them). Values and
    gradients equal the plain attention's to the dtype's rounding.

    The inputs are laid out once as blocks with the heads in front (`[blocks,
    kv_heads, (group,) block, d]`): XLA's batched products on the CPU want the
    batch axes leading, so every block pair's products then read their
    operands as they are."""
    seq, heads, d = q.shape
    kv_heads = k.shape[1]
    size = min(block, seq)
    pad = -seq % size
    segs = jnp.zeros((seq,), jnp.int32) if segment_ids is None else segment_ids
    q, k, v = (jnp.pad(x, [(0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
    segs = jnp.pad(segs.astype(jnp.int32), (0, pad), mode="edge")
    pos = jnp.arange(seq + pad, dtype=jnp.int32)
    spec = _Spec(size, sliding_window, d**-0.5 if scale is None else scale, softcap)
    grouped = q.reshape(-1, size, kv_heads, heads // kv_heads, d)
    qb = grouped.transpose(0, 2, 3, 1, 4)  # [blocks, kv_heads, group, B, d]
    kb, vb = (x.reshape(-1, size, kv_heads, d).transpose(0, 2, 1, 3) for x in (k, v))
    out = _flash(spec, qb, kb, vb, pos.reshape(-1, size), segs.reshape(-1, size))
    return out.transpose(0, 3, 1, 2, 4).reshape(-1, heads, d)[:seq]


def _scores(spec: _Spec, qi: Array, kj: Array) -> Array:
    """A block pair's f32 scores `[kv_heads, group, q, k]`, scaled and capped
    (before the mask)."""
    s = jnp.einsum("kgqd,ksd->kgqs", qi, kj, preferred_element_type=_F32)
    s = s * _F32(spec.scale)
    if spec.softcap is not None:
        s = _F32(spec.softcap) * jnp.tanh(s / _F32(spec.softcap))
    return s


def _keep(spec: _Spec, where: tuple[Array, ...]) -> Array:
    """Which keys each query of a block pair sees, `[q, k]`."""
    return position_mask(*where, spec.window)


def _forward_row(spec: _Spec, qi: Array, mine: tuple[Array, Array], keys: tuple):
    """Query block `qi` (`[kv_heads, group, B, d]`, at positions and segments
    `mine`) against its key blocks `keys = (k, v, positions, segments)` stacked
    `[n, ...]`: its output `[kv_heads, group, B, d]` (f32) and log-sum-exp
    `[kv_heads, group, B]`."""
    shape = qi.shape[:-1]
    init = (jnp.zeros(qi.shape, _F32), jnp.full(shape, _NEG, _F32))
    init = (*init, jnp.zeros(shape, _F32))

    def fold(carry: tuple, key: tuple) -> tuple:
        acc, top, total = carry
        kj, vj, kp, ks = key
        keep = _keep(spec, (*mine, kp, ks))
        s = _scores(spec, qi, kj)
        new = jnp.maximum(top, row_max(jnp.where(keep, s, _NEG))[..., 0])
        p = jnp.where(keep, jnp.exp(s - new[..., None]), 0.0)
        fade = jnp.exp(top - new)
        pv = jnp.einsum(
            "kgqs,ksd->kgqd", p.astype(vj.dtype), vj, preferred_element_type=_F32
        )
        return (
            acc * fade[..., None] + pv,
            new,
            total * fade + row_sum(p)[..., 0],
        ), None

    (acc, top, total), _ = lax.scan(fold, init, keys)
    return acc / total[..., None], top + jnp.log(total)


def _key_blocks(spec: _Spec, i: int, kb, vb, pb, sb) -> tuple:
    """The key blocks query block `i` sees: from its window's start to itself."""
    lo = spec.first_block(i)
    return kb[lo : i + 1], vb[lo : i + 1], pb[lo : i + 1], sb[lo : i + 1]


def _forward(spec: _Spec, qb: Array, kb: Array, vb: Array, pb: Array, sb: Array):
    """The output `[blocks, kv_heads, group, B, d]` (`q`'s dtype) and the
    log-sum-exp `[blocks, kv_heads, group, B]` of every query."""
    outs, sums = [], []
    for i in range(qb.shape[0]):
        keys = _key_blocks(spec, i, kb, vb, pb, sb)
        out, lse = _forward_row(spec, qb[i], (pb[i], sb[i]), keys)
        outs.append(out)
        sums.append(lse)
    return jnp.stack(outs).astype(qb.dtype), jnp.stack(sums)


def _primal(spec: _Spec, *blocks: Array) -> Array:
    return _forward(spec, *blocks)[0]


def _flash_fwd(spec: _Spec, *blocks: Array):
    out, lse = _forward(spec, *blocks)
    return out, (blocks, out, lse)


def _backward_row(spec: _Spec, row: tuple, keys: tuple):
    """One query block's gradient `dq` `[kv_heads, group, B, d]` and its
    contributions to the gradients of its key blocks, `(dk, dv)` stacked `[n,
    kv_heads, B, d]` (all f32). `row = (q, dout, lse, delta, positions,
    segments)` of the block; `keys` as `_forward_row`'s."""
    qi, do, lse, delta, qp, qs = row

    def fold(dq: Array, key: tuple) -> tuple:
        kj, vj, kp, ks = key
        keep = _keep(spec, (qp, qs, kp, ks))
        s = _scores(spec, qi, kj)
        p = jnp.where(keep, jnp.exp(s - lse[..., None]), 0.0)
        dv = jnp.einsum(
            "kgqs,kgqd->ksd", p.astype(do.dtype), do, preferred_element_type=_F32
        )
        dp = jnp.einsum("kgqd,ksd->kgqs", do, vj, preferred_element_type=_F32)
        ds = _score_grad(spec, s, p * (dp - delta[..., None])).astype(qi.dtype)
        dq = dq + jnp.einsum("kgqs,ksd->kgqd", ds, kj, preferred_element_type=_F32)
        dk = jnp.einsum("kgqs,kgqd->ksd", ds, qi, preferred_element_type=_F32)
        return dq, (dk, dv)

    return lax.scan(fold, jnp.zeros(qi.shape, _F32), keys)


def _score_grad(spec: _Spec, s: Array, ds: Array) -> Array:
    """The gradient of the raw products `q . k` from that of the scores `s`
    (through the cap `c * tanh(x / c)`, whose slope is `1 - (s / c)^2`, and the
    scale)."""
    if spec.softcap is not None:
        ds = ds * (1.0 - jnp.square(s / _F32(spec.softcap)))
    return ds * _F32(spec.scale)


def _flash_bwd(spec: _Spec, saved: tuple, dout: Array):
    (qb, kb, vb, pb, sb), out, lse = saved
    delta = row_sum(dout.astype(_F32) * out.astype(_F32))[..., 0]
    dq, dk, dv = [], jnp.zeros(kb.shape, _F32), jnp.zeros(vb.shape, _F32)
    for i in range(qb.shape[0]):
        lo = spec.first_block(i)
        row = (qb[i], dout[i], lse[i], delta[i], pb[i], sb[i])
        dqi, (dki, dvi) = _backward_row(spec, row, _key_blocks(spec, i, kb, vb, pb, sb))
        dq.append(dqi)
        dk, dv = dk.at[lo : i + 1].add(dki), dv.at[lo : i + 1].add(dvi)
    grads = (jnp.stack(dq), dk, dv)
    return (*(g.astype(x.dtype) for g, x in zip(grads, (qb, kb, vb), strict=True)),
            None, None)  # fmt: skip


_flash = jax.custom_vjp(_primal, nondiff_argnums=(0,))
_flash.defvjp(_flash_fwd, _flash_bwd)
