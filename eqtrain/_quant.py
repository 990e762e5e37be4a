"""Frozen weights in 4 or 8 bits: `QuantizedWeight`, the codes that make one
(`quantize`, on the host, one tensor at a time, its rows split over the
processor's cores), and the products that use one
(`matmul_t`, `apply_linear`: the weight dequantized beside the product, again in
the backward pass instead of being kept).

Three kinds, with bitsandbytes' layouts and arithmetic (QLoRA, Dettmers et al.
2023, arXiv:2305.14314):

- `"nf4"`, `"fp4"`: each run of `block` (64) consecutive values of a row is
  scaled by its absolute maximum and rounded to the nearest of 16 values (the
  NormalFloat or the 4-bit float codebook); two codes per byte, the first in the
  high nibble. With double quantization each tensor's block maxima, less their
  mean, are themselves stored in 8 bits (bitsandbytes' signed dynamic map,
  blocks of 256): about 4.13 bits per value instead of 4.5.
- `"int8"`: each row scaled by its absolute maximum to [-127, 127] and rounded
  (bitsandbytes' `int8_vectorwise_quant`, LLM.int8() without outliers).

A row whose width is not a whole number of blocks is never quantized (the
callers leave such a weight as it is).

A floor-0 piece: models, precision policies, sharding and the Hugging Face
reader all meet `QuantizedWeight`, so it sits below them all.
"""

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array


KINDS = ("nf4", "fp4", "int8")
"""The kinds of `QuantizedWeight`."""

BLOCK = 64
"""Values per scale of the 4-bit kinds (bitsandbytes' and QLoRA's default)."""

BLOCK2 = 256
"""Block maxima per second-level scale with double quantization."""

NF4 = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)
"""The NormalFloat4 codebook: quantiles of a standard normal, scaled to
[-1, 1], with an exact zero (QLoRA, appendix E; bitsandbytes' table)."""

FP4 = np.array(
    [0, 0.0625, 8, 12, 4, 6, 2, 3, -0.0, -0.0625, -8, -12, -4, -6, -2, -3],
    np.float32,
) / np.float32(12)
"""The 4-bit float codebook (1 sign, 2 exponent, 1 mantissa bit) in
bitsandbytes' bit order, scaled to [-1, 1]."""

_INT8_SCALE = np.float32(7.874015718698502e-3)  # 1 / 127 as bitsandbytes writes it


def dynamic_map() -> np.ndarray:
    """The 256 values of the signed 8-bit dynamic type (Dettmers 2015,
    arXiv:1511.04561) that double quantization rounds block maxima to: for
    exponents 1e-6 .. 1, the midpoints of an even split of [0.1, 1] into 2**e
    parts, each with both signs, then 0 and 1, sorted."""
    data: list[float] = []
    for i in range(7):
        bounds = _linspace(0.1, 1.0, 2**i + 1)
        means = (bounds[:-1] + bounds[1:]) / np.float32(2)
        scaled = np.float32(10.0 ** (i - 6)) * means
        data += scaled.tolist() + (-scaled).tolist()
    data += [0.0, 1.0]
    return np.sort(np.array(data, np.float32))


