"""Cross-entropy over an output head without the full logits: a `lax.scan` over
chunks of tokens, each forming only `[chunk, vocab]` logits in f32.

The loss (`chunked_cross_entropy`) is a `jax.custom_vjp` whose differentiated
forward computes each chunk's gradient on the spot (logits -> softmax -> the
chunk's `d hidden` and its share of `d weight`), so the backward only scales what
the forward saved by the incoming cotangent; undifferentiated calls (evaluation)
run the primal alone, with no gradient work. Both optionally transform the
logits as some heads do (Granite's `logit_scale`, then Gemma 2/3's final
`softcap`, `c * tanh(z / c)`), chain rule included. Per-token log-probs
(`chunked_token_logprobs`, for per-sequence sums) get a cotangent per token, so
their backward recomputes each chunk's logits instead. `eqtrain.losses` builds
the model-level losses on these.
"""

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from ._errors import ConfigError


class ChunkedCE(NamedTuple):
    """Sums over the target tokens of `chunked_cross_entropy`, in f32.

    Attributes:
        total: `sum(mask * (nll + z_loss * log_z**2))`, the differentiable one.
        nll: `sum(mask * nll)` (no gradient).
        z: `sum(mask * log_z**2)` (no gradient).
        correct: `sum(mask * correct)`, top-1 hits with `_token_cross_entropy`'s
            tie rule (no gradient).
    """

    total: Float[Array, ""]
    nll: Float[Array, ""]
    z: Float[Array, ""]
    correct: Float[Array, ""]


def _dot_t(x: Array, w: Array) -> Array:
    """`x @ w.T` accumulated and returned in f32."""
    dims = (((1,), (1,)), ((), ()))
    return lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)


