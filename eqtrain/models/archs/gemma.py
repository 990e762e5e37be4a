"""Gemma 1, 2 and 3 (text): RMSNorm with `1 + w` gains, embeddings scaled by
`sqrt(hidden)`, tanh-GELU MLPs; Gemma 2 adds four norms per block, soft-capped
scores and logits and alternating sliding layers; Gemma 3 q/k norms, a 5:1
sliding pattern and a local rotary base on its sliding layers."""

from typing import Any

from .._decoder_config import DecoderConfig
from ._common import (
    Arch,
    Reader,
    layer_types,
    read_layer_types,
    read_rope,
    rope_parameters,
)


GEMMA_SWITCHES = dict(norm="rms_one", embedding_multiplier=lambda c: c.hidden_size**0.5)


def _pattern(r: Reader, common: dict[str, Any], every: int) -> tuple[str, ...]:
    layers = common["num_hidden_layers"]
    types = read_layer_types(r, layers)
    if types is None:
        every = int(r.get("sliding_window_pattern", every))
        types = tuple(
            "sliding_attention" if (i + 1) % every else "full_attention"
            for i in range(layers)
        )
    return types


def _causal(r: Reader) -> None:
    bidirectional = r.get("use_bidirectional_attention", False)
    r.require("`use_bidirectional_attention`", not bidirectional, bidirectional)


def _gemma1(r: Reader, common: dict[str, Any]) -> dict[str, Any]:
    _causal(r)
    act = common["hidden_act"]
    return dict(
        attention_bias=bool(r.get("attention_bias", False)),
        # official releases say "gelu" and mean the tanh approximation
        hidden_act="gelu_pytorch_tanh" if act == "gelu" else act,
    )


def _gemma2(r: Reader, common: dict[str, Any], every: int = 2) -> dict[str, Any]:
    _causal(r)
    soft = lambda key, default: r.hf.get(key, default)
    types = _pattern(r, common, every)
    # transformers needs a window even if no layer slides (export writes one)
    window = int(r.get("sliding_window", 4096))
    return dict(
        attention_bias=bool(r.get("attention_bias", False)),
        attention_scale=float(r.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_logit_softcapping=soft(
            "attn_logit_softcapping", 50.0 if every == 2 else None
        ),
        final_logit_softcapping=soft(
            "final_logit_softcapping", 30.0 if every == 2 else None
        ),
        sliding_window=window if "sliding_attention" in types else None,
        layer_types=types,
    )


def _gemma3(r: Reader, common: dict[str, Any]) -> dict[str, Any]:
    out = _gemma2(r, common, every=6)
    out["attn_logit_softcapping"] = None  # Gemma 3 reads it but never applies it
    size = common["head_dim"] or common["hidden_size"] // common["num_attention_heads"]
    out.update(read_rope(r, GEMMA3, size, "full_attention"))
    local = read_rope(r, GEMMA3_LOCAL, size, "sliding_attention")
    out["local_rope"] = (
        local.get("rope")
        or DecoderConfig(rope_theta=local["rope_theta"], head_dim=size).global_rope
    )
    return out


def _write2(c: DecoderConfig) -> dict[str, Any]:
    scalar = (c.attention_scale or c.head_size**-0.5) ** -2
    return dict(
        attention_bias=c.attention_bias,
        query_pre_attn_scalar=round(scalar)
        if abs(scalar - round(scalar)) < 1e-6
        else scalar,
        attn_logit_softcapping=c.attn_logit_softcapping,
        final_logit_softcapping=c.final_logit_softcapping,
        # Gemma 2 and 3 build a sliding mask even if no layer uses it
        sliding_window=c.sliding_window or c.max_position_embeddings,
        layer_types=layer_types(c),
    )


def _write3(c: DecoderConfig) -> dict[str, Any]:
    local = c.local_rope or c.global_rope
    return {
        **_write2(c),
        "rope_parameters": {
            "full_attention": rope_parameters(c.global_rope),
            "sliding_attention": rope_parameters(local),
        },
        "rope_local_base_freq": float(local.theta),
    }


_GEMMA2_FREE = frozenset(
    {"attention_bias", "attention_scale", "attn_logit_softcapping"}
    | {"final_logit_softcapping", "sliding_window", "layer_types"}
)
GEMMA = Arch(
    "gemma",
    "GemmaForCausalLM",
    switches=GEMMA_SWITCHES,
    free=frozenset({"attention_bias"}),
    read=_gemma1,
    write=lambda c: dict(attention_bias=c.attention_bias),
    act=("hidden_act", "gelu_pytorch_tanh"),
    defaults=dict(head_dim=256, tie_word_embeddings=True),
)
GEMMA2 = Arch(
    "gemma2",
    "Gemma2ForCausalLM",
    switches={**GEMMA_SWITCHES, "block": "sandwich"},
    free=_GEMMA2_FREE,
    read=_gemma2,
    write=_write2,
    act=("hidden_activation", "gelu_pytorch_tanh"),
    defaults=dict(head_dim=256, tie_word_embeddings=True),
)
GEMMA3 = Arch(
    "gemma3_text",
    "Gemma3ForCausalLM",
    switches={**GEMMA_SWITCHES, "block": "sandwich", "qk_norm": "head"},
    free=(_GEMMA2_FREE - {"attn_logit_softcapping"}) | {"local_rope"},
    read=_gemma3,
    write=_write3,
    theta=1000000.0,
    act=("hidden_activation", "gelu_pytorch_tanh"),
    defaults=dict(head_dim=256, tie_word_embeddings=True),
)
GEMMA3_LOCAL = Arch("gemma3_text", "Gemma3ForCausalLM", theta=10000.0)
ARCHS = (GEMMA, GEMMA2, GEMMA3)
