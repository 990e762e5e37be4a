"""Mixture-of-experts architectures: Mixtral, Qwen2-MoE (with its gated shared
expert) and Qwen3-MoE (Qwen3's per-head q/k norms). Every layer's MLP is a
`SparseMoE` (`DecoderConfig.num_experts`); checkpoints hold one tensor per layer
and expert, which `renames` maps onto the stacked `[layers, experts, ...]`
leaves.

Hugging Face's Qwen-MoE configs can make some layers dense
(`decoder_sparse_step`, `mlp_only_layers`); eqtrain's model cannot, so such a
config is refused by name (every released Qwen-MoE checkpoint has none).
"""

from typing import Any

from .._decoder_config import DecoderConfig
from ._common import Arch, Reader, layer_types
from .llama import _windows, write_windows


EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
QWEN_RENAMES = tuple(
    (f"mlp.experts.{p}", f"mlp.experts.{{expert}}.{p}.weight") for p in EXPERT_PROJS
)
# Mixtral's original checkpoint names: w1 = gate, w3 = up, w2 = down.
MIXTRAL_RENAMES = (("mlp.gate.weight", "block_sparse_moe.gate.weight"),) + tuple(
    (f"mlp.experts.{p}", f"block_sparse_moe.experts.{{expert}}.{w}.weight")
    for p, w in zip(EXPERT_PROJS, ("w1", "w3", "w2"), strict=True)
)
_ROUTING = frozenset({"num_experts", "num_experts_per_tok", "router_aux_loss_coef"})
_QWEN = _ROUTING | {"moe_intermediate_size", "norm_topk_prob"}


def _num_experts(r: Reader, key: str, alias: str | None, default: int) -> int:
    """The experts per layer from `key` (or `alias`, which transformers' config
    class maps onto it: Qwen3-MoE files on the Hub say `num_experts`)."""
    value, other = r.get(key), None if alias is None else r.get(alias)
    if value is not None and other is not None:
        r.require(f"{key} and {alias} that differ", value == other, (value, other))
    return int(value if value is not None else other if other is not None else default)


def _routing(r: Reader, experts: int, top_k: int) -> dict[str, Any]:
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(r.get("num_experts_per_tok", top_k)),
        router_aux_loss_coef=float(r.get("router_aux_loss_coef", 0.001)),
    )


def _all_sparse(r: Reader) -> None:
    """Refuse dense MLP layers among the sparse ones (Qwen-MoE's keys)."""
    step = r.get("decoder_sparse_step", 1)
    r.require(
        "decoder_sparse_step other than 1 (dense MLP layers between the sparse "
        "ones; eqtrain's MoE model makes every layer's MLP sparse)",
        step == 1,
        step,
    )
    dense = r.get("mlp_only_layers", [])
    r.require(
        "mlp_only_layers (dense MLP layers among the sparse ones; eqtrain's MoE "
        "model makes every layer's MLP sparse)",
        not dense,
        dense,
    )


def _qwen_moe(
    r: Reader, common: dict[str, Any], experts: int, top_k: int, ff: int
) -> dict[str, Any]:
    _all_sparse(r)
    width = int(r.get("moe_intermediate_size", ff))
    return dict(
        **_routing(r, experts, top_k),
        # as wide as `intermediate_size`: None, as a config without it says
        moe_intermediate_size=None if width == common["intermediate_size"] else width,
        norm_topk_prob=bool(r.get("norm_topk_prob", False)),
    )


def _write_routing(c: DecoderConfig) -> dict[str, Any]:
    return dict(
        num_experts_per_tok=c.num_experts_per_tok,
        router_aux_loss_coef=float(c.router_aux_loss_coef),
        output_router_logits=False,
    )