def _grads(g: Array, h: Array, w: Array) -> tuple[Array, Array]:
    """For logit cotangents `g [chunk, V]` (f32): `(g @ w` in `h`'s dtype, `g.T @ h`
    in f32), each product rounded to its operand's dtype first as autodiff of a
    `w.dtype` matmul would."""
    dh = lax.dot_general(
        g.astype(w.dtype),
        w,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    dw = lax.dot_general(
        g.astype(h.dtype),
        h,
        (((0,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    return dh.astype(h.dtype), dw


def _logits(
    h: Array,
    w: Array,
    vocab_size: int | None,
    logit_scale: float | int = 1.0,
    softcap: float | int | None = None,
) -> Array:
    """`[chunk, V]` f32 logits, padded-vocabulary ids at -inf (`vocab_mask`)."""
    return _logits_slope(h, w, vocab_size, logit_scale, softcap)[0]


def _logits_slope(
    h: Array,
    w: Array,
    vocab_size: int | None,
    logit_scale: float,
    softcap: float | None,
) -> tuple[Array, Array | float | None]:
    """`(logits, slope)`: `h @ w.T` in f32, times `logit_scale`, soft-capped to
    `softcap * tanh(z / softcap)`, then padded-vocabulary ids at -inf; `slope` is
    `d logits / d (h @ w.T)` (None: 1, the default path's unchanged ops), taken
    before the mask so that a masked id's (zero) cotangent stays finite."""
    z = _dot_t(h, w)
    slope = None
    if logit_scale != 1.0:
        z = z * logit_scale
        slope = logit_scale
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
        d = 1.0 - jnp.square(z / softcap)
        slope = d if slope is None else d * slope
    if vocab_size is not None and vocab_size < z.shape[-1]:
        z = jnp.where(jnp.arange(z.shape[-1])[None, :] < vocab_size, z, -jnp.inf)
    return z, slope


def _stats(z: Array, t: Array) -> tuple[Array, Array, Array]:
    """Per-row `(log_z, target logit, correct)` of f32 logits, as
    `losses._token_cross_entropy` computes them."""
    top = jnp.max(z, axis=-1)
    log_z = jnp.log(jnp.sum(jnp.exp(z - top[:, None]), axis=-1)) + top
    picked = jnp.take_along_axis(z, t[:, None], axis=-1)[:, 0]
    at_top = jnp.sum((z >= top[:, None]).astype(jnp.int32), axis=-1)
    correct = ((picked >= top) & (at_top == 1)).astype(jnp.float32)
    return log_z, picked, correct


def _chunks(chunk: int, *arrays: Array) -> tuple[Array, ...]:
    """Each array padded with zeros to a multiple of `chunk` rows and split into
    `[num_chunks, chunk, ...]` (a zero mask keeps the padding out of every sum)."""
    n = arrays[0].shape[0]
    pad = -n % chunk
    out = []
    for a in arrays:
        a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        out.append(a.reshape(-1, chunk, *a.shape[1:]))
    return tuple(out)


def _sums(nll: Array, log_z: Array, correct: Array, m: Array, z_loss: float) -> Array:
    """`[total, nll, z, correct]` of one chunk; masked rows give exactly 0 (a
    `where`, not a product, so a non-finite masked row cannot leak)."""
    on = m != 0
    nll = jnp.where(on, m * nll, 0.0)
    z = jnp.where(on, m * jnp.square(log_z), 0.0)
    correct = jnp.where(on, m * correct, 0.0)
    total = nll + z_loss * z if z_loss else nll
    return jnp.stack([jnp.sum(total), jnp.sum(nll), jnp.sum(z), jnp.sum(correct)])


def _masked(h: Array, t: Array, m: Array) -> tuple[Array, Array, Array]:
    """Masked rows of `h` zeroed, so that not even a non-finite masked row can
    reach a sum or `g.T @ h` (0 * inf is nan)."""
    return jnp.where((m != 0)[:, None], h, jnp.zeros_like(h)), t, m


def _check_chunk(chunk: int) -> None:
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ConfigError(
            f"`chunk` must be a positive int (tokens per chunk, e.g. 256); got "
            f"{chunk!r}."
        )


def _transforms(logit_scale: Any, softcap: Any) -> tuple[float, Any]:
    """`(logit_scale, softcap)` as Python floats (static arguments), checked."""
    try:
        scale = float(logit_scale)
        cap = None if softcap is None else float(softcap)
    except (TypeError, jax.errors.ConcretizationTypeError):
        raise ConfigError(
            f"`logit_scale` and `softcap` must be Python numbers (static: fixed by "
            f"the model's config), not traced arrays; got {logit_scale!r}, "
            f"{softcap!r}."
        ) from None
    if not (math.isfinite(scale) and scale > 0):
        raise ConfigError(
            f"`logit_scale` must be a finite number > 0 (Granite: 1 / "
            f"logits_scaling); got {logit_scale!r}."
        )
    if cap is not None and not (math.isfinite(cap) and cap > 0):
        raise ConfigError(
            f"`softcap` must be None or a finite number > 0 (Gemma 2: 30.0); got "
            f"{softcap!r}."
        )
    return scale, cap


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _ce(h, w, t, m, chunk, z_loss, vocab_size, logit_scale=1.0, softcap=None):
    hs, ts, ms = _chunks(chunk, h, t, m)

    def body(acc, xs):
        hc, tc, mc = _masked(*xs)
        z = _logits(hc, w, vocab_size, logit_scale, softcap)
        log_z, picked, correct = _stats(z, tc)
        return acc + _sums(log_z - picked, log_z, correct, mc, z_loss), None

    sums, _ = lax.scan(body, jnp.zeros((4,), jnp.float32), (hs, ts, ms))
    return sums


def _ce_fwd(h, w, t, m, chunk, z_loss, vocab_size, logit_scale=1.0, softcap=None):
    hs, ts, ms = _chunks(chunk, h, t, m)

    def body(carry, xs):
        acc, dw = carry
        hc, tc, mc = _masked(*xs)
        z, slope = _logits_slope(hc, w, vocab_size, logit_scale, softcap)
        log_z, picked, correct = _stats(z, tc)
        g = _dlogits(z, log_z, tc, mc, slope, z_loss)
        dh, dw_chunk = _grads(g, hc, w)
        dw = dw + dw_chunk
        sums = acc + _sums(log_z - picked, log_z, correct, mc, z_loss)
        return (sums, dw), dh

    init = (jnp.zeros((4,), jnp.float32), jnp.zeros(w.shape, jnp.float32))
    (sums, dw), dh = lax.scan(body, init, (hs, ts, ms))
    dh = dh.reshape(-1, h.shape[-1])[: h.shape[0]]
    return sums, (dh, dw.astype(w.dtype), t, m)


def _dlogits(
    z: Array, log_z: Array, t: Array, m: Array, slope: Array | float | None, z_loss: Any
) -> Array:
    """The gradient of one chunk's loss with respect to its logits (masked rows 0)."""
    # d(nll)/dz = softmax - onehot; d(log_z**2)/dz = 2 log_z softmax.
    p = jnp.exp(z - log_z[:, None])
    scale = 1.0 + 2.0 * z_loss * log_z if z_loss else jnp.ones_like(log_z)
    onehot = jnp.arange(z.shape[-1])[None, :] == t[:, None]
    g = p * scale[:, None] - onehot.astype(jnp.float32)
    if slope is not None:  # back through the soft-cap and the scale
        g = g * slope
    return jnp.where((m != 0)[:, None], m[:, None] * g, 0.0)


def _ce_bwd(chunk, z_loss, vocab_size, logit_scale, softcap, saved, ct):
    dh, dw, t, m = saved
    # Only `total` (ct[0]) is differentiable; `ChunkedCE` stops the others.
    c = ct[0]
    return (
        (c * dh.astype(jnp.float32)).astype(dh.dtype),
        (c * dw.astype(jnp.float32)).astype(dw.dtype),
        None,
        jnp.zeros_like(m),
    )


_ce.defvjp(_ce_fwd, _ce_bwd)


@jax.named_scope("loss")
def chunked_cross_entropy(
    hidden: Float[Array, "tokens hidden"],
    weight: Float[Array, "vocab hidden"],
    targets: Int[Array, " tokens"],
    mask: ArrayLike,
    *,
    chunk: int,
    z_loss: float | int = 0.0,
    vocab_size: int | None = None,
    logit_scale: float | int = 1.0,
    softcap: float | int | None = None,
) -> ChunkedCE:
    """Cross-entropy of `logits = hidden @ weight.T` summed over target tokens,
    never holding more than `[chunk, vocab]` logits.

    With `logit_scale` or `softcap` the logits are `softcap * tanh(logit_scale *
    (hidden @ weight.T) / softcap)` (the scale first; either may be left out),
    and everything (nll, `log_z` of the z-loss, accuracy, the padded-id mask)
    is of these.

    Logits, log-sum-exp and gradients are f32 whatever the input dtype. Under
    `jax.grad` each chunk's gradient is computed in the forward pass (the backward
    only scales it; the saved gradients are `hidden`- and `weight`-sized); without
    differentiation no gradient work is done. Normalise outside (by the global
    target count) so that the chunking cannot change the mean.

    Args:
        hidden: `[N, d]` final hidden states (any float dtype).
        weight: `[V, d]` output head (`model.head_weight()`).
        targets: `[N]` target ids; those of masked tokens may hold anything.
        mask: `[N]` per-token weight, 0 drops a token (it contributes exactly 0,
            and so does an all-masked chunk).
        chunk: tokens per chunk; `N` is padded to a multiple with masked rows.
        z_loss: coefficient of `log_z**2` in `total`.
        vocab_size: the real vocabulary of a padded head (`losses.vocab_mask`).
        logit_scale: a factor on the logits (Granite: `1 / logits_scaling`);
            1 leaves them as they are.
        softcap: the soft-cap `c` of `c * tanh(z / c)` after the scale (Gemma
            2/3's `final_logit_softcapping`); None: none.

    Returns:
        A `ChunkedCE` of f32 sums; only `total` carries a gradient (w.r.t.
        `hidden` and `weight`).
    """
    _check_chunk(chunk)
    scale, cap = _transforms(logit_scale, softcap)
    m = jnp.asarray(mask).astype(jnp.float32)
    t = jnp.where(m != 0, jnp.asarray(targets), 0).astype(jnp.int32)
    chunk = min(chunk, max(hidden.shape[0], 1))
    sums = _ce(hidden, weight, t, m, chunk, float(z_loss), vocab_size, scale, cap)
    stats = lax.stop_gradient(sums[1:])
    return ChunkedCE(sums[0], stats[0], stats[1], stats[2])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _logp(h, w, t, chunk, vocab_size, logit_scale=1.0, softcap=None):
    return _logp_fwd(h, w, t, chunk, vocab_size, logit_scale, softcap)[0]


def _logp_fwd(h, w, t, chunk, vocab_size, logit_scale=1.0, softcap=None):
    hs, ts = _chunks(chunk, h, t)

    def body(_, xs):
        hc, tc = xs
        z = _logits(hc, w, vocab_size, logit_scale, softcap)
        log_z, picked, _ = _stats(z, tc)
        return None, (picked - log_z, log_z)

    _, (logp, log_z) = lax.scan(body, None, (hs, ts))
    n = h.shape[0]
    logp, log_z = logp.reshape(-1)[:n], log_z.reshape(-1)[:n]
    return logp, (h, w, t, log_z)


def _logp_bwd(chunk, vocab_size, logit_scale, softcap, saved, ct):
    h, w, t, log_z = saved
    hs, ts, lzs, cts = _chunks(chunk, h, t, log_z, ct.astype(jnp.float32))

    def body(dw, xs):
        hc, tc, lzc, cc = xs
        # d logp / dz = onehot - softmax, recomputed from the saved log_z.
        z, slope = _logits_slope(hc, w, vocab_size, logit_scale, softcap)
        p = jnp.exp(z - lzc[:, None])
        onehot = (jnp.arange(p.shape[-1])[None, :] == tc[:, None]).astype(jnp.float32)
        if slope is None:
            g = jnp.where((cc != 0)[:, None], cc[:, None] * (onehot - p), 0.0)
        else:  # back through the soft-cap and the scale
            g = jnp.where((cc != 0)[:, None], cc[:, None] * ((onehot - p) * slope), 0.0)
        dh, dw_chunk = _grads(g, hc, w)
        dw = dw + dw_chunk
        return dw, dh

    dw, dh = lax.scan(body, jnp.zeros(w.shape, jnp.float32), (hs, ts, lzs, cts))
    return dh.reshape(-1, h.shape[-1])[: h.shape[0]], dw.astype(w.dtype), None


_logp.defvjp(_logp_fwd, _logp_bwd)


def chunked_token_logprobs(
    hidden: Float[Array, "tokens hidden"],
    weight: Float[Array, "vocab hidden"],
    targets: Int[Array, " tokens"],
    *,
    chunk: int,
    vocab_size: int | None = None,
    logit_scale: float | int = 1.0,
    softcap: float | int | None = None,
) -> Float[Array, " tokens"]:
    """`log softmax(hidden @ weight.T)[target]` per token, in f32, chunk by chunk.

    Differentiable w.r.t. `hidden` and `weight`; the backward recomputes each
    chunk's logits (a cotangent per token cannot be folded in ahead of time), and
    tokens whose cotangent is 0 contribute exactly 0. `targets` must be valid ids.
    `logit_scale`, `softcap`: as for `chunked_cross_entropy`.
    """
    _check_chunk(chunk)
    scale, cap = _transforms(logit_scale, softcap)
    chunk = min(chunk, max(hidden.shape[0], 1))
    t = jnp.asarray(targets).astype(jnp.int32)
    return _logp(hidden, weight, t, chunk, vocab_size, scale, cap)
