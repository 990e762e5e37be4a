"""`load`: a Hugging Face checkpoint directory (safetensors only) as an eqtrain
model, strictly: every tensor must be present, expected and of the right shape.
The headers are checked first; then each parameter is read, one tensor (or one
device's block of it) at a time, and placed (`_lazy`). Builds on the key maps
of `_maps` and the reader of `_safetensors`.
"""

import hashlib
import json
import os
from typing import Any

import equinox as eqx
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from .._quant import is_quantized
from ..models import as_dtype
from ..quantize import Quantize, apply as quantize_model
from . import _lazy, _maps, _safetensors
from ._errors import HFFileNotFoundError, HFFormatError
from ._export import INDEX_NAME, SAFE_NAME
from ._json import read_object
from ._lazy import Entry, Leaf, Shardings


_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Buffers that transformers itself ignores when loading (older checkpoints hold them).
_IGNORED = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
_SHOWN = 5


def load(
    path: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    shardings: Shardings = None,
    quantize: Quantize | None = None,
) -> tuple[Any, Any]:
    """Read a Hugging Face checkpoint directory into `(model, config)`.

    Supports the decoder `model_type`s of `eqtrain.models.archs.ARCHS` (`llama`,
    `mistral`, `qwen2`, `qwen3`, `smollm3`, `gemma`, `gemma2`, `gemma3_text`,
    `phi3`, `olmo2`, `granite`, `starcoder2`, `mixtral`, `qwen2_moe`, `qwen3_moe`;
    rope types `default`, `linear`, `dynamic`, `yarn`, `longrope`, `llama3`) and
    `gpt2`, a single `model.safetensors` or shards with
    `model.safetensors.index.json`, stored in float32, bfloat16 or float16. What
    the model cannot reproduce exactly is refused by name (another model type or
    rope type, multimodal RoPE, Gemma's bidirectional attention, ...;
    docs/hf.md). Pickle checkpoints (`pytorch_model.bin`) are refused: reading
    them runs arbitrary code.

    Nothing is read before every tensor's name and shape has been checked against
    the model (from the files' headers). Then each parameter is read lazily and
    placed before the next: a stacked layer parameter from its per-layer tensors
    (experts' weights from their per-layer-and-expert ones), and with `shardings`
    only the block each local device holds. Host memory
    beyond the placed model stays about one parameter (one device's block of it
    with `shardings`), not the checkpoint.

    Args:
        path: the directory (as written by `save_pretrained` or `eqtrain.hf.export`).
        dtype: parameter dtype of the model (`None`: the stored tensors' dtype).
        shardings: where the parameters go. `None`: the default device, as
            `jnp.asarray` places them. A `jax.sharding.Sharding`: every
            parameter. A pytree like the model with a `Sharding` per array leaf
            (e.g. `eqtrain.sharding.state_shardings(abstract_model, mesh, rules)`),
            or a function from the abstract model (`ShapeDtypeStruct` leaves) to
            such a pytree. In a multi-process run each process reads only its
            own devices' blocks.
        quantize: quantize the weights it selects while reading
            (`eqtrain.quantize.Quantize`, QLoRA's frozen base): each stored
            tensor is read whole, quantized and dropped before the next, so host
            memory stays about the quantized model and one tensor. The
            quantized arrays are then placed whole on each device (or on
            `shardings`' for them).

    Example:
        Straight onto an FSDP mesh, without a full copy on one device:

        ```python
        mesh = sharding.make_mesh({"fsdp": -1})
        model, config = hf.load(
            "hf_dir",
            shardings=lambda m: sharding.state_shardings(
                m, mesh, sharding.rules_for(m, mesh)
            ),
        )
        ```

    Raises:
        HFFileNotFoundError: no directory, or no `config.json` in it.
        HFFormatError: unknown `model_type`, a config.json the model cannot
            reproduce (the key is named), a pickle-only checkpoint, a damaged
            safetensors file, or tensors missing, unexpected or of the wrong
            shape (named in the message).
        StructureError: `shardings` does not have one sharding per parameter.
    """
    path = os.fspath(path)
    hf_config = _read_config(path)
    entries = _index(path)
    param_dtype = dtype or _stored_dtype(entries, hf_config)
    model_type, config = _translate(path, hf_config, param_dtype)
    template = eqx.filter_eval_shape(_maps.model_class(config), config, jr.key(0))
    if quantize is not None:
        template = quantize_model(template, quantize)
    leaves = _plan(template, entries, _maps.ARCHS[model_type], config, path)
    targets = _lazy.targets(template, shardings)
    values = [  # each planned parameter read and placed on its target
        _lazy.place(leaf, target) if isinstance(leaf, Leaf) else leaf
        for leaf, target in zip(leaves, targets, strict=True)
    ]
    treedef = jtu.tree_structure(template, is_leaf=is_quantized)
    return jtu.tree_unflatten(treedef, values), config


