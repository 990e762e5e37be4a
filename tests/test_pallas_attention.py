"""Flash attention as Pallas kernels (`implementation="pallas"`,
`eqtrain.models._pallas_attention`), run interpreted on the CPU: the same
values and gradients as the plain attention for every mask the families use
(causal, packed segments, sliding windows, Gemma 2's soft-cap, grouped-query
heads), a head size and a sequence that are not whole tiles, in f32 and bf16;
the kernels lower to Triton for CUDA (forward and both backward kernels); a
model with `attention_impl="pallas"` trains as the default one; cuDNN's
soft-capped layers take the Pallas kernels."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax import export

from eqtrain import models
from eqtrain._errors import ConfigError
from eqtrain._rows import vmap_rows
from eqtrain.models import _pallas_attention
from eqtrain.models._attention import attention
from eqtrain.models._pallas_attention import pallas_attention

from .test_flash import CASES, _largest, _qkv, _segments


def _keywords(seq, case):
    opts = dict(CASES[case])
    segs = _segments(seq) if opts.pop("segments", False) else None
    kw = dict(segment_ids=segs, sliding_window=opts.pop("sliding_window", None))
    return kw | opts


def _both(seq, case, block):
    """`(pallas, plain)` functions of (q, k, v) for `CASES[case]`."""
    kw = _keywords(seq, case)

    def kernel(q, k, v):
        return pallas_attention(q, k, v, block=block, **kw)

    def plain(q, k, v):  # one masked call over the whole sequence
        return attention(q, k, v, implementation=None, query_chunk=seq, **kw)

    return kernel, plain


def _values_and_grads(fn, q, k, v, cotangent):
    out, pull = jax.vjp(jax.jit(fn), q, k, v)
    return (out, *pull(cotangent))


def _compare(case, seq, block, *, dim=8, heads=4, kv=2, dtype=jnp.float32, seed=0):
    q, k, v = _qkv(seq, heads=heads, kv=kv, dim=dim, dtype=dtype, seed=seed)
    cotangent = jr.normal(jr.key(seed + 7), q.shape).astype(dtype)
    kernel, plain = _both(seq, case, block)
    got = _values_and_grads(kernel, q, k, v, cotangent)
    want = _values_and_grads(plain, q, k, v, cotangent)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert a.dtype == dtype and a.shape == b.shape, name
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if dtype == jnp.float32:
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5, err_msg=name)
        else:  # bf16: 8 bits of mantissa, a few roundings apart
            np.testing.assert_allclose(a, b, atol=3e-2 * np.abs(b).max(), err_msg=name)


# Every mask at once, a head size of 24 (padded to 32) and a sequence of 100
# (padded to 4 tiles of 32), in both dtypes, in the default suite; the grid
# under `slow`.
FAST = {("everything", 100, 32, 24)}
GRID = [
    pytest.param(case, seq, block, dim,
                 marks=() if (case, seq, block, dim) in FAST else pytest.mark.slow)
    for case in CASES for seq, block, dim in [(100, 32, 24), (96, 16, 8), (40, 64, 8)]
]  # fmt: skip


@pytest.mark.parametrize("case,seq,block,dim", GRID)
def test_pallas_equals_plain_attention_values_and_gradients(case, seq, block, dim):
    _compare(case, seq, block, dim=dim)


def test_pallas_in_bf16_matches_within_bf16_rounding():
    _compare("everything", 100, 32, dim=24, dtype=jnp.bfloat16, seed=3)


@pytest.mark.slow  # the default suite's time
def test_multi_query_heads_and_a_single_tile():
    """One key/value head for eight query heads (their `dk`, `dv` summed);
    a sequence shorter than a tile is one tile pair."""
    _compare("segments", 24, 32, heads=8, kv=1, seed=5)


def test_the_kernels_lower_to_triton_for_cuda():
    """The forward and both backward kernels go through Pallas' Triton
    lowering for CUDA (no GPU needed: `jax.export` lowers for a platform it
    does not run), with every mask and a bf16 head of 80 (padded to 128): a
    construct Triton cannot take fails here, not first on a GPU."""
    seq = 200
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(seq, dim=80))
    segs = _segments(seq)

    def loss(q, k, v):
        out = pallas_attention(
            q, k, v, segment_ids=segs, sliding_window=64, softcap=50.0, interpret=False
        )
        return jnp.sum(out.astype(jnp.float32) ** 2)

    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    grad = jax.jit(jax.grad(loss, (0, 1, 2)))
    module = export.export(grad, platforms=["cuda"], disabled_checks=checks)(q, k, v)
    text = module.mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 3  # forward, dq, dk/dv
    assert "num_warps = 8" in text  # a head of 128 after padding


def _gemma2(impl):
    config = models.DecoderConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=24, layer_types=("sliding_attention", "full_attention"),
        attn_logit_softcapping=20.0, attention_impl=impl, scan_layers=False,
    )  # fmt: skip
    return models.Decoder(config, jr.key(0))


def test_a_model_with_pallas_attention_trains_as_the_default():
    """A Gemma-2-like decoder (soft-capped scores, a windowed and a full
    layer, GQA) on packed rows: the same loss and gradients as XLA's
    attention."""
    tokens = jr.randint(jr.key(1), (2, 80), 0, 64)
    segs = jnp.asarray(np.repeat([[1, 2]], 40, axis=1).repeat(2, axis=0))

    def loss(model):
        logits = jax.vmap(lambda t, s: model(t, segment_ids=s))(tokens, segs)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    got = jax.jit(jax.value_and_grad(loss))(_gemma2("pallas"))
    want = jax.jit(jax.value_and_grad(loss))(_gemma2(None))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)


def _kernels(fn, *args) -> int:
    jaxpr = jax.make_jaxpr(fn)(*args)
    return str(jaxpr).count("pallas_call")


def test_cudnn_takes_the_pallas_kernels_for_soft_capped_scores():
    """cuDNN has no soft-capped kernel: `attention_impl="cudnn"` runs Gemma
    2's capped layers through the Pallas kernels (the others go to cuDNN,
    which the CPU cannot trace); a masked call (`dot_attention`) still refuses
    the cap, naming the kernel that takes it."""
    q, k, v = _qkv(48)
    kw = dict(segment_ids=None, sliding_window=None, implementation="cudnn")
    capped = lambda q, k, v: attention(q, k, v, softcap=10.0, **kw)
    assert _kernels(capped, q, k, v) == 1
    assert (
        _kernels(
            lambda q, k, v: attention(q, k, v, **kw | {"implementation": "pallas"}),
            q,
            k,
            v,
        )
        == 1
    )
    from eqtrain.models._attention import dot_attention

    with pytest.raises(ConfigError, match="pallas"):
        dot_attention(q, k, v, implementation="cudnn", softcap=10.0)


def test_bad_tiles_and_tpus_are_refused(monkeypatch):
    q, k, v = _qkv(32)
    with pytest.raises(ConfigError, match="power of two"):
        pallas_attention(q, k, v, block=24)
    monkeypatch.setattr(_pallas_attention.jax, "default_backend", lambda: "tpu")
    with pytest.raises(ConfigError, match="TPU"):
        pallas_attention(q, k, v)
    with pytest.raises(ConfigError, match="attention_impl"):
        models.LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
                           num_hidden_layers=1, num_attention_heads=1,
                           attention_impl="triton")  # fmt: skip


def test_no_scores_beyond_one_tile_forward_or_backward():
    """What makes Gemma 2's memory Llama's on a GPU: the gradient of the
    soft-capped, windowed attention holds no value larger than the inputs'
    (`[heads, seq, head_dim]`); the scores exist one 64 x 64 tile per
    program. XLA's written-out capped attention holds `[heads, seq, seq]`."""
    seq, heads, dim = 1024, 4, 16
    q, k, v = _qkv(seq, heads=heads, dim=dim)

    def loss(impl):
        def fn(q, k, v):
            out = attention(q, k, v, segment_ids=None, sliding_window=512,
                            implementation=impl, softcap=50.0)  # fmt: skip
            return jnp.sum(out**2)

        return jax.make_jaxpr(jax.grad(fn, (0, 1, 2)))(q, k, v).jaxpr

    assert _largest(loss("pallas")) <= heads * seq * dim
    assert _largest(loss(None)) >= heads * seq * seq // 16


