"""A sparse layer inside a `shard_map`. Expert parallelism: the experts split
over the mesh's `expert` axis, the tokens sent to their experts' devices and
back with `all_to_all` (`expert_parallel`). And each device's own tokens
through every expert, for the Pallas grouped products, which XLA cannot split
(`on_own_tokens`).
"""

import math
from collections.abc import Callable, Set
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .._errors import ConfigError
from ._experts import MoEOptions, arrival_rank, grouped_ffn, router_stats
from ._layers import split_key
from ._pallas import free_axes, split_over_devices


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
    layer: eqx.Module,
    x: Float[Array, "tokens hidden"],
    valid: Bool[Array, " tokens"] | None,
    options: MoEOptions,
    key: PRNGKeyArray | None,
) -> tuple[Array, dict[str, Array]]:
    """`layer(x)` (a `SparseMoE`) with the experts split over the mesh's `expert`
    axis: each device routes its own tokens, sends every assignment to the
    device holding its expert (`all_to_all`, buffers of the worst case, so
    nothing is dropped), runs its experts on what it received, and sends the
    results back. The router, the shared expert and the statistics stay with
    the tokens."""
    ways = expert_axis_size()
    _check_ways(ways, layer.experts.num)
    run = lambda local, x, valid, key: _local_expert_parallel(
        local, x, valid, options, ways, key
    )
    return _layer_on_devices(layer, x, valid, key, run, token_axes(), P("expert"))


def kernel_token_axes(options: MoEOptions, tokens: int) -> tuple[str, ...]:
    """The mesh axes to split `tokens` tokens over for `on_own_tokens`: where
    the dropless layer runs the Pallas grouped products (`moe_impl="pallas"`)
    under a mesh that XLA splits over several devices, every such axis (the
    batch axes first, as the tokens lie; `tensor` too, so that no two devices
    repeat a product), else the batch axes alone where the tokens divide over
    them; () otherwise (the layer as it is: XLA cannot split the kernels and
    gathers their inputs)."""
    if options.resolved_impl() != "pallas" or options.capacity_factor is not None:
        return ()
    if not split_over_devices():
        return ()
    free = {name: size for name, size in free_axes().items() if size > 1}
    order = ("data", "fsdp", "expert", "sequence")
    batch = tuple(a for a in order if a in free)
    every = batch + tuple(a for a in free if a not in order)
    for axes in (every, batch):
        ways = math.prod(free[a] for a in axes)
        if ways > 1 and tokens % ways == 0:
            return axes
    return ()


def on_own_tokens(
    layer: eqx.Module,
    x: Float[Array, "tokens hidden"],
    valid: Bool[Array, " tokens"] | None,
    options: MoEOptions,
    key: PRNGKeyArray | None,
    axes: tuple[str, ...],
) -> tuple[Array, dict[str, Array]]:
    """`layer(x)` (a dropless `SparseMoE`) with the tokens split over the mesh
    `axes` (`kernel_token_axes`) and every expert on every device (gathered
    from their splits on entry, as FSDP gathers a layer's weights): each device
    routes its own tokens and runs them through the experts
    (`SparseMoE.local`); the router statistics are summed over the devices."""
    run = lambda local, x, valid, key: local.local(
        x, valid=valid, options=options, key=key
    )
    return _layer_on_devices(layer, x, valid, key, run, axes, None, set(free_axes()))


def _layer_on_devices(
    layer: eqx.Module,
    x: Array,
    valid: Array | None,
    key: PRNGKeyArray | None,
    run: Callable[..., tuple[Array, dict[str, Array]]],
    axes: tuple[str, ...],
    experts: P | None,
    manual: Set[str] = frozenset(),
) -> tuple[Array, dict[str, Array]]:
    """`run(layer, x, valid, key)` inside a `shard_map` (over the mesh axes
    `manual`; empty: all): the tokens split over `axes`, the experts' arrays
    by `experts` (None: on every device), the rest of the layer on every
    device; the router statistics summed over `axes`."""
    tokens = P(axes)
    dynamic, static = eqx.partition(layer, eqx.is_array)
    valid = jnp.ones(x.shape[:1], bool) if valid is None else valid

    def body(x: Array, valid: Array, params: Any, key: Any) -> Any:
        y, aux = run(eqx.combine(params, static), x, valid, key)
        return y, {name: lax.psum(v, axes) for name, v in aux.items()}

    fn = jax.shard_map(
        body,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(tokens, tokens, _layer_specs(dynamic, experts), P()),
        out_specs=(tokens, P()),
        axis_names=manual,
        check_vma=False,
    )
    return fn(x, valid, dynamic, key)


def _check_ways(ways: int, num: int) -> None:
    if num % ways:
        raise ConfigError(
            f"mesh.expert = {ways} must divide the number of experts ({num}); use "
            f"a divisor of {num}."
        )


def _layer_specs(dynamic: Any, experts: P | None) -> Any:
    """The layer's partition specs: the experts' arrays by `experts` (None:
    replicated), everything else replicated."""
    specs = jax.tree.map(lambda _: P(), dynamic)
    if experts is None:
        return specs
    on_experts = jax.tree.map(lambda _: experts, dynamic.experts)
    return eqx.tree_at(lambda m: m.experts, specs, on_experts)


def _local_expert_parallel(
    layer: Any,
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
    slot, cap = _send_slots(flat // local, ways)
    source = jnp.arange(tokens * k) // k  # the token of each assignment
    send_x = jnp.zeros((ways * cap, x.shape[-1]), x.dtype).at[slot].set(x[source])
    # local expert id, and `local` (a group of no expert) for an empty slot
    send_e = jnp.full((ways * cap,), local, jnp.int32).at[slot].set(flat % local)
    recv_x, recv_e = _exchange(send_x, ways), _exchange(send_e, ways)
    out = grouped_ffn(layer.experts, recv_x, recv_e, local, options)
    ys = _exchange(out, ways)[slot] * weights.reshape(-1)[:, None]
    y = jnp.zeros_like(x).at[source].add(ys)
    return layer.add_shared(x, y, ks, kg), router_stats(logits, ids, valid, None)


def _send_slots(owner: Array, ways: int) -> tuple[Array, int]:
    """Each assignment's slot in the send buffer and the buffer's slots per
    device (`cap`): per destination device, its assignments in order. The
    buffers hold every assignment of this device (the worst case: all to one
    device)."""
    cap = owner.shape[0]
    return owner * cap + arrival_rank(owner, ways), cap


def _exchange(x: Array, ways: int) -> Array:
    """`x` (`[ways * cap, ...]`, block `i` for device `i`) swapped over the
    `expert` axis: block `i` of the result came from device `i`."""
    blocks = x.reshape(ways, x.shape[0] // ways, *x.shape[1:])
    return lax.all_to_all(blocks, "expert", 0, 0, tiled=False).reshape(x.shape)
