"""Experts as stacked weights (`Experts`) and the ways tokens reach them (the
dispatch, `MOE_IMPLS`), on one device; with one layer's router statistics.

- `"sorted"` (dropless): the `tokens * k` assignments sorted by expert, cut into
  blocks of rows that all go to one expert (each expert's rows padded to a whole
  block), one `[block, hidden] @ [hidden, ff]` product per block in a
  `lax.scan`; blocks past the last expert's are skipped. Exact; each expert
  pads less than one block. The default on CPU and GPU.
- `"pallas"` (dropless): the blocks of `"sorted"` (of at least 16 rows)
  through a Pallas grouped matrix product (`_grouped_gemm`; its gradients too):
  compiled with Triton on GPUs, interpreted on CPU (slow: for tests), refused
  on TPU. Quantized weights are dequantized whole first.
- `"ragged"` (dropless): the sorted rows through `jax.lax.ragged_dot`, XLA's
  grouped matrix product. The default on TPU. XLA:CPU computes every group
  densely, and on GPUs XLA's `ragged_dot` is slower than one dense product of
  the same rows (docs/performance.md, "Mixture of experts").
- `"dense"`: every expert on every token, weighted by the routing (the
  reference; `experts / k` times the FLOPs).
- with a `capacity_factor`: each expert takes at most
  `ceil(capacity_factor * tokens * k / experts)` assignments (first choices
  before second ones, then in token order); the rest are dropped (their weight
  is 0) and counted in `moe/dropped`.
"""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._errors import ConfigError
from .._quant import QuantizedWeight, dense, matmul_t
from ._grouped_gemm import grouped_matmul
from ._layers import gated


MOE_IMPLS = ("auto", "sorted", "pallas", "ragged", "dense")
"""`DecoderConfig.moe_impl`: how tokens reach their experts (module docstring);
`"auto"` is `"ragged"` on TPU and `"sorted"` elsewhere."""

AUX_KEYS = ("counts", "probs", "rows", "z", "dropped")
"""What each sparse layer adds to the batch's router statistics (summed over
layers): top-k `counts` per expert and softmax `probs` summed per expert over
the valid tokens, the number of valid `rows`, the sum of `logsumexp(logits)**2`
(`z`) and the `dropped` assignments."""


@dataclasses.dataclass(frozen=True)
class MoEOptions:
    """How a sparse layer computes (from the model config's runtime fields)."""

    impl: str = "auto"
    capacity_factor: float | None = None

    def resolved_impl(self) -> str:
        if self.impl != "auto":
            return self.impl
        return "ragged" if jax.default_backend() == "tpu" else "sorted"


def check_moe_options(impl: Any, capacity_factor: Any) -> None:
    if impl not in MOE_IMPLS:
        raise ConfigError(f"`moe_impl` must be one of {MOE_IMPLS}; got {impl!r}.")
    if capacity_factor is not None and (
        isinstance(capacity_factor, bool)
        or not isinstance(capacity_factor, (int, float))
        or capacity_factor <= 0
    ):
        raise ConfigError(
            "`capacity_factor` must be None (dropless) or a number > 0 (e.g. 1.25: "
            f"each expert takes 1.25x its even share); got {capacity_factor!r}."
        )