def _linspace(start: float, end: float, steps: int) -> np.ndarray:
    """`torch.linspace` in float32 on the CPU: the first half counted up from
    `start`, the second down from `end`, each point one fused multiply-add
    (computed in float64, where the product is exact, and rounded once)."""
    step = (np.float32(end) - np.float32(start)) / np.float32(steps - 1)
    i = np.arange(steps, dtype=np.float64)
    up = np.float64(np.float32(start)) + np.float64(step) * i
    down = np.float64(np.float32(end)) - np.float64(step) * (steps - 1 - i)
    return np.where(i < steps // 2, up, down).astype(np.float32)


DYNAMIC = dynamic_map()
"""`dynamic_map()`, computed once."""


def codebook(kind: str) -> np.ndarray:
    """The values a 4-bit code stands for (`"nf4"`, `"fp4"`), in code order."""
    return {"nf4": NF4, "fp4": FP4}[kind]


@functools.cache
def _bounds(kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Midpoints between a codebook's sorted values, and the code of each sorted
    value (values at or below a midpoint round down)."""
    table = codebook(kind)
    order = np.argsort(table, kind="stable")
    ordered = table[order]
    return ((ordered[:-1] + ordered[1:]) / np.float32(2)), order.astype(np.uint8)


class QuantizedWeight(eqx.Module):
    """A frozen weight `[*lead, out, in]` stored in 4 or 8 bits.

    It stands where a linear layer's (or the experts') weight array stands:
    `shape` and `dtype` are the weight's, `dequantize()` gives it back, and the
    layers' products take it as it is (`matmul_t`). Its arrays carry the same
    leading axes as the weight (stacked layers, experts), so a scan over layers
    slices them like any other parameter. It never trains: the trainable filters
    of `eqtrain.lora` leave it out.

    Attributes:
        codes: `uint8 [*lead, out, in // 2]` (two 4-bit codes per byte) or
            `int8 [*lead, out, in]`.
        scales: per block `[*lead, out, in // 64]`: `float32`, or `uint8` codes
            into the dynamic map with double quantization; per row `float32
            [*lead, out]` for int8.
        scales2: double quantization's `float32 [*lead, ceil(out * in / 64 /
            256)]`, the scale of each 256 block maxima; else None.
        offset: double quantization's `float32 [*lead]`, the mean of each
            tensor's block maxima (added back); else None.
        kind: `"nf4"`, `"fp4"` or `"int8"`.
        dtype: the weight's dtype (what `dequantize` returns by default; LoRA
            adapters on it take this dtype).
    """

    # `Any`: arrays, numpy arrays while filled on the host, or `ShapeDtypeStruct`s
    codes: Any
    scales: Any
    scales2: Any
    offset: Any
    kind: str = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, width = self.codes.shape
        return (*lead, width * (1 if self.kind == "int8" else 2))

    @property
    def ndim(self) -> int:
        return len(self.codes.shape)

    @property
    def double(self) -> bool:
        """Whether the block maxima are quantized too."""
        return self.scales2 is not None

    def astype(self, dtype: Any) -> "QuantizedWeight":
        """The same codes, dequantizing to `dtype` (precision policies cast a
        model's floating leaves with this)."""
        return eqx.tree_at(lambda q: q.dtype, self, jnp.dtype(dtype))

    def dequantize(self, dtype: Any = None) -> Array:
        """The weight `[*lead, out, in]` in `dtype` (default: `self.dtype`),
        computed in float32 as bitsandbytes' `dequantize_4bit` (or
        `int8_vectorwise_dequant`) does."""
        dtype = self.dtype if dtype is None else dtype
        if self.kind == "int8":
            rows = jnp.asarray(self.scales, jnp.float32)[..., None]
            values = jnp.asarray(self.codes).astype(jnp.float32)
            return (values * rows * _INT8_SCALE).astype(dtype)
        table = jnp.asarray(codebook(self.kind))
        high = (self.codes >> 4).astype(jnp.int32)
        low = (self.codes & 15).astype(jnp.int32)
        values = jnp.stack([table[high], table[low]], axis=-1)
        *lead, out, half = self.codes.shape
        blocks = values.reshape(*lead, out, half * 2 // BLOCK, BLOCK)
        w = blocks * self.block_scales()[..., None]
        return w.reshape(*lead, out, half * 2).astype(dtype)

    def block_scales(self) -> Array:
        """The float32 scale of every block, `[*lead, out, in // 64]` (with
        double quantization: dequantized from the 8-bit codes)."""
        if self.scales2 is None:
            return self.scales.astype(jnp.float32)
        *lead, out, nb = self.scales.shape
        n = out * nb
        groups = self.scales2.shape[-1]
        codes = self.scales.reshape(*lead, n)
        codes = jnp.pad(codes, [(0, 0)] * len(lead) + [(0, groups * BLOCK2 - n)])
        values = jnp.asarray(DYNAMIC)[codes.astype(jnp.int32)]
        values = values.reshape(*lead, groups, BLOCK2) * self.scales2[..., None]
        flat = values.reshape(*lead, groups * BLOCK2)[..., :n]
        return flat.reshape(*lead, out, nb) + self.offset[..., None, None]

    def take(self, index: Any) -> "QuantizedWeight":
        """The weight at `index` of its first axis (one expert, one layer): every
        array indexed there (`index` may be traced)."""
        get = lambda a: lax.dynamic_index_in_dim(a, index, keepdims=False)
        return jtu.tree_map(get, self)

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays."""
        leaves = jtu.tree_leaves(self)
        return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves))


def is_quantized(x: Any) -> bool:
    return isinstance(x, QuantizedWeight)


