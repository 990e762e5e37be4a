"""Hugging Face config translation both ways, and the map between eqtrain's
(stacked) parameter paths and Hugging Face tensor names.

The architectures, their tensor names (`HFNames`: prefix, stacked layers, GPT-2's
`Conv1D` leaves) and the model type a config exports as come from the model
families' registry (`eqtrain.models.family`); this module adds what is specific
to Hugging Face's `config.json`.
"""

import dataclasses
import importlib.metadata
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax.tree_util as jtu
import numpy as np

from .._errors import ConfigError
from ..models import FAMILIES, GPT2Config, HFNames, family
from ..models.archs import ARCHS as DECODER_ARCHS, HFConfigError, Reader
from ..models.gpt2 import ACTIVATIONS as GPT2_ACTIVATIONS
from ._errors import HFFormatError


Arch = HFNames  # how one Hugging Face architecture names an eqtrain model's tensors
# Every architecture of every family, by Hugging Face `model_type`.
ARCHS: dict[str, HFNames] = {
    t: names for fam in FAMILIES.values() for t, names in fam.hf.items()
}

DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def infer_model_type(config: Any, model_type: str | None) -> str:
    """The Hugging Face `model_type` of an eqtrain config (see `eqtrain.hf.export`):
    `model_type`, else the config's own (`DecoderConfig.model_type`), else the
    first architecture that expresses it."""
    fam = _family(config)
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
    _check_expressed(config, model_type, inferred)
    return model_type


def _family(config: Any) -> Any:
    """The model family whose config `config` is."""
    fam = next((f for f in FAMILIES.values() if isinstance(config, f.config)), None)
    if fam is None:
        names = " or ".join(f"`{f.config.__name__}`" for f in FAMILIES.values())
        raise ConfigError(
            f"`eqtrain.hf` exports the decoder families and GPT-2; got a config of "
            f"type {type(config).__name__}. Pass the model's {names} (`model.config`)."
        )
    return fam


def _check_expressed(config: Any, model_type: str, inferred: str) -> None:
    """HF's `model_type` can express everything `config` sets."""
    arch = DECODER_ARCHS.get(model_type)
    problems = [] if arch is None else arch.problems(config)
    if problems:
        raise ConfigError(
            f"this {type(config).__name__} has {'; '.join(problems)}, which HF's "
            f"{model_type!r} cannot express; pass another model_type (or None to "
            f"infer it: {inferred!r})."
        )


# -- config.json -----------------------------------------------------------------------
def hf_config(
    config: Any, model_type: str, dtype: str, bos: int | None, eos: int | None
) -> dict[str, Any]:
    """`config.json` as `save_pretrained` writes it (transformers 5), plus the
    transformers 4 spellings `rope_theta` and `torch_dtype`."""
    common = _common_config(config, model_type, dtype, bos, eos)
    if model_type in DECODER_ARCHS:
        out = {**common, **DECODER_ARCHS[model_type].to_hf(config)}
    else:
        out = {**common, **_gpt2_config(config, model_type)}
    return dict(sorted(_with_version(out).items()))


