"""Flash attention as Pallas kernels (`implementation="pallas"`): the online
softmax of `_flash`, written as three kernels that Pallas compiles with Triton
on GPUs, and runs interpreted on the CPU (where the tests check them):

- forward: one program per block of queries and query head; it walks the key
  blocks the block can see (from its window's start to itself), keeps a running
  maximum, sum and output in f32, and writes the output and each query's
  log-sum-exp;
- `dq`: the same walk, recomputing each block pair's probabilities from the
  log-sum-exp;
- `dk`, `dv`: one program per block of keys and query head, walking the query
  blocks that see it; each query head writes its own `dk`, `dv`, which are
  then summed over the heads that share a key/value head (grouped-query
  attention, heads grouped as Hugging Face's `repeat_kv`).

The masks of `attention` (causal, packed segments, a sliding window) are built
inside the kernels from indices and segment ids, and the scores' options
(`scale`, Gemma 2's `softcap`) applied there: every family's attention has one
kernel, where cuDNN's has no soft-cap. Only one `[block, block]` tile of scores
exists per program, forward and backward.

Triton wants power-of-two tiles of at least 16: the sequence is padded to
whole blocks and the head size to a power of two with zeros (the padded keys
come after every real query, so causality hides them; zero features change no
score and their outputs are cut off).
"""

import dataclasses
import functools

import jax
import jax.lax as lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Float, Int

from .._errors import ConfigError
from ._pallas import interpreted, matmul_precision


ATTENTION_SETTING = "attention_impl = 'auto', 'flash' or 'xla'"
"""What TPUs take instead of the Pallas attention kernels."""


PALLAS_BLOCK = 64
"""Queries (and keys) per block: a 64 x 64 tile of f32 scores, and the
query, key and value tiles beside it, stay within one Triton program's
registers at head sizes up to 256 (untimed: docs/performance.md lists what
remains to measure on a GPU)."""

_NEG = -1e30  # a masked score: finite, so a row without keys yet never gives NaN
_F32 = jnp.float32
_TRANSPOSED_B = (((1,), (1,)), ((), ()))  # a [m, k] . b [n, k] -> [m, n]
_TRANSPOSED_A = (((0,), (0,)), ((), ()))  # a [k, m] . b [k, n] -> [m, n]
_PLAIN = (((1,), (0,)), ((), ()))  # a [m, k] . b [k, n] -> [m, n]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static part of a call: the tiles, the mask's window, the scores'
    options, how many query heads share a key/value head, and whether the
    kernels run interpreted (the CPU) or compiled by Triton (GPUs)."""

    block: int
    blocks: int
    window: int | None
    scale: float
    softcap: float | None
    group: int
    interpret: bool
    precision: lax.Precision | None = None
    """The products' precision: f32 inputs go through TF32 on GPUs by default,
    as XLA's products do; `jax_default_matmul_precision = "highest"` makes
    both exact."""

    def key_blocks(self, i: Array) -> tuple[Array, Array]:
        """The key blocks query block `i` sees: `[first, i]`."""
        if self.window is None:
            return jnp.int32(0), i + 1
        first = jnp.maximum(0, i * self.block - self.window + 1)
        return lax.div(first, jnp.int32(self.block)), i + 1

    def query_blocks(self, j: Array) -> tuple[Array, Array]:
        """The query blocks that see key block `j`: `[j, last]`."""
        if self.window is None:
            return j, jnp.int32(self.blocks)
        last = (j + 1) * self.block - 1 + self.window - 1
        return j, jnp.minimum(self.blocks, lax.div(last, jnp.int32(self.block)) + 1)

    def compiler_params(self, head_dim: int):
        """Triton's launch parameters (none when interpreted)."""
        if self.interpret:
            return None
        from jax.experimental.pallas import triton as plgpu

        return plgpu.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2)


def pallas_attention(
    q: Float[Array, "seq heads head_dim"],
    k: Float[Array, "seq kv_heads head_dim"],
    v: Float[Array, "seq kv_heads head_dim"],
    *,
    segment_ids: Int[Array, " seq"] | None = None,
    sliding_window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    block: int | None = None,
    interpret: bool | None = None,
) -> Float[Array, "seq heads head_dim"]:
    """Causal self-attention as `attention` computes it, by the Pallas kernels
    (module docstring), `block` queries and keys a tile (a power of two >= 16;
    default `PALLAS_BLOCK`, or the sequence rounded up to one when shorter).
    `interpret`: None runs the kernels interpreted on the CPU and compiled by
    Triton on GPUs. Values and gradients equal the plain attention's to the
    dtype's rounding."""
    seq, heads, d = q.shape
    kv_heads = k.shape[1]
    if interpret is None:
        interpret = interpreted(jax.default_backend(), ATTENTION_SETTING)
    size = block or min(PALLAS_BLOCK, max(16, pl.next_power_of_2(seq)))
    if size < 16 or size & (size - 1):
        raise ConfigError(
            f"pallas attention's `block` must be a power of two >= 16; got {size}."
        )
    pad, width = -seq % size, max(16, pl.next_power_of_2(d))
    plan = _Plan(
        block=size, blocks=(seq + pad) // size, window=sliding_window,
        scale=d**-0.5 if scale is None else float(scale),
        softcap=None if softcap is None else float(softcap),
        group=heads // kv_heads, interpret=interpret, precision=matmul_precision(),
    )  # fmt: skip
    heads_first = lambda x: jnp.pad(
        x.transpose(1, 0, 2), [(0, 0), (0, pad), (0, width - d)]
    )
    segs = jnp.zeros((seq,), jnp.int32) if segment_ids is None else segment_ids
    segs = jnp.pad(segs.astype(jnp.int32), (0, pad), mode="edge")
    out = _attend(plan, heads_first(q), heads_first(k), heads_first(v), segs)
    return out[:, :seq, :d].transpose(1, 0, 2)


