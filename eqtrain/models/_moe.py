"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE): a router, top-k
selection, experts as stacked weights, and the ways to send tokens to them.

A `SparseMoE` works on all the tokens of a batch at once (`x: [tokens, hidden]`,
see `Decoder.batch_features`): routing is per token, but grouping tokens by
expert pays off over the whole batch, and the load-balancing loss is a batch
statistic. The dispatch (`MOE_IMPLS`):

- `"sorted"` (dropless): the `tokens * k` assignments sorted by expert, cut into
  blocks of rows that all go to one expert (each expert's rows padded to a whole
  block), one `[block, hidden] @ [hidden, ff]` product per block in a
  `lax.scan`; blocks past the last expert's are skipped. Exact; each expert
  pads less than one block. The default on CPU and GPU.
- `"ragged"` (dropless): the sorted rows through `jax.lax.ragged_dot`, XLA's
  grouped matrix product. The default on TPU. XLA:CPU computes every group
  densely, and on an H200 (jax 0.11.2) one `ragged_dot` ran 6.2x the time of a
  dense product of the same rows (docs/performance.md, "Mixture of experts").
- `"dense"`: every expert on every token, weighted by the routing (the
  reference; `experts / k` times the FLOPs).
- with a `capacity_factor`: each expert takes at most
  `ceil(capacity_factor * tokens * k / experts)` assignments (first choices
  before second ones, then in token order); the rest are dropped (their weight
  is 0) and counted in `moe/dropped`.

Under a mesh with an `expert` axis larger than 1, the experts' weights are
split over it and the tokens travel to their experts' devices and back with
`all_to_all` inside a `shard_map` (`expert_parallel`).
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
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._errors import ConfigError
from ._layers import ACTIVATIONS, AnyLinear, Linear, as_dtype, split_key


