"""Models: plain Equinox modules with a frozen config dataclass each, built from
`(config, key)`.

- `eqtrain.models.decoder`: `Decoder`, `DecoderConfig`, one decoder for every
  Llama-like Hugging Face family (Llama, Mistral, Qwen2, Qwen3, SmolLM3, Gemma 1/2/3,
  Phi-3, OLMo 2, Granite, StarCoder2; with experts Mixtral, Qwen2-MoE and
  Qwen3-MoE: `SparseMoE`), told apart by the config's switches;
  `eqtrain.models.archs` maps each `model_type` to them (`ARCHS`);
  `eqtrain.models.llama`: the same classes as `Llama`, `LlamaConfig`;
- `eqtrain.models.gpt2`: `GPT2`, `GPT2Config`;
- `eqtrain.models.mlp`: `MLPClassifier`, `MLPConfig`.

Sequence parallelism (`sequence_attention`, `SCHEMES`): set a model's
`sequence_parallel` option and trace its step under the mesh
(`under_mesh(step, mesh)`); `sequence_rows` adds `positions` (and the zigzag
layout) to LM rows.

Each submodule also has `flops_per_token(config, seq_len)`. The language models
(the decoder, GPT-2) have one registry entry each, which owns the `[model]` config
section both ways, FLOPs, tensor-parallel rules and the Hugging Face names of every
`model_type` it covers:

    fam = models.family("gemma2")           # any model_type, a config, or a model
    model = fam.model(fam.from_section(section, vocab_size=259, max_seq_len=128), key)
"""

from . import gpt2 as gpt2, llama as llama, mlp as mlp
from ._layers import (
    Linear as Linear,
    LoRALinear as LoRALinear,
    as_dtype as as_dtype,
    num_params as num_params,
)
from ._moe import (
    AUX_KEYS as AUX_KEYS,
    MOE_IMPLS as MOE_IMPLS,
    Experts as Experts,
    SparseMoE as SparseMoE,
    active_params as active_params,
    load_balancing_loss as load_balancing_loss,
    router_terms as router_terms,
    router_z_loss as router_z_loss,
)
from ._registry import (
    FAMILIES as FAMILIES,
    Family as Family,
    HFNames as HFNames,
    family as family,
    moe_options as moe_options,
    runtime_options as runtime_options,
)
from ._sequence import (
    LAYOUTS as LAYOUTS,
    SCHEMES as SCHEMES,
    check_sequence as check_sequence,
    position_mask as position_mask,
    sequence_attention as sequence_attention,
    sequence_ways as sequence_ways,
    under_mesh as under_mesh,
)
from ._sequence_rows import (
    sequence_rows as sequence_rows,
    zigzag_order as zigzag_order,
)
from ._stack import (
    CHECKPOINT_NAMES as CHECKPOINT_NAMES,
    REMAT_PRESETS as REMAT_PRESETS,
    check_remat as check_remat,
    remat_policy as remat_policy,
)
from ._vocab import resize_vocab as resize_vocab
from .decoder import Decoder as Decoder, DecoderConfig as DecoderConfig
from .gpt2 import GPT2 as GPT2, GPT2Config as GPT2Config
from .llama import Llama as Llama, LlamaConfig as LlamaConfig
from .mlp import MLPClassifier as MLPClassifier, MLPConfig as MLPConfig
