"""Models: shapes and dtypes, Hugging Face math (against NumPy references of HF's
formulas), packing, scan vs unrolled, rematerialisation, FLOPs."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

from eqtrain import ConfigError, config as config_lib, models
from eqtrain.models import (
    GPT2,
    GPT2Config,
    Llama,
    LlamaConfig,
    MLPClassifier,
    MLPConfig,
    gpt2,
    llama,
    mlp,
    num_params,
)
from eqtrain.models._attention import attention
from eqtrain.models._layers import apply_rope, rope_cos_sin


TINY = LlamaConfig(
    vocab_size=37,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=100.0,  # large angles at short lengths: a layout bug shows
)
TINY_GPT2 = GPT2Config(vocab_size=37, n_positions=32, n_embd=16, n_layer=2, n_head=2)

VARIANTS = {
    "mha": dict(num_key_value_heads=None),
    "gqa": dict(num_key_value_heads=2),
    "mqa": dict(num_key_value_heads=1),
    "head_dim": dict(head_dim=6),
    "qkv_bias": dict(attention_bias=True, o_proj_bias=False),
    "all_bias": dict(attention_bias=True, mlp_bias=True),
    "tied": dict(tie_word_embeddings=True),
    "sliding_window": dict(sliding_window=3),
    "bf16": dict(param_dtype="bfloat16"),
}

RTOL, ATOL = 1e-5, 1e-6


def _tokens(n, seed=0, vocab=37):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, n), jnp.int32)


def _randomize(model, seed=1, scale=0.3):
    """Non-trivial norms and biases (init sets them to 1 and 0)."""
    leaves, treedef = jtu.tree_flatten(model)
    rng = np.random.default_rng(seed)
    new = []
    for x in leaves:
        if eqx.is_inexact_array(x):
            x = x + jnp.asarray(scale * rng.normal(size=x.shape), x.dtype)
        new.append(x)
    return jtu.tree_unflatten(treedef, new)


# -- NumPy references of Hugging Face's formulas ------------------------------------
def _np(x):
    return np.asarray(x, np.float64)


def np_rms_norm(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


def np_rotate_half(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], -1)


def np_rope(x, positions, theta):
    """HF `apply_rotary_pos_emb` on `x: [seq, heads, head_dim]`."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, d, 2) / d)
    freqs = np.outer(positions, inv_freq)
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    return x * cos + np_rotate_half(x) * sin


