"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE): a router, top-k
selection, experts as stacked weights, and the ways to send tokens to them.

A `SparseMoE` works on all the tokens of a batch at once (`x: [tokens, hidden]`,
see `Decoder.batch_features`): routing is per token, but grouping tokens by
expert pays off over the whole batch, and the load-balancing loss is a batch
statistic. The dispatch (`MOE_IMPLS`: sorted, pallas, ragged, dense, and the
capacity limit) is described in `_experts`, where it lives.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from .._errors import ConfigError
from ._expert_parallel import (
    expert_axis_size,
    expert_parallel,
    kernel_token_axes,
    on_own_tokens,
)
from ._experts import (
    AUX_KEYS as AUX_KEYS,
    MOE_IMPLS as MOE_IMPLS,
    Experts,
    MoEOptions as MoEOptions,
    check_moe_options as check_moe_options,
    routed_output,
    router_stats,
)
from ._layers import AnyLinear, Linear, as_dtype, num_params, split_key


DEFAULT_OPTIONS = MoEOptions()
"""A sparse layer's options by default: `"auto"` dispatch, dropless."""


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
        options: MoEOptions = DEFAULT_OPTIONS,
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, "tokens hidden"], dict[str, Array]]:
        """The layer's output and its router statistics (`AUX_KEYS`); `valid`
        marks the tokens that count in the statistics (padding does not)."""
        if expert_axis_size() > 1:
            _check_dropless(options)
            return expert_parallel(self, x, valid, options, key)
        axes = kernel_token_axes(options, x.shape[0])
        if axes:
            return on_own_tokens(self, x, valid, options, key, axes)
        return self.local(x, valid=valid, options=options, key=key)

    def local(
        self,
        x: Float[Array, "tokens hidden"],
        *,
        valid: Bool[Array, " tokens"] | None,
        options: MoEOptions,
        key: PRNGKeyArray | None,
    ) -> tuple[Float[Array, "tokens hidden"], dict[str, Array]]:
        """The layer on the tokens it is given, every expert here (as `__call__`
        without a mesh)."""
        kr, ks, kg = split_key(key, 3)
        logits, weights, ids = self.route(x, kr)
        y, dropped = routed_output(self.experts, x, weights, ids, options)
        return self.add_shared(x, y, ks, kg), router_stats(logits, ids, valid, dropped)

    def add_shared(self, x: Array, y: Array, ks: Any, kg: Any) -> Array:
        """`y` plus the shared expert's output, gated (Qwen2-MoE), if any."""
        if self.shared_expert is None:
            return y
        gate = jax.nn.sigmoid(self.shared_expert_gate(x, key=kg))  # pyright: ignore
        return y + gate * self.shared_expert(x, key=ks)


def _check_dropless(options: MoEOptions) -> None:
    """Expert parallelism is dropless: no `capacity_factor`."""
    if options.capacity_factor is not None:
        raise ConfigError(
            "`capacity_factor` is not supported with mesh.expert > 1 (expert "
            "parallelism is dropless); unset it or set mesh.expert = 1."
        )


def active_params(model: Any) -> int:
    """A model's parameters a token goes through: all of them, but of each
    sparse MLP's experts only `top_k` (for a model without experts, all)."""
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
