"""Hugging Face config translation both ways, and the map between eqtrain's
(stacked) parameter paths and Hugging Face tensor names.

The architectures, their tensor names (`HFNames`: prefix, stacked layers, GPT-2's
`Conv1D` leaves) and the model type a config exports as come from the model
families' registry (`eqtrain.models.family`); this module adds what is specific
to Hugging Face's `config.json`.
"""

import importlib.metadata
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
import numpy as np

from .._errors import ConfigError
from ..models import FAMILIES, GPT2Config, HFNames, LlamaConfig, family
from ..models.gpt2 import ACTIVATIONS as GPT2_ACTIVATIONS
from ._errors import HFFormatError


Arch = HFNames  # how one Hugging Face architecture names an eqtrain model's tensors
# Every architecture of every family, by Hugging Face `model_type`.
ARCHS: dict[str, HFNames] = {
    t: names for fam in FAMILIES.values() for t, names in fam.hf.items()
}

DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def infer_model_type(config: Any, model_type: str | None) -> str:
    """The Hugging Face `model_type` of an eqtrain config (see `eqtrain.hf.export`)."""
    fam = next((f for f in FAMILIES.values() if isinstance(config, f.config)), None)
    if fam is None:
        names = " or ".join(f"`{f.config.__name__}`" for f in FAMILIES.values())
        raise ConfigError(
            f"`eqtrain.hf` exports Llama-family and GPT-2 models; got a config of "
            f"type {type(config).__name__}. Pass the model's {names} (`model.config`)."
        )
    inferred = fam.model_type_of(config)
    model_type = model_type or inferred
    if model_type not in ARCHS:
        raise ConfigError(
            f"unknown `model_type` {model_type!r}; eqtrain.hf supports {sorted(ARCHS)}."
        )
    if model_type not in fam.hf:
        raise ConfigError(
            f"a {type(config).__name__} cannot be exported as {model_type!r}; "
            f"use model_type={inferred!r} (or None to infer it)."
        )
    _check_expressible(config, model_type)
    return model_type


def _check_expressible(config: Any, model_type: str) -> None:
    if family(model_type).name != "llama":
        return
    qkv, o = config.attention_bias, config.attention_bias
    if config.o_proj_bias is not None:
        o = config.o_proj_bias
    problems = {
        "llama": [
            (qkv != o, "q/k/v and o_proj biases differ (Llama has both or neither)"),
            (config.sliding_window is not None, "a sliding window"),
        ],
        "mistral": [(qkv or o or config.mlp_bias, "biases (Mistral has none)")],
        "qwen2": [
            (not qkv or o, "not q/k/v biases without an o_proj bias"),
            (config.mlp_bias, "MLP biases"),
            (config.sliding_window is not None, "a sliding window on every layer"),
        ],
    }[model_type]
    for bad, what in problems:
        if bad:
            raise ConfigError(
                f"this LlamaConfig has {what}, which HF's {model_type!r} cannot "
                f"express; pass another model_type (or None to infer it): qkv "
                f"bias={qkv}, o_proj bias={o}, mlp_bias={config.mlp_bias}, "
                f"sliding_window={config.sliding_window}."
            )