def np_attention(q, k, v, window=None, scaling=None):
    """HF eager attention: `repeat_kv` (contiguous groups), causal, softmax;
    scores times `scaling` (default `1 / sqrt(head_dim)`)."""
    seq, heads, d = q.shape
    k = np.repeat(k, heads // k.shape[1], axis=1)
    v = np.repeat(v, heads // v.shape[1], axis=1)
    scaling = 1 / math.sqrt(d) if scaling is None else scaling
    scores = np.einsum("thd,shd->hts", q, k) * scaling
    i, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= i - j < window
    scores = np.where(allowed[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hts,shd->thd", probs, v)


def np_linear(x, lin, i):
    y = x @ _np(lin.weight[i]).T
    return y if lin.bias is None else y + _np(lin.bias[i])


def np_llama(model, tokens, cfg=None):
    cfg = cfg or model.config
    seq, hd = len(tokens), cfg.head_size
    x = _np(model.embed_tokens.weight)[np.asarray(tokens)]
    pos = np.arange(seq)
    for i in range(cfg.num_hidden_layers):
        L = model.layers
        a = L.self_attn
        h = np_rms_norm(x, _np(L.input_layernorm.weight[i]), cfg.rms_norm_eps)
        q = np_linear(h, a.q_proj, i).reshape(seq, -1, hd)
        k = np_linear(h, a.k_proj, i).reshape(seq, -1, hd)
        v = np_linear(h, a.v_proj, i).reshape(seq, -1, hd)
        q, k = np_rope(q, pos, cfg.rope_theta), np_rope(k, pos, cfg.rope_theta)
        o = np_attention(q, k, v, cfg.sliding_window).reshape(seq, -1)
        x = x + np_linear(o, a.o_proj, i)
        h = np_rms_norm(x, _np(L.post_attention_layernorm.weight[i]), cfg.rms_norm_eps)
        m = L.mlp
        g, u = np_linear(h, m.gate_proj, i), np_linear(h, m.up_proj, i)
        x = x + np_linear(g / (1 + np.exp(-g)) * u, m.down_proj, i)
    x = np_rms_norm(x, _np(model.norm.weight), cfg.rms_norm_eps)
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return x @ _np(head).T


def np_layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def np_gelu_new(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


NP_ACTIVATIONS = {
    "gelu_new": np_gelu_new,
    "gelu": lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2))),
    "relu": lambda x: np.maximum(x, 0),
}


def np_gpt2(model, tokens):
    cfg = model.config
    seq, d, nh = len(tokens), cfg.n_embd, cfg.n_head
    x = _np(model.wte.weight)[np.asarray(tokens)] + _np(model.wpe.weight)[:seq]
    eps, act = cfg.layer_norm_epsilon, NP_ACTIVATIONS[cfg.activation_function]
    for i in range(cfg.n_layer):
        b = model.h
        h = np_layer_norm(x, _np(b.ln_1.weight[i]), _np(b.ln_1.bias[i]), eps)
        qkv = np_linear(h, b.attn.c_attn, i)  # HF: split(n_embd) into q | k | v
        q, k, v = (t.reshape(seq, nh, d // nh) for t in np.split(qkv, 3, -1))
        # HF's GPT2Attention.scaling
        scaling = (d // nh) ** -0.5 if cfg.scale_attn_weights else 1.0
        if cfg.scale_attn_by_inverse_layer_idx:
            scaling /= i + 1
        o = np_attention(q, k, v, scaling=scaling).reshape(seq, d)
        x = x + np_linear(o, b.attn.c_proj, i)
        h = np_layer_norm(x, _np(b.ln_2.weight[i]), _np(b.ln_2.bias[i]), eps)
        x = x + np_linear(act(np_linear(h, b.mlp.c_fc, i)), b.mlp.c_proj, i)
    x = np_layer_norm(x, _np(model.ln_f.weight), _np(model.ln_f.bias), eps)
    head = model.wte.weight if model.lm_head is None else model.lm_head.weight
    return x @ _np(head).T


# -- shapes, dtypes, structure -------------------------------------------------------
@pytest.mark.parametrize("name", list(VARIANTS))
def test_llama_variants_shapes_and_dtypes(name):
    cfg = dataclasses.replace(TINY, **VARIANTS[name])
    model = Llama(cfg, jr.key(0))
    logits = model(_tokens(7))
    dtype = jnp.bfloat16 if name == "bf16" else jnp.float32
    assert logits.shape == (7, cfg.vocab_size) and logits.dtype == dtype
    assert bool(jnp.all(jnp.isfinite(logits)))
    attn = model.layers.self_attn
    hd, kv = cfg.head_size, cfg.kv_heads
    assert attn.q_proj.weight.shape == (2, cfg.num_attention_heads * hd, 16)
    assert attn.k_proj.weight.shape == (2, kv * hd, 16)
    assert attn.o_proj.weight.shape == (2, 16, cfg.num_attention_heads * hd)
    assert (attn.q_proj.bias is not None) == cfg.attention_bias
    assert (attn.o_proj.bias is not None) == (name == "all_bias")
    assert (model.lm_head is None) == cfg.tie_word_embeddings
    for leaf in jtu.tree_leaves(eqx.filter(model, eqx.is_array)):
        assert leaf.dtype == dtype


@pytest.mark.parametrize("name", ["gqa", "mqa", "head_dim", "qkv_bias", "tied"])
def test_llama_matches_numpy_reference_of_hf_math(name):
    cfg = dataclasses.replace(TINY, **VARIANTS[name])
    model = _randomize(Llama(cfg, jr.key(0)))
    tokens = _tokens(8)
    np.testing.assert_allclose(
        model(tokens), np_llama(model, tokens), rtol=1e-4, atol=1e-5
    )  # f32 model vs f64 reference: accumulated rounding over two layers


def test_llama_sliding_window_matches_reference():
    model = _randomize(Llama(dataclasses.replace(TINY, sliding_window=3), jr.key(0)))
    tokens = _tokens(9)
    np.testing.assert_allclose(
        model(tokens), np_llama(model, tokens), rtol=1e-4, atol=1e-5
    )
    full = dataclasses.replace(TINY, sliding_window=None)
    unwindowed = np_llama(model, tokens, full)
    # The window matters from position 3 on, not before.
    np.testing.assert_allclose(model(tokens)[:3], unwindowed[:3], rtol=1e-4, atol=1e-5)
    assert not np.allclose(model(tokens)[3:], unwindowed[3:], atol=1e-3)


def test_gpt2_shapes_and_matches_numpy_reference():
    model = _randomize(GPT2(TINY_GPT2, jr.key(0)))
    tokens = _tokens(8)
    logits = model(tokens)
    assert logits.shape == (8, 37) and logits.dtype == jnp.float32
    assert model.h.attn.c_attn.weight.shape == (2, 48, 16)
    np.testing.assert_allclose(logits, np_gpt2(model, tokens), rtol=1e-4, atol=1e-5)


GPT2_OPTIONS = {
    "gelu": dict(activation_function="gelu"),
    "relu": dict(activation_function="relu"),
    "unscaled": dict(scale_attn_weights=False),
    "inverse_layer_idx": dict(scale_attn_by_inverse_layer_idx=True),
    "untied": dict(tie_word_embeddings=False),
    "all": dict(
        activation_function="gelu",
        scale_attn_weights=False,
        scale_attn_by_inverse_layer_idx=True,
        tie_word_embeddings=False,
    ),
}


@pytest.mark.parametrize("name", list(GPT2_OPTIONS))
@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
def test_gpt2_options_match_numpy_reference(name, scan):
    cfg = GPT2Config(
        vocab_size=37, n_positions=32, n_embd=16, n_layer=3, n_head=2, scan_layers=scan
    )
    cfg = dataclasses.replace(cfg, **GPT2_OPTIONS[name])
    model = _randomize(GPT2(cfg, jr.key(0)))
    tokens = _tokens(8)
    np.testing.assert_allclose(
        model(tokens), np_gpt2(model, tokens), rtol=1e-4, atol=1e-5
    )


def test_gpt2_untied_head_is_one_more_leaf():
    tied = GPT2(TINY_GPT2, jr.key(0))
    untied = GPT2(dataclasses.replace(TINY_GPT2, tie_word_embeddings=False), jr.key(0))
    assert tied.lm_head is None and untied.lm_head is not None
    assert untied.lm_head.weight.shape == (37, 16) and untied.lm_head.bias is None
    # The other arrays are the tied model's, and the head is not a copy of `wte`.
    rest = jtu.tree_leaves(eqx.tree_at(lambda m: m.lm_head, untied, None))
    for a, b in zip(jtu.tree_leaves(tied), rest, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not np.allclose(untied.lm_head.weight, untied.wte.weight)
    assert num_params(untied) == num_params(tied) + 37 * 16
    padded = models.resize_vocab(untied, 40)  # as a tensor-parallel run pads it
    assert padded.lm_head.weight.shape == padded.wte.weight.shape == (40, 16)


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_gpt2_inverse_layer_scale_gradients_scan_equal_unrolled():
    cfg = dataclasses.replace(
        TINY_GPT2, n_layer=3, scale_attn_by_inverse_layer_idx=True
    )
    model = _randomize(GPT2(cfg, jr.key(0)))
    tokens = _tokens(6)
    reference = _grads(model.with_options(scan_layers=False), tokens)
    for options in (dict(), dict(remat="full")):
        grads = _grads(model.with_options(**options), tokens)
        for a, b in zip(
            jtu.tree_leaves(reference), jtu.tree_leaves(grads), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_gpt2_untied_head_is_vocab_parallel():
    from eqtrain import sharding

    cfg = dataclasses.replace(
        TINY_GPT2, vocab_size=64, tie_word_embeddings=False, n_layer=3
    )
    cfg = dataclasses.replace(cfg, scale_attn_by_inverse_layer_idx=True)
    model = _randomize(GPT2(cfg, jr.key(0)))
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sharding.rules_for(model, mesh, fsdp_min_size=256)
    vocab = jax.sharding.PartitionSpec(("tensor", "fsdp"), None)
    assert rules.match("model.lm_head.weight") == vocab
    placed = sharding.shard(model, sharding.state_shardings(model, mesh, rules))
    assert placed.lm_head.weight.sharding.spec == vocab
    tokens = jnp.stack([_tokens(8, seed=s) for s in range(4)])
    run = jax.jit(jax.vmap(lambda m, t: m(t), in_axes=(None, 0)))
    np.testing.assert_allclose(
        run(placed, tokens), run(model, tokens), rtol=RTOL, atol=1e-5
    )


def test_gpt2_rejects_sequences_longer_than_its_positions():
    model = GPT2(dataclasses.replace(TINY_GPT2, n_positions=4), jr.key(0))
    with pytest.raises(ConfigError, match="n_positions"):
        model(_tokens(5))


def test_gpt2_bf16():
    model = GPT2(dataclasses.replace(TINY_GPT2, param_dtype="bfloat16"), jr.key(0))
    assert model(_tokens(5)).dtype == jnp.bfloat16


def test_mlp_classifier_shapes_and_dropout():
    cfg = MLPConfig(in_features=5, num_classes=3, hidden_sizes=(8, 8), dropout=0.5)
    model = MLPClassifier(cfg, jr.key(0))
    x = jnp.linspace(-1.0, 1.0, 5)
    out = model(x)
    assert out.shape == (3,) and out.dtype == jnp.float32
    np.testing.assert_array_equal(model(x), out)  # no key: deterministic
    a, b = model(x, key=jr.key(1)), model(x, key=jr.key(2))
    assert not np.allclose(a, b)  # dropout on with a key
    frozen = eqx.nn.inference_mode(model)
    np.testing.assert_array_equal(frozen(x, key=jr.key(1)), out)
    linear = MLPClassifier(MLPConfig(5, 3, hidden_sizes=[]), jr.key(0))
    assert linear(x).shape == (3,) and len(linear.layers) == 1
    bf16 = MLPClassifier(dataclasses.replace(cfg, param_dtype="bf16"), jr.key(0))
    assert bf16(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16


# -- HF layouts of RoPE and GQA ------------------------------------------------------
def test_rope_rotates_halves_like_hf():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 3, 8)).astype(np.float32)
    positions = np.array([0, 1, 2, 3, 7, 11])
    cos, sin = rope_cos_sin(jnp.asarray(positions), 8, 10000.0)
    got = apply_rope(jnp.asarray(x), cos, sin)
    np.testing.assert_allclose(got, np_rope(_np(x), positions, 10000.0), 1e-5, 1e-5)
    # The interleaved (GPT-J) layout would differ: the check can tell them apart.
    pairs = x.reshape(6, 3, 4, 2)
    assert not np.allclose(got, np_rope(_np(pairs[..., ::-1].reshape(x.shape)),
                                        positions, 10000.0), atol=1e-3)  # fmt: skip


def test_gqa_groups_query_heads_contiguously():
    rng = np.random.default_rng(0)
    q, k, v = (rng.normal(size=(5, n, 4)).astype(np.float32) for n in (6, 2, 2))
    got = attention(
        *(jnp.asarray(t) for t in (q, k, v)),
        segment_ids=None,
        sliding_window=None,
        implementation=None,
    )
    np.testing.assert_allclose(got, np_attention(_np(q), _np(k), _np(v)), RTOL, 1e-5)
    tiled = np_attention(_np(q), np.tile(_np(k), (1, 3, 1)), np.tile(_np(v), (1, 3, 1)))
    assert not np.allclose(got, tiled, atol=1e-3)  # query head h uses kv h // 3


# -- packing ---------------------------------------------------------------------------
SEGMENTS = np.array([1] * 5 + [2] * 4 + [3] * 3 + [0] * 2, np.int32)


@pytest.mark.parametrize(
    "model",
    [
        Llama(TINY, jr.key(0)),
        Llama(dataclasses.replace(TINY, sliding_window=3), jr.key(0)),
        GPT2(TINY_GPT2, jr.key(0)),
    ],
    ids=["llama", "llama_sliding_window", "gpt2"],
)
def test_packed_row_equals_examples_alone(model):
    tokens = _tokens(len(SEGMENTS), seed=3)
    packed = model(tokens, segment_ids=jnp.asarray(SEGMENTS))
    for s in (1, 2, 3):
        idx = np.flatnonzero(SEGMENTS == s)
        alone = model(tokens[idx])
        np.testing.assert_allclose(packed[idx], alone, rtol=RTOL, atol=1e-5)


# -- scan, remat -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "model",
    [
        Llama(dataclasses.replace(TINY, num_hidden_layers=3), jr.key(0)),
        GPT2(TINY_GPT2, jr.key(0)),
    ],
    ids=["llama", "gpt2"],
)
def test_scan_equals_unrolled(model):
    tokens, segs = _tokens(6), jnp.asarray([1, 1, 1, 2, 2, 2])
    unrolled = model.with_options(scan_layers=False)
    assert model.config.scan_layers and not unrolled.config.scan_layers
    np.testing.assert_allclose(
        model(tokens, segment_ids=segs),
        unrolled(tokens, segment_ids=segs),
        rtol=RTOL,
        atol=ATOL,
    )


def _grads(model, tokens):
    loss = lambda m: jnp.mean(jax.nn.log_softmax(m(tokens))[:, 0])
    return eqx.filter_jit(eqx.filter_grad(loss))(model)


@pytest.mark.parametrize(
    "scan, policies",
    [
        # scanned: under `nox -s slow` (test_memory checks every preset's gradients)
        pytest.param(True, ("full", "dots", "dots_no_batch"), marks=pytest.mark.slow),
        (False, ("full",)),
    ],
)
def test_remat_gives_identical_gradients(scan, policies):
    model = Llama(TINY, jr.key(0)).with_options(scan_layers=scan)
    tokens = _tokens(6)
    reference = _grads(model, tokens)
    for policy in policies:
        grads = _grads(model.with_options(remat=policy), tokens)
        for a, b in zip(
            jtu.tree_leaves(reference), jtu.tree_leaves(grads), strict=True
        ):
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_with_options_rejects_shape_changes():
    model = Llama(TINY, jr.key(0))
    with pytest.raises(ConfigError, match="changes only"):
        model.with_options(hidden_size=32)
    assert model.with_options(remat="full").embed_tokens is model.embed_tokens


# -- config validation ---------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(num_key_value_heads=3), "must divide"),
        (dict(head_dim=5), "even `head_dim`"),
        (dict(remat="everything"), "`remat` must be one of"),
        (dict(param_dtype="float8"), "`param_dtype` must be one of"),
        (dict(sliding_window=0), "`sliding_window`"),
        (dict(attention_impl="fast"), "`attention_impl`"),
    ],
)
def test_llama_config_errors(changes, match):
    with pytest.raises(ConfigError, match=match):
        dataclasses.replace(TINY, **changes)


def test_other_config_errors():
    with pytest.raises(ConfigError, match="multiple of `n_head`"):
        GPT2Config(n_embd=10, n_head=3)
    with pytest.raises(ConfigError, match="`activation_function` must be one of"):
        GPT2Config(activation_function="prelu")
    with pytest.raises(ConfigError, match="`activation`"):
        MLPConfig(4, 2, activation="swish")
    with pytest.raises(ConfigError, match="`dropout`"):
        MLPConfig(4, 2, dropout=1.0)


# -- FLOPs -----------------------------------------------------------------------------
def test_flops_per_token():
    base = llama.flops_per_token(TINY, 128)
    assert base > 6 * num_params(Llama(TINY, jr.key(0))) * 0.5
    deeper = dataclasses.replace(TINY, num_hidden_layers=4)
    assert llama.flops_per_token(deeper, 128) > base
    assert llama.flops_per_token(TINY, 256) > base
    windowed = dataclasses.replace(TINY, sliding_window=64)
    assert llama.flops_per_token(windowed, 256) == llama.flops_per_token(TINY, 64)
    # Llama-2-7B at 4k context: about 6 * 6.7e9 + attention.
    assert 4.0e10 < llama.flops_per_token(LlamaConfig(), 4096) < 5.0e10

    g = gpt2.flops_per_token(TINY_GPT2, 64)
    assert 0 < g < gpt2.flops_per_token(TINY_GPT2, 128)
    deeper_gpt2 = dataclasses.replace(TINY_GPT2, n_layer=4)
    assert gpt2.flops_per_token(deeper_gpt2, 64) > g
    # The head counts whether tied or not (as for Llama).
    untied = dataclasses.replace(TINY_GPT2, tie_word_embeddings=False)
    assert gpt2.flops_per_token(untied, 64) == g
    assert mlp.flops_per_token(MLPConfig(4, 3, hidden_sizes=(8,))) == 6 * (32 + 24)


# -- against transformers itself (when installed: `pip install -e .[hf]`) ------------
def _hf_state(model, prefix, transpose=()):
    """Our leaves as an HF state dict: stacked layers unstacked under `prefix`."""
    import torch

    state = {}
    for path, leaf in jtu.tree_leaves_with_path(model):
        name = jtu.keystr(path, simple=True, separator=".")
        value = np.array(leaf, np.float32)
        head, _, rest = name.partition(".")
        if head in ("layers", "h"):
            for i in range(value.shape[0]):
                v = (
                    value[i].T
                    if rest.endswith(transpose) and value[i].ndim == 2
                    else value[i]
                )
                state[f"{prefix}{head}.{i}.{rest}"] = torch.from_numpy(np.array(v))
        elif head == "lm_head":
            state[name] = torch.from_numpy(value)
        else:
            state[prefix + name] = torch.from_numpy(value)
    return state


def _hf_logits(hf, state, tokens):
    import torch

    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" and "inv_freq" not in k]
    assert not missing and not unexpected, (missing, unexpected)
    hf.eval()
    with torch.no_grad():
        ids = torch.from_numpy(np.asarray(tokens, np.int64))[None]
        return hf(input_ids=ids).logits[0].numpy()


@pytest.mark.parametrize(
    "family, changes",
    [
        ("llama", dict(attention_bias=True, head_dim=6)),
        ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
        ("qwen2", dict(attention_bias=True, o_proj_bias=False)),
        ("mistral", dict(sliding_window=3)),
    ],
)
def test_llama_family_matches_transformers(family, changes):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = dataclasses.replace(TINY, **changes)
    model = _randomize(Llama(cfg, jr.key(0)))
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_size,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attn_implementation="eager",
    )
    if family == "llama":
        hf_cfg = transformers.LlamaConfig(attention_bias=cfg.attention_bias, **kwargs)
        hf = transformers.LlamaForCausalLM(hf_cfg)
    elif family == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**kwargs))
    else:
        hf_cfg = transformers.MistralConfig(sliding_window=cfg.sliding_window, **kwargs)
        hf = transformers.MistralForCausalLM(hf_cfg)
    tokens = _tokens(9)
    expected = _hf_logits(hf, _hf_state(model, "model."), tokens)
    np.testing.assert_allclose(model(tokens), expected, rtol=1e-4, atol=1e-5)