MOE_IMPLS = ("auto", "sorted", "ragged", "dense")
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

    gate_proj: Float[Array, "experts ff hidden"]
    up_proj: Float[Array, "experts ff hidden"]
    down_proj: Float[Array, "experts hidden ff"]
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
        product (`weights`: `[experts, out, in]`)."""
        h = ACTIVATIONS[self.act](matmul(x, self.gate_proj)) * matmul(x, self.up_proj)
        return matmul(h, self.down_proj)

    def blocked(self, x: Array, sizes: Array, block: int) -> Array:
        """`ffn` of rows sorted by expert (`sizes[e]` rows of expert `e`), in
        blocks of rows (`Blocks`): padded once, gate and up in one scan, down
        in another, unpadded once."""
        blocks = Blocks.of(sizes, x.shape[0], block)
        gate, up = blocks.matmul(blocks.pad(x), self.gate_proj, self.up_proj)
        h = ACTIVATIONS[self.act](gate) * up
        return blocks.unpad(blocks.matmul(h, self.down_proj))


class SparseMoE(eqx.Module):
    """A sparse MLP: `gate` (the router, `hidden -> experts`), `experts`, and
    Qwen2-MoE's `shared_expert` with its sigmoid `shared_expert_gate`.

    Routing (each family's rule): `p = softmax(gate(x))` in f32, the `top_k`
    largest, renormalised to sum to 1 when `norm_topk_prob` (Mixtral always;
    Qwen: the config's `norm_topk_prob`).
    """

    gate: AnyLinear
    experts: Experts
    shared_expert: Any
    shared_expert_gate: AnyLinear | None
    top_k: int = eqx.field(static=True)
    norm_topk_prob: bool = eqx.field(static=True)

    def __init__(
        self,
        *,
        hidden: int,
        num_experts: int,
        top_k: int,
        ff: int,
        norm_topk_prob: bool,
        act: str,
        std: float,
        dtype: Any,
        shared: Callable[[PRNGKeyArray], Any] | None,
        key: PRNGKeyArray,
    ):
        kr, ke, ks, kg = jr.split(key, 4)
        dtype = as_dtype(dtype)
        linear = lambda d_out, k: Linear(
            hidden, d_out, use_bias=False, std=std, dtype=dtype, key=k
        )
        self.gate = linear(num_experts, kr)
        self.experts = Experts(
            num_experts, hidden, ff, act=act, std=std, dtype=dtype, key=ke
        )
        self.shared_expert = None if shared is None else shared(ks)
        self.shared_expert_gate = None if shared is None else linear(1, kg)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def route(
        self, x: Float[Array, "tokens hidden"], key: PRNGKeyArray | None = None
    ) -> tuple[Array, Array, Array]:
        """`(router logits [tokens, experts] in f32, weights [tokens, k] in x's
        dtype, expert ids [tokens, k])`."""
        logits = self.gate(x, key=key).astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, ids = lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return logits, weights.astype(x.dtype), ids

    @jax.named_scope("moe")
    def __call__(
        self,
        x: Float[Array, "tokens hidden"],
        *,
        valid: Bool[Array, " tokens"] | None = None,
        options: MoEOptions = MoEOptions(),
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "tokens hidden"], dict[str, Array]]:
        """The layer's output and its router statistics (`AUX_KEYS`); `valid`
        marks the tokens that count in the statistics (padding does not)."""
        if expert_axis_size() > 1:
            if options.capacity_factor is not None:
                raise ConfigError(
                    "`capacity_factor` is not supported with mesh.expert > 1 (expert "
                    "parallelism is dropless); unset it or set mesh.expert = 1."
                )
            return expert_parallel(self, x, valid, options, key)
        kr, ks, kg = split_key(key, 3)
        logits, weights, ids = self.route(x, kr)
        if options.capacity_factor is not None:
            y, dropped = capacity_dispatch(
                self.experts, x, weights, ids, options.capacity_factor
            )
        else:
            y, dropped = dispatch(self.experts, x, weights, ids, options), None
        return self._shared(x, y, ks, kg), _stats(logits, ids, valid, dropped)

    def _shared(self, x: Array, y: Array, ks: Any, kg: Any) -> Array:
        """`y` plus the shared expert's output, gated (Qwen2-MoE), if any."""
        if self.shared_expert is None:
            return y
        gate = jax.nn.sigmoid(self.shared_expert_gate(x, key=kg))  # pyright: ignore
        return y + gate * self.shared_expert(x, key=ks)


def _stats(
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


def active_params(model: Any) -> int:
    """A model's parameters a token goes through: all of them, but of each
    sparse MLP's experts only `top_k` (for a model without experts, all)."""
    from ._layers import num_params

    total = num_params(model)
    layer = getattr(getattr(model, "layers", None), "mlp", None)
    if not isinstance(layer, SparseMoE):
        return total
    experts = num_params(layer.experts)
    return total - experts + experts * layer.top_k // model.config.num_experts


def empty_aux(num_experts: int) -> dict[str, Array]:
    """Router statistics of no layer (the sum's start)."""
    zero = jnp.zeros((), jnp.float32)
    vec = jnp.zeros((num_experts,), jnp.float32)
    return {"counts": vec, "probs": vec, "rows": zero, "z": zero, "dropped": zero}


def load_balancing_loss(aux: dict[str, Array]) -> Array:
    """The Switch/Mixtral auxiliary loss of summed router statistics, as
    transformers' `load_balancing_loss_func`: `experts * sum_e f_e * P_e`, with
    `f_e` the top-k assignments to expert `e` and `P_e` its softmax probability,
    each summed over every layer's valid tokens and divided by their number."""
    rows = jnp.maximum(aux["rows"], 1.0)
    num = aux["counts"].shape[-1]
    return num * jnp.sum((aux["counts"] / rows) * (aux["probs"] / rows))


def router_z_loss(aux: dict[str, Array]) -> Array:
    """ST-MoE's router z-loss: the mean over tokens and layers of
    `logsumexp(router logits)**2`."""
    return aux["z"] / jnp.maximum(aux["rows"], 1.0)


def router_terms(config: Any, aux: dict[str, Array]) -> tuple[Array, dict[str, Array]]:
    """`(penalty, metrics)` of a batch's router statistics: the penalty the LM
    losses add (`router_aux_loss_coef * aux_loss + router_z_loss_coef *
    z_loss`) and the metrics `moe/aux_loss`, `moe/z_loss` (unscaled),
    `moe/dropped` (the fraction of assignments dropped by a capacity),
    `moe/expert_load/{i}` (expert `i`'s share of the assignments times the
    number of experts: 1 everywhere is a perfect balance) and its max and min."""
    balance, z = load_balancing_loss(aux), router_z_loss(aux)
    penalty = config.router_aux_loss_coef * balance + config.router_z_loss_coef * z
    picks = jnp.maximum(jnp.sum(aux["counts"]), 1.0)
    load = aux["counts"] * aux["counts"].shape[-1] / picks
    metrics = {
        "moe/aux_loss": balance,
        "moe/z_loss": z,
        "moe/dropped": aux["dropped"] / picks,
        "moe/expert_load_max": jnp.max(load),
        "moe/expert_load_min": jnp.min(load),
    }
    metrics.update({f"moe/expert_load/{i}": load[i] for i in range(load.shape[-1])})
    return penalty, metrics


# -- dispatch ----------------------------------------------------------------------
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
    num = experts.num
    tokens, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    rows = order // k  # the token of each sorted assignment
    sizes = jnp.bincount(flat, length=num).astype(jnp.int32)
    xs = x[rows]
    if impl == "ragged":
        matmul = lambda a, w: lax.ragged_dot(a, jnp.swapaxes(w, 1, 2), sizes)
        ys = experts.ffn(xs, matmul)
    else:
        ys = experts.blocked(xs, sizes, block_size(tokens * k, num))
    ys = ys * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[rows].add(ys)


def dense_dispatch(experts: Experts, x: Array, weights: Array, ids: Array) -> Array:
    """Every expert on every token, combined with the routing weights (zero for
    the experts a token did not pick)."""
    combine = jnp.sum(
        jax.nn.one_hot(ids, experts.num, dtype=x.dtype) * weights[..., None], axis=1
    )  # [tokens, experts]
    act = ACTIVATIONS[experts.act]
    g = jnp.einsum("th,efh->etf", x, experts.gate_proj)
    u = jnp.einsum("th,efh->etf", x, experts.up_proj)
    y = jnp.einsum("etf,ehf->eth", act(g) * u, experts.down_proj)
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
    by_choice = ids.T.reshape(-1)  # slot-major: every first choice, then seconds
    onehot = jax.nn.one_hot(by_choice, num, dtype=jnp.int32)
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
    keep = rank < capacity
    token = jnp.tile(jnp.arange(tokens), k)
    slot = jnp.where(keep, by_choice * capacity + rank, num * capacity)  # out: dropped
    buffer = jnp.zeros((num * capacity, x.shape[-1]), x.dtype)
    buffer = buffer.at[slot].set(x[token], mode="drop").reshape(num, capacity, -1)
    batched = lambda a, w: jnp.einsum("ech,efh->ecf", a, w)
    out = experts.ffn(buffer, batched).reshape(num * capacity, -1)
    w = weights.T.reshape(-1) * keep.astype(weights.dtype)
    ys = out.at[slot].get(mode="fill", fill_value=0) * w[:, None]
    y = jnp.zeros_like(x).at[token].add(ys)
    return y, jnp.sum(1.0 - keep.astype(jnp.float32))


def block_size(rows: int, groups: int) -> int:
    """Rows per block of `Blocks`: the power of two nearest below half an
    expert's even share, between 8 and 512. Larger blocks are faster products
    (on 2 CPU cores, [512, 256] @ [256, 256] blocks ran 1.9x the rows per second
    of [64, 256] ones) but pad more: each expert's last block is on average
    half empty."""
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

    def matmul(self, xp: Array, *ws: Array) -> Any:
        """`xp @ w[group].T` block by block for each `w` of `ws` (one array, or a
        tuple for several: they share the scan)."""

        def step(_: None, inputs: Any) -> tuple[None, Any]:
            xb, g, on = inputs

            def products() -> tuple[Array, ...]:
                take = lambda w: lax.dynamic_index_in_dim(w, g, keepdims=False)
                dims = (((1,), (1,)), ((), ()))
                return tuple(lax.dot_general(xb, take(w), dims) for w in ws)

            def empty() -> tuple[Array, ...]:
                return tuple(jnp.zeros((self.block, w.shape[1]), xp.dtype) for w in ws)

            return None, lax.cond(on, products, empty)

        blocks = xp.reshape(self.bound, self.block, -1)
        _, ys = lax.scan(step, None, (blocks, self.group, self.used))
        ys = tuple(y.reshape(self.bound * self.block, -1) for y in ys)
        return ys[0] if len(ws) == 1 else ys


# -- expert parallelism -------------------------------------------------------------
def expert_axis_size() -> int:
    """The `expert` axis of the mesh in context (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    return int(sizes.get("expert", 1))


def token_axes() -> tuple[str, ...]:
    """The mesh axes a batch's tokens are split over (`eqtrain.sharding`'s batch
    axes present in the mesh in context)."""
    mesh = jax.sharding.get_abstract_mesh()
    return tuple(a for a in ("data", "fsdp", "expert") if a in mesh.axis_names)


def expert_parallel(
    layer: SparseMoE,
    x: Float[Array, "tokens hidden"],
    valid: Bool[Array, " tokens"] | None,
    options: MoEOptions,
    key: PRNGKeyArray | None,
) -> tuple[Array, dict[str, Array]]:
    """`layer(x)` with the experts split over the mesh's `expert` axis: each
    device routes its own tokens, sends every assignment to the device holding
    its expert (`all_to_all`, buffers of the worst case, so nothing is dropped),
    runs its experts on what it received, and sends the results back. The
    router, the shared expert and the statistics stay with the tokens."""
    ways = expert_axis_size()
    num = layer.experts.num
    if num % ways:
        raise ConfigError(
            f"mesh.expert = {ways} must divide the number of experts ({num}); use "
            f"a divisor of {num}."
        )
    axes = token_axes()
    tokens = P(axes)
    dynamic, static = eqx.partition(layer, eqx.is_array)
    specs = jax.tree.map(lambda _: P(), dynamic)
    on_experts = jax.tree.map(lambda _: P("expert"), dynamic.experts)
    specs = eqx.tree_at(lambda m: m.experts, specs, on_experts)
    valid = jnp.ones(x.shape[:1], bool) if valid is None else valid

    def body(x: Array, valid: Array, params: Any, key: Any) -> Any:
        local = eqx.combine(params, static)
        y, aux = _local_expert_parallel(local, x, valid, options, ways, key)
        return y, {name: lax.psum(v, axes) for name, v in aux.items()}

    fn = jax.shard_map(
        body,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(tokens, tokens, specs, P()),
        out_specs=(tokens, P()),
        check_vma=False,
    )
    return fn(x, valid, dynamic, key)


def _local_expert_parallel(
    layer: SparseMoE,
    x: Array,
    valid: Array,
    options: MoEOptions,
    ways: int,
    key: PRNGKeyArray | None,
) -> tuple[Array, dict[str, Array]]:
    """One device's part of `expert_parallel` (inside the `shard_map`)."""
    kr, ks, kg = split_key(key, 3)
    logits, weights, ids = layer.route(x, kr)
    tokens, k = ids.shape
    local = layer.experts.num  # experts on this device
    flat = ids.reshape(-1)
    owner = flat // local
    # Per destination, its assignments in order; the buffers hold every
    # assignment of this device (the worst case: all to one device).
    cap = tokens * k
    onehot = jax.nn.one_hot(owner, ways, dtype=jnp.int32)
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1)
    slot = owner * cap + rank
    send_x = (
        jnp.zeros((ways * cap, x.shape[-1]), x.dtype)
        .at[slot]
        .set(x[jnp.arange(tokens * k) // k])
    )
    # local expert id, and `local` (a group of no expert) for an empty slot
    send_e = jnp.full((ways * cap,), local, jnp.int32).at[slot].set(flat % local)
    recv_x = lax.all_to_all(
        send_x.reshape(ways, cap, -1), "expert", 0, 0, tiled=False
    ).reshape(ways * cap, -1)
    recv_e = lax.all_to_all(
        send_e.reshape(ways, cap), "expert", 0, 0, tiled=False
    ).reshape(-1)
    out = _grouped_ffn(layer.experts, recv_x, recv_e, local, options)
    back = lax.all_to_all(
        out.reshape(ways, cap, -1), "expert", 0, 0, tiled=False
    ).reshape(ways * cap, -1)
    ys = back[slot] * weights.reshape(-1)[:, None]
    y = jnp.zeros_like(x).at[jnp.arange(tokens * k) // k].add(ys)
    return layer._shared(x, y, ks, kg), _stats(logits, ids, valid, None)


def _grouped_ffn(
    experts: Experts, x: Array, ids: Array, num: int, options: MoEOptions
) -> Array:
    """Each row of `x` through expert `ids[row]` (`ids == num`: no expert, the
    row's output is 0), unsorted back to the rows' order."""
    order = jnp.argsort(ids, stable=True)
    sizes = jnp.bincount(ids, length=num + 1).astype(jnp.int32)[:num]
    xs = x[order]
    rows = x.shape[0]
    if options.resolved_impl() == "ragged":
        # the rows of no expert sort last; ragged_dot leaves rows past the
        # groups' total as zeros
        matmul = lambda a, w: lax.ragged_dot(a, jnp.swapaxes(w, 1, 2), sizes)
        ys = experts.ffn(xs, matmul)
    else:
        ys = experts.blocked(xs, sizes, block_size(rows, num))
    in_group = jnp.arange(rows) < jnp.sum(sizes)
    ys = jnp.where(in_group[:, None], ys, 0)
    return jnp.zeros_like(ys).at[order].set(ys)
