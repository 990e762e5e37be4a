"""Phi-3 and Phi-4-mini: fused `qkv_proj` and `gate_up_proj`, longrope, partial
rotary embeddings."""

from ._common import Arch


def _original(c):
    rope = c.global_rope
    if rope.original_max_position_embeddings is None:
        return {}
    return dict(original_max_position_embeddings=rope.original_max_position_embeddings)


def _rope_type(c):
    kind = c.global_rope.rope_type
    if kind in ("default", "longrope"):
        return []
    return [f"rope_type={kind!r} (Phi-3 has 'default' or 'longrope')"]


PHI3 = Arch(
    "phi3",
    "Phi3ForCausalLM",
    switches=dict(fused_qkv=True, mlp="fused_gated"),
    free=frozenset({"partial_rotary_factor", "sliding_window"}),
    read=lambda r, c: dict(sliding_window=r.get("sliding_window")),
    write=lambda c: dict(
        sliding_window=c.sliding_window,
        partial_rotary_factor=c.partial_rotary_factor,
        **_original(c),
    ),
    check=_rope_type,
    original_default=4096,
    defaults=dict(rms_norm_eps=1e-5),
    rope_aliases=dict(su="longrope", yarn="longrope"),
)
ARCHS = (PHI3,)