def test_gpt2_matches_transformers():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = _randomize(GPT2(TINY_GPT2, jr.key(0)))
    c = TINY_GPT2
    hf_cfg = transformers.GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=c.n_positions,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        layer_norm_epsilon=c.layer_norm_epsilon,
        attn_implementation="eager",
    )
    hf = transformers.GPT2LMHeadModel(hf_cfg)
    # HF's Conv1D stores [in, out]: our [out, in] weights are transposed.
    state = _hf_state(model, "transformer.", transpose=(".weight",))
    tokens = _tokens(9)
    expected = _hf_logits(hf, state, tokens)
    np.testing.assert_allclose(model(tokens), expected, rtol=1e-4, atol=1e-5)


# -- the families' registry ----------------------------------------------------------
SECTIONS = {  # a `[model]` section per architecture, as a config file would give it
    "llama": dict(arch="llama", num_kv_heads=2),
    "mistral": dict(arch="mistral", sliding_window=8),
    "qwen2": dict(arch="qwen2", num_kv_heads=1),
    "gpt2": dict(arch="gpt2", num_kv_heads=None, norm_eps=1e-5),
}


@pytest.mark.parametrize("arch", SECTIONS)
def test_family_maps_the_model_section_both_ways(arch):
    section = dataclasses.replace(config_lib.ModelConfig(), **SECTIONS[arch])
    fam = models.family(arch)
    cfg = fam.from_section(section, vocab_size=37, max_seq_len=32)
    assert isinstance(cfg, fam.config) and fam.model_type_of(cfg) == arch
    assert models.family(cfg) is fam and models.family(fam.model(cfg, jr.key(0))) is fam
    back = dataclasses.replace(section, **fam.to_section(cfg))
    # `max_seq_len` and `vocab_size` were unset (the data's and the tokenizer's);
    # the rest reads back as written, defaults made explicit.
    assert back.vocab_size == 37 and back.max_seq_len == 32
    again = fam.from_section(back, vocab_size=37, max_seq_len=32)
    assert again == cfg
    assert fam.flops_per_token(cfg, 16) == getattr(models, fam.name).flops_per_token(
        cfg, 16
    )
    assert (
        fam.tp_rules()
        and fam.tp_rules() == getattr(models, fam.name).tensor_parallel_rules()
    )