class Experts(eqx.Module):
    """`num_experts` gated MLPs as stacked weights (`[experts, out, in]`, each
    expert's matrices in `torch.nn.Linear`'s layout, as Hugging Face stores them
    one expert at a time)."""

    gate_proj: Float[Array, "experts ff hidden"] | QuantizedWeight
    up_proj: Float[Array, "experts ff hidden"] | QuantizedWeight
    down_proj: Float[Array, "experts hidden ff"] | QuantizedWeight
    act: str = eqx.field(static=True)

    def __init__(
        self,
        num: int,
        hidden: int,
        ff: int,
        *,
        act: str,
        std: float,
        dtype: Any,
        key: PRNGKeyArray,
    ):
        kg, ku, kd = jr.split(key, 3)
        normal = lambda k, shape: (jr.normal(k, shape, jnp.float32) * std).astype(dtype)
        self.gate_proj = normal(kg, (num, ff, hidden))
        self.up_proj = normal(ku, (num, ff, hidden))
        self.down_proj = normal(kd, (num, hidden, ff))
        self.act = act

    @property
    def num(self) -> int:
        """The number of experts (of one layer: not under a stacked axis)."""
        return self.gate_proj.shape[-3]

    def ffn(self, x: Array, matmul: Callable[[Array, Array], Array]) -> Array:
        """`down(act(gate(x)) * up(x))` with `matmul(rows, weights)` doing each
        product (`weights`: `[experts, out, in]`; quantized ones dequantized
        first, whole)."""
        mm = lambda a, w: matmul(a, dense(w, a.dtype))
        h = gated(self.act, mm(x, self.gate_proj), mm(x, self.up_proj))
        return mm(h, self.down_proj)

    def blocked(
        self, x: Array, sizes: Array, block: int, *, pallas: bool = False
    ) -> Array:
        """`ffn` of rows sorted by expert (`sizes[e]` rows of expert `e`), in
        blocks of rows (`Blocks`): padded once, gate and up in one scan (or, with
        `pallas`, two Pallas kernels over the same layout), down in another,
        unpadded once."""
        blocks = Blocks.of(sizes, x.shape[0], block)
        matmul = blocks.pallas_matmul if pallas else blocks.matmul
        gate, up = matmul(blocks.pad(x), self.gate_proj, self.up_proj)
        h = gated(self.act, gate, up)
        return blocks.unpad(matmul(h, self.down_proj))


def router_stats(
    logits: Array, ids: Array, valid: Array | None, dropped: Array | None
) -> dict[str, Array]:
    """One layer's router statistics (`AUX_KEYS`) over its valid tokens."""
    tokens, num = logits.shape
    mask = jnp.ones((tokens,), jnp.float32) if valid is None else valid
    mask = mask.astype(jnp.float32)
    onehot = jnp.sum(jax.nn.one_hot(ids, num, dtype=jnp.float32), axis=1)
    return {
        "counts": jnp.sum(onehot * mask[:, None], axis=0),
        "probs": jnp.sum(jax.nn.softmax(logits, -1) * mask[:, None], axis=0),
        "rows": jnp.sum(mask),
        "z": jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * mask),
        "dropped": jnp.zeros((), jnp.float32) if dropped is None else dropped,
    }


# -- dispatch ----------------------------------------------------------------------
def routed_output(
    experts: Experts,
    x: Float[Array, "tokens hidden"],
    weights: Array,
    ids: Int[Array, "tokens k"],
    options: MoEOptions,
) -> tuple[Array, Array | None]:
    """The mixture of the routed experts and the count of dropped assignments:
    through `capacity_dispatch` with a `capacity_factor`, else dropless
    (`dispatch`, nothing dropped: None)."""
    if options.capacity_factor is not None:
        return capacity_dispatch(experts, x, weights, ids, options.capacity_factor)
    return dispatch(experts, x, weights, ids, options), None


def dispatch(
    experts: Experts,
    x: Float[Array, "tokens hidden"],
    weights: Array,
    ids: Int[Array, "tokens k"],
    options: MoEOptions,
) -> Array:
    """The dropless mixture `sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`."""
    impl = options.resolved_impl()
    if impl == "dense":
        return dense_dispatch(experts, x, weights, ids)
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = order // k  # the token of each sorted assignment
    sizes = jnp.bincount(flat, length=experts.num).astype(jnp.int32)
    ys = sorted_ffn(experts, x[rows], sizes, impl=impl)
    ys = ys * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[rows].add(ys)


def dense_dispatch(experts: Experts, x: Array, weights: Array, ids: Array) -> Array:
    """Every expert on every token, combined with the routing weights (zero for
    the experts a token did not pick)."""
    combine = jnp.sum(
        jax.nn.one_hot(ids, experts.num, dtype=x.dtype) * weights[..., None], axis=1
    )  # [tokens, experts]
    gate_proj, up_proj, down_proj = (
        dense(w, x.dtype)
        for w in (experts.gate_proj, experts.up_proj, experts.down_proj)
    )
    g = jnp.einsum("th,efh->etf", x, gate_proj)
    u = jnp.einsum("th,efh->etf", x, up_proj)
    y = jnp.einsum("etf,ehf->eth", gated(experts.act, g, u), down_proj)
    return jnp.einsum("eth,te->th", y, combine)


