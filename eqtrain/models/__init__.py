"""Models: plain Equinox modules with a frozen config dataclass each, built from
`(config, key)`.

- `eqtrain.models.llama`: `Llama`, `LlamaConfig` (Llama, Mistral, Qwen2);
- `eqtrain.models.gpt2`: `GPT2`, `GPT2Config`;
- `eqtrain.models.mlp`: `MLPClassifier`, `MLPConfig`.

Each submodule also has `flops_per_token(config, seq_len)`.
"""

from . import gpt2 as gpt2, llama as llama, mlp as mlp
from ._layers import (
    REMAT_POLICIES as REMAT_POLICIES,
    as_dtype as as_dtype,
    num_params as num_params,
)
from .gpt2 import GPT2 as GPT2, GPT2Config as GPT2Config
from .llama import Llama as Llama, LlamaConfig as LlamaConfig
from .mlp import MLPClassifier as MLPClassifier, MLPConfig as MLPConfig
