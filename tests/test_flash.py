"""Flash attention (`implementation="flash"`, `eqtrain.models._flash`): the
same values and gradients as the plain attention, with GQA, packed segments,
sliding windows, soft-capping, a last block shorter than the others, in f32 and
bf16; no `[heads, block, seq]` scores anywhere in its forward or backward; a
model with `attention_impl="flash"` trains as the default one."""

import jax
import jax.extend
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from eqtrain import models
from eqtrain._errors import ConfigError
from eqtrain.models._attention import attention
from eqtrain.models._flash import flash_attention


def _qkv(seq, heads=4, kv=2, dim=8, dtype=jnp.float32, seed=0):
    keys = jr.split(jr.key(seed), 3)
    return tuple(
        jr.normal(key, (seq, h, dim)).astype(dtype)
        for key, h in zip(keys, (heads, kv, kv), strict=True)
    )


def _segments(seq):
    """Three packed examples and a padding tail (id 0)."""
    cut = [seq // 4, seq // 2 + 3, seq - seq // 8]
    ids = np.zeros(seq, np.int32)
    ids[: cut[0]], ids[cut[0] : cut[1]], ids[cut[1] : cut[2]] = 1, 2, 3
    return jnp.asarray(ids)


CASES = {
    "causal": dict(),
    "segments": dict(segments=True),
    "window": dict(segments=True, sliding_window=23),
    "softcap": dict(softcap=5.0, scale=0.3),
    "everything": dict(segments=True, sliding_window=40, softcap=8.0),
}


def _both(seq, case, block, dtype=jnp.float32, heads=4, kv=2):
    """`(flash, plain)` functions of (q, k, v) for `CASES[case]`."""
    opts = dict(CASES[case])
    segs = _segments(seq) if opts.pop("segments", False) else None
    kw = dict(segment_ids=segs, sliding_window=opts.pop("sliding_window", None))
    kw |= opts

    def flash(q, k, v):
        return flash_attention(q, k, v, block=block, **kw)

    def plain(q, k, v):  # one masked call: `dot_attention` over the whole sequence
        return attention(q, k, v, implementation=None, query_chunk=seq, **kw)

    return flash, plain


def _values_and_grads(fn, q, k, v, cotangent):
    out, pull = jax.vjp(fn, q, k, v)
    return (out, *pull(cotangent))


# One case of each in the default suite (every mask at once, and a sequence
# shorter than a block), the whole grid under `slow`.
FAST = {("everything", 100, 32), ("causal", 40, 64)}
GRID = [
    pytest.param(case, seq, block, marks=() if (case, seq, block) in FAST
                 else pytest.mark.slow)
    for case in CASES for seq, block in [(96, 32), (100, 32), (40, 64)]
]  # fmt: skip


@pytest.mark.parametrize("case,seq,block", GRID)
def test_flash_equals_plain_attention_values_and_gradients(case, seq, block):
    q, k, v = _qkv(seq)
    cotangent = jr.normal(jr.key(7), q.shape)
    flash, plain = _both(seq, case, block)
    got = _values_and_grads(jax.jit(flash), q, k, v, cotangent)
    want = _values_and_grads(jax.jit(plain), q, k, v, cotangent)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.slow  # the default suite's time; f32 cases run there
def test_flash_in_bf16_matches_within_bf16_rounding():
    seq = 160
    q, k, v = _qkv(seq, dtype=jnp.bfloat16, seed=3)
    cotangent = jr.normal(jr.key(8), q.shape).astype(jnp.bfloat16)
    flash, plain = _both(seq, "window", 64)
    got = _values_and_grads(jax.jit(flash), q, k, v, cotangent)
    want = _values_and_grads(jax.jit(plain), q, k, v, cotangent)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == jnp.bfloat16, name
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = np.abs(b).max()
        np.testing.assert_allclose(a, b, atol=3e-2 * scale, err_msg=name)


@pytest.mark.slow  # the default suite's time
def test_multi_query_heads_and_a_single_block():
    """One key/value head for eight query heads; a sequence shorter than a
    block is one block pair."""
    q, k, v = _qkv(24, heads=8, kv=1, seed=5)
    cotangent = jr.normal(jr.key(9), q.shape)
    flash, plain = _both(24, "segments", 128, heads=8, kv=1)
    got = _values_and_grads(flash, q, k, v, cotangent)
    want = _values_and_grads(plain, q, k, v, cotangent)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def _largest(jaxpr) -> int:
    """The most elements of any value in `jaxpr`, its sub-jaxprs included."""
    largest = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            largest = max(largest, int(np.prod(getattr(var.aval, "shape", ()))))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            largest = max(largest, _largest(sub))
    return largest


@pytest.mark.parametrize("impl", ["flash", None])
def test_no_scores_of_a_block_against_the_whole_sequence(impl):
    """Forward and backward of flash attention hold scores of one block pair
    at a time; the causal blocks of XLA's kernel (the default) hold a block's
    scores against every key before it, up to `[heads, block, seq]`."""
    seq, heads = 1024, 4
    q, k, v = _qkv(seq, heads=heads)

    def loss(q, k, v):
        out = attention(
            q, k, v, segment_ids=None, sliding_window=None, implementation=impl
        )
        return jnp.sum(out**2)

    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v).jaxpr
    whole_rows = heads * 128 * seq  # one 128-query block's scores against all keys
    if impl == "flash":
        assert _largest(jaxpr) < whole_rows // 4
    else:
        assert _largest(jaxpr) >= whole_rows // 2