def capacity_dispatch(
    experts: Experts,
    x: Array,
    weights: Array,
    ids: Array,
    capacity_factor: float,
) -> tuple[Array, Array]:
    """The dropping variant: each expert's first `capacity` assignments (first
    choices before second ones, then in token order) through `[experts,
    capacity, hidden]` buffers; returns the output and the dropped count."""
    tokens, k = ids.shape
    num = experts.num
    capacity = max(1, math.ceil(capacity_factor * tokens * k / num))
    slot, keep = _capacity_slots(ids, num, capacity)
    token = jnp.tile(jnp.arange(tokens), k)
    buffer = jnp.zeros((num * capacity, x.shape[-1]), x.dtype)
    buffer = buffer.at[slot].set(x[token], mode="drop").reshape(num, capacity, -1)
    batched = lambda a, w: jnp.einsum("ech,efh->ecf", a, w)
    out = experts.ffn(buffer, batched).reshape(num * capacity, -1)
    w = weights.T.reshape(-1) * keep.astype(weights.dtype)
    ys = out.at[slot].get(mode="fill", fill_value=0) * w[:, None]
    y = jnp.zeros_like(x).at[token].add(ys)
    return y, jnp.sum(1.0 - keep.astype(jnp.float32))


def _capacity_slots(ids: Array, num: int, capacity: int) -> tuple[Array, Array]:
    """Each assignment's slot in the `[experts * capacity]` buffer (slot-major:
    every first choice, then the seconds), `num * capacity` (out of range) for
    the dropped ones, and whether it is kept."""
    by_choice = ids.T.reshape(-1)
    rank = arrival_rank(by_choice, num)
    keep = rank < capacity
    return jnp.where(keep, by_choice * capacity + rank, num * capacity), keep


def arrival_rank(ids: Int[Array, " n"], num: int) -> Int[Array, " n"]:
    """Each entry's rank among the entries before it with the same id (of
    `num`): 0 for the first, 1 for the second, ..."""
    onehot = jax.nn.one_hot(ids, num, dtype=jnp.int32)
    return jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)


def sorted_ffn(experts: Experts, xs: Array, sizes: Array, *, impl: str) -> Array:
    """`experts.ffn` of rows sorted by expert (`sizes[e]` rows of expert `e`)
    by the resolved dropless `impl`: through `lax.ragged_dot` (which leaves rows
    past the groups' total as zeros), or in blocks of rows (`Blocks`), by a
    scan (`"sorted"`) or the Pallas kernels (`"pallas"`: blocks of at least
    16 rows, as Triton's products want)."""
    if impl == "ragged":
        matmul = lambda a, w: lax.ragged_dot(a, jnp.swapaxes(w, 1, 2), sizes)
        return experts.ffn(xs, matmul)
    block = block_size(xs.shape[0], sizes.shape[0])
    if impl == "pallas":
        return experts.blocked(xs, sizes, max(16, block), pallas=True)
    return experts.blocked(xs, sizes, block)