def test_gpt2_section_maps_tie_embeddings():
    base = dataclasses.replace(config_lib.ModelConfig(), **SECTIONS["gpt2"])
    fam = models.family("gpt2")
    for tie in (True, False):
        section = dataclasses.replace(base, tie_embeddings=tie)
        cfg = fam.from_section(section, vocab_size=37, max_seq_len=32)
        assert cfg.tie_word_embeddings is tie
        assert fam.to_section(cfg)["tie_embeddings"] is tie


def test_qwen2_bias_default_yields_to_an_explicit_setting():
    section = dataclasses.replace(config_lib.ModelConfig(), arch="qwen2")
    fam = models.family("qwen2")
    assert fam.from_section(section, vocab_size=8, max_seq_len=8).attention_bias
    given = fam.from_section(
        section, vocab_size=8, max_seq_len=8, given={"attention_bias"}
    )
    assert not given.attention_bias and given.o_proj_bias is False


def test_family_lookup_and_errors():
    assert {f.name for f in models.FAMILIES.values()} == {"llama", "gpt2"}
    assert models.family("mistral").name == "llama"
    assert models.family(TINY_GPT2).model is GPT2
    with pytest.raises(ConfigError, match="no model family covers 'bert'"):
        models.family("bert")
    with pytest.raises(ConfigError, match="no model family covers a MLPConfig"):
        models.family(MLPConfig(4, 3))