def _positions(start: Array, size: int) -> Array:
    return start + lax.broadcasted_iota(jnp.int32, (size,), 0)


def _keep(plan: _Plan, q_pos: Array, q_seg: Array, k_pos: Array, k_seg: Array) -> Array:
    """`[q, k]`: which keys each query sees (causal within its segment, and
    within the window)."""
    diff = q_pos[:, None] - k_pos[None, :]
    keep = (diff >= 0) & (q_seg[:, None] == k_seg[None, :])
    if plan.window is not None:
        keep = keep & (diff < plan.window)
    return keep


def _scores(plan: _Plan, q: Array, k: Array) -> Array:
    """A tile's f32 scores `q . k * scale`, capped (before the mask)."""
    s = _dot(plan, q, k, _TRANSPOSED_B) * _F32(plan.scale)
    if plan.softcap is not None:
        s = _F32(plan.softcap) * jnp.tanh(s / _F32(plan.softcap))
    return s


def _dot(plan: _Plan, a: Array, b: Array, dims: tuple = _PLAIN) -> Array:
    """A tile product in f32, at the plan's precision."""
    return lax.dot_general(
        a, b, dims, precision=plan.precision, preferred_element_type=_F32
    )


def _score_grad(plan: _Plan, s: Array, ds: Array) -> Array:
    """The gradient of the raw products `q . k` from that of the capped
    scores `s` (the cap's slope `1 - (s / c)^2`, then the scale)."""
    if plan.softcap is not None:
        ds = ds * (1.0 - jnp.square(s / _F32(plan.softcap)))
    return ds * _F32(plan.scale)


def _forward_kernel(plan: _Plan, q_ref, k_ref, v_ref, qs_ref, ks_ref, o_ref, lse_ref):
    i, b = pl.program_id(0), plan.block
    q, q_seg = q_ref[...], qs_ref[...]
    q_pos = _positions(i * b, b)

    def fold(j: Array, carry: tuple) -> tuple:
        acc, top, total = carry
        keys = pl.ds(j * b, b)
        keep = _keep(plan, q_pos, q_seg, _positions(j * b, b), ks_ref[keys])
        s = jnp.where(keep, _scores(plan, q, k_ref[keys, :]), _NEG)
        new = jnp.maximum(top, jnp.max(s, axis=1))
        p = jnp.where(keep, jnp.exp(s - new[:, None]), 0.0)
        fade = jnp.exp(top - new)
        v = v_ref[keys, :]
        pv = _dot(plan, p.astype(v.dtype), v)
        return acc * fade[:, None] + pv, new, total * fade + jnp.sum(p, axis=1)

    init = (jnp.zeros(q.shape, _F32), jnp.full((b,), _NEG, _F32), jnp.zeros((b,), _F32))
    acc, top, total = lax.fori_loop(*plan.key_blocks(i), fold, init)
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)
    lse_ref[...] = top + jnp.log(total)


def _probabilities(plan: _Plan, q, k, keep, lse) -> tuple[Array, Array]:
    """A tile's capped scores and its probabilities, from the log-sum-exp."""
    s = _scores(plan, q, k)
    return s, jnp.where(keep, jnp.exp(s - lse[:, None]), 0.0)


