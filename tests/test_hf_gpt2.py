"""GPT-2's options against transformers itself: each `GPT2Config` variant
transformers writes (activation, attention scaling, untied head) loads in eqtrain
with transformers' logits, and exports back to the same logits and config values."""

import dataclasses
import json

import pytest


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402
from transformers.activations import ACT2CLS, ACT2FN  # noqa: E402

from eqtrain import hf  # noqa: E402
from eqtrain._errors import ConfigError  # noqa: E402
from eqtrain.hf import _safetensors  # noqa: E402
from eqtrain.models import GPT2, GPT2Config  # noqa: E402
from eqtrain.models.gpt2 import ACTIVATIONS  # noqa: E402


SEQ = 12
SHAPE = dict(vocab_size=97, n_positions=32, n_embd=16, n_layer=3, n_head=4)
OPTIONS = (
    "activation_function",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "reorder_and_upcast_attn",
    "tie_word_embeddings",
)
VARIANTS = {  # GPT2Config changes, the same names in transformers and eqtrain
    "gelu": dict(activation_function="gelu"),
    "inverse_layer_idx": dict(scale_attn_by_inverse_layer_idx=True),
    "untied": dict(tie_word_embeddings=False),
    "unscaled": dict(scale_attn_weights=False),
    "upcast": dict(reorder_and_upcast_attn=True),
    "combined": dict(
        activation_function="gelu",
        scale_attn_by_inverse_layer_idx=True,
        tie_word_embeddings=False,
        reorder_and_upcast_attn=True,
    ),
    "quick_gelu-unscaled-untied": dict(
        activation_function="quick_gelu",
        scale_attn_weights=False,
        tie_word_embeddings=False,
    ),
}


def _tokens():
    return np.random.default_rng(0).integers(0, SHAPE["vocab_size"], SEQ)


def _randomize(model, seed=1, scale=0.3):
    """Non-trivial norms and biases (init sets them to 1 and 0)."""
    rng = np.random.default_rng(seed)
    return jtu.tree_map(
        lambda x: (
            x + jnp.asarray(scale * rng.normal(size=x.shape), x.dtype)
            if eqx.is_inexact_array(x)
            else x
        ),
        model,
    )


