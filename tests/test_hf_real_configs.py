"""The configs people have, not the fixtures: for every family, the config
transformers writes by default (only the sizes set) and the config.json of a
published checkpoint (sizes scaled down, every other key as published), through
`eqtrain import` and `eqtrain export`, against transformers' logits.

A published config is written over the `save_pretrained` directory of a random
model built from it, as a Hub download has it (transformers 4.x keys:
`rope_scaling`, top-level `rope_theta`, `torch_dtype`). Scaled down: the hidden,
intermediate and expert widths, the heads, layers (and the layer lists with
them), the vocabulary (with the token ids in it) and the longrope factor lists
(one per rotating pair of the smaller heads); positions only where they size a
tensor (GPT-2), so rope scaling keeps its published ratios. Windows stay as
published, so at these lengths no window bites: windows' parity is
tests/test_hf_families.py's.
"""

import contextlib
import json

import pytest


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from eqtrain import job  # noqa: E402

from . import _hf_families as F  # noqa: E402
from .test_failures_inputs import invoke  # noqa: E402


torch.set_num_threads(1)
VOCAB = 320  # above the byte tokenizer's 259 ids (`eqtrain import`'s "auto")
LENGTH = 12
_SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# A pad id is the embedding's padding row (`padding_idx`), so it must be inside the
# scaled vocabulary; bos and eos ids stay as published (beyond it).
PAD = VOCAB - 1

