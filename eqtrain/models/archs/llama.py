"""Llama (1, 2, 3.x with any rope type), Mistral and Qwen2: the shared decoder's
defaults, with biases or sliding windows."""

from collections.abc import Callable
from typing import Any

from .._decoder_config import DecoderConfig
from ._common import Arch, Reader, layer_types, read_layer_types


def _biases(r: Reader, common: dict[str, Any]) -> dict[str, Any]:
    return dict(
        attention_bias=bool(r.get("attention_bias", False)),
        mlp_bias=bool(r.get("mlp_bias", False)),
    )


def _windows(
    r: Reader, common: dict[str, Any], slides: Callable[[int], bool] | None = None
) -> dict[str, Any]:
    """Qwen2/Qwen3/SmolLM3: `sliding_window` only with `use_sliding_window`, on
    the layers `slides(i)` says (Qwen's default: from `max_window_layers` on), or
    as `layer_types` says."""
    window = r.get("sliding_window") if r.get("use_sliding_window", False) else None
    if window is None:
        return {}
    layers = common["num_hidden_layers"]
    types = read_layer_types(r, layers)
    if types is None:
        first = int(r.get("max_window_layers", layers))
        slides = slides or (lambda i: i >= first)
        types = tuple(
            "sliding_attention" if slides(i) else "full_attention"
            for i in range(layers)
        )
    return dict(sliding_window=int(window), layer_types=types)


def write_windows(c: DecoderConfig) -> dict[str, Any]:
    types = layer_types(c)
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    return dict(
        sliding_window=c.sliding_window if sliding else None,
        use_sliding_window=bool(sliding),
        max_window_layers=sliding[0] if sliding else c.num_hidden_layers,
        layer_types=types,
    )


def _contiguous_windows(c: DecoderConfig) -> list[str]:
    """Sliding layers must be the last ones (`max_window_layers` on)."""
    types = layer_types(c)
    first = types.index("sliding_attention") if "sliding_attention" in types else None
    if first is not None and "full_attention" in types[first:]:
        return [f"layer_types={types} (sliding layers must come last)"]
    return []


LLAMA = Arch(
    "llama",
    "LlamaForCausalLM",
    free=frozenset({"attention_bias", "mlp_bias"}),
    read=_biases,
    write=lambda c: dict(
        attention_bias=c.attention_bias, mlp_bias=c.mlp_bias, pretraining_tp=1
    ),
)
MISTRAL = Arch(
    "mistral",
    "MistralForCausalLM",
    free=frozenset({"sliding_window"}),
    read=lambda r, c: dict(sliding_window=r.get("sliding_window")),
    write=lambda c: dict(sliding_window=c.sliding_window),
)
QWEN2 = Arch(
    "qwen2",
    "Qwen2ForCausalLM",
    switches=dict(attention_bias=True, o_proj_bias=False),
    free=frozenset({"sliding_window", "layer_types"}),
    read=_windows,
    write=write_windows,
    check=_contiguous_windows,
)
ARCHS = (LLAMA, MISTRAL, QWEN2)
