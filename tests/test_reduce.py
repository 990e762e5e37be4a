"""`eqtrain._reduce`: row sums, maxima and softmax in reductions of at most 32
elements, equal to jnp's (values and gradients), and compiled by XLA:CPU
without its `reduce-window` rewrite where XLA would make one."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqtrain import _reduce
from eqtrain._reduce import _factors, row_max, row_softmax, row_sum


LENGTHS = [1, 5, 31, 32, 33, 64, 100, 1000, 1009, 1024, 2048, 4036]
"""Lengths with and without divisors up to 32, primes past it (1009) and a
prime factor past it (4036 = 4 x 1009)."""


@pytest.fixture(params=["pieces", "whole"])
def pieces(request, monkeypatch):
    """Each test twice: the rows reduced in pieces (as where XLA:CPU would
    rewrite them) and whole (as under XLA's default settings)."""
    monkeypatch.setattr(_reduce, "windowed", lambda: request.param == "pieces")
    return request.param


def _rows(n: int, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(n), (3, 2, n), jnp.float32).astype(dtype)


@pytest.mark.parametrize("n", LENGTHS)
def test_factors_multiply_back(n):
    factors = _factors(n)
    assert int(np.prod(factors)) == n
    assert all(f <= 32 for f in factors[:-1])


@pytest.mark.parametrize("n", LENGTHS)
def test_row_sum_and_max_equal_jnp(n, pieces):
    x = _rows(n)
    total = jax.jit(row_sum)(x)
    exact = np.sum(np.asarray(x, np.float64), axis=-1, keepdims=True)
    bound = (
        n * np.finfo(np.float32).eps * np.sum(np.abs(np.asarray(x)), -1, keepdims=True)
    )
    assert total.shape == (3, 2, 1) and total.dtype == jnp.float32
    assert np.all(np.abs(np.asarray(total, np.float64) - exact) <= bound)
    np.testing.assert_array_equal(jax.jit(row_max)(x), jnp.max(x, -1, keepdims=True))


def test_row_sum_in_bf16_stays_bf16_and_close(pieces):
    x = _rows(1024, jnp.bfloat16)
    got = row_sum(x)
    assert got.dtype == jnp.bfloat16
    want = jnp.sum(x.astype(jnp.float32), -1, keepdims=True)
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=0.5, rtol=2e-2)


def test_gradients_equal_jnp(pieces):
    x = _rows(1000)
    x = x.at[..., 7].set(jnp.max(x, -1))  # ties for the max share its gradient
    weights = jnp.arange(6.0).reshape(3, 2, 1)
    loss = lambda f: lambda a: jnp.sum(f(a) * weights)
    for ours, theirs in [
        (lambda a: row_sum(a * a), lambda a: jnp.sum(a * a, -1, keepdims=True)),
        (row_max, lambda a: jnp.max(a, -1, keepdims=True)),
    ]:
        g1, g2 = jax.grad(loss(ours))(x), jax.grad(loss(theirs))(x)
        np.testing.assert_allclose(g1, g2, rtol=1e-6, atol=1e-6)


def test_row_softmax_equals_jax_nn_softmax(pieces):
    x = _rows(768) * 4
    x = x.at[0, 0, 100:].set(-1e30)  # a masked tail, as the attention masks
    f32 = np.finfo(np.float32).eps
    np.testing.assert_allclose(row_softmax(x), jax.nn.softmax(x, -1), atol=4 * f32)
    cot = _rows(768)
    g1 = jax.grad(lambda a: jnp.sum(row_softmax(a) * cot))(x)
    g2 = jax.grad(lambda a: jnp.sum(jax.nn.softmax(a, -1) * cot))(x)
    np.testing.assert_allclose(g1, g2, atol=16 * f32)


_STRUCTURE = """
import jax, jax.numpy as jnp
from eqtrain import _reduce
from eqtrain.losses import _token_cross_entropy
from eqtrain.models._layers import RMSNorm

def windows(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text().count("reduce-window(")

x = jax.random.normal(jax.random.key(0), (3, 2, 64, 1024))
logits, targets = x.reshape(-1, 2048)[:64], jnp.arange(64)
norm = RMSNorm(256, eps=1e-6, dtype=jnp.float32)
print(_reduce.windowed(), windows(lambda s: jax.nn.softmax(s, -1), x),
      windows(_reduce.row_softmax, x), windows(_token_cross_entropy, logits, targets),
      windows(lambda h: norm(h), x.reshape(-1, 256)))
"""


@pytest.mark.parametrize("ynn", ["default", "off"])
def test_pieces_only_where_xla_would_rewrite(ynn):
    """XLA:CPU rewrites a reduction over more than 32 elements into an
    unfused `reduce-window` and a reduction unless YNNPACK takes it (XLA's
    default settings). With YNNPACK's fusions off (`tune_cpu`'s products on
    processor B), `windowed()` says so and the softmax, the loss and the
    norm compile without a `reduce-window` (the plain softmax shows the
    rewrite); with the defaults there is none to avoid, and the rows are
    reduced whole. A fresh process each: XLA reads its flags once."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    if ynn == "off":
        env["XLA_FLAGS"] = "--xla_cpu_experimental_ynn_fusion_type="
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_STRUCTURE)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    windowed, plain, softmax, loss, norm = run.stdout.split()
    if ynn == "off":
        assert (windowed, softmax, loss, norm) == ("True", "0", "0", "0")
        assert int(plain) > 0
    else:
        assert (windowed, plain, softmax) == ("False", "0", "0")