def block_size(rows: int, groups: int) -> int:
    """Rows per block of `Blocks`: the power of two nearest below half an
    expert's even share, between 8 and 512. Larger blocks are faster products
    (fewer, larger library calls) but pad more: each expert's last block is on
    average half empty."""
    share = max(1, rows // max(1, groups) // 2)
    return int(min(512, max(8, 2 ** int(math.log2(share)))))


def blocked_matmul(
    x: Float[Array, "rows d_in"],
    w: Float[Array, "groups d_out d_in"],
    sizes: Int[Array, " groups"],
    block: int,
) -> Float[Array, "rows d_out"]:
    """`y[i] = x[i] @ w[g(i)].T` for rows sorted by group (`sizes[g]` rows of
    group `g`, in order); see `Blocks`."""
    blocks = Blocks.of(sizes, x.shape[0], block)
    return blocks.unpad(blocks.matmul(blocks.pad(x), w))


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Rows sorted by group (`sizes[g]` rows of group `g`, in order), each
    group's rows padded to whole blocks of `block` rows: `pad` lays rows out so,
    `matmul` does one `[block, d_in] @ [d_in, d_out]` product per block with its
    group's matrix (a `lax.scan` over a static bound on the number of blocks;
    the blocks past the last group's are skipped), `unpad` takes the rows back.
    An expert MLP pads once and unpads once around its three products."""

    dest: Array  # each row's place in the padded layout
    group: Array  # each block's group
    used: Array  # whether a block holds rows
    bound: int
    block: int

    @classmethod
    def of(cls, sizes: Array, rows: int, block: int) -> "Blocks":
        groups = sizes.shape[0]
        bound = -(-rows // block) + groups
        padded = -(-sizes // block) * block
        ends = jnp.cumsum(padded)
        starts = ends - padded
        group = jnp.repeat(jnp.arange(groups), sizes, total_repeat_length=rows)
        first = jnp.cumsum(sizes) - sizes
        dest = starts[group] + jnp.arange(rows) - first[group]
        at = jnp.arange(bound) * block
        block_group = jnp.searchsorted(ends, at, side="right")
        return cls(
            dest, jnp.minimum(block_group, groups - 1), at < ends[-1], bound, block
        )

    def pad(self, x: Array) -> Array:
        out = jnp.zeros((self.bound * self.block, x.shape[1]), x.dtype)
        return out.at[self.dest].set(x)

    def unpad(self, y: Array) -> Array:
        return y[self.dest]

    def matmul(self, xp: Array, *ws: Any) -> Any:
        """`xp @ w[group].T` block by block for each `w` of `ws` (one array, or a
        tuple for several: they share the scan)."""

        def step(_: None, inputs: Any) -> tuple[None, Any]:
            xb, g, on = inputs

            def products() -> tuple[Array, ...]:
                return tuple(_expert_product(xb, w, g) for w in ws)

            def empty() -> tuple[Array, ...]:
                return tuple(jnp.zeros((self.block, w.shape[1]), xp.dtype) for w in ws)

            return None, lax.cond(on, products, empty)

        blocks = xp.reshape(self.bound, self.block, -1)
        _, ys = lax.scan(step, None, (blocks, self.group, self.used))
        ys = tuple(y.reshape(self.bound * self.block, -1) for y in ys)
        return ys[0] if len(ws) == 1 else ys

    def pallas_matmul(self, xp: Array, *ws: Any) -> Any:
        """`matmul` through the Pallas kernels (`grouped_matmul`), one call per
        `w`; quantized weights are dequantized whole first."""
        ys = tuple(
            grouped_matmul(
                xp, dense(w, xp.dtype), self.group, self.used, block=self.block
            )
            for w in ws
        )
        return ys[0] if len(ws) == 1 else ys


def _expert_product(x: Array, w: Any, group: Array) -> Array:
    """`x @ w[group].T`; a quantized `w` has only that expert's weight
    dequantized, beside the product (`apply_linear`)."""
    if isinstance(w, QuantizedWeight):
        return matmul_t(x, w.take(group))
    return matmul_t(x, lax.dynamic_index_in_dim(w, group, keepdims=False))


def grouped_ffn(
    experts: Experts, x: Array, ids: Array, num: int, options: MoEOptions
) -> Array:
    """Each row of `x` through expert `ids[row]` (`ids == num`: no expert, the
    row's output is 0), unsorted back to the rows' order."""
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=num + 1).astype(jnp.int32)[:num]
    # the rows of no expert sort last, past the groups' total
    ys = sorted_ffn(experts, x[order], sizes, impl=options.resolved_impl())
    in_group = jnp.arange(x.shape[0]) < jnp.sum(sizes)
    ys = jnp.where(in_group[:, None], ys, 0)
    return jnp.zeros_like(ys).at[order].set(ys)