# -- config.json -----------------------------------------------------------------------
def hf_config(
    config: Any, model_type: str, dtype: str, bos: int | None, eos: int | None
) -> dict[str, Any]:
    """`config.json` as `save_pretrained` writes it (transformers 5), plus the
    transformers 4 spellings `rope_theta` and `torch_dtype`."""
    common: dict[str, Any] = {
        "architectures": [ARCHS[model_type].architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "initializer_range": float(config.initializer_range),
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": None,
        "tie_word_embeddings": True,
        "use_cache": True,
        "dtype": dtype,
        "torch_dtype": dtype,
    }
    to_hf = {"gpt2": _gpt2_config, "llama": _llama_config}[family(model_type).name]
    out = {**common, **to_hf(config, model_type)}
    version = _transformers_version()
    if version:
        out["transformers_version"] = version
    return dict(sorted(out.items()))


def _gpt2_config(c: GPT2Config, model_type: str) -> dict[str, Any]:
    return {
        "activation_function": c.activation_function,
        "n_positions": c.n_positions,
        "n_embd": c.n_embd,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": c.n_inner,
        "layer_norm_epsilon": float(c.layer_norm_epsilon),
        # eqtrain's GPT-2 has no dropout; the export says so.
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "scale_attn_weights": c.scale_attn_weights,
        "scale_attn_by_inverse_layer_idx": c.scale_attn_by_inverse_layer_idx,
        "reorder_and_upcast_attn": c.reorder_and_upcast_attn,
        "add_cross_attention": False,
        "tie_word_embeddings": c.tie_word_embeddings,
    }


def _llama_config(c: LlamaConfig, model_type: str) -> dict[str, Any]:
    theta = float(c.rope_theta)
    out: dict[str, Any] = {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": float(c.rms_norm_eps),
        "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
        "rope_theta": theta,
        "attention_dropout": 0.0,
        "tie_word_embeddings": c.tie_word_embeddings,
    }
    if model_type == "llama":
        out.update(
            attention_bias=c.attention_bias, mlp_bias=c.mlp_bias, pretraining_tp=1
        )
    elif model_type == "mistral":
        out.update(sliding_window=c.sliding_window)
    else:
        layers = c.num_hidden_layers
        out.update(
            sliding_window=None,
            use_sliding_window=False,
            max_window_layers=layers,
            layer_types=["full_attention"] * layers,
        )
    return out


def generation_config(bos: int | None, eos: int | None) -> dict[str, Any]:
    """`generation_config.json` as `save_pretrained` writes it."""
    out: dict[str, Any] = {"_from_model_config": True}
    if bos is not None:
        out["bos_token_id"] = bos
    if eos is not None:
        out["eos_token_id"] = eos
    out.update(output_attentions=False, output_hidden_states=False, use_cache=True)
    version = _transformers_version()
    if version:
        out["transformers_version"] = version
    return out


def _transformers_version() -> str | None:
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return None


# -- config.json -> eqtrain config -----------------------------------------------------
def eqtrain_config(hf: dict[str, Any], path: str, param_dtype: str) -> tuple[str, Any]:
    """`(model_type, eqtrain config)` for a parsed `config.json`."""
    model_type = hf.get("model_type")
    if model_type not in ARCHS:
        raise HFFormatError(
            f"{path}: unknown model_type {model_type!r}; eqtrain.hf loads "
            f"{sorted(ARCHS)}. Another architecture needs a model family "
            "(eqtrain/models/_registry.py) and its config.json map here."
        )
    from_hf = {"gpt2": _gpt2_from_hf, "llama": _llama_from_hf}[family(model_type).name]
    try:
        return model_type, from_hf(hf, model_type, path, param_dtype)
    except KeyError as error:
        raise HFFormatError(
            f"{path}: the {model_type} config has no {error.args[0]!r}; it is needed "
            "to build the model. Add it to config.json."
        ) from None


def _require(path: str, what: str, ok: bool, got: Any) -> None:
    if not ok:
        raise HFFormatError(
            f"{path}: eqtrain's model does not support {what} (got {got!r}); this "
            "checkpoint cannot be loaded exactly."
        )


def _gpt2_from_hf(
    hf: dict[str, Any], model_type: str, path: str, param_dtype: str
) -> GPT2Config:
    # Absent keys take transformers' GPT2Config defaults.
    act = hf.get("activation_function", "gelu_new")
    _require(
        path,
        "this activation_function (it takes the parameter-free ones of "
        f"transformers' ACT2FN: {', '.join(sorted(GPT2_ACTIVATIONS))})",
        act in GPT2_ACTIVATIONS,
        act,
    )
    cross = hf.get("add_cross_attention", False)
    _require(
        path,
        "cross-attention (add_cross_attention: an encoder-decoder's decoder, "
        "which needs encoder states)",
        not cross,
        cross,
    )
    return GPT2Config(
        vocab_size=int(hf["vocab_size"]),
        n_positions=int(hf.get("n_positions", 1024)),
        n_embd=int(hf["n_embd"]),
        n_layer=int(hf["n_layer"]),
        n_head=int(hf["n_head"]),
        n_inner=hf.get("n_inner"),
        layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        activation_function=act,
        scale_attn_weights=bool(hf.get("scale_attn_weights", True)),
        scale_attn_by_inverse_layer_idx=bool(
            hf.get("scale_attn_by_inverse_layer_idx", False)
        ),
        reorder_and_upcast_attn=bool(hf.get("reorder_and_upcast_attn", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        param_dtype=param_dtype,
    )


def _rope_theta(hf: dict[str, Any], path: str) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    _require(path, "RoPE scaling", kind == "default", kind)
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _llama_from_hf(
    hf: dict[str, Any], model_type: str, path: str, param_dtype: str
) -> LlamaConfig:
    act = hf.get("hidden_act", "silu")
    _require(path, "activations other than silu", act == "silu", act)
    heads = int(hf["num_attention_heads"])
    bias = o_bias = mlp_bias = False
    window = None
    if model_type == "llama":
        bias = o_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False))
    elif model_type == "mistral":
        window = hf.get("sliding_window")
    else:
        bias, o_bias = True, False
        sliding = hf.get("use_sliding_window", False)
        _require(path, "Qwen2's per-layer sliding windows", not sliding, sliding)
    # Values equal to their defaults are written as `None`, as a hand-written
    # LlamaConfig would have them, so that a round trip gives an equal config.
    hidden = int(hf["hidden_size"])
    kv = int(hf.get("num_key_value_heads") or heads)
    head_dim = hf.get("head_dim")
    if head_dim is not None and hidden % heads == 0 and head_dim == hidden // heads:
        head_dim = None
    return LlamaConfig(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_hidden_layers=int(hf["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=None if kv == heads else kv,
        head_dim=None if head_dim is None else int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(hf, path),
        attention_bias=bias,
        o_proj_bias=None if o_bias == bias else o_bias,
        mlp_bias=mlp_bias,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        sliding_window=window,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        param_dtype=param_dtype,
    )


def model_class(config: Any) -> Any:
    return family(config).model


# -- parameter names -------------------------------------------------------------------
def _is_leaf_array(x: Any) -> bool:
    return eqx.is_array(x) or isinstance(x, np.ndarray) or is_struct(x)


def is_struct(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not eqx.is_array(x)


def leaves(model: Any) -> Iterator[tuple[str, Any]]:
    """`(eqtrain path, leaf)` for every array (or `ShapeDtypeStruct`) of a model."""
    flat, _ = jtu.tree_flatten_with_path(model)
    for path, leaf in flat:
        if _is_leaf_array(leaf):
            yield jtu.keystr(path, simple=True, separator="."), leaf


def hf_names(arch: Arch, path: str, num_layers: int) -> list[str]:
    """The Hugging Face tensor names of one eqtrain leaf (one per layer if stacked)."""
    head, _, rest = path.partition(".")
    if head == arch.layers:
        return [f"{arch.prefix}{head}.{i}.{rest}" for i in range(num_layers)]
    if head == "lm_head":
        return [path]
    return [arch.prefix + path]


def is_conv1d(arch: Arch, path: str) -> bool:
    """Whether a leaf is stored transposed (`[in, out]`) by Hugging Face."""
    head, _, rest = path.partition(".")
    return head == arch.layers and rest in arch.conv1d
