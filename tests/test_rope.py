"""eqtrain.models._rope against transformers' own rotary embedding classes: every
rope type, both config spellings, positions on both sides of the original length,
partial rotary (Phi-3), Gemma 3's per-layer-type dict, round trips and errors."""

import dataclasses

import pytest


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from transformers.models.gemma3 import modeling_gemma3  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.phi3 import modeling_phi3  # noqa: E402

from eqtrain._errors import ConfigError  # noqa: E402
from eqtrain.models import _layers  # noqa: E402
from eqtrain.models._rope import (  # noqa: E402
    Rope,
    apply_rope,
    rope_cos_sin,
    rope_from_hf,
)


def _factors(n, low, high, seed=0):
    """A Phi-3-like factor list: rising from `low` to `high`, a little noise."""
    ramp = np.linspace(low, high, n) + np.random.default_rng(seed).uniform(0, 0.05, n)
    return [float(v) for v in ramp]


def _rope(rope_type, theta, **params):
    return {"rope_type": rope_type, "rope_theta": theta} | params


def _yarn(theta, factor, original, **params):
    return _rope(
        "yarn",
        theta,
        factor=factor,
        original_max_position_embeddings=original,
        **params,
    )


def _longrope(original, n, long_max, **params):
    short, long = _factors(n, 1.0, 1.2), _factors(n, 1.0, long_max, seed=1)
    return _rope(
        "longrope",
        10000.0,
        original_max_position_embeddings=original,
        short_factor=short,
        long_factor=long,
        **params,
    )