def test_registry_agrees_with_the_config_schema_and_hf():
    """`eqtrain.config` cannot import the models (it would pull JAX into config
    parsing), so its architecture names and Llama-only keys are checked here."""
    from eqtrain import hf
    from eqtrain.config._validate import ARCH_KEYS

    types = {t for fam in models.FAMILIES.values() for t in fam.model_types}
    assert set(config_lib.schema()["model.arch"].choices) == types == set(hf.ARCHS)
    for fam in models.FAMILIES.values():
        keys = set(fam.to_section(fam.config(**_SMALLEST[fam.name])))
        assert keys <= set(ARCH_KEYS) | {"init_std"}
        assert keys - {"init_std"} <= fam.section_keys <= set(ARCH_KEYS), fam.name


_SMALLEST = {
    "llama": dict(vocab_size=8, hidden_size=8, intermediate_size=8,
                  num_hidden_layers=1, num_attention_heads=2),
    "gpt2": dict(vocab_size=8, n_positions=8, n_embd=8, n_layer=1, n_head=2),
}  # fmt: skip


@pytest.mark.parametrize("window", [None, 50])
def test_causal_blocks_equal_one_shot_attention(window):
    """Past 128 tokens `attention` runs in causal blocks (keys after a block never
    multiplied): the same outputs and gradients as one masked attention, with
    packed segments, GQA, a window, and a last block shorter than the others."""
    from eqtrain.models import _attention, _masks

    seq, heads, kv, dim = 300, 4, 2, 8
    q, k, v = (
        jr.normal(key, (seq, h, dim))
        for key, h in zip(jr.split(jr.key(0), 3), (heads, kv, kv), strict=True)
    )
    segs = jnp.array([1] * 70 + [2] * 200 + [0] * 30)

    def one_shot(q, k, v):
        pos = jnp.arange(seq)
        mask = _masks.position_mask(pos, segs, pos, segs, window)
        return jax.nn.dot_product_attention(q, k, v, mask=mask[None])

    def blocked(q, k, v):
        return attention(
            q, k, v, segment_ids=segs, sliding_window=window, implementation=None
        )

    assert _attention.causal_block_size(seq) == 128
    sizes = [_attention.causal_block_size(n) for n in (512, 513, 2048, 4096, 4097)]
    assert sizes == [128, 256, 256, 256, 264]
    loss = lambda fn: jax.jit(
        jax.value_and_grad(lambda *a: jnp.sum(fn(*a) ** 2), (0, 1, 2))
    )  # noqa: E731
    want, got = loss(one_shot)(q, k, v), loss(blocked)(q, k, v)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5)
    text = jax.jit(blocked).lower(q, k, v).as_text()
    assert "300x300" not in text and "128x300" not in text  # no block sees every key


