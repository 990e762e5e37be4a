"""Tiny random transformers models for the decoder families of Hugging Face.

A helper for parity tests, not a test file. `VARIANTS` is plain data (importable
without torch); the functions need torch and transformers, so a caller does
`pytest.importorskip("torch")` and `pytest.importorskip("transformers")` first.

    model = hf_model("gemma2")                   # random, eval mode, eager attention
    path = save("gemma2", tmp_path / "gemma2")   # save_pretrained(safetensors)
    logits = hf_logits(model, tokens)            # [batch, seq] -> f32 numpy
    again = load(path)                           # from_pretrained, no missing keys

Every parameter is random (norm gains and biases too), so a swapped tensor, a
missing `1 +` or a dropped bias shows in the logits. Attention is "eager"; SDPA
agrees to float32 rounding (<= 3e-5 on logits of ~10) and Gemma 2 refuses it.
An independent float64 forward from config.json + safetensors agreed with every
variant within 1.5e-5 * max|logit| at 20, 33 and 100 tokens (float32 noise):
compare float32 logits with ~5e-5 * max|logit|. Sliding windows are 8 and the
longrope / dynamic / yarn / llama3 variants switch or scale at 32 tokens, so use
sequences of 33+ (and 32 vs 33 for the longrope switch). On a 2-core CPU a model
builds in ~5-25 ms, save + load takes ~20-60 ms and a [2, 128] forward ~3-17 ms
(one torch thread; importing torch + transformers costs ~2.5 s once).
"""

import copy
import os

import numpy as np


try:
    import torch
    import transformers
except ImportError:  # callers importorskip("torch") / ("transformers") first
    torch = transformers = None


# Common shapes: hidden 64, 4 query heads of 16, 2 key/value heads (GQA), MLP 96
# (not square: a transposed MLP matrix fails on shape).
_BASE = dict(
    vocab_size=101,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,  # the defaults (e.g. SmolLM3's 128004) lie outside the vocab
    bos_token_id=1,
    eos_token_id=2,
)

# Rope parameters for the llama variants. theta 10000 with head_dim 16 puts the
# 8 frequencies' wavelengths at 6.3, 20, 63, 199, ... tokens: with an original
# context of 32, llama3 keeps the first, smooths the second and divides the rest;
# yarn's ramp covers dims 0..2.
_THETA = 10000.0
_LONGROPE_16 = dict(  # 8 = head_dim 16 // 2 factors each
    short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    long_factor=[1.2, 1.9, 2.7, 3.9, 5.2, 7.0, 9.1, 12.5],
)