def _dq_kernel(plan: _Plan, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               qs_ref, ks_ref, dq_ref):  # fmt: skip
    i, b = pl.program_id(0), plan.block
    q, do, lse, delta, q_seg = (
        q_ref[...],
        do_ref[...],
        lse_ref[...],
        delta_ref[...],
        qs_ref[...],
    )
    q_pos = _positions(i * b, b)

    def fold(j: Array, dq: Array) -> Array:
        keys = pl.ds(j * b, b)
        k, v = k_ref[keys, :], v_ref[keys, :]
        keep = _keep(plan, q_pos, q_seg, _positions(j * b, b), ks_ref[keys])
        s, p = _probabilities(plan, q, k, keep, lse)
        dp = _dot(plan, do, v, _TRANSPOSED_B)
        ds = _score_grad(plan, s, p * (dp - delta[:, None])).astype(k.dtype)
        return dq + _dot(plan, ds, k)

    dq = lax.fori_loop(*plan.key_blocks(i), fold, jnp.zeros(q.shape, _F32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _dkv_kernel(plan: _Plan, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                qs_ref, ks_ref, dk_ref, dv_ref):  # fmt: skip
    j, b = pl.program_id(0), plan.block
    k, v, k_seg = k_ref[...], v_ref[...], ks_ref[...]
    k_pos = _positions(j * b, b)

    def fold(i: Array, grads: tuple) -> tuple:
        dk, dv = grads
        rows = pl.ds(i * b, b)
        q, do = q_ref[rows, :], do_ref[rows, :]
        keep = _keep(plan, _positions(i * b, b), qs_ref[rows], k_pos, k_seg)
        s, p = _probabilities(plan, q, k, keep, lse_ref[rows])
        dv = dv + _dot(plan, p.astype(do.dtype), do, _TRANSPOSED_A)
        dp = _dot(plan, do, v, _TRANSPOSED_B)
        ds = _score_grad(plan, s, p * (dp - delta_ref[rows][:, None])).astype(q.dtype)
        return dk + _dot(plan, ds, q, _TRANSPOSED_A), dv

    zeros = jnp.zeros(k.shape, _F32)
    dk, dv = lax.fori_loop(*plan.query_blocks(j), fold, (zeros, zeros))
    dk_ref[...], dv_ref[...] = dk, dv


def _call(plan: _Plan, kernel, grid: tuple[int, int], in_specs, out_specs, out_shape):
    return pl.pallas_call(
        functools.partial(kernel, plan), out_shape=out_shape, grid=grid,
        in_specs=in_specs, out_specs=out_specs, interpret=plan.interpret,
        compiler_params=plan.compiler_params(out_shape[0].shape[-1]),
    )  # fmt: skip


def _specs(plan: _Plan, seq: int, width: int):
    """The block specs of a grid `(block, query head)`: a tile of rows, a
    whole row sequence, and each for the query head or its key/value head."""
    b, g = plan.block, plan.group
    return dict(
        tile=pl.BlockSpec((None, b, width), lambda t, h: (h, t, 0)),
        kv_tile=pl.BlockSpec((None, b, width), lambda t, h: (h // g, t, 0)),
        whole=pl.BlockSpec((None, seq, width), lambda t, h: (h, 0, 0)),
        kv_whole=pl.BlockSpec((None, seq, width), lambda t, h: (h // g, 0, 0)),
        row_tile=pl.BlockSpec((None, b), lambda t, h: (h, t)),
        row_whole=pl.BlockSpec((None, seq), lambda t, h: (h, 0)),
        seg_tile=pl.BlockSpec((b,), lambda t, h: (t,)),
        seg_whole=pl.BlockSpec((seq,), lambda t, h: (0,)),
    )


def _forward(plan: _Plan, q: Array, k: Array, v: Array, segs: Array):
    heads, seq, width = q.shape
    sp = _specs(plan, seq, width)
    shapes = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct((heads, seq), _F32),
    )
    return _call(
        plan, _forward_kernel, (plan.blocks, heads),
        [sp["tile"], sp["kv_whole"], sp["kv_whole"], sp["seg_tile"], sp["seg_whole"]],
        [sp["tile"], sp["row_tile"]], shapes,
    )(q, k, v, segs, segs)  # fmt: skip


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(plan: _Plan, q: Array, k: Array, v: Array, segs: Array) -> Array:
    return _forward(plan, q, k, v, segs)[0]


def _attend_fwd(plan: _Plan, q: Array, k: Array, v: Array, segs: Array):
    out, lse = _forward(plan, q, k, v, segs)
    return out, (q, k, v, segs, out, lse)


def _attend_bwd(plan: _Plan, saved: tuple, dout: Array):
    q, k, v, segs, out, lse = saved
    heads, seq, width = q.shape
    delta = jnp.sum(dout.astype(_F32) * out.astype(_F32), axis=-1)
    sp = _specs(plan, seq, width)
    dq = _call(
        plan, _dq_kernel, (plan.blocks, heads),
        [sp["tile"], sp["kv_whole"], sp["kv_whole"], sp["tile"], sp["row_tile"],
         sp["row_tile"], sp["seg_tile"], sp["seg_whole"]],
        [sp["tile"]], (jax.ShapeDtypeStruct(q.shape, q.dtype),),
    )(q, k, v, dout, lse, delta, segs, segs)[0]  # fmt: skip
    per_head = jax.ShapeDtypeStruct(q.shape, _F32)
    dk, dv = _call(
        plan, _dkv_kernel, (plan.blocks, heads),
        [sp["whole"], sp["kv_tile"], sp["kv_tile"], sp["whole"], sp["row_whole"],
         sp["row_whole"], sp["seg_whole"], sp["seg_tile"]],
        [sp["tile"], sp["tile"]], (per_head, per_head),
    )(q, k, v, dout, lse, delta, segs, segs)  # fmt: skip
    grouped = lambda g: (
        g.reshape(-1, plan.group, seq, width).sum(axis=1).astype(k.dtype)
    )
    return dq, grouped(dk), grouped(dv), None


_attend.defvjp(_attend_fwd, _attend_bwd)