@pytest.mark.slow  # default-suite time: gemma2's parity and mesh tests run the kernel
@pytest.mark.parametrize("window", [None, 50])
def test_soft_capped_scaled_attention_in_every_kernel(window):
    """Gemma 2's attention (a custom scale, scores capped at `c * tanh(s / c)`)
    through the one-shot, causal-block (past 128 tokens) and query-chunked
    kernels equals a plain NumPy computation of it, with packed segments, GQA
    and a window; values and gradients agree between the kernels."""
    from eqtrain.models import _attention, _masks

    seq, heads, kv, dim, scale, cap = 300, 4, 2, 8, 0.2, 5.0
    q, k, v = (
        3 * jr.normal(key, (seq, h, dim))
        for key, h in zip(jr.split(jr.key(1), 3), (heads, kv, kv), strict=True)
    )
    segs = jnp.array([1] * 70 + [2] * 200 + [0] * 30)
    pos = jnp.arange(seq)
    mask = np.asarray(_masks.position_mask(pos, segs, pos, segs, window))
    s = np.einsum("qhd,khd->hqk", q, np.repeat(np.asarray(k), heads // kv, 1)) * scale
    s = np.where(mask[None], cap * np.tanh(s / cap), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("hqk,khd->qhd", p, np.repeat(np.asarray(v), heads // kv, 1))
    kw = dict(segment_ids=segs, sliding_window=window, implementation=None)
    kw.update(scale=scale, softcap=cap)
    kernels = {
        "blocks": lambda q, k, v: attention(q, k, v, **kw),
        "chunked": lambda q, k, v: attention(q, k, v, query_chunk=64, **kw),
        "short": lambda q, k, v: attention(q[:100], k[:100], v[:100], **kw | {
            "segment_ids": segs[:100]}),
    }  # fmt: skip
    for name, fn in kernels.items():
        n = 100 if name == "short" else seq
        got = fn(q, k, v)
        np.testing.assert_allclose(got, want[:n], rtol=2e-5, atol=2e-5, err_msg=name)
    grads = [
        jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a) ** 2), (0, 1, 2))(q, k, v)
        for fn in (kernels["blocks"], kernels["chunked"])
    ]
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(a, b, atol=2e-4)
    # the unchanged path: no cap gives jax.nn.dot_product_attention's result
    plain = attention(q, k, v, segment_ids=segs, sliding_window=window,
                      implementation=None)  # fmt: skip
    no_cap = attention(q, k, v, **kw | {"softcap": None, "scale": None})
    np.testing.assert_array_equal(plain, no_cap)
    with pytest.raises(ConfigError, match="soft-capping"):
        _attention.dot_attention(q, k, v, implementation="cudnn", softcap=cap)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_silu_gate_equals_autodiff_values_and_gradients(dtype):
    """SwiGLU's hand-written gradient (`_layers._silu_gate`) equals autodiff's
    of `silu(gate) * up`, values bit for bit, gradients to the dtype's
    precision; other activations take autodiff's path."""
    from eqtrain.models._layers import ACTIVATIONS, gated

    k1, k2, k3 = jr.split(jr.key(0), 3)
    gate, up, dout = (4 * jr.normal(k, (64, 96), jnp.float32).astype(dtype)
                      for k in (k1, k2, k3))  # fmt: skip

    def loss(fn):
        return lambda g, u: jnp.sum((fn(g, u) * dout).astype(jnp.float32))

    for act in ("silu", "gelu_pytorch_tanh"):
        ours = lambda g, u, act=act: gated(act, g, u)
        ref = lambda g, u, act=act: ACTIVATIONS[act](g) * u
        assert ours(gate, up).dtype == dtype
        np.testing.assert_array_equal(
            np.asarray(ours(gate, up), np.float32),
            np.asarray(ref(gate, up), np.float32),
        )
        got = jax.grad(loss(ours), (0, 1))(gate, up)
        want = jax.grad(loss(ref), (0, 1))(gate, up)
        tol = 1e-5 if dtype == jnp.float32 else 2e-2
        for a, b in zip(got, want, strict=True):
            assert a.dtype == dtype
            scale = float(jnp.max(jnp.abs(b.astype(jnp.float32))))
            diff = jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
            assert float(diff) <= tol * scale, (act, float(diff), scale)


@pytest.mark.parametrize("packed", [False, True])
def test_rope_tables_are_computed_once_per_step(packed, monkeypatch):
    """On the CPU the rotary tables pass through a product with the identity
    (`_rope.stored_once`), so that XLA keeps them rather than evaluating cos
    and sin again inside every fusion that reads them: the compiled gradient of
    an unrolled Llama holds one `cosine` and one `sine`, and the tables equal
    the plain ones bit for bit (packed rows' positions too)."""
    from eqtrain.losses import causal_lm_loss
    from eqtrain.models import _rope

    rope = _rope.rope_from_hf({"rope_type": "llama3", "rope_theta": 100.0,
        "factor": 8.0, "original_max_position_embeddings": 16,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0}, head_dim=16,
        max_position_embeddings=128)  # fmt: skip
    positions = jnp.asarray([0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6] * 9)
    tables = jax.jit(lambda p: _rope.rope_cos_sin(rope, p))
    got = tables(positions)
    with monkeypatch.context() as patch:
        patch.setattr(_rope, "stored_once", lambda *t: t)
        want = jax.jit(lambda p: _rope.rope_cos_sin(rope, p))(positions)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)

    config = dataclasses.replace(TINY, num_hidden_layers=3, scan_layers=False)
    model = Llama(config, jr.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 37, (4, 33)), jnp.int32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    if packed:
        batch["segment_ids"] = jnp.asarray([[1] * 12 + [2] * 20] * 4, jnp.int32)
    grad = jax.jit(jax.grad(lambda m, b: causal_lm_loss(m, b)[0]))
    text = grad.lower(model, batch).compile().as_text()
    counts = text.count(" cosine("), text.count(" sine(")
    assert counts == (1, 1), counts


def _scan_consts(jaxpr: jax.extend.core.Jaxpr) -> list:
    """The avals of the constants of every `scan` in `jaxpr` and below."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            out += [v.aval for v in eqn.invars[: eqn.params["num_consts"]]]
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if isinstance(inner, jax.extend.core.Jaxpr):
                out += _scan_consts(inner)
    return out


@pytest.mark.parametrize("hoisted", [False, True])
def test_scanned_layers_build_the_attention_mask_in_the_loop(hoisted, monkeypatch):
    """Under `lax.scan` JAX computes what depends on constants alone before
    the loop. The attention ties its mask and masked score to the queries
    (`_attention._in_layer`), so that only the `[q, k]` mask is computed there,
    not its broadcast to the scores' `[kv_heads, group, q, k]` (per row of the
    batch) nor a score-sized fill, which every layer would read from memory.
    `hoisted=True` undoes the tie: the test sees the broadcasts come back."""
    from eqtrain.losses import causal_lm_loss
    from eqtrain.models import _attention

    if hoisted:
        monkeypatch.setattr(
            _attention, "_in_layer", lambda q, keep: (q, keep, _attention._MASKED)
        )
    model = Llama(dataclasses.replace(TINY, scan_layers=True), jr.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 37, (4, 33)), jnp.int32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    jaxpr = jax.make_jaxpr(jax.grad(lambda m, b: causal_lm_loss(m, b)[0]))(model, batch)
    consts = _scan_consts(jaxpr.jaxpr)
    assert consts  # the layers' scan (and its transpose)
    score_sized = [c for c in consts if c.ndim >= 3 and c.shape[-2:] == (32, 32)]
    assert bool(score_sized) == hoisted, score_sized


def _scan_outputs(jaxpr: jax.extend.core.Jaxpr) -> list:
    """The avals of the stacked outputs of the first `scan` in `jaxpr` (or below)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            return [v.aval for v in eqn.outvars[eqn.params["num_carry"] :]]
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if isinstance(inner, jax.extend.core.Jaxpr) and (
                out := _scan_outputs(inner)
            ):
                return out
    return []