def generation_eos(directory: str | os.PathLike[str]) -> list[int]:
    """The end-of-sequence ids of `directory`'s generation_config.json
    (`eos_token_id`: an int or a list); `[]` without the file or the key."""
    file = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(file):
        return []
    try:
        with open(file, encoding="utf-8") as f:
            value = json.load(f).get("eos_token_id")
    except (ValueError, AttributeError) as e:
        raise HFFormatError(f"{file} does not parse as a JSON object: {e}") from None
    values = value if isinstance(value, list) else [value]
    return [int(v) for v in values if isinstance(v, int)]


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
    model_type, config = _translate(path, hf_config, param_dtype)
    return config, model_type


def _translate(
    path: str, hf_config: dict[str, Any], param_dtype: str
) -> tuple[str, Any]:
    """`(model_type, eqtrain config)` of a directory's parsed config.json, with
    parameters of `param_dtype` (checked first)."""
    as_dtype(param_dtype, field="dtype")
    file = os.path.join(path, "config.json")
    return _maps.eqtrain_config(hf_config, file, param_dtype)


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
    raise HFFormatError(
        f"{path} has a vocabulary of {vocab} ids but no tokenizer.json, so its "
        "tokenizer is unknown; the byte tokenizer (259 ids) would train on ids "
        f"that mean other tokens. {_other_tokenizers(path)}Set data.tokenizer to "
        "the model's tokenizer.json, or to 'byte' if you mean it."
    )


def _other_tokenizers(path: str) -> str:
    """A sentence on the tokenizer files eqtrain cannot read in `path`, if any."""
    others = [f for f in _OTHER_TOKENIZERS if os.path.exists(os.path.join(path, f))]
    if not others:
        return ""
    return (
        f"It holds {', '.join(others)}, which eqtrain cannot read (only a "
        "`tokenizers` tokenizer.json): convert it with transformers "
        "(`AutoTokenizer.from_pretrained(dir).save_pretrained(dir)` writes "
        "tokenizer.json for a fast tokenizer). "
    )


def _read_config(path: str) -> dict[str, Any]:
    return read_object(
        path,
        "config.json",
        kind="a Hugging Face checkpoint directory (with config.json and *.safetensors)",
        missing="so the architecture is unknown. Pass the directory that "
        "`save_pretrained` or `eqtrain.hf.export` wrote.",
    )


