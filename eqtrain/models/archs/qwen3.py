"""Qwen3 (q/k RMSNorm per head before the rotary embedding) and SmolLM3 (layers
without rotary embeddings)."""

from ._common import Arch
from .llama import _biases, _contiguous_windows, _windows, write_windows


def _no_rope_layers(r, common):
    layers = common["num_hidden_layers"]
    given = r.get("no_rope_layers")
    if given is None:
        every = int(r.get("no_rope_layer_interval", 4))
        given = [int((i + 1) % every != 0) for i in range(layers)]
    r.require(
        f"no_rope_layers of {len(given)} entries for {layers} layers",
        len(given) == layers,
        given,
    )
    flags = tuple(int(bool(x)) for x in given)
    # SmolLM3's default windows are on the layers without rotary embeddings
    windows = _windows(r, common, lambda i: not flags[i])
    return {
        **_biases(r, common),
        **windows,
        "no_rope_layers": None if all(flags) else flags,
    }


QWEN3 = Arch(
    "qwen3",
    "Qwen3ForCausalLM",
    switches=dict(qk_norm="head"),
    free=frozenset({"attention_bias", "sliding_window", "layer_types"}),
    read=lambda r, c: {
        **_windows(r, c),
        "attention_bias": r.get("attention_bias", False),
    },
    write=lambda c: {**write_windows(c), "attention_bias": c.attention_bias},
    check=_contiguous_windows,
    defaults=dict(head_dim=128),
)
SMOLLM3 = Arch(
    "smollm3",
    "SmolLM3ForCausalLM",
    free=frozenset(
        {"attention_bias", "mlp_bias", "sliding_window", "layer_types"}
        | {"no_rope_layers"}
    ),
    read=_no_rope_layers,
    write=lambda c: {
        **write_windows(c),
        "attention_bias": c.attention_bias,
        "mlp_bias": c.mlp_bias,
        "no_rope_layers": list(c.no_rope_layers or [1] * c.num_hidden_layers),
    },
    theta=2000000.0,
    defaults=dict(tie_word_embeddings=True),
)
ARCHS = (QWEN3, SMOLLM3)
