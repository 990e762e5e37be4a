"""Row sums and maxima (over the last axis) in reductions of at most 32
elements each, which XLA:CPU runs fused and vectorised.

XLA:CPU rewrites a reduction over more than 32 elements into a `reduce-window`
of 32 and a reduction of the windows, for a sum's accuracy. That
`reduce-window` runs on its own, unfused and unvectorised: the row max of an
attention score block becomes a pass over memory of its own, as costly as the
softmax around it. A reduction over at most 32 elements is left as it
is and takes its elementwise producer in (the mask and scale before a max, the
square before a norm's sum).

So `row_sum` and `row_max` split the last axis into factors of at most 32
(`_factors`), keep the innermost (32 lanes where `n` allows) while they reduce
the others one by one, then reduce the lanes: each reduction is vectorised
across the lanes. XLA merges a reduction of a reduction that starts from the
same value back into one (which the rewrite then splits again), so the
reductions alternate two start values that give the same result: `0.0` and
`-0.0` for a sum (`x + -0.0 == x`), `-inf` and the largest negative float for a
maximum (finite rows; a row of `-inf` may give that float instead of `-inf`).
The start values are arrays: `lax.reduce` would turn a Python `-0.0` into a
plain sum that starts from 0. A factor past 32 with no divisor up to 32 (a
prime) is reduced as it is, and XLA rewrites that one.

This holds where XLA:CPU runs reductions itself, as with Eigen's products
(`--xla_cpu_experimental_ynn_fusion_type=`, empty). With XLA's default
settings YNNPACK takes a long reduction whole, faster than the pieces
(`benchmarks/attention.py` compares them). So the pieces are used only where
a compiled 1,024-wide row max shows the
rewrite (`windowed`, asked once per process); elsewhere, and on other
backends, `row_sum` and `row_max` are `jnp.sum` and `jnp.max`.

Both have the plain gradients of `jnp.sum` and `jnp.max` (a sum's transpose is
a broadcast, no reduction).
"""

import functools
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, Float


PIECE = 32
"""The longest axis XLA:CPU reduces as it is (its tree-reduction rewrite's
window)."""


def _factors(n: int) -> list[int]:
    """`n` as factors of at most `PIECE` (largest first), and a last factor
    past it when one remains with no divisor up to `PIECE`."""
    out = []
    while n > PIECE:
        c = next((c for c in range(PIECE, 1, -1) if n % c == 0), None)
        if c is None:
            break
        out.append(c)
        n //= c
    return [*out, n] if n > 1 else out


@functools.cache
def windowed() -> bool:
    """Whether this process's XLA rewrites a long row reduction into a
    `reduce-window` (XLA:CPU without YNNPACK's reductions), from a compiled
    `[64, 1024]` row max (tens of ms, once)."""
    if jax.default_backend() != "cpu":
        return False
    shape = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
    compiled = jax.jit(lambda x: jnp.max(x, axis=-1)).lower(shape).compile()
    return "reduce-window" in compiled.as_text()


def _pieces(x: Array, op: Any, starts: tuple[float, float]) -> Array:
    """`x` reduced with `op` over its last axis (kept, of size 1): the axis
    split into factors of at most `PIECE`, the innermost (`lanes`) kept while
    the others are reduced one by one, innermost first, then the lanes; the
    reductions start from `starts[0]` and `starts[1]` in turn."""
    if not windowed():
        return lax.reduce(x, jnp.asarray(starts[0], x.dtype), op, (x.ndim - 1,))[
            ..., None
        ]
    lanes, *rest = _factors(x.shape[-1]) or [1]
    lead = x.shape[:-1]
    x = x.reshape(*lead, *reversed(rest), lanes)
    for i in range(len(rest)):
        start = jnp.asarray(starts[i % 2], x.dtype)
        x = lax.reduce(x, start, op, (x.ndim - 2,))
    start = jnp.asarray(starts[len(rest) % 2], x.dtype)
    return lax.reduce(x, start, op, (x.ndim - 1,))[..., None]


@jax.custom_jvp
def row_sum(x: Float[Array, "*rows n"]) -> Float[Array, "*rows 1"]:
    """`jnp.sum(x, axis=-1, keepdims=True)` in pieces of at most 32."""
    return _pieces(x, lax.add, (0.0, -0.0))


@row_sum.defjvp
def _row_sum_jvp(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
    (x,), (t,) = primals, tangents
    return row_sum(x), jnp.sum(t, axis=-1, keepdims=True)


@jax.custom_jvp
def row_max(x: Float[Array, "*rows n"]) -> Float[Array, "*rows 1"]:
    """`jnp.max(x, axis=-1, keepdims=True)` in pieces of at most 32."""
    return _pieces(x, lax.max, (-jnp.inf, float(jnp.finfo(x.dtype).min)))


@row_max.defjvp
def _row_max_jvp(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
    # jnp.max's: the mean of the tangents where the row takes its maximum
    (x,), (t,) = primals, tangents
    top = row_max(x)
    at = x == top
    share = jnp.sum(jnp.where(at, t, 0), axis=-1, keepdims=True)
    return top, share / row_sum(at.astype(x.dtype))


def row_softmax(x: Float[Array, "*rows n"]) -> Float[Array, "*rows n"]:
    """`jax.nn.softmax(x, axis=-1)` (for a floating `x`) with its row max and
    row sum in pieces of at most 32; the max's gradient stopped, as there."""
    e = jnp.exp(x - lax.stop_gradient(row_max(x)))
    return e / row_sum(e)