VARIANTS: dict[str, tuple[str, dict]] = {
    # -- llama: every rope type -------------------------------------------------
    "llama": ("llama", dict(_BASE, rope_parameters=dict(rope_theta=_THETA))),
    "llama-linear": (
        "llama",
        dict(
            _BASE,
            rope_parameters=dict(rope_type="linear", factor=4.0, rope_theta=_THETA),
        ),
    ),
    # Dynamic NTK: the base grows once the call's longest position exceeds
    # max_position_embeddings (32 here), so logits depend on the call's length.
    "llama-dynamic": (
        "llama",
        dict(
            _BASE,
            max_position_embeddings=32,
            rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=_THETA),
        ),
    ),
    "llama-yarn": (
        "llama",
        dict(
            _BASE,
            max_position_embeddings=128,
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=32,
                rope_theta=_THETA,
            ),
        ),
    ),
    # Longrope: short factors while the call's longest position < 32, long ones
    # (for every position) past it; cos/sin scaled by sqrt(1 + ln 4 / ln 32).
    "llama-longrope": (
        "llama",
        dict(
            _BASE,
            max_position_embeddings=128,
            rope_parameters=dict(
                rope_type="longrope",
                factor=4.0,
                original_max_position_embeddings=32,
                rope_theta=_THETA,
                **_LONGROPE_16,
            ),
        ),
    ),
    # Llama 3.1 rope with an original context of 32 (positions 64..128 are past it).
    "llama-llama3": (
        "llama",
        dict(
            _BASE,
            max_position_embeddings=256,
            rope_parameters=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
                rope_theta=_THETA,
            ),
        ),
    ),
    "llama-bias": (
        "llama",
        dict(
            _BASE,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=dict(rope_theta=_THETA),
        ),
    ),
    # -- mistral, qwen2 ---------------------------------------------------------
    # head_dim 12: q/k/v widths (48, 24) differ from hidden (64).
    "mistral": (
        "mistral",
        dict(
            _BASE,
            head_dim=12,
            sliding_window=8,
            rope_parameters=dict(rope_theta=_THETA),
        ),
    ),
    "qwen2": (  # q/k/v biases, no o bias; tied like Qwen2 0.5B/1.5B
        "qwen2",
        dict(_BASE, tie_word_embeddings=True, rope_parameters=dict(rope_theta=_THETA)),
    ),
    "qwen2-yarn": (  # Qwen2.5's long-context recipe
        "qwen2",
        dict(
            _BASE,
            max_position_embeddings=128,
            rope_parameters=dict(
                rope_type="yarn",
                factor=4.0,
                original_max_position_embeddings=32,
                rope_theta=_THETA,
            ),
        ),
    ),
    # -- qwen3: per-head q/k norms; head_dim given (its default is 128) ----------
    "qwen3": (
        "qwen3",
        dict(_BASE, head_dim=16, rope_parameters=dict(rope_theta=_THETA)),
    ),
    # layer_types = [full, sliding, sliding]: layers >= max_window_layers slide.
    "qwen3-sliding": (
        "qwen3",
        dict(
            _BASE,
            num_hidden_layers=3,
            head_dim=16,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
            rope_parameters=dict(rope_theta=_THETA),
        ),
    ),
    # -- smollm3: no_rope_layers[i] == 0 means layer i has NO rope ---------------
    "smollm3": (
        "smollm3",
        dict(
            _BASE,
            num_hidden_layers=4,
            no_rope_layers=[1, 0, 1, 0],
            rope_parameters=dict(rope_theta=_THETA),
        ),
    ),
    # -- gemma family: (1 + w) norms, scaled embeddings, gelu tanh, tied head -----
    # MQA; 4 heads of 16 = 64 != hidden 48 (like Gemma 7B's 16 x 256 != 3072).
    "gemma": (
        "gemma",
        dict(
            _BASE,
            hidden_size=48,
            num_key_value_heads=1,
            head_dim=16,
            rope_parameters=dict(rope_theta=_THETA),
        ),
    ),
    # Sliding (8) on even layers, full on odd; softcaps low enough to bend the
    # values (scores ~ +-5, logits ~ +-3); 1/sqrt(24) scaling, not 1/sqrt(16).
    "gemma2": (
        "gemma2",
        dict(
            _BASE,
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            rope_parameters=dict(rope_theta=_THETA),
        ),
    ),
    # 7 layers: sliding x5, full, sliding (pattern 6). Local rope theta 100,
    # global theta 10000 with linear factor 8 (as Gemma 3 4B and up).
    "gemma3_text": (
        "gemma3_text",
        dict(
            _BASE,
            num_hidden_layers=7,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", factor=8.0, rope_theta=_THETA),
                sliding_attention=dict(rope_type="default", rope_theta=100.0),
            ),
        ),
    ),
    # -- phi3: fused qkv_proj / gate_up_proj; longrope -------------------------
    # original_max_position_embeddings is a top-level field in phi3 (it overrides
    # the rope dict's); factor comes from 128 / 32.
    "phi3": (
        "phi3",
        dict(
            _BASE,
            max_position_embeddings=128,
            original_max_position_embeddings=32,
            rope_parameters=dict(
                rope_type="longrope", rope_theta=_THETA, **_LONGROPE_16
            ),
        ),
    ),
    # Phi-4-mini-like: rope on the first 12 of 16 dims, longrope, tied embeddings.
    "phi3-partial": (
        "phi3",
        dict(
            _BASE,
            max_position_embeddings=128,
            original_max_position_embeddings=32,
            partial_rotary_factor=0.75,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=_THETA,
                short_factor=[1.0, 1.2, 1.5, 1.9, 2.4, 3.0],
                long_factor=[1.3, 2.2, 3.4, 5.0, 7.3, 10.0],
            ),
        ),
    ),
    # -- olmo2: post-norms only; q/k norms over the whole projection -------------
    "olmo2": ("olmo2", dict(_BASE, rope_parameters=dict(rope_theta=_THETA))),
    # -- granite: every multiplier != 1 -----------------------------------------
    "granite": (
        "granite",
        dict(
            _BASE,
            embedding_multiplier=6.0,
            attention_multiplier=0.15,  # replaces head_dim**-0.5 = 0.25
            residual_multiplier=0.4,
            logits_scaling=3.0,  # logits are DIVIDED by it
            tie_word_embeddings=True,
            rope_parameters=dict(rope_theta=_THETA),
        ),
    ),
    # -- starcoder2: LayerNorm (with bias), plain gelu MLP, biases, window -------
    "starcoder2": (
        "starcoder2",
        dict(
            _BASE,
            sliding_window=8,
            use_bias=True,
            rope_parameters=dict(rope_theta=_THETA),
        ),
    ),
}


