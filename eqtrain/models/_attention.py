"""Attention kernels and their masks: causal attention of one sequence
(`attention`), dispatching to one fused call (`dot_attention`), causal query
blocks (`causal_blocks`) or rematerialised query chunks (`blocked_attention`);
or flash blocks (`_flash.flash_attention`, `implementation="flash"`), or the
same as Pallas kernels (`_pallas_attention`, `implementation="pallas"`: Triton
on GPUs, interpreted on the CPU); the masks come from positions and segment
ids (`_masks`). A new kernel belongs beside these.

Sequence-parallel attention (`_sequence`) and the KV cache's (`_cache`) build on
these masks and kernels.
"""

import functools
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from .._errors import ConfigError
from .._reduce import row_softmax, row_sum
from .._rows import rows_follow_mesh
from ._flash import flash_attention
from ._masks import position_mask, segment_mask
from ._pallas import free_axes, split_over_devices
from ._pallas_attention import pallas_attention


def attention(
    q: Float[Array, "seq heads head_dim"],
    k: Float[Array, "seq kv_heads head_dim"],
    v: Float[Array, "seq kv_heads head_dim"],
    *,
    segment_ids: Int[Array, " seq"] | None,
    sliding_window: int | None,
    implementation: str | None,
    query_chunk: int = 0,
    scale: float | None = None,
    softcap: float | None = None,
) -> Float[Array, "seq heads head_dim"]:
    """Causal attention: XLA's, in causal blocks of queries (`causal_blocks`;
    one block up to 128 tokens), or a kernel `implementation` names.

    Query head `h` reads key/value head `h // (heads // kv_heads)` (grouped-query
    attention, heads grouped contiguously as Hugging Face's `repeat_kv`). A position
    attends to earlier-or-same positions with the same segment id, and, with a
    sliding window `w`, only to the last `w` of them (itself included), as Mistral.

    `query_chunk > 0` (and shorter than the sequence): the queries go through in
    blocks of that many (`blocked_attention`), so that the `[heads, seq, seq]`
    scores never exist at once, in the backward pass either.

    `implementation="flash"`: flash blocks (`flash_attention`: an online
    softmax over key blocks, the probabilities recomputed in the backward pass),
    so that no `[heads, block, seq]` scores exist either; "cudnn": one fused
    GPU kernel (`dot_attention`); None or "xla": XLA's, the causal blocks;
    "auto": `resolved_implementation`.
    "pallas": the flash blocks as Pallas kernels (`pallas_attention`: Triton
    on GPUs, interpreted on the CPU). cuDNN has no soft-capped kernel: with a
    `softcap`, "cudnn" takes the Pallas kernels (Gemma 2 on GPUs).

    `scale` multiplies the scores (default `head_dim ** -0.5`); `softcap` caps
    them as `softcap * tanh(scores / softcap)` before the mask (Gemma 2).
    """
    implementation = resolved_implementation(
        implementation, q.dtype, q.shape[-1], softcap
    )
    common = dict(
        segment_ids=segment_ids, sliding_window=sliding_window,
        implementation=implementation, scale=scale, softcap=softcap,
    )  # fmt: skip
    if implementation == "pallas" or (implementation == "cudnn" and softcap):
        return pallas_on_devices(q, k, v, **_flash_args(common))
    if implementation == "cudnn":  # the fused kernel takes the whole sequence
        return one_call_attention(q, k, v, **common)
    if implementation == "flash":
        return flash_attention(q, k, v, **_flash_args(common))
    if 0 < query_chunk < q.shape[0]:
        return blocked_attention(q, k, v, query_chunk=query_chunk, **common)
    return causal_blocks(q, k, v, **_flash_args(common))  # None or "xla"


CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
"""The dtypes cuDNN's fused attention takes."""
CUDNN_HEAD_DIMS = range(8, 129, 8)
"""The head sizes `"auto"` gives cuDNN's fused attention (multiples of 8 up to
128, which every cuDNN 9 release takes); larger heads go to the Pallas kernels."""


@functools.cache
def has_cudnn() -> bool:
    """Whether this process's GPUs are CUDA's (cuDNN's fused attention; ROCm
    has none: Triton's kernels run there)."""
    if jax.default_backend() != "gpu":
        return False
    version = getattr(jax.devices()[0].client, "platform_version", "")
    return "rocm" not in str(version).lower()