def quantizable(shape: tuple[int, ...], kind: str) -> bool:
    """Whether a weight of `shape` (`[*lead, out, in]`) can be quantized as
    `kind`: its rows are whole blocks (4-bit kinds)."""
    return len(shape) >= 2 and (kind == "int8" or shape[-1] % BLOCK == 0)


# ---------------------------------------------------------------------------
# Making codes: numpy on the host, one tensor at a time, its rows in pieces that
# run on threads (numpy releases the GIL inside each operation).

_PIECE = 2**18  # values of a tensor quantized in one piece (1 MiB of float32): an
# expert's tensor (768 x 2048 in Qwen3-30B-A3B) still spreads over six threads


_MOST_THREADS = 16  # past this, memory bandwidth bounds the pieces, not cores


def _threads() -> int:
    """The processor's cores this process may run on, at most `_MOST_THREADS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, _MOST_THREADS))


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """The threads that quantize a tensor's pieces, one per core (`_threads`;
    started on first use and kept: loading a model quantizes hundreds of
    tensors)."""
    return ThreadPoolExecutor(_threads(), thread_name_prefix="eqtrain-quantize")


if hasattr(os, "register_at_fork"):  # a forked child has none of the threads
    os.register_at_fork(after_in_child=_pool.cache_clear)


def _scaled(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row of `blocks` scaled by its absolute maximum (as bitsandbytes:
    times the maximum's reciprocal, clamped to [-1, 1]), and the maxima."""
    absmax = np.abs(blocks).max(axis=-1)
    inv = np.float32(1.0) / np.maximum(absmax, np.float32(1e-38))
    return np.clip(blocks * inv[:, None], -1, 1), absmax


def _nearest(x: np.ndarray, kind: str) -> np.ndarray:
    """Each value's nearest code in a codebook, as `torch.bucketize` over the
    midpoints finds it (`np.searchsorted(mid, x, side="left")`): the number of
    midpoints below the value, so that a tie rounds down and NaN lands past
    them all. Counted with one comparison per midpoint, which numpy runs about
    five times faster than its binary search."""
    mid, order = _bounds(kind)
    below = np.full(x.shape, len(mid), np.uint8)
    for m in mid:
        below -= x <= m
    return order[below]