def _dtype(dtype):
    if dtype is None:
        return torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def config(variant: str):
    """The variant's transformers config (a fresh one each call)."""
    model_type, kwargs = VARIANTS[variant]
    # deepcopy: config classes fill the rope dict in place
    return transformers.AutoConfig.for_model(model_type, **copy.deepcopy(kwargs))


def _randomize(model, seed):
    """Every parameter drawn again, in float32, in `named_parameters` order.

    Matrices (and embeddings) ~ N(0, 0.3); biases ~ N(0, 0.2); norm gains around
    their identity: 1 + N(0, 0.2) for `w * x` norms, N(0, 0.2) for Gemma's
    `(1 + w) * x` ones (those init to zeros, the others to ones).
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights come once
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.ndim >= 2:
                value = 0.3 * noise
            elif name.endswith(".bias"):
                value = 0.2 * noise
            elif bool((p == 0).all()):
                value = 0.2 * noise
            elif bool((p == 1).all()):
                value = 1.0 + 0.2 * noise
            else:
                raise AssertionError(f"unexpected initial values for {name}")
            p.copy_(value.to(p.dtype))


def hf_model(variant: str, *, dtype=None, seed: int = 0):
    """AutoModelForCausalLM.from_config, randomized, eval mode, eager attention.

    `dtype` (torch dtype or name; default float32): built in it as
    `from_pretrained(..., dtype=dtype)` builds (rope inv_freq stays float32,
    Gemma's embed_scale buffer takes the dtype), so `save` + `load` gives this
    model's logits exactly. The parameters are drawn in float32 and rounded, so a
    bfloat16 model is the rounding of the float32 one with the same seed.
    """
    model = transformers.AutoModelForCausalLM.from_config(
        config(variant), attn_implementation="eager", dtype=_dtype(dtype)
    )
    _randomize(model, seed)
    return model.eval()


def save(variant: str, path, *, dtype=None, seed: int = 0) -> str:
    """`hf_model(variant, dtype=dtype, seed=seed).save_pretrained(path)`; the path."""
    path = os.fspath(path)
    hf_model(variant, dtype=dtype, seed=seed).save_pretrained(
        path, safe_serialization=True
    )
    return path


def load(path, *, dtype=None):
    """from_pretrained with eager attention, eval mode; asserts no missing,
    unexpected or mismatched keys. `dtype` None: the checkpoint's own."""
    kwargs = {"dtype": _dtype(dtype)} if dtype is not None else {"dtype": "auto"}
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        os.fspath(path), attn_implementation="eager", output_loading_info=True, **kwargs
    )
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"}
    assert not bad and not info.get("error_msgs"), info
    return model.eval()


def _rope_types(model):
    params = model.config.rope_parameters or {}
    nested = [v for v in params.values() if isinstance(v, dict)]
    return {p.get("rope_type", "default") for p in nested or [params]}


def hf_logits(model, tokens) -> np.ndarray:
    """Float32 numpy logits for int tokens [batch, seq] ([seq] gives [seq, vocab]).

    Positions 0..seq-1, attention mask all ones, no cache, no grad.

    Dynamic NTK rope is stateful in transformers: a call longer than
    max_position_embeddings replaces inv_freq, and only a later call SHORTER than
    max_position_embeddings restores it (a 32-token call after a 40-token one, with
    max 32, keeps the 40-token frequencies). A one-token call first resets it, so
    these logits are those of a fresh model: rope for this call's length alone.
    """
    tokens = np.asarray(tokens)
    ids = torch.from_numpy(tokens.astype(np.int64))
    if ids.ndim == 1:
        return hf_logits(model, tokens[None])[0]
    with torch.no_grad():
        if any("dynamic" in t for t in _rope_types(model)):
            model(input_ids=ids[:, :1], use_cache=False)
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return out.logits.float().numpy()