def _resolved_in_rows(rows, resolve, head):
    """What `"auto"` resolves to for a soft-capped layer inside `vmap_rows`
    over `rows` rows."""
    seen = []

    def one(x):
        seen.append(resolve("auto", *head(64), 50.0))
        return x

    jax.make_jaxpr(vmap_rows(one))(jnp.zeros((rows, 4)))
    return seen[0]


def test_auto_takes_cudnn_where_it_applies_and_pallas_elsewhere_on_gpus(monkeypatch):
    """`attention_impl="auto"` (the default): on CUDA GPUs cuDNN's kernel for
    bf16/f16 heads of 8-128 without a soft-cap, the Pallas kernels for the
    rest (and on ROCm) on one device; XLA's on the CPU."""
    from eqtrain.models import _attention

    resolve = _attention.resolved_implementation
    head = lambda d, dtype=jnp.bfloat16: (dtype, d)
    assert resolve("auto", *head(64), None) is None  # the CPU
    monkeypatch.setattr(_attention.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(_attention, "has_cudnn", lambda: True)
    assert resolve("auto", *head(64), None) == "cudnn"
    assert resolve("auto", *head(128, jnp.float16), None) == "cudnn"
    assert resolve("auto", *head(64), 50.0) == "pallas"  # Gemma 2
    assert resolve("auto", *head(64, jnp.float32), None) == "pallas"
    assert resolve("auto", *head(256), None) == "pallas"
    assert resolve("auto", *head(72), None) == "cudnn"
    assert resolve("xla", *head(64), None) == "xla"
    monkeypatch.setattr(_attention, "has_cudnn", lambda: False)  # ROCm
    assert resolve("auto", *head(64), None) == "pallas"
    # under a mesh XLA splits over several devices: the Pallas kernels where
    # each device's rows reach them (the losses' `vmap_rows` with rows that
    # divide over the batch axes), else XLA's (XLA cannot split a Pallas
    # call); cuDNN's is split by its own rule
    mesh = jax.sharding.AbstractMesh((4, 2), ("fsdp", "tensor"))
    with jax.sharding.use_abstract_mesh(mesh):
        assert resolve("auto", *head(64), 50.0) is None  # outside `vmap_rows`
        assert _resolved_in_rows(8, resolve, head) == "pallas"
        assert _resolved_in_rows(6, resolve, head) is None  # 6 rows over 4
        monkeypatch.setattr(_attention, "has_cudnn", lambda: True)
        assert resolve("auto", *head(64), None) == "cudnn"
    one = jax.sharding.AbstractMesh((1, 1), ("fsdp", "tensor"))
    with jax.sharding.use_abstract_mesh(one):
        assert resolve("auto", *head(64), 50.0) == "pallas"
    # through `attention`: a soft-capped layer traces the Pallas kernels
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(64, dim=16))
    capped = lambda q, k, v: attention(
        q, k, v, segment_ids=None, sliding_window=None, implementation="auto",
        softcap=50.0,
    )  # fmt: skip
    assert _kernels(capped, q, k, v) == 1


