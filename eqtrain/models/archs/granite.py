"""Granite: the Llama decoder with multipliers on the embeddings, the attention
scores and each residual branch, and its logits divided by `logits_scaling`."""

from ._common import Arch


def _read(r, common):
    one = lambda key: None if float(r.get(key, 1.0)) == 1.0 else float(r.get(key))
    scale = float(r.get("attention_multiplier", 1.0))
    size = common["head_dim"] or common["hidden_size"] // common["num_attention_heads"]
    return dict(
        attention_bias=bool(r.get("attention_bias", False)),
        mlp_bias=bool(r.get("mlp_bias", False)),
        embedding_multiplier=one("embedding_multiplier"),
        residual_multiplier=one("residual_multiplier"),
        logits_scaling=one("logits_scaling"),
        # the default scale is written as None, as `_write` reads it
        attention_scale=None if scale == size**-0.5 else scale,
    )


def _write(c):
    one = lambda v: 1.0 if v is None else float(v)
    return dict(
        attention_bias=c.attention_bias,
        mlp_bias=c.mlp_bias,
        embedding_multiplier=one(c.embedding_multiplier),
        residual_multiplier=one(c.residual_multiplier),
        logits_scaling=one(c.logits_scaling),
        attention_multiplier=c.attention_scale or c.head_size**-0.5,
    )


GRANITE = Arch(
    "granite",
    "GraniteForCausalLM",
    free=frozenset(
        {"attention_bias", "mlp_bias", "embedding_multiplier"}
        | {"residual_multiplier", "logits_scaling", "attention_scale"}
    ),
    read=_read,
    write=_write,
)
ARCHS = (GRANITE,)