def _hf_model(**changes):
    # Eager attention: the only one in which transformers honours
    # `reorder_and_upcast_attn`.
    config = transformers.GPT2Config(
        **{**SHAPE, **changes},
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval()


def _hf_load(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, attn_implementation="eager"
    )
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"}
    assert not bad, bad
    return model.eval()


def _hf_logits(model, tokens):
    with torch.no_grad():
        ids = torch.from_numpy(np.asarray(tokens, np.int64))[None]
        return model(input_ids=ids).logits[0].float().numpy()


def _assert_close(ours, theirs):
    """As tests/test_hf.py: f32 logits within 1e-4 of the largest, plus 1e-4."""
    ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
    tol = 1e-4 * np.max(np.abs(theirs)) + 1e-4
    assert np.max(np.abs(ours - theirs)) <= tol, np.max(np.abs(ours - theirs))


def _assert_logits(model, theirs):
    """Scanned and unrolled layers both give transformers' logits."""
    tokens = _tokens()
    expected = _hf_logits(theirs, tokens)
    for scan in (True, False):
        _assert_close(
            model.with_options(scan_layers=scan)(jnp.asarray(tokens)), expected
        )


def _header(path):
    header = _safetensors.read_header(str(path / "model.safetensors"))
    header.pop("__metadata__")
    return {k: (v["dtype"], v["shape"]) for k, v in header.items()}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_save_pretrained_loads_in_eqtrain(tmp_path, name):
    theirs = _hf_model(**VARIANTS[name])
    theirs.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    model, config = hf.load(tmp_path)
    for key in OPTIONS:
        assert getattr(config, key) == written[key] == getattr(theirs.config, key)
    assert (model.lm_head is None) == config.tie_word_embeddings
    _assert_logits(model, theirs)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_loads_in_transformers(tmp_path, name):
    config = GPT2Config(**SHAPE, **VARIANTS[name])
    model = _randomize(GPT2(config, jr.key(0)))
    hf.export(model, None, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    theirs = _hf_load(tmp_path / "ours")
    for key in OPTIONS:
        assert written[key] == getattr(theirs.config, key) == getattr(config, key)
    _assert_logits(model, theirs)
    # The tensors (an untied head's `lm_head.weight` included) are those
    # `save_pretrained` writes, and come back bit for bit.
    theirs.save_pretrained(tmp_path / "theirs")
    assert _header(tmp_path / "ours") == _header(tmp_path / "theirs")
    assert ("lm_head.weight" in _header(tmp_path / "ours")) == (
        not config.tie_word_embeddings
    )
    loaded, loaded_config = hf.load(tmp_path / "ours")
    assert loaded_config == config
    assert jtu.tree_structure(loaded) == jtu.tree_structure(model)
    for a, b in zip(jtu.tree_leaves(loaded), jtu.tree_leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_absent_options_take_transformers_defaults(tmp_path):
    ours, theirs = GPT2Config(**SHAPE), transformers.GPT2Config(**SHAPE)
    assert {k: getattr(ours, k) for k in OPTIONS} == {
        k: getattr(theirs, k) for k in OPTIONS
    }
    hf.export(GPT2(ours, jr.key(0)), None, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    bare = {k: v for k, v in config.items() if k not in OPTIONS}
    (tmp_path / "config.json").write_text(json.dumps(bare))
    assert hf.load_config(tmp_path)[0] == ours


# -- activations -------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_matches_transformers(name):
    x = np.linspace(-12, 12, 2001, dtype=np.float32)
    theirs = ACT2FN[name](torch.from_numpy(x)).numpy()
    ours = ACTIVATIONS[name](jnp.asarray(x))
    assert ours.dtype == jnp.float32
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert ACTIVATIONS[name](jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16


def test_every_parameter_free_activation_is_supported():
    learned = {name for name in ACT2CLS if list(ACT2FN[name].parameters())}
    assert learned == {"prelu", "xielu"}
    assert set(ACTIVATIONS) == set(ACT2CLS) - learned


# -- what stays refused ------------------------------------------------------------
@pytest.mark.parametrize(
    "changes, match",
    [
        (
            dict(activation_function="prelu"),
            r"does not support this activation_function \(it takes the "
            r"parameter-free ones.*gelu_new.*\(got 'prelu'\)",
        ),
        (
            dict(add_cross_attention=True),
            r"does not support cross-attention \(add_cross_attention.*\(got True\)",
        ),
    ],
    ids=["prelu", "cross_attention"],
)
def test_options_without_an_equivalent_are_refused(tmp_path, changes, match):
    hf.export(GPT2(GPT2Config(**SHAPE), jr.key(0)), None, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(hf.HFFormatError, match=match):
        hf.load(tmp_path)


def test_unknown_activation_is_a_config_error():
    with pytest.raises(ConfigError, match=r"`activation_function` must be one of"):
        dataclasses.replace(GPT2Config(**SHAPE), activation_function="gelu_tanh")


@pytest.mark.slow  # test_interop's import of a variant runs a job by default
def test_fine_tune_a_combined_variant_from_hf(tmp_path):
    """`model.init_from` on an untied, gelu, layer-scaled GPT-2: the run starts
    from its weights, trains, and exports what transformers loads with eqtrain's
    logits and the same options."""
    from eqtrain import config as config_lib, job

    theirs = _hf_model(**VARIANTS["combined"], vocab_size=300)  # the byte tokenizer's
    theirs.save_pretrained(tmp_path / "base")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("def f(x):\n    return x + 1\n" * 80)
    config = config_lib.load(
        overrides=[
            f"run_dir={tmp_path / 'run'}",
            f"model.init_from={tmp_path / 'base'}",
            f"data.train={tmp_path / 'text'}",
            "data.eval=none",
            "loop.eval_every=0",
            "data.seq_len=16",
            "data.batch_size=8",
            "loop.steps=2",
            "optim.warmup_steps=0",
            "log.progress=none",
        ]
    )
    result = job.run(config, echo=lambda s: None)
    trained = result.fit.state.model
    assert trained.lm_head is not None and not trained.config.tie_word_embeddings
    assert result.config.model.tie_embeddings is False
    exported = _hf_load(tmp_path / "run" / "hf")
    for key in OPTIONS:
        assert getattr(exported.config, key) == getattr(theirs.config, key)
    _assert_logits(trained, exported)
    start, _ = hf.load(tmp_path / "base")
    assert not np.array_equal(trained.lm_head.weight, start.lm_head.weight)