# transformers' config classes with only the sizes (and token ids inside the
# vocabulary, where the default lies outside) set.
DEFAULTS: dict[str, dict] = {
    "llama": _SIZES,
    "mistral": _SIZES,
    "qwen2": _SIZES,
    "qwen3": dict(_SIZES, head_dim=16),
    "smollm3": dict(_SIZES, num_hidden_layers=4, **_IDS),
    "gemma": dict(_SIZES, head_dim=16),
    "gemma2": dict(_SIZES, head_dim=16),
    "gemma3_text": dict(_SIZES, head_dim=16, num_hidden_layers=7),
    "phi3": dict(_SIZES, **_IDS),
    "olmo2": dict(_SIZES, **_IDS),
    "granite": _SIZES,
    "starcoder2": dict(_SIZES, **_IDS),
    "mixtral": dict(_SIZES, num_local_experts=4),
    "qwen2_moe": dict(
        _SIZES,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "qwen3_moe": dict(
        _SIZES,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
    "gpt2": dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    | dict(bos_token_id=1, eos_token_id=2),
}


def _longrope(pairs, short_step, long_step):
    """A longrope factor list per rotating pair (the published lists, 48 long,
    have one per pair of the full-size heads)."""
    short = [round(1.0 + short_step * i, 4) for i in range(pairs)]
    long = [round(1.0 + long_step * i * i, 4) for i in range(pairs)]
    return dict(short_factor=short, long_factor=long)


PUBLISHED: dict[str, dict] = {
    "meta-llama/Llama-3.2-1B": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "mistralai/Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.34.0.dev0",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "Qwen/Qwen2.5-0.5B": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 32768,
        "max_window_layers": 2,
        "model_type": "qwen2",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "use_cache": True,
        "use_mrope": False,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    },
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 40960,
        "max_window_layers": 2,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    },
    "HuggingFaceTB/SmolLM3-3B": {
        "architectures": ["SmolLM3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": 128012,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "layer_types": ["full_attention"] * 4,
        "max_position_embeddings": 65536,
        "max_window_layers": 4,
        "mlp_bias": False,
        "model_type": "smollm3",
        "no_rope_layer_interval": 4,
        "no_rope_layers": [1, 1, 1, 0],
        "num_attention_heads": 4,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "pad_token_id": PAD,  # 128004: the embedding's padding row
        "pretraining_tp": 2,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 5000000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.54.0.dev0",
        "use_cache": False,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    },
    "google/gemma-2b": {
        "architectures": ["GemmaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "head_dim": 16,
        "hidden_act": "gelu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 8192,
        "model_type": "gemma",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 1,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.38.0.dev0",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "google/gemma-2-2b": {
        "architectures": ["Gemma2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": 1,
        "final_logit_softcapping": 30.0,
        "head_dim": 32,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 8192,
        "model_type": "gemma2",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "torch_dtype": "float32",
        "transformers_version": "4.42.4",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "google/gemma-3-1b-pt": {
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": 1,
        "final_logit_softcapping": None,
        "head_dim": 32,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 32768,
        "model_type": "gemma3_text",
        "num_attention_heads": 4,
        "num_hidden_layers": 7,
        "num_key_value_heads": 1,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "microsoft/Phi-3-mini-4k-instruct": {
        "_name_or_path": "Phi-3-mini-4k-instruct",
        "architectures": ["Phi3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_phi3.Phi3Config",
            "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
        },
        "bos_token_id": 1,
        "embd_pdrop": 0.0,
        "eos_token_id": 32000,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 4096,
        "model_type": "phi3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "original_max_position_embeddings": 4096,
        "pad_token_id": PAD,  # 32000
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": 2047,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.2",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "microsoft/Phi-4-mini-instruct": {
        "architectures": ["Phi3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_phi3.Phi3Config",
            "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
            "AutoTokenizer": "Xenova/gpt-4o",
        },
        "bos_token_id": 199999,
        "embd_pdrop": 0.0,
        "eos_token_id": 199999,
        "full_attn_mod": 1,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "interpolate_factor": 1,
        "lm_head_bias": False,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "phi3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "original_max_position_embeddings": 4096,
        "pad_token_id": PAD,  # 199999
        "partial_rotary_factor": 0.75,
        "resid_pdrop": 0.0,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {"type": "longrope", **_longrope(6, 0.02, 0.9)},
        "rope_theta": 10000.0,
        "sliding_window": 262144,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "allenai/OLMo-2-0425-1B": {
        "architectures": ["Olmo2ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "eos_token_id": 100257,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 4096,
        "model_type": "olmo2",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "pad_token_id": PAD,  # 100277
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 500000,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.48.3",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "ibm-granite/granite-3.0-2b-base": {
        "architectures": ["GraniteForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.1,
        "attention_multiplier": 0.015625,
        "bos_token_id": 0,
        "embedding_multiplier": 12.0,
        "eos_token_id": 0,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "logits_scaling": 8.0,
        "max_position_embeddings": 4096,
        "mlp_bias": False,
        "model_type": "granite",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pad_token_id": 0,
        "residual_multiplier": 0.22,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.0.dev0",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "bigcode/starcoder2-3b": {
        "architectures": ["Starcoder2ForCausalLM"],
        "attention_dropout": 0.1,
        "residual_dropout": 0.1,
        "embedding_dropout": 0.1,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "initializer_range": 0.018042,
        "intermediate_size": 96,
        "max_position_embeddings": 16384,
        "mlp_type": "default",
        "model_type": "starcoder2",
        "norm_epsilon": 1e-05,
        "norm_type": "layer_norm",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rope_theta": 999999.4420358813,
        "sliding_window": 4096,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.37.0.dev0",
        "use_bias": True,
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "mistralai/Mixtral-8x7B-v0.1": {
        "architectures": ["MixtralForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 32768,
        "model_type": "mixtral",
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-05,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.36.0.dev0",
        "use_cache": True,
        "vocab_size": VOCAB,
    },
    "Qwen/Qwen1.5-MoE-A2.7B": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 8192,
        "max_window_layers": 2,
        "model_type": "qwen2_moe",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.39.0.dev0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 96,
        "num_experts_per_tok": 2,
        "num_experts": 4,
        "norm_topk_prob": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    },
    "Qwen/Qwen3-30B-A3B": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "decoder_sparse_step": 1,
        "eos_token_id": 151645,
        "head_dim": 32,
        "hidden_act": "silu",
        "hidden_size": 64,
        "initializer_range": 0.02,
        "intermediate_size": 96,
        "max_position_embeddings": 40960,
        "max_window_layers": 2,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "num_attention_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    },
    "openai-community/gpt2": {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1,
        "bos_token_id": 50256,
        "embd_pdrop": 0.1,
        "eos_token_id": 50256,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": 64,
        "n_embd": 64,
        "n_head": 4,
        "n_layer": 2,
        "n_positions": 64,
        "resid_pdrop": 0.1,
        "summary_activation": None,
        "summary_first_dropout": 0.1,
        "summary_proj_to_labels": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "task_specific_params": {
            "text-generation": {"do_sample": True, "max_length": 50}
        },
        "vocab_size": VOCAB,
    },
}
CASES = [pytest.param("default", t, id=f"default-{t}") for t in DEFAULTS] + [
    pytest.param("published", name, id=name.split("/")[1]) for name in PUBLISHED
]


def test_every_family_has_a_default_and_a_published_config():
    from eqtrain import hf

    assert set(DEFAULTS) == set(hf.ARCHS)
    assert {c["model_type"] for c in PUBLISHED.values()} == set(hf.ARCHS)


# -- helpers ---------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet():
    logging = transformers.utils.logging
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.enable_progress_bar()
        logging.set_verbosity(verbosity)


def _hf_config(kind, name, tmp_path):
    """transformers' config of a case (a published one read from its file, as
    `from_pretrained` reads a Hub download)."""
    if kind == "default":
        return transformers.AutoConfig.for_model(name, **DEFAULTS[name])
    source = tmp_path / "published"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(PUBLISHED[name]))
    return transformers.AutoConfig.from_pretrained(source)


def _saved(kind, name, tmp_path):
    """A random float32 model of the case, saved as a Hub download has it; the
    model (eval mode, eager attention)."""
    config = _hf_config(kind, name, tmp_path)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    F._randomize(model, 0)
    path = tmp_path / "hf"
    model.save_pretrained(path)
    if kind == "published":  # the file as published, not as transformers 5 writes it
        (path / "config.json").write_text(json.dumps(PUBLISHED[name], indent=2))
    return path, model.eval()


def _eqtrain_logits(run, tokens):
    """The imported run's model (its step-0 checkpoint) on `tokens`, op by op
    (no compile per case: the ops' shapes repeat across the cases); experts
    dispatched densely, the reference (tests/test_moe.py compares the others)."""
    job_, state = job.restore_run(run)
    # on one device: the ops of a model spread over the 8 test devices cost more
    model = jax.device_put(job_.exported(state.model), jax.devices()[0])
    if getattr(model.config, "num_experts", 0):
        model = model.with_options(moe_impl="dense")
    return np.asarray(model(jnp.asarray(tokens)), np.float32)


def _hf_logits(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(tokens)[None]).logits[0].numpy()


# config.json keys an import and export need not keep: the run's own (token
# ids: its tokenizer's; `dtype`: `model.param_dtype`; `use_cache`), dropout
# (eqtrain has none: export writes 0.0, docs/hf.md) and `max_window_layers`
# (`layer_types`, compared, says which layers slide).
NOT_KEPT = {"_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id"}
NOT_KEPT |= {"dtype", "use_cache", "max_window_layers"}
NOT_KEPT |= {"attention_dropout", "embedding_dropout", "residual_dropout"}
NOT_KEPT |= {"attn_pdrop", "embd_pdrop", "resid_pdrop"}


def _changed(before, after):
    """The keys of transformers' config `before` that `after` (the export's)
    gives another value, among those its class has (a published file's extra
    keys, which transformers' model never reads, are not written back)."""
    a, b = _standard(before), _standard(after)
    return {k: (a[k], b[k]) for k in a.keys() & b.keys() - NOT_KEPT if a[k] != b[k]}


def _standard(config):
    """`config.to_dict()` with defaults in one spelling: a null `head_dim`
    filled in, the legacy `type` of a rope dict dropped beside `rope_type`,
    longrope's default `factor` filled in."""
    out = config.to_dict()
    if "head_dim" in out and out["head_dim"] is None:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    params = out.get("rope_parameters") or {}
    for rope in [p for p in params.values() if isinstance(p, dict)] or [params]:
        if "rope_type" in rope:
            rope.pop("type", None)
        if rope.get("rope_type") == "longrope" and "factor" not in rope:
            original = rope["original_max_position_embeddings"]
            rope["factor"] = out["max_position_embeddings"] / original
    return out


def _rel_err(ours, theirs):
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


# -- the test --------------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "name"), CASES)
def test_import_and_export_match_transformers(kind, name, tmp_path):
    with _quiet():
        path, model = _saved(kind, name, tmp_path)
    tokens = np.random.default_rng(0).integers(0, VOCAB, LENGTH)
    theirs = _hf_logits(model, tokens)

    # SGD: no optimizer state to place and save (the model is what is tested)
    result = invoke("import", path, tmp_path / "run", "--set", "optim.name=sgd")
    assert result.exit_code == 0, result.output
    # float32 noise is <= 1.5e-5 of max|logit| (tests/_hf_families.py)
    assert _rel_err(_eqtrain_logits(tmp_path / "run", tokens), theirs) <= 1e-4

    result = invoke("export", tmp_path / "run", tmp_path / "out")
    assert result.exit_code == 0, result.output
    with _quiet():
        again = F.load(tmp_path / "out")  # strictly: no missing/unexpected keys
    np.testing.assert_allclose(_hf_logits(again, tokens), theirs, rtol=1e-5, atol=1e-5)
    # what the logits of 12 tokens cannot show (windows, long-context rope, ...)
    assert _changed(model.config, again.config) == {}


def test_a_qwen2_moe_section_with_attention_bias_has_qkv_biases_only():
    """`[model]` arch = qwen2_moe with attention_bias (what `eqtrain import`
    writes for a default Qwen2-MoE) is Qwen2-MoE's `qkv_bias`: no o_proj bias."""
    import dataclasses

    from eqtrain import hf, models
    from eqtrain.config import ModelConfig

    section = dataclasses.replace(
        ModelConfig(),
        arch="qwen2_moe",
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_experts=4,
        expert_size=16,
        shared_expert_size=24,
        attention_bias=True,
    )
    config = models.family("qwen2_moe").from_section(
        section, vocab_size=64, max_seq_len=32
    )
    assert config.attention_bias and config.o_proj_bias is False
    assert hf.infer_model_type(config, None) == "qwen2_moe"
