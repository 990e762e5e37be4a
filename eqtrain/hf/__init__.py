"""Hugging Face interop: `export` writes an eqtrain model as the directory
`transformers`' `save_pretrained` would write (safetensors, config.json,
generation_config.json, tokenizer files); `load` reads such a directory back
(safetensors only, strictly). Architectures: the decoder families of
`eqtrain.models.archs` (`llama`, `mistral`, `qwen2`, `qwen3`, `smollm3`, `gemma`,
`gemma2`, `gemma3_text`, `phi3`, `olmo2`, `granite`, `starcoder2`, and the mixtures
of experts `mixtral`, `qwen2_moe`, `qwen3_moe`) and `gpt2`.
LoRA adapters go both ways in PEFT's format: `export_adapter`, `load_adapter`.
"""

from ..config import parse_size as parse_size
from ._errors import (
    HFExportExistsError as HFExportExistsError,
    HFExportWarning as HFExportWarning,
    HFFileNotFoundError as HFFileNotFoundError,
    HFFormatError as HFFormatError,
)
from ._export import export as export
from ._hook import export_hook as export_hook
from ._load import (
    content_hash as content_hash,
    generation_eos as generation_eos,
    load as load,
    load_config as load_config,
    tokenizer_for as tokenizer_for,
)
from ._maps import ARCHS as ARCHS, infer_model_type as infer_model_type
from ._peft import export_adapter as export_adapter
from ._peft_load import (
    adapter_base as adapter_base,
    adapter_spec as adapter_spec,
    load_adapter as load_adapter,
)
