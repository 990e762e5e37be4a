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
    gradients equal the plain attention's to the dtype's rounding."""
    seq, _, d = q.shape
    size = min(block, seq)
    pad = -seq % size
    segs = jnp.zeros((seq,), jnp.int32) if segment_ids is None else segment_ids
    padded = [jnp.pad(x, [(0, pad), (0, 0), (0, 0)]) for x in (q, k, v)]
    segs = jnp.pad(segs.astype(jnp.int32), (0, pad), mode="edge")
    spec = _Spec(size, sliding_window, d**-0.5 if scale is None else scale, softcap)
    return _flash(spec, *padded, segs)[:seq]


def _blocks(x: Array, size: int) -> Array:
    """`[seq, ...]` as `[seq / size, size, ...]`."""
    return x.reshape(-1, size, *x.shape[1:])


def _grouped(q: Array, kv_heads: int) -> Array:
    """Query heads `[..., heads, d]` as `[..., kv_heads, group, d]`."""
    *lead, heads, d = q.shape
    return q.reshape(*lead, kv_heads, heads // kv_heads, d)


def _scores(spec: _Spec, qi: Array, kj: Array) -> Array:
    """A block pair's f32 scores `[kv_heads, group, q, k]`, scaled and capped
    (before the mask)."""
    s = jnp.einsum("qkgd,skd->kgqs", qi, kj, preferred_element_type=_F32)
    s = s * _F32(spec.scale)
    if spec.softcap is not None:
        s = _F32(spec.softcap) * jnp.tanh(s / _F32(spec.softcap))
    return s


def _keep(spec: _Spec, where: tuple[Array, ...]) -> Array:
    """Which keys each query of a block pair sees, `[q, k]`."""
    return position_mask(*where, spec.window)


def _forward_row(spec: _Spec, qi: Array, mine: tuple[Array, Array], keys: tuple):
    """Query block `qi` (`[B, kv_heads, group, d]`, at positions and segments
    `mine`) against its key blocks `keys = (k, v, positions, segments)` stacked
    `[n, B, ...]`: its output `[B, kv_heads, group, d]` (f32) and log-sum-exp
    `[kv_heads, group, B]`."""
    kv_heads, group, d = qi.shape[1:]
    shape = (kv_heads, group, qi.shape[0])
    init = (jnp.zeros((*shape, d), _F32), jnp.full(shape, _NEG, _F32))
    init = (*init, jnp.zeros(shape, _F32))

    def fold(carry: tuple, key: tuple) -> tuple:
        acc, top, total = carry
        kj, vj, kp, ks = key
        keep = _keep(spec, (*mine, kp, ks))
        s = _scores(spec, qi, kj)
        new = jnp.maximum(top, jnp.where(keep, s, _NEG).max(-1))
        p = jnp.where(keep, jnp.exp(s - new[..., None]), 0.0)
        fade = jnp.exp(top - new)
        pv = jnp.einsum(
            "kgqs,skd->kgqd", p.astype(vj.dtype), vj, preferred_element_type=_F32
        )
        return (acc * fade[..., None] + pv, new, total * fade + p.sum(-1)), None

    (acc, top, total), _ = lax.scan(fold, init, keys)
    out = acc / total[..., None]
    return out.transpose(2, 0, 1, 3), top + jnp.log(total)


def _pieces(spec: _Spec, q: Array, k: Array, v: Array, segs: Array):
    """`q` grouped and every input in blocks: `(queries, keys, values,
    positions, segments)`, each `[blocks, B, ...]`."""
    pos = jnp.arange(q.shape[0], dtype=jnp.int32)
    grouped = _grouped(q, k.shape[1])
    return tuple(_blocks(x, spec.block) for x in (grouped, k, v, pos, segs))


def _forward(spec: _Spec, q: Array, k: Array, v: Array, segs: Array):
    """The output `[seq, heads, d]` (`q`'s dtype) and the log-sum-exp
    `[blocks, kv_heads, group, B]` of every query."""
    qb, kb, vb, pb, sb = _pieces(spec, q, k, v, segs)
    outs, sums = [], []
    for i in range(qb.shape[0]):
        lo = spec.first_block(i)
        keys = (kb[lo : i + 1], vb[lo : i + 1], pb[lo : i + 1], sb[lo : i + 1])
        out, lse = _forward_row(spec, qb[i], (pb[i], sb[i]), keys)
        outs.append(out)
        sums.append(lse)
    out = jnp.stack(outs).reshape(q.shape).astype(q.dtype)
    return out, jnp.stack(sums)


def _primal(spec: _Spec, q: Array, k: Array, v: Array, segs: Array) -> Array:
    return _forward(spec, q, k, v, segs)[0]


def _flash_fwd(spec: _Spec, q: Array, k: Array, v: Array, segs: Array):
    out, lse = _forward(spec, q, k, v, segs)
    return out, (q, k, v, segs, out, lse)


def _backward_row(spec: _Spec, row: tuple, keys: tuple):
    """One query block's gradient `dq` `[B, kv_heads, group, d]` and its
    contributions to the gradients of its key blocks, `(dk, dv)` stacked `[n,
    B, kv_heads, d]` (all f32). `row = (q, dout, lse, delta, positions,
    segments)` of the block; `keys` as `_forward_row`'s."""
    qi, do, lse, delta, qp, qs = row

    def fold(dq: Array, key: tuple) -> tuple:
        kj, vj, kp, ks = key
        keep = _keep(spec, (qp, qs, kp, ks))
        s = _scores(spec, qi, kj)
        p = jnp.where(keep, jnp.exp(s - lse[..., None]), 0.0)
        dv = jnp.einsum(
            "kgqs,qkgd->skd", p.astype(do.dtype), do, preferred_element_type=_F32
        )
        dp = jnp.einsum("qkgd,skd->kgqs", do, vj, preferred_element_type=_F32)
        ds = _score_grad(spec, s, p * (dp - delta[..., None])).astype(qi.dtype)
        dq = dq + jnp.einsum("kgqs,skd->qkgd", ds, kj, preferred_element_type=_F32)
        dk = jnp.einsum("kgqs,qkgd->skd", ds, qi, preferred_element_type=_F32)
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
    q, k, v, segs, out, lse = saved
    qb, kb, vb, pb, sb = _pieces(spec, q, k, v, segs)
    dob = _blocks(_grouped(dout, k.shape[1]), spec.block)
    ob = _blocks(_grouped(out, k.shape[1]), spec.block)
    delta = jnp.sum(dob.astype(_F32) * ob.astype(_F32), -1).transpose(0, 2, 3, 1)
    dq, dk, dv = [], jnp.zeros(kb.shape, _F32), jnp.zeros(vb.shape, _F32)
    for i in range(qb.shape[0]):
        lo = spec.first_block(i)
        keys = (kb[lo : i + 1], vb[lo : i + 1], pb[lo : i + 1], sb[lo : i + 1])
        row = (qb[i], dob[i], lse[i], delta[i], pb[i], sb[i])
        dqi, (dki, dvi) = _backward_row(spec, row, keys)
        dq.append(dqi)
        dk, dv = dk.at[lo : i + 1].add(dki), dv.at[lo : i + 1].add(dvi)
    grads = (jnp.stack(dq).reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape))
    return (*(g.astype(x.dtype) for g, x in zip(grads, (q, k, v), strict=True)), None)


_flash = jax.custom_vjp(_primal, nondiff_argnums=(0,))
_flash.defvjp(_flash_fwd, _flash_bwd)
