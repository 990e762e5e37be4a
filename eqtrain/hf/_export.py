"""`export`: an eqtrain model as the directory `save_pretrained` would write
(config.json, generation_config.json, safetensors, tokenizer files), atomically.
Builds on the key maps of `_maps` and the writer of `_safetensors`.
"""

import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .. import lora
from .._errors import ConfigError
from ..config import parse_size
from ..data import write_chat_templates
from ..models import as_dtype, family
from ..quantize import dequantize
from . import _maps, _safetensors
from ._json import write_json
from ._target import atomic_dir, check_target


SAFE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def export(
    model: Any,
    config: Any = None,
    out_dir: str | os.PathLike[str] = "hf",
    *,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    tokenizer: Any = None,
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
    model_type: str | None = None,
    chat_template: str | Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> str:
    """Write `model` as a Hugging Face checkpoint directory that
    `transformers.AutoModelForCausalLM.from_pretrained(out_dir)` loads exactly.

    Args:
        model: a `Decoder` (`Llama`) or `GPT2` (stacked layers).
        config: its config (`None`: `model.config`).
        out_dir: the directory to create; written to a temporary sibling and
            renamed, so it is either complete or absent.
        dtype: dtype of the written tensors (`"float32"`, `"bfloat16"`,
            `"float16"`; `None`: the model's parameter dtype).
        max_shard_size: above this (`"5GB"`, `"500MB"`, `"2GiB"` or bytes), write
            shards `model-0000k-of-0000n.safetensors` and an index.
        tokenizer: an `eqtrain.data.HFTokenizer` (its files are written) or any
            object with `bos_id`/`eos_id` (e.g. `ByteTokenizer`: ids only).
        bos_token_id, eos_token_id: override the tokenizer's ids.
        model_type: a `model_type` of `eqtrain.models.archs.ARCHS` (`"llama"`,
            `"mistral"`, `"qwen2"`, `"qwen3"`, `"smollm3"`, `"gemma"`,
            `"gemma2"`, `"gemma3_text"`, `"phi3"`, `"olmo2"`, `"granite"`,
            `"starcoder2"`, `"mixtral"`, `"qwen2_moe"`, `"qwen3_moe"`) or
            `"gpt2"`; `None` infers it: a `GPT2Config` is `gpt2`; a
            `DecoderConfig` exports as its own `model_type` when set,
            else as the first architecture of that list (`ARCHS`' order) that
            expresses it (the defaults: `llama`; with a `sliding_window`:
            `mistral`; q/k/v biases without an o_proj bias: `qwen2`). A type that
            cannot express the config (e.g. Mistral with biases) raises
            `ConfigError` naming what it lacks.
        chat_template: a Jinja chat template (e.g. the one a fine-tuning run
            rendered its data with), or several by name (`{"default": ...,
            "tool_use": ...}`, as `tokenizer.chat_template` holds them), written
            with an `HFTokenizer`'s files: as `chat_template.jinja` and
            `additional_chat_templates/<name>.jinja` (transformers 5) and in
            `tokenizer_config.json` (transformers 4: a string, or a list of
            `{name, template}`), so that `apply_chat_template` formats prompts
            (with tools: the `tool_use` one) as the model was trained.
        overwrite: replace an existing export at `out_dir`.

    Returns:
        `out_dir` as a string.
    """
    _refuse_adapters(model)
    model = dequantize(model)  # a quantized base is written as its weights
    config = model.config if config is None else config
    model_type = _maps.infer_model_type(config, model_type)
    out_dir = os.fspath(out_dir)
    check_target(out_dir, overwrite)
    tensors = hf_tensors(model, _maps.ARCHS[model_type], dtype)
    bos, eos = _special_ids(tokenizer, bos_token_id, eos_token_id)
    files = _config_files(config, model_type, tensors, bos, eos)
    limit = parse_size(max_shard_size)
    with atomic_dir(out_dir, overwrite) as tmp:
        for name, content in files.items():
            write_json(os.path.join(tmp, name), content)
        _write_weights(tmp, tensors, limit)
        write_tokenizer_files(tmp, tokenizer, chat_template)
    return out_dir


def _refuse_adapters(model: Any) -> None:
    if lora.adapter_paths(model):
        raise ConfigError(
            "this model carries LoRA adapters, which a Hugging Face model has no "
            "place for: export them in PEFT's format with `export_adapter`, or the "
            "full model with `export(lora.merge(model), ...)`."
        )


def _config_files(
    config: Any,
    model_type: str,
    tensors: dict[str, np.ndarray],
    bos: int | None,
    eos: int | None,
) -> dict[str, dict[str, Any]]:
    """config.json and generation_config.json, by file name."""
    dtype_name = _dtype_name(next(iter(tensors.values())).dtype)
    return {
        "config.json": _maps.hf_config(config, model_type, dtype_name, bos, eos),
        "generation_config.json": _maps.generation_config(bos, eos),
    }


def hf_tensors(
    model: Any, arch: _maps.Arch, dtype: str | None
) -> dict[str, np.ndarray]:
    """The model's arrays under Hugging Face names and layouts (host NumPy)."""
    target = None if dtype is None else as_dtype(dtype, field="dtype")
    out: dict[str, np.ndarray] = {}
    for path, leaf in _maps.leaves(model):
        value = _on_host(leaf, target)
        conv1d = _maps.is_conv1d(arch, path)
        # one tensor per layer (and expert) of a stacked leaf
        for name, at in _maps.indexed_names(arch, path, value.shape):
            part = value[(*at, ...)]
            out[name] = np.ascontiguousarray(part.T if conv1d else part)
    return out


def _on_host(leaf: Any, dtype: Any) -> np.ndarray:
    """`leaf` as a NumPy array, cast to `dtype` (None: as it is)."""
    value = np.asarray(jax.device_get(leaf))
    if dtype is not None and value.dtype != dtype:
        value = value.astype(dtype)
    return value


def _num_layers(config: Any) -> int:
    return family(config).num_layers(config)


def _dtype_name(dtype: Any) -> str:
    for name in _maps.DTYPE_NAMES:
        if np.dtype(as_dtype(name)) == dtype:
            return name
    raise ConfigError(
        f"cannot export parameters of dtype {dtype}; pass dtype='float32', "
        "'bfloat16' or 'float16' (CLI: --dtype; config: export.dtype)."
    )


def _special_ids(
    tokenizer: Any, bos: int | None, eos: int | None
) -> tuple[int | None, int | None]:
    if tokenizer is not None:
        bos = getattr(tokenizer, "bos_id", None) if bos is None else bos
        eos = getattr(tokenizer, "eos_id", None) if eos is None else eos
    return bos, eos


def _shards(tensors: dict[str, np.ndarray], limit: int) -> list[list[str]]:
    """Greedy split in name order, as `save_pretrained`: a new shard when the next
    tensor would pass `limit` (a tensor larger than `limit` gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_weights(directory: str, tensors: dict[str, np.ndarray], limit: int) -> None:
    meta = {"format": "pt"}
    shards = _shards(tensors, limit)
    if len(shards) == 1:
        _safetensors.write(os.path.join(directory, SAFE_NAME), tensors, meta)
        return
    weight_map = {}
    for k, names in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        _safetensors.write(
            os.path.join(directory, file), {n: tensors[n] for n in names}, meta
        )
        weight_map.update(dict.fromkeys(names, file))
    write_json(os.path.join(directory, INDEX_NAME), _shard_index(tensors, weight_map))


def _shard_index(
    tensors: dict[str, np.ndarray], weight_map: dict[str, str]
) -> dict[str, Any]:
    """model.safetensors.index.json: the totals and each tensor's shard."""
    return {
        "metadata": {
            "total_parameters": int(sum(t.size for t in tensors.values())),
            "total_size": int(sum(t.nbytes for t in tensors.values())),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    """`{"bos_token": ..., "eos_token": ..., "pad_token": ...}`, those it has."""
    names = {}
    for kind in ("bos", "eos", "pad"):
        token_id = getattr(tokenizer, f"{kind}_id", None)
        if token_id is not None:
            names[f"{kind}_token"] = tokenizer._tok.id_to_token(token_id)
    return names


def write_tokenizer_files(
    directory: str,
    tokenizer: Any,
    chat_template: str | Mapping[str, str] | None = None,
) -> None:
    """An `HFTokenizer`'s files (and the chat templates') in `directory`, as
    `export` writes them; nothing for another tokenizer (the byte one has no
    file transformers reads) or None."""
    if tokenizer is not None and hasattr(tokenizer, "_tok"):
        _write_tokenizer(directory, tokenizer, chat_template)


def _write_tokenizer(
    directory: str,
    tokenizer: Any,
    chat_template: str | Mapping[str, str] | None = None,
) -> None:
    """tokenizer.json and a `tokenizer_config.json` for `PreTrainedTokenizerFast`
    (and the chat templates' files, when there are templates)."""
    tokenizer._tok.save(os.path.join(directory, "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **_special_tokens(tokenizer),
    }
    if chat_template is not None:
        # transformers 4 reads them here; 5 reads the files, which win
        config["chat_template"] = _config_templates(chat_template)
        write_chat_templates(directory, chat_template)
    write_json(os.path.join(directory, "tokenizer_config.json"), config)


def _config_templates(templates: str | Mapping[str, str]) -> Any:
    """`tokenizer_config.json`'s `chat_template`, as transformers writes it
    without `.jinja` files: the default alone as a string, else a list of
    `{name, template}`."""
    if isinstance(templates, str):
        return templates
    if list(templates) == ["default"]:
        return templates["default"]
    return [{"name": k, "template": v} for k, v in templates.items()]
