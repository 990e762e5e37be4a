"""The Llama names of the shared decoder (`eqtrain.models.decoder`): `Llama` is
`Decoder` and `LlamaConfig` is `DecoderConfig`, whose defaults are Llama's.
Mistral, Qwen2 and the other Llama-like families are the same classes with other
switches (their Hugging Face mappings: `eqtrain.models.archs`)."""

from ._layers import head_weight as head_weight
from .decoder import (
    RUNTIME_OPTIONS as RUNTIME_OPTIONS,
    Attention as LlamaAttention,
    Decoder as Llama,
    DecoderConfig as LlamaConfig,
    DecoderLayer as LlamaDecoderLayer,
    GatedMLP as LlamaMLP,
    flops_per_token as flops_per_token,
    tensor_parallel_rules as tensor_parallel_rules,
)


__all__ = [
    "RUNTIME_OPTIONS",
    "Llama",
    "LlamaAttention",
    "LlamaConfig",
    "LlamaDecoderLayer",
    "LlamaMLP",
    "flops_per_token",
    "head_weight",
    "tensor_parallel_rules",
]
