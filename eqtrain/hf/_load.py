"""`load`: a Hugging Face checkpoint directory (safetensors only) as an eqtrain
model, strictly: every tensor must be present, expected and of the right shape.
Builds on the key maps of `_maps` and the reader of `_safetensors`.
"""

import json
import os
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from ..models import as_dtype
from . import _maps, _safetensors
from ._errors import HFFileNotFoundError, HFFormatError
from ._export import INDEX_NAME, SAFE_NAME


_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Buffers that transformers itself ignores when loading (older checkpoints hold them).
_IGNORED = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
_SHOWN = 5


def load(path: str | os.PathLike[str], *, dtype: str | None = None) -> tuple[Any, Any]:
    """Read a Hugging Face checkpoint directory into `(model, config)`.

    Supports `model_type` `llama`, `mistral`, `qwen2` and `gpt2`, a single
    `model.safetensors` or shards with `model.safetensors.index.json`, stored in
    float32, bfloat16 or float16. Pickle checkpoints (`pytorch_model.bin`) are
    refused: reading them runs arbitrary code.

    Args:
        path: the directory (as written by `save_pretrained` or `eqtrain.hf.export`).
        dtype: parameter dtype of the model (`None`: the stored tensors' dtype).

    Raises:
        HFFileNotFoundError: no directory, or no `config.json` in it.
        HFFormatError: unknown `model_type`, a pickle-only checkpoint, or tensors
            missing, unexpected or of the wrong shape (named in the message).
    """
    path = os.fspath(path)
    hf_config = _read_config(path)
    tensors = _read_tensors(path)
    stored = _stored_dtype(tensors, hf_config)
    param_dtype = dtype or stored
    as_dtype(param_dtype, field="dtype")
    model_type, config = _maps.eqtrain_config(
        hf_config, os.path.join(path, "config.json"), param_dtype
    )
    arch = _maps.ARCHS[model_type]
    cls = _maps.model_class(config)
    template = eqx.filter_eval_shape(cls, config, jr.key(0))
    return _fill(template, tensors, arch, config, path), config


def load_config(
    path: str | os.PathLike[str], *, dtype: str | None = None
) -> tuple[Any, str]:
    """`(eqtrain config, model_type)` of a Hugging Face directory, from its
    config.json alone (no tensors are read). The config is what
    `load(path, dtype=dtype)[1]` returns, except that `param_dtype` is `dtype` or
    the config's own `dtype`/`torch_dtype` (else float32), not the stored
    tensors' dtype.

    Raises:
        HFFileNotFoundError, HFFormatError: as `load`.
    """
    path = os.fspath(path)
    hf_config = _read_config(path)
    declared = hf_config.get("dtype") or hf_config.get("torch_dtype")
    param_dtype = dtype or (declared if declared in _maps.DTYPE_NAMES else "float32")
    as_dtype(param_dtype, field="dtype")
    model_type, config = _maps.eqtrain_config(
        hf_config, os.path.join(path, "config.json"), param_dtype
    )
    return config, model_type


BYTE_VOCAB_LIMIT = 1024
"""The largest vocabulary `tokenizer_for` pairs with the byte tokenizer (259 ids,
often padded to 384 or 512) when a directory has no tokenizer.json."""