MESH = {"data": 2, "fsdp": 2, "tensor": 2}
eight_devices = pytest.mark.skipif(
    jax.device_count() < 8, reason="a mesh of 8 (the CPU's simulated devices)"
)


@eight_devices
def test_on_a_mesh_each_device_runs_its_own_rows_and_heads():
    """Under a `data x fsdp x tensor` mesh the kernels run inside a `shard_map`
    (XLA cannot split a Pallas call; it would gather every row and head onto
    each device): lowered for CUDA, each of the forward and backward Triton
    calls gets a quarter of the rows (`data x fsdp`, through the losses'
    `vmap_rows`) and half the heads (`tensor`; one of the two key/value heads)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from eqtrain.models._attention import pallas_on_devices
    from eqtrain.sharding import make_mesh

    mesh = make_mesh(MESH)
    rows, seq, heads, kv, dim = 8, 128, 4, 2, 16
    q, k, v = (
        jr.normal(jr.key(i), (rows, seq, h, dim), jnp.bfloat16)
        for i, h in enumerate((heads, kv, kv))
    )
    sharding = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor"))
    q, k, v = (jax.device_put(x, sharding) for x in (q, k, v))

    def loss(q, k, v):
        one = lambda q, k, v: pallas_on_devices(
            q, k, v, segment_ids=None, sliding_window=None, softcap=20.0,
            interpret=False,
        )  # fmt: skip
        return jnp.sum(vmap_rows(one)(q, k, v).astype(jnp.float32) ** 2)

    grad = jax.jit(models.under_mesh(jax.grad(loss, (0, 1, 2)), mesh))
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    text = export.export(grad, platforms=["cuda"], disabled_checks=checks)(
        q, k, v
    ).mlir_module()
    calls = [line for line in text.splitlines() if "__gpu$xla.gpu.triton" in line]
    assert len(calls) == 3  # forward, dq, dk/dv
    for line in calls:  # the kernels' layout: [rows, heads, seq, head_dim]
        assert "tensor<2x2x128x16xbf16>" in line and "tensor<2x1x128x16xbf16>" in line
        assert "tensor<8x" not in line and "x4x128x16" not in line


@eight_devices
def test_a_model_on_a_mesh_with_pallas_trains_as_on_one_device():
    """A Gemma-2-like decoder with `attention_impl="pallas"` on a `data x fsdp
    x tensor` mesh (rows, weights and heads split; the kernels in their
    `shard_map`): the loss and gradients of XLA's attention on one device."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from eqtrain import losses
    from eqtrain.sharding import make_mesh

    mesh = make_mesh(MESH)
    tokens = jr.randint(jr.key(1), (8, 49), 0, 64)
    segs = jnp.asarray(np.repeat([[1, 2]], 24, axis=1).repeat(8, axis=0))
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segs}
    grad = eqx.filter_value_and_grad(lambda m, b: losses.causal_lm_loss(m, b)[0])
    want = eqx.filter_jit(grad)(_gemma2(None), batch)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    placed = {name: jax.device_put(x, rows) for name, x in batch.items()}
    model, step = _gemma2("pallas"), models.under_mesh(grad, mesh)
    jaxpr = str(jax.make_jaxpr(step)(model, placed))
    assert "shard_map" in jaxpr and "pallas_call" in jaxpr
    got = eqx.filter_jit(lambda m, b: step(m, b))(model, placed)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