@pytest.mark.parametrize("kept", [False, True])
def test_scanned_layers_recompute_the_mlp_hidden_layer(kept, monkeypatch):
    """The gated MLP's hidden layer `act(gate) * up` is recomputed for the down
    projection's gradient (`gated_down`), so scanned layers stack two
    `[tokens, intermediate]` residuals per layer (gate and up), not three;
    `kept=True` applies the down projection plainly and sees the third."""
    from eqtrain.losses import causal_lm_loss
    from eqtrain.models import _decoder_mlps as mlps

    if kept:
        monkeypatch.setattr(
            mlps,
            "gated_down",
            lambda lin, act, g, u, k: lin(mlps.gated(act, g, u), key=k),
        )
    model = Llama(dataclasses.replace(TINY, scan_layers=True), jr.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 37, (4, 33)), jnp.int32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    jaxpr = jax.make_jaxpr(jax.grad(lambda m, b: causal_lm_loss(m, b)[0]))(model, batch)
    hidden = [a for a in _scan_outputs(jaxpr.jaxpr) if a.shape[-2:] == (32, 24)]
    assert len(hidden) == (3 if kept else 2), hidden


def _kept_norms(norm, fn, x, *args, name=None):
    """`_decoder_mlps.normed` without the fold: the norm applied plainly."""
    return fn(x if norm is None else norm(x), *args)