def _write_qwen_moe(c: DecoderConfig) -> dict[str, Any]:
    return dict(
        **_write_routing(c),
        moe_intermediate_size=c.expert_size,
        norm_topk_prob=c.norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def _has_experts(c: DecoderConfig) -> list[str]:
    return [] if c.num_experts else ["num_experts=0 (it has experts in every layer)"]


# -- Mixtral: Mistral's attention, experts of width `intermediate_size` ----------
def _read_mixtral(r: Reader, common: dict[str, Any]) -> dict[str, Any]:
    jitter = r.get("router_jitter_noise", 0.0)
    r.require(
        "router_jitter_noise other than 0 (noise on the router's input in "
        "training); set it to 0.0 in config.json to train without it",
        float(jitter) == 0.0,
        jitter,
    )
    experts = _num_experts(r, "num_local_experts", "num_experts", 8)
    return dict(**_routing(r, experts, 2), sliding_window=r.get("sliding_window"))


def _write_mixtral(c: DecoderConfig) -> dict[str, Any]:
    return dict(
        **_write_routing(c),
        num_local_experts=c.num_experts,
        router_jitter_noise=0.0,
        sliding_window=c.sliding_window,
    )


# -- Qwen2-MoE: Qwen2's q/k/v biases, a shared expert behind a sigmoid gate -------
def _read_qwen2_moe(r: Reader, common: dict[str, Any]) -> dict[str, Any]:
    bias = bool(r.get("qkv_bias", True))
    # transformers 5's default windows: the even layers below max_window_layers
    first = int(r.get("max_window_layers", 28))
    return dict(
        **_qwen_moe(r, common, int(r.get("num_experts", 60)), 4, 1408),
        shared_expert_intermediate_size=int(
            r.get("shared_expert_intermediate_size", 5632)
        ),
        attention_bias=bias,
        o_proj_bias=_qkv_only(bias),
        **_windows(r, common, lambda i: i % 2 == 0 and i < first),
    )


def _qkv_only(bias: bool, o_proj_bias: bool | None = None) -> bool | None:
    """Qwen2-MoE's `o_proj_bias`: False beside q/k/v biases (`qkv_bias`), as
    given without them (`_check_qwen2_moe` refuses an o_proj bias)."""
    return False if bias else o_proj_bias


def _write_qwen2_moe(c: DecoderConfig) -> dict[str, Any]:
    windows = write_windows(c)
    if not windows["use_sliding_window"]:
        windows["sliding_window"] = 0  # as transformers' config class sets it
    return dict(
        **_write_qwen_moe(c),
        **windows,
        num_experts=c.num_experts,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size,
        qkv_bias=c.attention_bias,
    )


def _check_qwen2_moe(c: DecoderConfig) -> list[str]:
    out = _has_experts(c)
    if c.shared_expert_intermediate_size is None:
        out.append("shared_expert_intermediate_size=None (it has a shared expert)")
    if c.attention_bias if c.o_proj_bias is None else c.o_proj_bias:
        out.append("an o_proj bias (it has q/k/v biases only)")
    return out


# -- Qwen3-MoE: Qwen3's attention; its window, when on, covers every layer --------
def _read_qwen3_moe(r: Reader, common: dict[str, Any]) -> dict[str, Any]:
    window = r.get("sliding_window") if r.get("use_sliding_window", False) else None
    experts = _num_experts(r, "num_local_experts", "num_experts", 128)
    return dict(
        **_qwen_moe(r, common, experts, 8, 768),
        attention_bias=bool(r.get("attention_bias", False)),
        sliding_window=None if window is None else int(window),
    )


def _write_qwen3_moe(c: DecoderConfig) -> dict[str, Any]:
    return dict(
        **_write_qwen_moe(c),
        # transformers 5 writes `num_local_experts`; 4.x reads `num_experts`
        num_local_experts=c.num_experts,
        num_experts=c.num_experts,
        attention_bias=c.attention_bias,
        use_sliding_window=c.sliding_window is not None,
        sliding_window=c.sliding_window,
    )


def _check_qwen3_moe(c: DecoderConfig) -> list[str]:
    types = layer_types(c)
    if c.sliding_window is not None and "full_attention" in types:
        return [*_has_experts(c), f"layer_types={types} (it slides on every layer)"]
    return _has_experts(c)


MIXTRAL = Arch(
    "mixtral",
    "MixtralForCausalLM",
    switches=dict(norm_topk_prob=True),
    free=_ROUTING | {"sliding_window"},
    read=_read_mixtral,
    write=_write_mixtral,
    check=_has_experts,
    theta=1000000.0,
    defaults=dict(rms_norm_eps=1e-5, max_position_embeddings=4096 * 32),
    renames=MIXTRAL_RENAMES,
)
QWEN2_MOE = Arch(
    "qwen2_moe",
    "Qwen2MoeForCausalLM",
    # a `[model]` section's attention_bias is qkv_bias: no o_proj bias with it
    switches=dict(o_proj_bias=lambda c: _qkv_only(c.attention_bias, c.o_proj_bias)),
    free=_QWEN
    | {"shared_expert_intermediate_size", "attention_bias"}
    | {"sliding_window", "layer_types"},
    read=_read_qwen2_moe,
    write=_write_qwen2_moe,
    check=_check_qwen2_moe,
    defaults=dict(max_position_embeddings=32768),
    renames=QWEN_RENAMES,
)
QWEN3_MOE = Arch(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    switches=dict(qk_norm="head"),
    free=_QWEN | {"attention_bias", "sliding_window", "layer_types"},
    read=_read_qwen3_moe,
    write=_write_qwen3_moe,
    check=_check_qwen3_moe,
    defaults=dict(max_position_embeddings=32768),
    renames=QWEN_RENAMES,
)
ARCHS = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)
