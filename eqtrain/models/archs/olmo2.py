"""OLMo 2: norms after attention and the MLP (none before), q/k RMSNorm over the
whole projection."""

from ._common import Arch


OLMO2 = Arch(
    "olmo2",
    "Olmo2ForCausalLM",
    switches=dict(block="post", qk_norm="full"),
    free=frozenset({"attention_bias"}),
    read=lambda r, c: dict(attention_bias=bool(r.get("attention_bias", False))),
    write=lambda c: dict(attention_bias=c.attention_bias),
    defaults=dict(rms_norm_eps=1e-5),
)
ARCHS = (OLMO2,)
