"""The Llama names of the shared decoder (`eqtrain.models.decoder`): `Llama` is
`Decoder` and `LlamaConfig` is `DecoderConfig`, whose defaults are Llama's.
Mistral, Qwen2 and the other Llama-like families are the same classes with other
switches (their Hugging Face mappings: `eqtrain.models.archs`)."""

from ._decoder_blocks import (
    Attention as LlamaAttention,
    DecoderLayer as LlamaDecoderLayer,
)
from ._decoder_config import (
    DecoderConfig as LlamaConfig,
    flops_per_token as flops_per_token,
)
from ._decoder_mlps import GatedMLP as LlamaMLP
from ._layers import head_weight as head_weight
from ._options import RUNTIME_OPTIONS as RUNTIME_OPTIONS
from .decoder import Decoder as Llama, tensor_parallel_rules as tensor_parallel_rules


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