@pytest.mark.parametrize(
    "kept",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # default-suite time
)
def test_scanned_layers_recompute_the_norms(kept, monkeypatch):
    """Scanned layers without remat fold each norm into its sublayer's first
    projections (`normed`): the backward pass makes the norm's output again
    from the residual stream, so the scan stacks one `[tokens, hidden]` value
    per norm (its input) instead of three (its input, the normalised values
    and the output the projections' weight gradients read); `kept=True` sees
    the two more per norm. The products are not computed again (the compiled
    gradient has as many as with the norms kept), and the gradient is the
    unrolled model's, which does not fold."""
    from eqtrain.losses import causal_lm_loss
    from eqtrain.models import _decoder_blocks as blocks, _decoder_mlps as mlps

    def keep_norms():
        for module in (blocks, mlps):
            monkeypatch.setattr(module, "normed", _kept_norms)

    if kept:
        keep_norms()
    model = Llama(dataclasses.replace(TINY, scan_layers=True), jr.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 37, (4, 33)), jnp.int32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    grad = jax.grad(lambda m, b: causal_lm_loss(m, b)[0])
    jaxpr = jax.make_jaxpr(grad)(model, batch)
    stream = [a for a in _scan_outputs(jaxpr.jaxpr) if a.shape[1:] == (4, 32, 16)]
    # two norms per block; besides them the attention's output (o_proj's input)
    assert len(stream) == (7 if kept else 3), stream
    # kept, the first projections' concatenated weights are stacked too
    weights = [
        a for a in _scan_outputs(jaxpr.jaxpr) if a.shape in ((2, 32, 16), (2, 48, 16))
    ]
    assert len(weights) == (2 if kept else 0), weights
    compiled = jax.jit(grad).lower(model, batch).compile()
    grads = compiled(model, batch)
    want = jax.jit(grad)(model.with_options(scan_layers=False), batch)
    products = lambda: (
        jax.jit(grad).lower(model, batch).compile().as_text().count(" dot(")
    )
    got = compiled.as_text().count(" dot(")
    keep_norms()
    assert got == products() > 0
    for a, b in zip(jtu.tree_leaves(grads), jtu.tree_leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