_OTHER_TOKENIZERS = ("tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def tokenizer_for(path: str | os.PathLike[str]) -> str:
    """The tokenizer to use with the Hugging Face model in `path` when none is
    named (`data.tokenizer = "auto"`): its `tokenizer.json`, or `"byte"` for a
    small vocabulary (an eqtrain byte-level export writes no tokenizer file).

    Raises:
        HFFormatError: a vocabulary above `BYTE_VOCAB_LIMIT` and no
            `tokenizer.json`: the byte tokenizer would silently feed the model ids
            that mean something else. The message names a sentencepiece (or
            other) tokenizer file when the directory has one.
    """
    path = os.fspath(path)
    file = os.path.join(path, "tokenizer.json")
    if os.path.exists(file):
        return file
    vocab = _read_config(path).get("vocab_size")
    if not isinstance(vocab, int) or vocab <= BYTE_VOCAB_LIMIT:
        return "byte"
    others = [f for f in _OTHER_TOKENIZERS if os.path.exists(os.path.join(path, f))]
    found = (
        f"It holds {', '.join(others)}, which eqtrain cannot read (only a "
        "`tokenizers` tokenizer.json): convert it with transformers "
        "(`AutoTokenizer.from_pretrained(dir).save_pretrained(dir)` writes "
        "tokenizer.json for a fast tokenizer). "
        if others
        else ""
    )
    raise HFFormatError(
        f"{path} has a vocabulary of {vocab} ids but no tokenizer.json, so its "
        "tokenizer is unknown; the byte tokenizer (259 ids) would train on ids "
        f"that mean other tokens. {found}Set data.tokenizer to the model's "
        "tokenizer.json, or to 'byte' if you mean it."
    )


def _read_config(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise HFFileNotFoundError(
            f"{path} is not a directory; pass a Hugging Face checkpoint directory "
            "(with config.json and *.safetensors)."
        )
    file = os.path.join(path, "config.json")
    if not os.path.exists(file):
        raise HFFileNotFoundError(
            f"{path} has no config.json, so the architecture is unknown. Pass the "
            "directory that `save_pretrained` or `eqtrain.hf.export` wrote."
        )
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HFFormatError(f"{file} is not valid JSON: {error}.") from None
    if not isinstance(config, dict):
        raise HFFormatError(f"{file} must hold a JSON object.")
    return config


def content_hash(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A reference to a Hugging Face directory's weights: its absolute `path`,
    the sha256 of each safetensors file and one `sha256` over them (what a LoRA
    run's checkpoints record of their frozen base). Reads every byte once."""
    import hashlib

    path = os.path.abspath(os.fspath(path))
    files = {}
    for file in _weight_files(path):
        digest = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
        files[os.path.basename(file)] = digest.hexdigest()
    combined = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return {"path": path, "files": files, "sha256": combined}


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, INDEX_NAME)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
        for file in files:
            if not os.path.exists(os.path.join(path, file)):
                raise HFFileNotFoundError(
                    f"{index} names the shard {file}, which is not in {path}. "
                    "Copy every shard, or re-export."
                )
        return [os.path.join(path, f) for f in files]
    if os.path.exists(os.path.join(path, SAFE_NAME)):
        return [os.path.join(path, SAFE_NAME)]
    pickles = sorted(f for f in os.listdir(path) if f.endswith(_PICKLES))
    if pickles:
        raise HFFormatError(
            f"{path} holds only PyTorch pickle weights ({', '.join(pickles)}); "
            "eqtrain reads safetensors only, because loading a pickle can run "
            "arbitrary code. Convert it where you trust the file: "
            "`AutoModelForCausalLM.from_pretrained(path).save_pretrained(new_path)` "
            "writes safetensors."
        )
    raise HFFileNotFoundError(
        f"{path} has no {SAFE_NAME} and no {INDEX_NAME}; export the weights with "
        "`save_pretrained` (safetensors) or `eqtrain.hf.export`."
    )


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    tensors: dict[str, np.ndarray] = {}
    for file in _weight_files(path):
        for name, value in _safetensors.read(file)[0].items():
            if name in tensors:
                raise HFFormatError(
                    f"tensor {name!r} appears in two shards of {path}; re-export."
                )
            tensors[name] = value
    return tensors


def _stored_dtype(tensors: dict[str, np.ndarray], hf_config: dict[str, Any]) -> str:
    kinds = {
        str(t.dtype)
        for t in tensors.values()
        if t.dtype.kind == "f" or t.dtype.name == "bfloat16"
    }
    if len(kinds) == 1:
        return next(iter(kinds))
    return str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")


def _fill(
    template: Any,
    tensors: dict[str, np.ndarray],
    arch: _maps.Arch,
    config: Any,
    path: str,
) -> Any:
    tensors = _normalise_names(dict(tensors), arch, config)
    num_layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    flat, treedef = jtu.tree_flatten_with_path(template)
    values, used, missing, wrong = [], set(), [], []
    for key_path, struct in flat:
        if not _maps.is_struct(struct):
            values.append(struct)
            continue
        leaf_path = jtu.keystr(key_path, simple=True, separator=".")
        names = _maps.hf_names(arch, leaf_path, num_layers)
        stacked = leaf_path.startswith(arch.layers + ".")
        conv1d = _maps.is_conv1d(arch, leaf_path)
        shape = tuple(struct.shape[1:] if stacked else struct.shape)
        shape = shape[::-1] if conv1d else shape
        parts = []
        for name in names:
            if name not in tensors:
                missing.append(f"{name} {list(shape)}")
                continue
            used.add(name)
            t = tensors[name]
            if tuple(t.shape) != shape:
                wrong.append(f"{name}: file {list(t.shape)}, model {list(shape)}")
                continue
            parts.append(t.T if conv1d else t)
        if len(parts) == len(names):
            value = np.stack(parts) if stacked else parts[0]
            values.append(jnp.asarray(value.astype(struct.dtype)))
    unexpected = sorted(set(tensors) - used)
    _report(path, config, missing, unexpected, wrong)
    return jtu.tree_unflatten(treedef, values)


def _normalise_names(
    tensors: dict[str, np.ndarray], arch: _maps.Arch, config: Any
) -> dict[str, np.ndarray]:
    """Drop buffers transformers ignores too; accept GPT-2 files without the
    `transformer.` prefix (OpenAI's original upload) and a tied `lm_head.weight`
    that equals the embedding."""
    for name in [n for n in tensors if n.endswith(_IGNORED)]:
        del tensors[name]
    if arch.model_type == "gpt2" and not any(
        n.startswith(arch.prefix) for n in tensors
    ):
        tensors = {
            (n if n == "lm_head.weight" else arch.prefix + n): t
            for n, t in tensors.items()
        }
    tied = getattr(config, "tie_word_embeddings", True)
    embed = arch.prefix + (
        "wte.weight" if arch.model_type == "gpt2" else "embed_tokens.weight"
    )
    head = tensors.get("lm_head.weight")
    if (
        tied
        and head is not None
        and embed in tensors
        and np.array_equal(head, tensors[embed])
    ):
        del tensors["lm_head.weight"]
    return tensors


def _report(
    path: str, config: Any, missing: list[str], unexpected: list[str], wrong: list[str]
) -> None:
    if not (missing or unexpected or wrong):
        return
    lines = []
    for label, items in (
        ("missing", missing),
        ("unexpected", unexpected),
        ("wrong shape", wrong),
    ):
        if items:
            shown = "; ".join(items[:_SHOWN])
            more = f" (and {len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
            lines.append(f"{len(items)} {label}: {shown}{more}")
    raise HFFormatError(
        f"the tensors in {path} do not match the model its config.json describes "
        f"({type(config).__name__}): " + ". ".join(lines) + ". Check that config.json "
        "belongs to these weights (sizes, tie_word_embeddings, biases)."
    )