def resolved_implementation(
    implementation: str | None, dtype: Any, head_dim: int, softcap: float | None
) -> str | None:
    """The kernel `"auto"` stands for, for queries of `dtype` and `head_dim`: on
    CUDA GPUs cuDNN's fused attention where it applies (bf16 or f16 queries, a
    head size of `CUDNN_HEAD_DIMS`, no soft-cap), else (and on ROCm) the Pallas
    kernels: on one device, or under a mesh that XLA splits over several
    (`split_over_devices`) where each device's rows reach them
    (`rows_follow_mesh`; `pallas_on_devices` maps them), else XLA's; XLA's
    elsewhere (the CPU, TPUs). Any other value is returned as it is."""
    if implementation != "auto":
        return implementation
    if jax.default_backend() != "gpu":
        return None
    fits = dtype in CUDNN_DTYPES and head_dim in CUDNN_HEAD_DIMS
    if has_cudnn() and fits and softcap is None:
        return "cudnn"
    return "pallas" if rows_follow_mesh() or not split_over_devices() else None


def tensor_heads(tensor: int, q: Array, k: Array, v: Array) -> tuple[Array, Array, Any]:
    """`(k, v, axis)`: the mesh axis of the heads, `"tensor"` (of size `tensor`)
    when it divides the query heads (whole heads per device, as the
    tensor-parallel rules put them), else None (gathered); the key/value heads
    repeated (as GQA groups them) when too few to split."""
    split = tensor > 1 and q.shape[1] % tensor == 0
    if split and k.shape[1] % tensor:
        k, v = (jnp.repeat(x, q.shape[1] // k.shape[1], axis=1) for x in (k, v))
    return k, v, "tensor" if split else None


def pallas_on_devices(
    q: Float[Array, "seq heads head_dim"],
    k: Float[Array, "seq kv_heads head_dim"],
    v: Float[Array, "seq kv_heads head_dim"],
    *,
    segment_ids: Int[Array, " seq"] | None,
    **kernel: Any,
) -> Float[Array, "seq heads head_dim"]:
    """`pallas_attention`, on each device's own rows and heads under a mesh
    that XLA splits (`split_over_devices`): a `shard_map` over every mesh axis,
    the heads on `tensor` (`tensor_heads`), the rows on the batch axes of the
    `vmap` around the model (`eqtrain._rows.vmap_rows`), so that nothing is
    gathered. Elsewhere the kernels as they are."""
    if not split_over_devices():
        return pallas_attention(q, k, v, segment_ids=segment_ids, **kernel)
    free = free_axes()
    k, v, axis = tensor_heads(free.get("tensor", 1), q, k, v)
    heads = P(None, axis)
    segs = jnp.zeros(q.shape[:1], jnp.int32) if segment_ids is None else segment_ids
    given = segment_ids is not None

    def local(q: Array, k: Array, v: Array, s: Array) -> Array:
        return pallas_attention(q, k, v, segment_ids=s if given else None, **kernel)

    mapped = jax.shard_map(
        local,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(heads, heads, heads, P()),
        out_specs=heads,
        axis_names=set(free),
        check_vma=False,
    )
    return mapped(q, k, v, segs.astype(jnp.int32))


def _flash_args(common: dict[str, Any]) -> dict[str, Any]:
    """`attention`'s keywords as `flash_attention` and `causal_blocks` take
    them (the kernel is theirs)."""
    return {k: v for k, v in common.items() if k != "implementation"}


def one_call_attention(
    q: Float[Array, "seq heads head_dim"],
    k: Float[Array, "seq kv_heads head_dim"],
    v: Float[Array, "seq kv_heads head_dim"],
    *,
    segment_ids: Int[Array, " seq"] | None,
    sliding_window: int | None,
    **kernel: Any,
) -> Float[Array, "seq heads head_dim"]:
    """`attention` as one `dot_attention` over the whole sequence: its causal
    mask and window, and the segments' mask (`kernel`: `implementation`,
    `scale`, `softcap`)."""
    mask = None
    if segment_ids is not None:
        mask = segment_mask(segment_ids)[None]
    window = None if sliding_window is None else (sliding_window - 1, 0)
    return dot_attention(
        q, k, v, mask=mask, is_causal=True, local_window_size=window, **kernel
    )


_MASKED = -1e30  # a masked score: finite, so a fully masked row never gives NaN


def dot_attention(
    q: Float[Array, "q heads head_dim"],
    k: Float[Array, "k kv_heads head_dim"],
    v: Float[Array, "k kv_heads head_dim"],
    *,
    mask: Bool[Array, "#heads q k"] | None = None,
    is_causal: bool = False,
    local_window_size: tuple[int, int] | None = None,
    implementation: str | None = None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Float[Array, "q heads head_dim"]:
    """`jax.nn.dot_product_attention`, or, with a `softcap`, the same computation
    written out (no fused kernel caps scores): f32 scores `q . k * scale`,
    `softcap * tanh(scores / softcap)`, masked, softmax in f32, cast to `q`'s
    dtype, times `v`. Grouped-query heads as `attention`."""
    implementation = resolved_implementation(
        implementation, q.dtype, q.shape[-1], softcap
    )
    if implementation in ("flash", "pallas"):  # kernels of `attention`; one
        implementation = None  # masked call is XLA's
    if softcap is None:
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            is_causal=is_causal,
            local_window_size=local_window_size,
            implementation=implementation,  # pyright: ignore[reportArgumentType]
            scale=scale,
        )
    if implementation == "cudnn":
        raise ConfigError(
            "attention soft-capping (attn_logit_softcapping, Gemma 2) has no "
            "cuDNN kernel here (a masked or sequence-parallel call); use "
            "attention_impl = 'pallas', None or 'xla'."
        )
    keep = _grouped_mask(q, k, mask, is_causal, local_window_size)
    return capped_attention(q, k, v, keep, scale=scale, softcap=softcap)


def capped_attention(
    q: Float[Array, "q heads head_dim"],
    k: Float[Array, "k kv_heads head_dim"],
    v: Float[Array, "k kv_heads head_dim"],
    keep: Bool[Array, "#kv_heads #group q k"],
    *,
    scale: float | None,
    softcap: float,
) -> Float[Array, "q heads head_dim"]:
    """The soft-capped attention written out (`heads_first_attention`, each
    key/value head with its group of query heads)."""
    kv_heads = k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = heads_first_attention(
        heads_first(q, kv_heads), *(x.transpose(1, 0, 2) for x in (k, v)), keep,
        scale=scale, softcap=softcap,
    )  # fmt: skip
    return seq_first(out)


def heads_first(q: Float[Array, "seq heads d"], kv_heads: int) -> Array:
    """Query heads `[seq, heads, d]` as `[kv_heads, group, seq, d]`: each
    key/value head's group of query heads (Hugging Face's `repeat_kv` order)."""
    seq, heads, d = q.shape
    return q.reshape(seq, kv_heads, heads // kv_heads, d).transpose(1, 2, 0, 3)


def seq_first(out: Float[Array, "kv_heads group seq d"]) -> Array:
    """`heads_first`'s inverse: `[seq, heads, d]`."""
    kv_heads, group, seq, d = out.shape
    return out.transpose(2, 0, 1, 3).reshape(seq, kv_heads * group, d)


def heads_first_attention(
    q: Float[Array, "kv_heads group q d"],
    k: Float[Array, "kv_heads k d"],
    v: Float[Array, "kv_heads k d"],
    keep: Bool[Array, "*#heads q k"],
    *,
    scale: float,
    softcap: float | None,
) -> Float[Array, "kv_heads group q d"]:
    """Attention with the heads in front (`heads_first`), so that XLA's batched
    products take their operands as they are: f32 scores `q . k * scale`
    (capped at `softcap * tanh(scores / softcap)`), those not in `keep`
    (`[q, k]`, or with leading head axes that broadcast) masked, softmax in
    f32, cast to `k`'s dtype, times `v`; the numerics of
    `jax.nn.dot_product_attention`'s XLA implementation. Without a cap it is
    `_softmax_attention` (the scores masked before they are scaled, and a
    gradient of its own)."""
    if softcap is None:
        return _softmax_attention(q, k, v, keep, scale)
    q, keep, masked = _in_layer(q, keep)
    scores = jnp.einsum("kgqd,ksd->kgqs", q, k, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(scale)
    scores = jnp.float32(softcap) * jnp.tanh(scores / jnp.float32(softcap))
    scores = jnp.where(keep, scores, masked)
    probs = row_softmax(scores).astype(k.dtype)
    return jnp.einsum("kgqs,ksd->kgqd", probs, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _softmax_attention(
    q: Float[Array, "kv_heads group q d"],
    k: Float[Array, "kv_heads k d"],
    v: Float[Array, "kv_heads k d"],
    keep: Bool[Array, "*#heads q k"],
    scale: float,
) -> Float[Array, "kv_heads group q d"]:
    """`heads_first_attention` without a cap, with a gradient written for the
    CPU's products:

    - Every product stands alone. What follows one is first a `where` of the
      mask, which oneDNN's fusions do not take in, and only then the scale
      (forward) or the softmax's gradient: XLA would fuse a multiplication or
      subtraction into the product, and oneDNN's fusions in the jaxlibs
      `eqtrain.cpu` verified compute one wrongly when its other operand (a
      broadcast scale) shares
      the result's memory (`eqtrain.cpu._onednn`).
    - The keys' and values' gradients come out as `[d, k]` (`q^T ds`,
      `do^T p`), reading the large `[q, k]` operand as it lies, where
      autodiff's `ds^T q` first writes `ds` transposed.
    """
    return _softmax_forward(q, k, v, keep, scale)[0]


def _softmax_forward(
    q: Array, k: Array, v: Array, keep: Array, scale: float
) -> tuple[Array, tuple[Array, ...]]:
    q, keep, masked = _in_layer(q, keep)
    scores = jnp.einsum("kgqd,ksd->kgqs", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(keep, scores, masked) * jnp.float32(scale)
    probs = row_softmax(scores)
    out = jnp.einsum("kgqs,ksd->kgqd", probs.astype(k.dtype), v)
    return out, (q, k, v, keep, probs, out)


def _in_layer(q: Array, keep: Array) -> tuple[Array, Array, Array]:
    """`(q, keep, _MASKED)` through one optimization barrier, so that the
    mask and the masked score depend on the queries.

    Under `lax.scan` over layers, JAX computes what depends on constants
    alone once, before the loop, and passes it in (`_scan_known_hoisting`).
    The mask (a constant of positions) is small, but its broadcast to the
    scores' shape (batch x heads) and the masked score's fill are not: the
    scan would read a `[4, 4, 256, 1024]` f32 fill and its boolean mask from
    memory in every layer, where XLA builds them inside the fusions that use
    them. Tied to the queries, only the `[q, k]` mask is computed before the
    loop."""
    return lax.optimization_barrier((q, keep, jnp.float32(_MASKED)))


def _softmax_bwd(
    scale: float, res: tuple[Array, ...], dout: Array
) -> tuple[Array, Array, Array, None]:
    q, k, v, keep, probs, out = res
    f32 = jnp.float32
    # softmax's gradient p * (dp - sum(p * dp)), the sum as sum(dout * out),
    # times the scale; a masked score's p is 0
    dp = jnp.einsum("kgqd,ksd->kgqs", dout, v, preferred_element_type=f32)
    delta = row_sum(dout.astype(f32) * out.astype(f32))
    ds = (probs * (jnp.where(keep, dp, 0.0) - delta) * f32(scale)).astype(q.dtype)
    dq = jnp.einsum("kgqs,ksd->kgqd", ds, k)
    dk = _rows_product(q, ds)
    dv = _rows_product(dout, probs.astype(v.dtype))
    return dq, dk, dv, None


def _rows_product(a: Array, b: Array) -> Array:
    """`einsum("kgqd,kgqs->ksd", a, b)`, as `(a^T b)^T` over one merged `g * q`
    axis: XLA:CPU writes an operand transposed before a product that sums over
    two axes, and reads it as it lies over one."""
    kv, g, t, d = a.shape
    rows = lambda x: x.reshape(kv, g * t, x.shape[-1])
    return jnp.einsum("kqd,kqs->kds", rows(a), rows(b)).transpose(0, 2, 1)


_softmax_attention.defvjp(_softmax_forward, _softmax_bwd)


def _grouped_mask(
    q: Array,
    k: Array,
    mask: Array | None,
    is_causal: bool,
    local_window_size: tuple[int, int] | None,
) -> Array:
    """`dot_attention`'s mask as `[kv_heads or 1, group or 1, q, k]`: causal
    and windowed by index, and `mask` (`[1 or heads, q, k]`) with its heads
    grouped as `capped_attention` groups them."""
    (t, heads, _), (s, kv_heads) = q.shape, k.shape[:2]
    full = _index_mask(t, s, is_causal, local_window_size)[None, None]
    if mask is not None:
        m = jnp.broadcast_to(mask, (mask.shape[0], t, s))
        groups = (kv_heads, heads // kv_heads) if m.shape[0] > 1 else (1, 1)
        full = full & m.reshape(*groups, t, s)
    return full


def _index_mask(
    t: int, s: int, is_causal: bool, local_window_size: tuple[int, int] | None
) -> Array:
    """`[t, s]`: query `i` sees key `j` (causal: `j <= i`; a window `(left,
    right)`: `i - left <= j <= i + right`)."""
    keep = jnp.ones((t, s), bool)
    if is_causal or local_window_size is not None:
        diff = jnp.arange(t)[:, None] - jnp.arange(s)[None, :]
        if is_causal:
            keep = keep & (diff >= 0)
        if local_window_size is not None:
            left, right = local_window_size
            keep = keep & (diff <= left) & (-diff <= right)
    return keep


CAUSAL_BLOCK_MIN = 128
"""Queries per causal block (`causal_blocks`), at least: a sequence up to this
long is one block."""
CAUSAL_BLOCK_LONG = 256
"""Queries per block past `CAUSAL_BLOCK_SHORT` tokens."""
CAUSAL_BLOCK_SHORT = 512
CAUSAL_BLOCKS_MAX = 16


def causal_block_size(seq: int) -> int:
    """Queries per block of `causal_blocks`: 128 up to 512 tokens, 256 past
    them, or `seq / 16` (rounded up to a multiple of 8) past 4,096, so that a
    layer has at most 16 blocks (its compiled size grows with their number).

    Smaller blocks skip more of the masked scores, larger ones copy fewer keys:
    each block reads the keys before it as one slice, and the slices add up to
    about `seq * blocks / 2` rows: 256-query blocks pay off from 1,024 tokens,
    128 below (`docs/performance.md`, "Flash attention on the CPU")."""
    base = CAUSAL_BLOCK_MIN if seq <= CAUSAL_BLOCK_SHORT else CAUSAL_BLOCK_LONG
    per_block = -(-seq // CAUSAL_BLOCKS_MAX)
    return max(base, -(-per_block // 8) * 8)


def causal_blocks(
    q: Float[Array, "seq heads head_dim"],
    k: Float[Array, "seq kv_heads head_dim"],
    v: Float[Array, "seq kv_heads head_dim"],
    *,
    segment_ids: Int[Array, " seq"] | None,
    sliding_window: int | None,
    scale: float | None = None,
    softcap: float | None = None,
) -> Float[Array, "seq heads head_dim"]:
    """Causal attention as `attention`, block by block of queries, each against
    only the keys it can see: block `[i, j)` attends to keys `[0, j)` (from
    `i - sliding_window + 1` with a window). The keys after a block, masked out
    anyway, are never multiplied, so the work (scores, softmax and their
    backward) is about half of the full `[seq, seq]` one, in pieces that stay in
    cache, faster on the CPU the longer the sequence (docs/performance.md).
    The heads are moved in front once
    (`heads_first`), not per block: XLA's batched products on the CPU want them
    there, and each block would otherwise copy its queries and every key and
    value it sees. Plain autodiff, nothing recomputed; the blocks are unrolled
    (`causal_block_size`)."""
    seq, _, d = q.shape
    size = causal_block_size(seq)
    segs = jnp.zeros((seq,), jnp.int32) if segment_ids is None else segment_ids
    pos = jnp.arange(seq, dtype=jnp.int32)
    qh = heads_first(q, k.shape[1])
    starts = range(0, seq, size)
    seen = tuple(
        (0 if sliding_window is None else max(0, start - sliding_window + 1),
         min(start + size, seq))
        for start in starts
    )  # fmt: skip
    ks = key_ranges(k.transpose(1, 0, 2), seen)
    vs = key_ranges(v.transpose(1, 0, 2), seen)
    score = dict(scale=d**-0.5 if scale is None else scale, softcap=softcap)
    qs = jnp.split(qh, list(starts)[1:], axis=2)  # its gradient: one concatenate
    outs = []
    for start, (first, end), qb, kb, vb in zip(starts, seen, qs, ks, vs, strict=True):
        mask = position_mask(
            pos[start:end], segs[start:end], pos[first:end], segs[first:end],
            sliding_window,
        )  # fmt: skip
        outs.append(heads_first_attention(qb, kb, vb, mask, **score))
    return seq_first(jnp.concatenate(outs, axis=2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def key_ranges(
    x: Float[Array, "kv_heads seq head_dim"], ranges: tuple[tuple[int, int], ...]
) -> tuple[Array, ...]:
    """`x[:, a:b]` for each `(a, b)` of `ranges`: the keys (or values) each
    causal block sees. Its gradient adds each range's cotangent into its own
    range of one array, in order, where autodiff pads every cotangent to the
    whole sequence and adds them all: half the additions at 1,024 tokens, and
    no chain of additions after one product, which oneDNN's fusions of the
    jaxlibs `eqtrain.cpu` verified abort on (`eqtrain.cpu._onednn`).

    `x` passes an optimization barrier first, so XLA takes it as it lies (heads
    first) and does not fold the transpose that made it into the products: it
    would then also write every key and value transposed (`[d, k]`) for the
    scores and the values' gradient, besides the heads-first copy the
    backward pass keeps."""
    x = lax.optimization_barrier(x)
    return tuple(x[:, a:b] for a, b in ranges)


def _key_ranges_fwd(
    x: Array, ranges: tuple[tuple[int, int], ...]
) -> tuple[tuple[Array, ...], Array]:
    return key_ranges(x, ranges), jnp.zeros((0, *x.shape), x.dtype)


def _key_ranges_bwd(
    ranges: tuple[tuple[int, int], ...], empty: Array, cts: tuple[Array, ...]
) -> tuple[Array]:
    grad = jnp.zeros(empty.shape[1:], empty.dtype)
    for (a, b), ct in zip(ranges, cts, strict=True):
        grad = lax.dynamic_update_slice_in_dim(
            grad, lax.slice_in_dim(grad, a, b, axis=1) + ct.astype(grad.dtype), a, 1
        )
    return (grad,)


key_ranges.defvjp(_key_ranges_fwd, _key_ranges_bwd)


def blocked_attention(
    q: Float[Array, "seq heads head_dim"],
    k: Float[Array, "seq kv_heads head_dim"],
    v: Float[Array, "seq kv_heads head_dim"],
    *,
    segment_ids: Int[Array, " seq"] | None,
    sliding_window: int | None,
    implementation: str | None,
    query_chunk: int,
    scale: float | None = None,
    softcap: float | None = None,
) -> Float[Array, "seq heads head_dim"]:
    """`attention`, one block of `query_chunk` queries at a time against all keys
    (a `lax.map` of a rematerialised block), each block's mask built from the
    queries' and keys' positions and segment ids: the scores held at once are
    `[heads, query_chunk, seq]`, forward and backward, for the price of
    recomputing each block's scores in the backward pass. The sequence is padded
    to a multiple of `query_chunk` (the padded queries are cut off)."""
    seq = q.shape[0]
    k_pos = jnp.arange(seq, dtype=jnp.int32)
    segs = jnp.zeros((seq,), jnp.int32) if segment_ids is None else segment_ids
    kernel = dict(implementation=implementation, scale=scale, softcap=softcap)

    def block(qb: Array, qp: Array, qs_: Array) -> Array:
        mask = position_mask(qp, qs_, k_pos, segs, sliding_window)
        return dot_attention(qb, k, v, mask=mask[None], **kernel)

    run = jax.checkpoint(block, prevent_cse=False)
    out = lax.map(lambda xs: run(*xs), _query_blocks(q, segs, query_chunk))
    return out.reshape(-1, *q.shape[1:])[:seq]


def _query_blocks(
    q: Array, segs: Array, query_chunk: int
) -> tuple[Array, Array, Array]:
    """`(queries, positions, segment ids)` in blocks of `query_chunk` (`[blocks,
    query_chunk, ...]`), the sequence padded to whole blocks; the padded queries
    join the last segment (and are cut off afterwards)."""
    seq = q.shape[0]
    blocks = -(-seq // query_chunk)
    pad = blocks * query_chunk - seq
    qs = jnp.pad(q, [(0, pad), (0, 0), (0, 0)]).reshape(
        blocks, query_chunk, *q.shape[1:]
    )
    q_pos = jnp.arange(blocks * query_chunk, dtype=jnp.int32).reshape(blocks, -1)
    q_segs = jnp.pad(segs, (0, pad), mode="edge").reshape(blocks, -1)
    return qs, q_pos, q_segs
