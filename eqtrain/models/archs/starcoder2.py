"""StarCoder2: LayerNorm with biases, a plain GELU MLP (`c_fc`, `c_proj`),
biases everywhere (`use_bias`), sliding windows."""

from ._common import Arch


def _read(r, common):
    bias = bool(r.get("use_bias", True))
    return dict(
        attention_bias=bias,
        mlp_bias=bias,
        rms_norm_eps=float(r.get("norm_epsilon", 1e-5)),
        sliding_window=r.get("sliding_window"),
    )


STARCODER2 = Arch(
    "starcoder2",
    "Starcoder2ForCausalLM",
    switches=dict(norm="layer", mlp="plain"),
    free=frozenset({"attention_bias", "mlp_bias", "sliding_window"}),
    read=_read,
    write=lambda c: dict(
        use_bias=c.attention_bias,
        norm_epsilon=float(c.rms_norm_eps),
        sliding_window=c.sliding_window,
    ),
    act=("hidden_act", "gelu_pytorch_tanh"),
    check=lambda c: (
        []
        if c.attention_bias == c.mlp_bias
        else [
            f"attention_bias={c.attention_bias}, mlp_bias={c.mlp_bias} (one use_bias)"
        ]
    ),
    defaults=dict(tie_word_embeddings=True),
)
ARCHS = (STARCODER2,)
