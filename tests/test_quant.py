"""Quantized frozen weights (QLoRA): codes equal to bitsandbytes' on the CPU,
products with a quantized weight, LoRA through it, quantizing on read, and the
shardings of the codes."""

import os
import signal
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from eqtrain import _quant, checkpoint, hf, lora, quantize, sharding
from eqtrain._errors import ConfigError
from eqtrain.hf import _lazy
from eqtrain.models import llama


def _bnb():
    pytest.importorskip("torch")
    return pytest.importorskip("bitsandbytes.functional")


def _tensor(shape, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    w[0, :64] = 0.0  # a block of zeros
    w[-1, -64:] *= 40.0  # a block far from the rest (large scales)
    return w.astype(dtype)


def _weight(parts, kind, dtype=jnp.float32):
    names = ("codes", "scales", "scales2", "offset")
    arrays = [None if parts[n] is None else jnp.asarray(parts[n]) for n in names]
    return _quant.QuantizedWeight(*arrays, kind, jnp.dtype(dtype))


def test_dynamic_map_is_bitsandbytes():
    F = _bnb()
    assert np.array_equal(_quant.dynamic_map(), F.create_dynamic_map().numpy())


# (128, 256): 512 block maxima, two whole 256-blocks; (96, 192): 288, a partial
# second block; (3, 64): three maxima in one partial block.
SHAPES = [(128, 256), (96, 192), (3, 64)]


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("shape", SHAPES)
def test_4bit_codes_and_scales_equal_bitsandbytes(kind, shape):
    import torch

    F = _bnb()
    for dtype, torch_dtype in [
        (np.float32, torch.float32),
        ("bfloat16", torch.bfloat16),
    ]:
        w = _tensor(shape, np.float32)
        t = torch.from_numpy(w).to(torch_dtype)
        x = (
            t.float()
            .numpy()
            .astype(jnp.bfloat16 if dtype == "bfloat16" else np.float32)
        )
        q, state = F.quantize_4bit(
            t, blocksize=64, quant_type=kind, compress_statistics=False
        )
        ours = _quant.quantize_tensor(x, kind, double=False)
        assert np.array_equal(ours["codes"].reshape(-1), q.numpy().reshape(-1))
        assert np.array_equal(ours["scales"].reshape(-1), state.absmax.numpy())
        back = F.dequantize_4bit(q, state).float().numpy()  # in the input's dtype
        mine = _weight(ours, kind, x.dtype).dequantize().astype(jnp.float32)
        assert np.array_equal(np.asarray(mine), back)


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
@pytest.mark.parametrize("shape", SHAPES)
def test_double_quantization_equals_bitsandbytes(kind, shape):
    """With bitsandbytes' mean of the block maxima, every array and the
    dequantized weight are bit for bit its; with eqtrain's own mean (summed in
    float64) the mean is within one ulp and the weight within a float32
    rounding of the scales."""
    import torch

    F = _bnb()
    w = _tensor(shape)
    q, state = F.quantize_4bit(
        torch.from_numpy(w), blocksize=64, quant_type=kind, compress_statistics=True
    )
    back = F.dequantize_4bit(q, state).numpy()
    codes, absmax = _quant._tensor_4bit(w, kind)
    assert np.array_equal(codes.reshape(-1), q.numpy().reshape(-1))
    scales, scales2, offset = _quant._double(absmax, offset=state.offset.item())
    assert np.array_equal(scales.reshape(-1), state.absmax.numpy())
    assert np.array_equal(scales2, state.state2.absmax.numpy())
    parts = {"codes": codes, "scales": scales, "scales2": scales2, "offset": offset}
    assert np.array_equal(np.asarray(_weight(parts, kind).dequantize()), back)

    own = _quant.quantize_tensor(w, kind, double=True)
    assert abs(float(own["offset"]) - state.offset.item()) <= np.spacing(
        np.float32(state.offset.item())
    )
    agree = np.mean(own["scales"].reshape(-1) == state.absmax.numpy())
    assert agree >= 0.99
    mine = np.asarray(_weight(own, kind).dequantize())
    np.testing.assert_allclose(mine, back, rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_each_value_gets_the_code_bucketize_gives(kind):
    """The nearest code, counted one midpoint at a time, is
    `torch.bucketize`'s over the midpoints on the values where they could
    differ: the midpoints themselves (a tie rounds down), their float
    neighbours, the codebook's values, the ends, both zeros, NaN (past every
    midpoint, as bucketize puts it) and random values."""
    import torch

    mid, order = _quant._bounds(kind)
    edges = [mid, np.nextafter(mid, np.float32(-2)), np.nextafter(mid, np.float32(2))]
    special = np.array([-1, 1, 0, -0.0, np.nan, -np.inf, np.inf], np.float32)
    randoms = np.random.default_rng(1).uniform(-1, 1, 5000).astype(np.float32)
    x = np.concatenate([*edges, _quant.codebook(kind), special, randoms])
    bucket = torch.bucketize(torch.from_numpy(x), torch.from_numpy(mid), right=False)
    assert np.array_equal(_quant._nearest(x, kind), order[bucket.numpy()])


@pytest.mark.parametrize("kind", ["nf4", "fp4"])
def test_a_tensor_cut_into_pieces_on_threads_equals_bitsandbytes(kind):
    """A tensor larger than one piece (its rows quantized on several threads)
    gives bitsandbytes' codes and block maxima, and any cut of its rows gives
    the same bytes as one piece."""
    import torch

    F = _bnb()
    w = _tensor((2 * _quant._PIECE // 1024 + 3, 1024), jnp.bfloat16)
    q, state = F.quantize_4bit(
        torch.from_numpy(w.astype(np.float32)).to(torch.bfloat16),
        blocksize=64, quant_type=kind, compress_statistics=False,
    )  # fmt: skip
    codes, absmax = _quant._tensor_4bit(w, kind)
    assert np.array_equal(codes.reshape(-1), q.numpy().reshape(-1))
    assert np.array_equal(absmax.reshape(-1), state.absmax.numpy())
    for piece in (1, 7 * 1024, w.size):  # a row, 7 rows, all
        cut = _quant._tensor_4bit(w, kind, piece=piece)
        assert np.array_equal(cut[0], codes) and np.array_equal(cut[1], absmax)


@pytest.mark.filterwarnings("ignore:os.fork.. was called")  # JAX's; numpy alone here
def test_a_forked_child_quantizes_with_threads_of_its_own():
    """The pool of quantizing threads is the process's own: a child forked
    after the parent used it (as a data worker may be) starts its own instead
    of waiting on threads it does not have."""
    w = _tensor((3 * _quant._PIECE // 512, 512))
    codes, _ = _quant._tensor_4bit(w, "nf4")  # the parent's pool, started
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: exit 0 if its codes are the parent's
        try:
            same = np.array_equal(_quant._tensor_4bit(w, "nf4")[0], codes)
            os.write(write, b"1" if same else b"0")
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's quantization did not finish in 30 s")
        time.sleep(0.05)
    assert os.read(read, 1) == b"1"


def test_int8_equals_bitsandbytes():
    import torch

    F = _bnb()
    w = _tensor((64, 96))
    codes, stats, _ = F.int8_vectorwise_quant(torch.from_numpy(w))
    ours = _quant.quantize_tensor(w, "int8")
    assert np.array_equal(ours["codes"], codes.numpy())
    assert np.array_equal(ours["scales"], stats.numpy())
    back = F.int8_vectorwise_dequant(codes, stats).numpy()
    assert np.array_equal(np.asarray(_weight(ours, "int8").dequantize()), back)


def test_quantize_stacked_weights_tensor_by_tensor():
    """Each `[out, in]` tensor under the leading axes is quantized on its own
    (its own mean, its own second-level scales), as bitsandbytes quantizes a
    checkpoint's tensors one by one."""
    w = np.stack([_tensor((32, 128), seed=s) * (s + 1) for s in range(3)])
    q = _quant.quantize(w, "nf4")
    assert q.shape == w.shape and q.codes.shape == (3, 32, 64)
    assert q.scales.shape == (3, 32, 2) and q.scales2.shape == (3, 1)
    for i in range(3):
        one = _quant.quantize_tensor(w[i], "nf4")
        for name in ("codes", "scales", "scales2", "offset"):
            assert np.array_equal(getattr(q, name)[i], one[name])
    dq = np.asarray(jax.tree.map(jnp.asarray, q).dequantize())
    for i in range(3):
        one = _weight(_quant.quantize_tensor(w[i], "nf4"), "nf4").dequantize()
        assert np.array_equal(dq[i], np.asarray(one))


def test_quantize_refuses_rows_of_partial_blocks():
    with pytest.raises(ValueError, match="whole blocks of 64"):
        _quant.quantize(np.ones((4, 96), np.float32), "nf4")
    with pytest.raises(ConfigError, match="nf4, fp4, int8"):
        quantize.Quantize("nf3")


def _model(dtype="float32", vocab=128, **kw):
    config = llama.LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32, param_dtype=dtype, **kw,
    )  # fmt: skip
    return llama.Llama(config, jr.key(0))


IDS = jnp.arange(16) * 7 % 128


@pytest.mark.parametrize("kind", ["nf4", "fp4", "int8"])
def test_quantized_model_computes_its_dequantized_weights(kind):
    model = _model()
    q = quantize.apply(model, quantize.Quantize(kind))
    paths = quantize.quantized_paths(q)
    assert "layers.self_attn.q_proj.weight" in paths
    assert not any("lm_head" in p or "embed" in p for p in paths)
    plain = quantize.dequantize(q)
    np.testing.assert_allclose(q(IDS), plain(IDS), rtol=1e-5, atol=1e-5)
    size, count = quantize.quantized_bytes(q)
    bits = 8 * size / count
    assert bits < {"nf4": 4.2, "fp4": 4.2, "int8": 8.3}[kind]


@pytest.mark.tuned  # re-run under each CPU setting (test_tuned_settings.py)
def test_lora_on_a_quantized_base_trains_only_the_adapters():
    q = quantize.apply(_model(), quantize.Quantize("nf4"))
    adapted = lora.apply(q, lora.LoRA(rank=4), key=jr.key(1))
    adapted = eqx.tree_at(  # nonzero B, so the update shows in the output
        lambda m: m.layers.self_attn.q_proj.lora_b,
        adapted,
        jnp.full_like(adapted.layers.self_attn.q_proj.lora_b, 0.01),
    )
    trainable = lora.trainable(adapted)
    flags = jax.tree.leaves(trainable)
    assert sum(flags) == 2 * 7  # lora_a, lora_b of each of the 7 projections
    params, static = eqx.partition(adapted, trainable)

    def loss(p):
        return jnp.mean(eqx.combine(p, static)(IDS) ** 2)

    grads = jax.grad(loss)(params)
    q_proj = grads.layers.self_attn.q_proj
    assert float(jnp.abs(q_proj.lora_a).max()) > 0
    assert float(jnp.abs(q_proj.lora_b).max()) > 0
    # the same gradient as through the dequantized weights (a custom backward)
    dense_model = quantize.dequantize(adapted)
    plain_params, plain_static = eqx.partition(dense_model, lora.trainable(dense_model))
    plain = jax.grad(lambda p: jnp.mean(eqx.combine(p, plain_static)(IDS) ** 2))
    expected = plain(plain_params).layers.self_attn.q_proj
    np.testing.assert_allclose(q_proj.lora_a, expected.lora_a, rtol=1e-4, atol=1e-7)
    with pytest.raises(ConfigError, match="selects quantized weights"):
        lora.trainable(adapted, also="q_proj")
    merged = lora.merge(adapted)
    assert isinstance(merged.layers.self_attn.q_proj.weight, jax.Array)


def test_quantized_experts_compute_their_dequantized_weights():
    model = _model(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    q = quantize.apply(model, quantize.Quantize("nf4"))
    paths = quantize.quantized_paths(q)
    assert "layers.mlp.experts.gate_proj" in paths
    assert not any(p.endswith("mlp.gate.weight") for p in paths)  # the router
    np.testing.assert_allclose(
        q(IDS), quantize.dequantize(q)(IDS), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("experts", [0, 4])
def test_quantize_on_read_equals_quantizing_after(tmp_path, monkeypatch, experts):
    """`hf.load(quantize=)` gives the codes of quantizing the loaded model, and
    reads a quantized parameter one stored tensor at a time (never the stacked
    parameter whole); experts' weights one expert's tensor at a time."""
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "model_type": "mixtral"}
    model = _model("bfloat16", **(moe if experts else {}))
    hf.export(model, None, tmp_path / "hf")
    plain, _ = hf.load(tmp_path / "hf")
    expected = quantize.apply(plain, quantize.Quantize("nf4"))

    whole = []
    block = _lazy.Leaf.block
    monkeypatch.setattr(
        _lazy.Leaf,
        "block",
        lambda self, index: whole.append(self) or block(self, index),
    )
    read, _ = hf.load(tmp_path / "hf", quantize=quantize.Quantize("nf4"))
    assert not any(leaf.quantized is not None for leaf in whole)
    if experts:
        assert "layers.mlp.experts.down_proj" in quantize.quantized_paths(read)
    for a, b in zip(jax.tree.leaves(read), jax.tree.leaves(expected), strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_codes_are_sharded_like_their_weights():
    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    q = quantize.apply(_model(), quantize.Quantize("nf4"))
    rules = sharding.rules_for(q, mesh)
    shardings = sharding.state_shardings(q, mesh, rules)
    weight = q.layers.mlp.up_proj.weight
    plain = sharding.state_shardings(quantize.dequantize(q), mesh, rules)
    spec = plain.layers.mlp.up_proj.weight.spec
    got = shardings.layers.mlp.up_proj.weight
    assert got.codes.spec == spec and got.scales.spec[: len(spec)] == spec[:2] + (
        got.scales.spec[2],
    )
    assert got.scales2.spec[0] == spec[0] if len(spec) else True
    placed = sharding.shard(q, shardings)
    assert placed.layers.mlp.up_proj.weight.codes.sharding.spec == spec
    del weight
    out = eqx.filter_jit(lambda m: m(IDS))(placed)
    np.testing.assert_allclose(out, q(IDS), rtol=1e-5, atol=1e-5)


def test_quantize_keys_reach_the_run(tmp_path):
    """`model.quantize`, `quantize_skip` and `quantize_double` shape the run's
    base; a quantized base without adapters is refused; a run quantizes its
    `init_from` on read and trains (loss falls) and resumes."""
    from eqtrain import config as config_lib, job
    from tests.test_lora_job import write_config

    hf.export(_model(vocab=320), None, tmp_path / "base")
    path = write_config(tmp_path)
    keys = ["model.quantize=fp4", r"model.quantize_skip=(lm_head|down_proj)$"]
    built = job.build(config_lib.load(path, [*keys, "model.quantize_double=false"]))
    model = built.abstract.model
    assert quantize.quantized_paths(model) == [
        f"layers.{p}.weight"
        for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                  "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")
    ]  # fmt: skip
    q = model.layers.self_attn.q_proj.weight
    assert q.kind == "fp4" and q.scales2 is None and q.scales.dtype == jnp.float32
    with pytest.raises(ConfigError, match="needs LoRA adapters"):
        plain = tmp_path / "plain.toml"
        text = path.read_text().replace(
            "[lora]\nrank = 4\nalpha = 8\ndropout = 0.1", ""
        )
        plain.write_text(text)
        job.build(config_lib.load(plain, ["model.quantize=nf4"]))

    result = job.run(config_lib.load(path, ["model.quantize=nf4"]), echo=lambda s: None)
    manifest = checkpoint.read_manifest(tmp_path / "run", step=6)
    saved = [k for k in manifest["leaves"] if k.startswith("model.")]
    assert saved and all(lora.is_adapter_path(k) for k in saved)  # no codes
    assert manifest["base"]["quantize"] == {
        "kind": "nf4", "skip": quantize.DEFAULT_SKIP, "double": True,
    }  # fmt: skip
    assert manifest["base"]["sha256"] != hf.content_hash(tmp_path / "base")["sha256"]
    state = result.fit.state
    weight = state.model.layers.mlp.up_proj.weight
    assert isinstance(weight, quantize.QuantizedWeight) and weight.double
    losses = [h["loss"] for h in result.fit.history if "loss" in h]
    assert losses[-1] < losses[0]
    more = config_lib.load(path, ["model.quantize=nf4", "loop.steps=8"])
    resumed = job.run(more, echo=lambda s: None)
    assert int(resumed.fit.state.step) == 8
