"""The parts of a decoder block around its attention: the dense MLPs in
their three shapes (`GatedMLP`, `FusedGatedMLP`, `PlainMLP`), the projections'
initialisation (`config_linear`), and `normed`, which folds a block's norm into
the first projections of the sublayer after it. The block: `_decoder_blocks`.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, PRNGKeyArray

from ._decoder_config import DecoderConfig
from ._layers import (
    ACTIVATIONS,
    AnyLinear,
    LayerNorm,
    Linear,
    RMSNorm,
    as_dtype,
    fused_linears,
    gated,
    split_key,
)
from ._stack import name_activation


AnyNorm = RMSNorm | LayerNorm


def normed(
    norm: AnyNorm | None,
    fn: Callable[..., Any],
    x: Array,
    *args: Any,
    name: str | None = None,
) -> Any:
    """`fn(norm(x), *args)`, with the norm's output made again from `x` in the
    backward pass rather than kept (`jax.checkpoint`, without `prevent_cse`).

    `fn` is a sublayer's first projections, whose weight gradients need their
    input: kept, that is the norm's output, besides the normalised values the
    norm's own gradient needs; folded, only `x`. Under scanned layers every
    kept value is stacked, zero-filled and copied in and out each step, and a
    norm is cheap to make again. The projections' products are not computed
    twice: nothing in the backward pass needs their outputs. `fn` takes its
    arrays through `args` (modules, keys), not from a closure. `name` marks the
    norm's output for remat policies (`"mlp_in"`). Without a norm:
    `fn(x, *args)`."""
    if norm is None:
        return fn(x, *args)

    def inner(norm: Any, x: Array, args: tuple) -> Any:
        y = norm(x)
        return fn(y if name is None else name_activation(y, name), *args)

    return jax.checkpoint(inner, prevent_cse=False)(norm, x, args)


def config_linear(
    config: DecoderConfig, d_in: int, d_out: int, bias: bool, key: Any
) -> Linear:
    """A projection with `config`'s initialisation and parameter dtype."""
    std, dtype = config.initializer_range, as_dtype(config.param_dtype)
    return Linear(d_in, d_out, use_bias=bias, std=std, dtype=dtype, key=key)


class GatedMLP(eqx.Module):
    """`down_proj(act(gate_proj(x)) * up_proj(x))` (SwiGLU with `silu`)."""

    gate_proj: AnyLinear
    up_proj: AnyLinear
    down_proj: AnyLinear
    act: str = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, key: PRNGKeyArray):
        kg, ku, kd = jr.split(key, 3)
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = config_linear(config, d, f, bias, kg)
        self.up_proj = config_linear(config, d, f, bias, ku)
        self.down_proj = config_linear(config, f, d, bias, kd)
        self.act = config.hidden_act

    @jax.named_scope("mlp")
    def __call__(
        self, x: Array, *, key: PRNGKeyArray | None = None, norm: AnyNorm | None = None
    ) -> Array:
        """`norm`: the norm to apply to `x` first (`normed`), or None."""
        kg, ku, kd = split_key(key, 3)
        gate, up = normed(norm, _gate_up, x, self, (kg, ku), name="mlp_in")
        return gated_down(self.down_proj, self.act, gate, up, kd)


def _gate_up(x: Array, mlp: "GatedMLP", keys: tuple) -> list[Array]:
    return fused_linears((mlp.gate_proj, mlp.up_proj), x, keys)


def gated_down(
    down_proj: AnyLinear, act: str, gate: Array, up: Array, key: PRNGKeyArray | None
) -> Array:
    """`down_proj(gated(act, gate, up))` with the hidden layer recomputed for
    the down projection's weight gradient rather than kept (`jax.checkpoint`,
    without `prevent_cse`): under scanned layers every kept value is stacked,
    zero-filled, copied in and copied back out each step, and this one is
    cheap to make again from `gate` and `up`, which the backward pass keeps
    anyway. Unrolled, XLA merges the recomputation with the forward pass."""
    down = lambda lin, g, u, k: lin(gated(act, g, u), key=k)
    return jax.checkpoint(down, prevent_cse=False)(down_proj, gate, up, key)


class FusedGatedMLP(eqx.Module):
    """The gated MLP with gate and up in one `gate_up_proj` (gate first: Phi-3)."""

    gate_up_proj: AnyLinear
    down_proj: AnyLinear
    act: str = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, key: PRNGKeyArray):
        width = 2 * config.intermediate_size
        self.gate_up_proj, self.down_proj = _in_and_out(config, width, key)
        self.act = config.hidden_act

    @jax.named_scope("mlp")
    def __call__(
        self, x: Array, *, key: PRNGKeyArray | None = None, norm: AnyNorm | None = None
    ) -> Array:
        """`norm`: the norm to apply to `x` first (`normed`), or None."""
        ku, kd = split_key(key, 2)
        project = lambda y, mlp, k: mlp.gate_up_proj(y, key=k)
        gate, up = jnp.split(normed(norm, project, x, self, ku, name="mlp_in"), 2, -1)
        return gated_down(self.down_proj, self.act, gate, up, kd)


class PlainMLP(eqx.Module):
    """`c_proj(act(c_fc(x)))` (StarCoder2)."""

    c_fc: AnyLinear
    c_proj: AnyLinear
    act: str = eqx.field(static=True)

    def __init__(self, config: DecoderConfig, key: PRNGKeyArray):
        width = config.intermediate_size
        self.c_fc, self.c_proj = _in_and_out(config, width, key)
        self.act = config.hidden_act

    @jax.named_scope("mlp")
    def __call__(
        self, x: Array, *, key: PRNGKeyArray | None = None, norm: AnyNorm | None = None
    ) -> Array:
        """`norm`: the norm to apply to `x` first (`normed`), or None."""
        ku, kd = split_key(key, 2)
        project = lambda y, mlp, k: mlp.c_fc(y, key=k)
        h = normed(norm, project, x, self, ku, name="mlp_in")
        return self.c_proj(ACTIVATIONS[self.act](h), key=kd)


def _in_and_out(
    config: DecoderConfig, width: int, key: PRNGKeyArray
) -> tuple[Linear, Linear]:
    """An MLP's input projection (hidden -> `width`) and its output projection
    (intermediate -> hidden), drawn from `key` in that order."""
    ku, kd = jr.split(key)
    d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
    return config_linear(config, d, width, bias, ku), config_linear(
        config, f, d, bias, kd
    )


_MLPS = {"gated": GatedMLP, "fused_gated": FusedGatedMLP, "plain": PlainMLP}