def content_hash(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A reference to a Hugging Face directory's weights: its absolute `path`,
    the sha256 of each safetensors file and one `sha256` over them (what a LoRA
    run's checkpoints record of their frozen base). Reads every byte once."""
    path = os.path.abspath(os.fspath(path))
    files = {os.path.basename(f): _sha256(f) for f in _weight_files(path)}
    combined = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return {"path": path, "files": files, "sha256": combined}


def _sha256(file: str) -> str:
    """The hex sha256 of a file, read in 16 MiB chunks."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _weight_files(path: str) -> list[str]:
    """The directory's safetensors files: its shards, or its one file."""
    index = os.path.join(path, INDEX_NAME)
    if os.path.exists(index):
        return _shard_files(path, index)
    if os.path.exists(os.path.join(path, SAFE_NAME)):
        return [os.path.join(path, SAFE_NAME)]
    raise _no_weights(path)


def _shard_files(path: str, index: str) -> list[str]:
    """The shards an index names, each checked to be there."""
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


def _no_weights(path: str) -> HFFormatError | HFFileNotFoundError:
    """The error for a directory without safetensors weights: pickles, or none."""
    pickles = sorted(f for f in os.listdir(path) if f.endswith(_PICKLES))
    if pickles:
        return HFFormatError(
            f"{path} holds only PyTorch pickle weights ({', '.join(pickles)}); "
            "eqtrain reads safetensors only, because loading a pickle can run "
            "arbitrary code. Convert it where you trust the file: "
            "`AutoModelForCausalLM.from_pretrained(path).save_pretrained(new_path)` "
            "writes safetensors."
        )
    return HFFileNotFoundError(
        f"{path} has no {SAFE_NAME} and no {INDEX_NAME}; export the weights with "
        "`save_pretrained` (safetensors) or `eqtrain.hf.export`."
    )


def _index(path: str) -> dict[str, Entry]:
    """Every tensor of the directory, from the files' headers (no data read)."""
    entries: dict[str, Entry] = {}
    for file in _weight_files(path):
        for name, info in _safetensors.read_header(file).items():
            if name == "__metadata__":
                continue
            if name in entries:
                raise HFFormatError(
                    f"tensor {name!r} appears in two shards of {path}; re-export."
                )
            entries[name] = Entry(file, name, info["dtype"], tuple(info["shape"]))
    return entries


_FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _stored_dtype(entries: dict[str, Entry], hf_config: dict[str, Any]) -> str:
    kinds = {_FLOATS[e.dtype] for e in entries.values() if e.dtype in _FLOATS}
    if len(kinds) == 1:
        return next(iter(kinds))
    return str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")


def _plan(
    template: Any, entries: dict[str, Entry], arch: _maps.Arch, config: Any, path: str
) -> list[Any]:
    """The template's leaves with a `Leaf` for each parameter, after checking
    every name and shape (from the headers alone)."""
    entries = _normalise_names(dict(entries), arch, config)
    out: list[Any] = []
    wanted: list[tuple[str, tuple[int, ...]]] = []
    flat = jtu.tree_flatten_with_path(template, is_leaf=is_quantized)[0]
    for key_path, struct in flat:
        if not _maps.is_struct(struct):
            out.append(struct)
            continue
        leaf_path = jtu.keystr(key_path, simple=True, separator=".")
        leaf, tensors = _leaf(arch, leaf_path, struct, entries)
        out.append(leaf)
        wanted += tensors
    _check_names(path, config, entries, wanted)
    return out


def _leaf(
    arch: _maps.Arch, leaf_path: str, struct: Any, entries: dict[str, Entry]
) -> tuple[Leaf, list[tuple[str, tuple[int, ...]]]]:
    """The `Leaf` of one parameter, and the `(name, stored shape)` of each
    tensor it is made of."""
    stack = _maps.stack_shape(arch, leaf_path, struct.shape)
    conv1d = _maps.is_conv1d(arch, leaf_path)
    shape = tuple(struct.shape[len(stack) :])
    shape = shape[::-1] if conv1d else shape
    names = [n for n, _ in _maps.indexed_names(arch, leaf_path, struct.shape)]
    parts = tuple(entries[n] for n in names if n in entries)
    quantized = struct if is_quantized(struct) else None
    leaf = Leaf(parts, stack, conv1d, tuple(struct.shape), struct.dtype, quantized)
    return leaf, [(name, shape) for name in names]


def _check_names(
    path: str,
    config: Any,
    entries: dict[str, Entry],
    wanted: list[tuple[str, tuple[int, ...]]],
) -> None:
    """Every wanted tensor is stored with its shape, and nothing else is (the
    message names the first `_SHOWN` of each kind)."""
    missing = [f"{n} {list(shape)}" for n, shape in wanted if n not in entries]
    wrong = [
        f"{n}: file {list(entries[n].shape)}, model {list(shape)}"
        for n, shape in wanted
        if n in entries and entries[n].shape != shape
    ]
    unexpected = sorted(set(entries) - {n for n, _ in wanted})
    kinds = (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong))
    lines = []  # "3 missing: a; b; c"
    for label, items in kinds:
        if items:
            more = f" (and {len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
            lines.append(f"{len(items)} {label}: {'; '.join(items[:_SHOWN])}{more}")
    if lines:
        raise HFFormatError(
            f"the tensors in {path} do not match the model its config.json describes "
            f"({type(config).__name__}): " + ". ".join(lines) + ". Check that "
            "config.json belongs to these weights (sizes, tie_word_embeddings, biases)."
        )


def _normalise_names(
    entries: dict[str, Entry], arch: _maps.Arch, config: Any
) -> dict[str, Entry]:
    """Drop buffers transformers ignores too; accept GPT-2 files without the
    `transformer.` prefix (OpenAI's original upload) and a tied `lm_head.weight`
    that equals the embedding (the two are read to compare them)."""
    for name in [n for n in entries if n.endswith(_IGNORED)]:
        del entries[name]
    if arch.unprefixed and not any(n.startswith(arch.prefix) for n in entries):
        entries = {  # the head keeps its name
            (n if n == "lm_head.weight" else arch.prefix + n): e
            for n, e in entries.items()
        }
    embed = entries.get(arch.prefix + arch.embedding)
    head = entries.get("lm_head.weight")
    if (
        getattr(config, "tie_word_embeddings", True)
        and head is not None
        and embed is not None
        and head.shape == embed.shape
        and np.array_equal(head.read(), embed.read())
    ):
        del entries["lm_head.weight"]  # a tied copy
    return entries