def _common_config(
    config: Any, model_type: str, dtype: str, bos: int | None, eos: int | None
) -> dict[str, Any]:
    """The keys of config.json every architecture has."""
    return {
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


def generation_config(bos: int | None, eos: int | None) -> dict[str, Any]:
    """`generation_config.json` as `save_pretrained` writes it."""
    out: dict[str, Any] = {"_from_model_config": True}
    if bos is not None:
        out["bos_token_id"] = bos
    if eos is not None:
        out["eos_token_id"] = eos
    out.update(output_attentions=False, output_hidden_states=False, use_cache=True)
    return _with_version(out)


def _with_version(content: dict[str, Any]) -> dict[str, Any]:
    """`content` with the installed `transformers_version`, as transformers writes
    it (nothing without transformers)."""
    try:
        version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return content
    return {**content, "transformers_version": version} if version else content


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
    try:
        if model_type in DECODER_ARCHS:
            return model_type, _decoder_from_hf(hf, model_type, path, param_dtype)
        return model_type, _gpt2_from_hf(hf, model_type, path, param_dtype)
    except HFConfigError as error:
        raise HFFormatError(str(error)) from None
    except KeyError as error:
        raise HFFormatError(
            f"{path}: the {model_type} config has no {error.args[0]!r}; it is needed "
            "to build the model. Add it to config.json."
        ) from None


def _decoder_from_hf(
    hf: dict[str, Any], model_type: str, path: str, param_dtype: str
) -> Any:
    config = DECODER_ARCHS[model_type].from_hf(Reader(hf, path), param_dtype)
    # Without a model_type, the config is exported as the first architecture that
    # expresses it: record the file's only if it differs.
    plain = dataclasses.replace(config, model_type=None)
    return plain if family(plain).model_type_of(plain) == model_type else config


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
    _check_gpt2(hf, path)
    return GPT2Config(
        vocab_size=int(hf["vocab_size"]),
        n_positions=int(hf.get("n_positions", 1024)),
        n_embd=int(hf["n_embd"]),
        n_layer=int(hf["n_layer"]),
        n_head=int(hf["n_head"]),
        n_inner=hf.get("n_inner"),
        layer_norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        initializer_range=float(hf.get("initializer_range", 0.02)),
        activation_function=hf.get("activation_function", "gelu_new"),
        scale_attn_weights=bool(hf.get("scale_attn_weights", True)),
        scale_attn_by_inverse_layer_idx=bool(
            hf.get("scale_attn_by_inverse_layer_idx", False)
        ),
        reorder_and_upcast_attn=bool(hf.get("reorder_and_upcast_attn", False)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        param_dtype=param_dtype,
    )


_ACTIVATION = (
    "this activation_function (it takes the parameter-free ones of transformers' "
    f"ACT2FN: {', '.join(sorted(GPT2_ACTIVATIONS))})"
)
_CROSS = (
    "cross-attention (add_cross_attention: an encoder-decoder's decoder, which "
    "needs encoder states)"
)


def _check_gpt2(hf: dict[str, Any], path: str) -> None:
    """No activation or cross-attention eqtrain's GPT-2 lacks."""
    act = hf.get("activation_function", "gelu_new")
    _require(path, _ACTIVATION, act in GPT2_ACTIVATIONS, act)
    cross = hf.get("add_cross_attention", False)
    _require(path, _CROSS, not cross, cross)


def model_class(config: Any) -> Any:
    return family(config).model


# -- parameter names -------------------------------------------------------------------
def is_struct(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype") and not eqx.is_array(x)


def leaves(model: Any) -> Iterator[tuple[str, Any]]:
    """`(eqtrain path, leaf)` for every array (or `ShapeDtypeStruct`) of a model."""
    flat, _ = jtu.tree_flatten_with_path(model)
    for path, leaf in flat:
        if eqx.is_array(leaf) or isinstance(leaf, np.ndarray) or is_struct(leaf):
            yield jtu.keystr(path, simple=True, separator="."), leaf


EXPERT = "{expert}"  # in a renamed layer tensor: one tensor per expert


def _layer_name(arch: Arch, rest: str) -> str:
    """A layer leaf's name in Hugging Face's files (`HFNames.renames`)."""
    return dict(arch.renames).get(rest, rest)


def stack_shape(arch: Arch, path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The leading axes of a leaf of `shape` that index its Hugging Face tensors:
    `()` (one tensor), `(layers,)` (one per layer) or `(layers, experts)` (one
    per layer and expert)."""
    head, _, rest = path.partition(".")
    if head != arch.layers:
        return ()
    return tuple(shape[: 2 if EXPERT in _layer_name(arch, rest) else 1])


def hf_names(
    arch: Arch, path: str, num_layers: int, num_experts: int | None = None
) -> list[str]:
    """The Hugging Face tensor names of one eqtrain leaf: one per layer if
    stacked; for a per-expert leaf (`HFNames.renames`), one per layer and expert
    in row-major order (layer 0's experts first), which needs `num_experts`."""
    head, _, rest = path.partition(".")
    if head == arch.layers:
        name = _layer_name(arch, rest)
        names = [f"{arch.prefix}{head}.{i}.{name}" for i in range(num_layers)]
        if EXPERT not in name:
            return names
        if num_experts is None:
            raise ValueError(f"`{path}` is one tensor per expert: pass num_experts")
        return [n.replace(EXPERT, str(e)) for n in names for e in range(num_experts)]
    if head == "lm_head":
        return [path]
    return [arch.prefix + path]


def indexed_names(
    arch: Arch, path: str, shape: tuple[int, ...]
) -> list[tuple[str, tuple[int, ...]]]:
    """`(Hugging Face name, index)` of each tensor of a leaf of `shape`: the index
    over its `stack_shape` axes (`()` for an unstacked leaf), row-major."""
    stack = stack_shape(arch, path, shape)
    names = hf_names(arch, path, *stack) if stack else hf_names(arch, path, 0)
    return list(zip(names, np.ndindex(*stack), strict=True))


def is_conv1d(arch: Arch, path: str) -> bool:
    """Whether a leaf is stored transposed (`[in, out]`) by Hugging Face."""
    head, _, rest = path.partition(".")
    return head == arch.layers and rest in arch.conv1d