def _transposes(jaxpr) -> int:
    """How many `transpose`s `jaxpr` holds, its sub-jaxprs included (a scan's
    body once)."""
    count = sum(eqn.primitive.name == "transpose" for eqn in jaxpr.eqns)
    for eqn in jaxpr.eqns:
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _transposes(sub)
    return count


@pytest.mark.parametrize("impl", ["flash", None])
def test_the_heads_move_in_front_once_not_per_block(impl):
    """Both kernels transpose their inputs to heads in front once and back
    once, however many blocks the sequence has: XLA's batched products on
    the CPU want their batch axes leading, and a transpose per block copied
    every key and value a block sees (docs/performance.md, flash attention on
    the CPU). Flash's backward too; the causal blocks' backward is autodiff's
    (its transposes of the products' gradients grow with the blocks)."""

    def count(seq, grad):
        def loss(q, k, v):
            out = attention(
                q, k, v, segment_ids=None, sliding_window=None, implementation=impl
            )
            return jnp.sum(out**2)

        fn = jax.grad(loss, (0, 1, 2)) if grad else loss
        return _transposes(jax.make_jaxpr(fn)(*_qkv(seq)).jaxpr)

    assert count(256, False) == count(1024, False) == 4  # q, k, v and the output
    if impl == "flash":
        assert count(256, True) == count(1024, True)


def _tiny(impl):
    config = models.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=48,
        attention_impl=impl, scan_layers=False,
    )  # fmt: skip
    return models.Llama(config, jr.key(0))


@pytest.mark.slow  # the default suite's time (15 min): `nox -s slow`
def test_a_model_with_flash_attention_trains_as_the_default():
    tokens = jr.randint(jr.key(1), (2, 160), 0, 64)
    segs = jnp.asarray(np.repeat([[1, 2]], 80, axis=1).repeat(2, axis=0))

    def loss(model):
        logits = jax.vmap(lambda t, s: model(t, segment_ids=s))(tokens, segs)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    grads = {}
    for impl in ("flash", None):
        value, grad = jax.value_and_grad(loss)(_tiny(impl))
        grads[impl] = (value, jax.tree.leaves(grad))
    np.testing.assert_allclose(grads["flash"][0], grads[None][0], rtol=1e-5)
    for a, b in zip(grads["flash"][1], grads[None][1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_an_unknown_attention_impl_names_flash():
    with pytest.raises(ConfigError, match="'flash'"):
        _tiny("fast")


@pytest.mark.parametrize(
    "case,seq",
    [("everything", 300), ("window", 64)]
    + [pytest.param(c, s, marks=pytest.mark.slow) for c in CASES for s in (64, 300)],
)
def test_causal_blocks_equal_one_call_values_and_gradients(case, seq):
    """The default attention (`causal_blocks`, one block up to 128 tokens; its
    gradient written by hand, `_softmax_attention`) equals one masked call of
    `jax.nn.dot_product_attention` over the whole sequence, with GQA,
    segments, windows and a last block shorter than the others."""
    from eqtrain.models._attention import one_call_attention

    opts = dict(CASES[case])
    segs = _segments(seq) if opts.pop("segments", False) else None
    kw = dict(segment_ids=segs, sliding_window=opts.pop("sliding_window", None))
    kw |= opts
    q, k, v = _qkv(seq, heads=6, kv=2)
    cotangent = jr.normal(jr.key(9), q.shape)
    blocks = jax.jit(lambda q, k, v: attention(q, k, v, implementation=None, **kw))
    one = jax.jit(
        lambda q, k, v: one_call_attention(q, k, v, implementation=None, **kw)
    )
    got = _values_and_grads(blocks, q, k, v, cotangent)
    want = _values_and_grads(one, q, k, v, cotangent)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)