def _tensor_4bit(
    x: np.ndarray, kind: str, piece: int = _PIECE
) -> tuple[np.ndarray, np.ndarray]:
    """One tensor `[out, in]`'s packed codes `[out, in // 2]` and float32 block
    maxima `[out, in // 64]`, in pieces of about `piece` values (whole rows)
    quantized on `_pool`'s threads. Each block is a row's own, so the pieces
    are independent and the result is the same however the rows are cut."""
    out, width = x.shape
    codes = np.empty((out, width // 2), np.uint8)
    absmax = np.empty((out, width // BLOCK), np.float32)
    rows = max(1, piece // width)

    def fill(r: int) -> None:
        part = np.asarray(x[r : r + rows], np.float32)
        scaled, am = _scaled(part.reshape(-1, BLOCK))
        q = _nearest(scaled.reshape(-1), kind).reshape(part.shape)
        codes[r : r + rows] = (q[:, 0::2] << 4) | q[:, 1::2]
        absmax[r : r + rows] = am.reshape(part.shape[0], -1)

    starts = range(0, out, rows)
    if len(starts) == 1 or _threads() == 1:
        for r in starts:
            fill(r)
    else:
        for done in [_pool().submit(fill, r) for r in starts]:
            done.result()  # raises what a piece raised
    return codes, absmax


def _double(
    absmax: np.ndarray, offset: Any = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Block maxima less their mean in 8 bits, as bitsandbytes' CPU
    `quantize_blockwise` makes them (blocks of 256, each times the reciprocal
    of its absolute maximum, rounded through a table of 65,536 points):
    codes shaped as `absmax`, the 256-block scales, and the mean.

    The mean is summed in float64 and rounded once (`offset` given: that one).
    torch sums float32 in an order that depends on the CPU's vector width, so
    bitsandbytes' mean can differ from this one in its last bit; its codes are
    then still these, but for the rare value that falls on a rounding edge."""
    flat = absmax.reshape(-1)
    if offset is None:
        offset = flat.astype(np.float64).sum() / flat.size
    offset = np.float32(offset)
    centred = flat - offset
    n = centred.size
    groups = -(-n // BLOCK2)
    padded = np.zeros(groups * BLOCK2, np.float32)
    padded[:n] = centred
    blocks = padded.reshape(groups, BLOCK2)
    scale2 = np.abs(blocks).max(axis=-1)  # the padding's zeros never count
    codes = _lut_codes(blocks, scale2).reshape(-1)[:n]
    return codes.reshape(absmax.shape), scale2, np.asarray(offset)


_LUT = 65536


@functools.cache
def _lut() -> np.ndarray:
    """bitsandbytes' CPU lookup table for 8-bit codes: 65,536 evenly spaced
    points of [-1, 1], each with the first map entry whose midpoint with the
    next is not below it."""
    table = DYNAMIC
    mid = np.float32(0.5) * (table[:-1] + table[1:])
    points = np.float32(-1) + (
        np.float32(2) * np.arange(_LUT, dtype=np.float32)
    ) / np.float32(_LUT - 1)
    return np.searchsorted(mid, points, side="left").astype(np.uint8)


def _lut_codes(blocks: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Each row of `blocks` times its scale's reciprocal, rounded to the nearest
    of the lookup table's points, and that point's code (bitsandbytes'
    `quantize_blockwise` on the CPU; a row whose scale is 0 gets code 0)."""
    inv = np.float32(1) / np.where(scale > 0, scale, np.float32(1))
    v = np.clip(blocks * inv[:, None], np.float32(-1), np.float32(1))
    at = (v + np.float32(1)) * np.float32(0.5) * np.float32(_LUT - 1) + np.float32(0.5)
    codes = _lut()[at.astype(np.uint16)]
    return np.where((scale > 0)[:, None], codes, np.uint8(0))


def _tensor_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One tensor's int8 rows and their float32 absolute maxima."""
    x = np.asarray(x)
    absmax = np.abs(x).max(axis=-1).astype(np.float32)
    safe = np.where(absmax > 0, absmax, np.float32(1))  # a row of zeros: codes 0
    scaled = x.astype(np.float32) * (np.float32(127.0) / safe)[:, None]
    return np.round(scaled).astype(np.int8), absmax


def quantize_tensor(x: np.ndarray, kind: str, *, double: bool = True) -> dict[str, Any]:
    """The arrays of one `[out, in]` tensor quantized as `kind` (`codes`,
    `scales`, and with double quantization `scales2`, `offset`), as numpy."""
    if kind == "int8":
        codes, scales = _tensor_int8(x)
        return {"codes": codes, "scales": scales, "scales2": None, "offset": None}
    codes, absmax = _tensor_4bit(x, kind)
    if not double:
        return {"codes": codes, "scales": absmax, "scales2": None, "offset": None}
    scales, scales2, offset = _double(absmax)
    return {"codes": codes, "scales": scales, "scales2": scales2, "offset": offset}


def abstract(
    shape: tuple[int, ...], dtype: Any, kind: str, *, double: bool = True
) -> QuantizedWeight:
    """The `QuantizedWeight` of a weight of `shape`, with `ShapeDtypeStruct`
    arrays (for templates, dry runs and shardings)."""
    *lead, out, width = shape
    s = lambda shp, dt: jax.ShapeDtypeStruct(tuple(shp), jnp.dtype(dt))
    if kind == "int8":
        return QuantizedWeight(
            s((*lead, out, width), jnp.int8), s((*lead, out), jnp.float32),
            None, None, kind, jnp.dtype(dtype),
        )  # fmt: skip
    nb = width // BLOCK
    codes = s((*lead, out, width // 2), jnp.uint8)
    if not double:
        scales = s((*lead, out, nb), jnp.float32)
        return QuantizedWeight(codes, scales, None, None, kind, jnp.dtype(dtype))
    groups = -(-(out * nb) // BLOCK2)
    return QuantizedWeight(
        codes, s((*lead, out, nb), jnp.uint8), s((*lead, groups), jnp.float32),
        s(tuple(lead), jnp.float32), kind, jnp.dtype(dtype),
    )  # fmt: skip


def quantize(x: Any, kind: str, *, double: bool = True) -> QuantizedWeight:
    """`x` (`[*lead, out, in]`, an array or numpy) quantized tensor by tensor
    over its leading axes, as numpy arrays in a `QuantizedWeight` (place them
    with `jax.device_put`). Each `[out, in]` tensor is quantized on its own, as
    bitsandbytes quantizes a Hugging Face checkpoint's tensors."""
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {', '.join(KINDS)}; got {kind!r}.")
    shape = tuple(x.shape)
    if not quantizable(shape, kind):
        raise ValueError(
            f"a weight of shape {shape} cannot be quantized as {kind}: its rows "
            f"must be whole blocks of {BLOCK} values."
        )
    dtype = jnp.dtype(x.dtype)
    filler = Filler(abstract(shape, dtype, kind, double=double))
    array = np.asarray(x) if not isinstance(x, jax.Array) else None
    for at in np.ndindex(*shape[:-2]):
        part = array[at] if array is not None else np.asarray(x[at])
        filler.put(at, part)
    return filler.weight()


class Filler:
    """Host buffers for one `QuantizedWeight`, filled one `[out, in]` tensor at a
    time (`put`): peak memory is the quantized weight and one tensor."""

    def __init__(self, template: QuantizedWeight):
        self.template = template
        self.arrays = {
            name: None if a is None else np.zeros(a.shape, a.dtype)
            for name, a in _fields(template).items()
        }

    def put(self, at: tuple[int, ...], tensor: np.ndarray) -> None:
        parts = quantize_tensor(tensor, self.template.kind, double=self.template.double)
        for name, value in parts.items():
            if value is not None:
                self.arrays[name][at] = value

    def weight(
        self, place: Callable[[str, np.ndarray], Any] | None = None
    ) -> QuantizedWeight:
        """The filled weight; `place(name, array)` puts each array somewhere."""
        place = place or (lambda _, a: a)
        values = {k: None if v is None else place(k, v) for k, v in self.arrays.items()}
        t = self.template
        return QuantizedWeight(
            values["codes"], values["scales"], values["scales2"], values["offset"],
            t.kind, t.dtype,
        )  # fmt: skip


def _fields(q: QuantizedWeight) -> dict[str, Any]:
    return {
        "codes": q.codes,
        "scales": q.scales,
        "scales2": q.scales2,
        "offset": q.offset,
    }


# ---------------------------------------------------------------------------
# Products with a quantized weight.


def dense(w: Any, dtype: Any = None) -> Array:
    """`w` as an array: a `QuantizedWeight` dequantized (to `dtype`), an array
    as it is. For products that are not `apply_linear`'s (their backward pass
    keeps what they use)."""
    return w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w


def apply_linear(fn: Callable[[Array, Array], Array], x: Array, w: Any) -> Array:
    """`fn(x, W)` for `fn` linear in `x`, with `W = w` dequantized to `x`'s dtype
    when `w` is a `QuantizedWeight`. The backward pass dequantizes `W` again
    rather than keeping it: what a step keeps of a quantized layer is its codes,
    never the wide weight (which across stacked layers would be the whole model
    in the compute dtype). `w` gets no gradient (it is frozen)."""
    if not isinstance(w, QuantizedWeight):
        return fn(x, w)
    leaves, treedef = jtu.tree_flatten(w)
    return _linear(fn, treedef, (tuple(x.shape), jnp.dtype(x.dtype)), x, *leaves)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _linear(fn: Callable, treedef: Any, like: Any, x: Array, *leaves: Array) -> Array:
    w = jtu.tree_unflatten(treedef, leaves)
    return fn(x, w.dequantize(x.dtype))


def _linear_fwd(fn: Callable, treedef: Any, like: Any, x: Array, *leaves: Array) -> Any:
    return _linear(fn, treedef, like, x, *leaves), leaves


def _linear_bwd(fn: Callable, treedef: Any, like: Any, leaves: Any, dy: Array) -> Any:
    shape, dtype = like
    w = jtu.tree_unflatten(treedef, leaves).dequantize(dtype)
    transpose = jax.linear_transpose(
        lambda x: fn(x, w), jax.ShapeDtypeStruct(shape, dtype)
    )
    (dx,) = transpose(dy)
    return (dx, *(_zero_like(a) for a in leaves))


def _zero_like(a: Array) -> Any:
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, jax.dtypes.float0)


_linear.defvjp(_linear_fwd, _linear_bwd)


def _dot_t(x: Array, w: Array) -> Array:
    return lax.dot_general(x, w, (((x.ndim - 1,), (w.ndim - 1,)), ((), ())))


def matmul_t(x: Array, w: Any) -> Array:
    """`x @ w.T` over the last dimension of `x`, for an array or a
    `QuantizedWeight` `w` (`[out, in]`)."""
    return apply_linear(_dot_t, x, w)