LLAMA31 = _rope(
    "llama3",
    500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
# (name, rope parameters, head_dim, max_position_embeddings, original length)
CASES = [
    ("default-16", _rope("default", 10000.0), 16, 4096, 4096),
    ("default-96", _rope("default", 10000.0), 96, 4096, 4096),  # Phi-3's head_dim
    ("linear", _rope("linear", 10000.0, factor=4.0), 32, 16384, 4096),
    ("dynamic-16", _rope("dynamic", 10000.0, factor=2.0), 16, 2048, 2048),
    ("dynamic-128", _rope("dynamic", 500000.0, factor=2.0), 128, 2048, 2048),
    ("llama3-16", LLAMA31, 16, 131072, 8192),
    ("llama3-128", LLAMA31, 128, 131072, 8192),
    ("yarn-qwen", _yarn(1000000.0, 4.0, 32768), 128, 131072, 32768),  # Qwen2.5
    (
        "yarn-small",
        _yarn(10000.0, 2.0, 64, beta_fast=16, beta_slow=2, truncate=False),
        16,
        128,
        64,
    ),
    ("yarn-clamped", _yarn(10000.0, 2.0, 64, beta_slow=16), 16, 128, 64),  # low == high
    # DeepSeek-style: the attention factor from mscale / mscale_all_dim
    (
        "yarn-mscale",
        _yarn(10000.0, 40.0, 4096, mscale=1.0, mscale_all_dim=0.707),
        32,
        163840,
        4096,
    ),
    ("yarn-null-truncate", _yarn(10000.0, 2.0, 64, truncate=None), 16, 128, 64),
    ("yarn-attention", _yarn(10000.0, 8.0, 512, attention_factor=1.5), 16, 4096, 512),
    ("longrope-phi3", _longrope(4096, 48, 60.0), 96, 131072, 4096),  # factor derived
    (
        "longrope-16",
        _longrope(256, 8, 8.0, factor=4.0, attention_factor=1.2),
        16,
        1024,
        256,
    ),
]


def _positions(original):
    """Rows of 16: within the original length (up to it), and past 1.5x of it."""
    start = int(1.5 * original)
    long = np.concatenate([np.arange(8), np.arange(start, start + 8)])
    return [np.arange(16), np.arange(original - 16, original), long]


def _hf_config(cls, head_dim, max_pos, **kwargs):
    return cls(
        vocab_size=32,
        hidden_size=2 * head_dim,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        **kwargs,
    )


def _hf_tables(rotary, positions, layer_type=None):
    """transformers' cos, sin and the inverse frequencies it used for them."""
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    cos, sin = rotary(torch.zeros(1), torch.as_tensor(positions)[None], **kwargs)
    inv_freq = getattr(rotary, f"{layer_type}_inv_freq" if layer_type else "inv_freq")
    return cos[0].numpy(), sin[0].numpy(), inv_freq.numpy()


def _llama_tables(config, positions):
    # A fresh module per call: transformers' dynamic module keeps grown frequencies.
    return _hf_tables(modeling_llama.LlamaRotaryEmbedding(config), positions)


def _assert_tables(rope, positions, expected):
    """Equal to ~1e-6 of their magnitude, plus a few ulp of an inverse frequency
    times the position: torch's vectorised pow rounds ~1% of them one ulp away
    from the correctly rounded power, which moves the angle by position * ulp."""
    cos, sin = rope_cos_sin(rope, jnp.asarray(positions, jnp.int32))
    assert cos.shape == sin.shape == (len(positions), rope.dim)
    assert cos.dtype == sin.dtype == jnp.float32
    want_cos, want_sin, inv_freq = expected
    scale = max(np.abs(want_cos).max(), 1.0)
    ulp = np.spacing(np.concatenate([inv_freq, inv_freq]))[None, :]
    tol = scale * (2e-6 + 4 * np.asarray(positions, np.float64)[:, None] * ulp)
    for got, want in ((cos, want_cos), (sin, want_sin)):
        np.testing.assert_array_less(np.abs(np.asarray(got) - want), tol)


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize(("name", "params", "head_dim", "max_pos", "original"), CASES)
def test_tables_match_transformers(spelling, name, params, head_dim, max_pos, original):
    params = dict(params)
    if spelling == "rope_parameters":
        config = _hf_config(
            transformers.LlamaConfig, head_dim, max_pos, rope_parameters=dict(params)
        )
    else:  # transformers 4.x: `type`, and rope_theta at the top of config.json
        scaling = {"type": params.pop("rope_type")} | params
        theta = scaling.pop("rope_theta")
        config = _hf_config(
            transformers.LlamaConfig,
            head_dim,
            max_pos,
            rope_scaling=dict(scaling),
            rope_theta=theta,
        )
        params = scaling | {"rope_theta": theta}
    rope = rope_from_hf(params, head_dim=head_dim, max_position_embeddings=max_pos)
    assert rope.dim == head_dim
    for positions in _positions(original):
        _assert_tables(rope, positions, _llama_tables(config, positions))


def test_length_dependent_types_switch_tables():
    """dynamic and longrope change their frequencies past the original length; a
    row's own length chooses, under jit and vmap (rows of one batch may differ)."""
    for name in ("dynamic-16", "longrope-16"):
        _, params, head_dim, max_pos, original = next(c for c in CASES if c[0] == name)
        rope = rope_from_hf(params, head_dim=head_dim, max_position_embeddings=max_pos)
        short, long = np.arange(8), np.concatenate([np.arange(7), [3 * original]])
        eager = [
            np.asarray(rope_cos_sin(rope, jnp.asarray(p))[0][:7]) for p in (short, long)
        ]
        assert np.abs(eager[0][:, 2:] - eager[1][:, 2:]).max() > 1e-3, name
        tables = jax.jit(jax.vmap(lambda p, r=rope: rope_cos_sin(r, p)[0]))
        traced = tables(jnp.stack([short, long]))
        np.testing.assert_array_equal(np.asarray(traced)[:, :7], np.stack(eager))


def test_top_level_original_length_wins_like_phi3():
    """Phi-3's config class keeps original_max_position_embeddings at the top and
    gives it priority; longrope derives factor from max / original when absent."""
    params = dict(CASES[-2][1]) | {"original_max_position_embeddings": 999}
    rope = rope_from_hf(
        params,
        head_dim=96,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
    )
    assert rope.original_max_position_embeddings == 4096
    assert rope.factor == 32.0
    config = _hf_config(
        transformers.Phi3Config, 96, 131072, rope_parameters=dict(params)
    )
    assert config.rope_parameters["original_max_position_embeddings"] == 4096
    for positions in _positions(4096):
        expected = _hf_tables(modeling_phi3.Phi3RotaryEmbedding(config), positions)
        _assert_tables(rope, positions, expected)


@pytest.mark.parametrize("rope_type", ["default", "longrope"])
@pytest.mark.parametrize("partial", [0.5, 0.75])
def test_partial_rotary_matches_phi3(rope_type, partial):
    head_dim, dim = 128, int(128 * partial)
    params = {
        "rope_type": rope_type,
        "rope_theta": 10000.0,
        "partial_rotary_factor": partial,
    }
    if rope_type == "longrope":
        params |= {
            "short_factor": _factors(dim // 2, 1.0, 1.1),
            "long_factor": _factors(dim // 2, 1.0, 30.0),
        }
    config = _hf_config(
        transformers.Phi3Config, head_dim, 131072, rope_parameters=dict(params)
    )
    rope = rope_from_hf(
        {k: v for k, v in params.items() if k != "partial_rotary_factor"},
        head_dim=head_dim,
        max_position_embeddings=131072,
        partial_rotary_factor=partial,  # top-level, as in Phi-4-mini's config.json
        original_max_position_embeddings=config.original_max_position_embeddings,
    )
    assert rope.dim == dim and rope.to_hf()["partial_rotary_factor"] == partial
    q = np.random.default_rng(0).normal(size=(2, 3, 16, head_dim)).astype(np.float32)
    for positions in (np.arange(16), np.arange(6000, 6016)):
        expected = _hf_tables(modeling_phi3.Phi3RotaryEmbedding(config), positions)
        _assert_tables(rope, positions, expected)
        cos, sin = expected[:2]
        want, _ = modeling_phi3.apply_rotary_pos_emb(
            torch.as_tensor(q),
            torch.as_tensor(q),
            torch.as_tensor(cos)[None],
            torch.as_tensor(sin)[None],
        )
        got = jax.vmap(apply_rope, in_axes=(0, None, None))(
            jnp.asarray(q).transpose(0, 2, 1, 3), jnp.asarray(cos), jnp.asarray(sin)
        )
        np.testing.assert_allclose(
            np.asarray(got).transpose(0, 2, 1, 3), want.numpy(), atol=1e-6
        )
        np.testing.assert_array_equal(
            np.asarray(got)[..., dim:], q.transpose(0, 2, 1, 3)[..., dim:]
        )


def test_gemma3_per_layer_type():
    """Gemma 3 nests one dict per layer type; each gets its own `rope_from_hf` call."""
    nested = {
        "full_attention": {
            "rope_type": "linear",
            "factor": 8.0,
            "rope_theta": 1000000.0,
        },
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    config = transformers.Gemma3TextConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=16,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=131072,
        rope_parameters={k: dict(v) for k, v in nested.items()},
    )
    rotary = modeling_gemma3.Gemma3RotaryEmbedding(config)
    for layer_type, params in nested.items():
        rope = rope_from_hf(
            params,
            head_dim=32,
            max_position_embeddings=131072,
            name=f"rope_parameters.{layer_type}",
        )
        for positions in (np.arange(16), np.arange(50000, 50016)):
            _assert_tables(
                rope, positions, _hf_tables(rotary, positions, layer_type=layer_type)
            )


@pytest.mark.parametrize(("name", "params", "head_dim", "max_pos", "original"), CASES)
def test_round_trip(name, params, head_dim, max_pos, original):
    rope = rope_from_hf(params, head_dim=head_dim, max_position_embeddings=max_pos)
    exported = rope.to_hf()
    assert (
        rope_from_hf(exported, head_dim=head_dim, max_position_embeddings=max_pos)
        == rope
    )
    assert hash(rope) == hash(dataclasses.replace(rope))
    before = _hf_config(
        transformers.LlamaConfig, head_dim, max_pos, rope_parameters=dict(params)
    )
    after = _hf_config(
        transformers.LlamaConfig, head_dim, max_pos, rope_parameters=exported
    )
    positions = _positions(original)[-1]
    for a, b in zip(
        _llama_tables(before, positions), _llama_tables(after, positions), strict=True
    ):
        np.testing.assert_array_equal(a, b)


def test_defaults_follow_transformers():
    """rope_theta 10000, `type` for `rope_type`, the dict's partial_rotary_factor
    over the top-level one, the original length falling back to the model's, and a
    null yarn factor derived as max / original (transformers does the same)."""
    kwargs = {"head_dim": 16, "max_position_embeddings": 4096}
    rope = rope_from_hf({"type": "linear", "factor": 2}, **kwargs)
    assert rope == Rope("linear", theta=10000.0, dim=16, factor=2.0)
    inner = {"partial_rotary_factor": 0.5}
    assert rope_from_hf(inner, **kwargs, partial_rotary_factor=0.25).dim == 8
    no_original = {k: v for k, v in LLAMA31.items() if "original" not in k}
    assert rope_from_hf(no_original, **kwargs).original_max_position_embeddings == 4096
    params = _yarn(10000.0, None, 512)
    rope = rope_from_hf(params, **kwargs)
    assert rope.factor == 8.0 and rope.to_hf()["factor"] == 8.0
    config = _hf_config(transformers.LlamaConfig, 16, 4096, rope_parameters=params)
    for positions in _positions(512):
        _assert_tables(rope, positions, _llama_tables(config, positions))


def _error(params, **kwargs):
    kwargs = {"head_dim": 16, "max_position_embeddings": 4096} | kwargs
    with pytest.raises(ConfigError) as info:
        rope_from_hf(params, where="ckpt/config.json", **kwargs)
    return str(info.value)


def test_errors_name_the_field():
    message = _error({"rope_type": "su"})
    assert (
        "`rope_parameters.rope_type` in ckpt/config.json" in message
        and "'llama3'" in message
    )
    message = _error({k: v for k, v in LLAMA31.items() if k != "factor"})
    assert (
        "`rope_parameters.factor` in ckpt/config.json" in message
        and "missing" in message
    )
    message = _error(
        {"type": "yarn", "original_max_position_embeddings": 512}, name="rope_scaling"
    )
    assert "`rope_scaling.factor`" in message
    message = _error(
        {"rope_type": "longrope", "short_factor": [1.0] * 7, "long_factor": [1.0] * 8}
    )
    assert (
        "`rope_parameters.short_factor`" in message and "expected 8 numbers" in message
    )
    message = _error({"rope_type": "linear", "factor": "4"})
    assert "`rope_parameters.factor`" in message and "expected a number" in message
    message = _error({"rope_type": "default", "partial_rotary_factor": 0.3125})
    assert "`rope_parameters.partial_rotary_factor`" in message and "even" in message
    message = _error({"rope_type": "default", "mrope_section": [2, 3, 3]})
    assert "`rope_parameters.mrope_section`" in message
    with pytest.raises(ConfigError, match="`Rope.factor`"):
        Rope(rope_type="default", dim=16, factor=2.0)  # a field the type does not read
    with pytest.raises(ConfigError, match="`Rope.dim`"):
        rope_cos_sin(Rope(), jnp.arange(4))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_apply_rope_is_the_layers_one_at_full_dim(dtype):
    rope = rope_from_hf(LLAMA31, head_dim=32, max_position_embeddings=131072)
    cos, sin = rope_cos_sin(rope, jnp.arange(10))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(10, 3, 32)), dtype)
    np.testing.assert_array_equal(
        apply_rope(x, cos, sin), _layers.apply_rope(x, cos, sin)
    )
    # At a power-of-two dim the plain tables equal `_layers`' too (at 80 or 96 its
    # XLA division by head_dim is a multiplication by the reciprocal: inexact).
    plain = Rope(theta=10000.0, dim=32)
    np.testing.assert_array_equal(
        rope_cos_sin(plain, jnp.arange(10))[0],
        _layers.rope_cos_sin(jnp.arange(10), 32, 10000.0)[0],
    )
