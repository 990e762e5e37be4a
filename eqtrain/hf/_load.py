"""`load`: a Hugging Face checkpoint directory (safetensors only) as an eqtrain
model, strictly: every tensor must be present, expected and of the right shape.
The headers are checked first; then each parameter is read, one tensor (or one
device's block of it) at a time, and placed. Builds on the key maps of `_maps` and
the reader of `_safetensors`.
"""

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Sharding

from .._errors import StructureError
from ..models import as_dtype
from . import _maps, _safetensors
from ._errors import HFFileNotFoundError, HFFormatError
from ._export import INDEX_NAME, SAFE_NAME


_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Buffers that transformers itself ignores when loading (older checkpoints hold them).
_IGNORED = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")
_SHOWN = 5


Shardings = Sharding | Any | Callable[[Any], Any] | None


def load(
    path: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    shardings: Shardings = None,
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
    stored = _stored_dtype(entries, hf_config)
    param_dtype = dtype or stored
    as_dtype(param_dtype, field="dtype")
    model_type, config = _maps.eqtrain_config(
        hf_config, os.path.join(path, "config.json"), param_dtype
    )
    arch = _maps.ARCHS[model_type]
    cls = _maps.model_class(config)
    template = eqx.filter_eval_shape(cls, config, jr.key(0))
    leaves = _plan(template, entries, arch, config, path)
    targets = _targets(template, shardings)
    values = [
        _place(leaf, target) if isinstance(leaf, _Leaf) else leaf
        for leaf, target in zip(leaves, targets, strict=True)
    ]
    return jtu.tree_unflatten(jtu.tree_structure(template), values), config


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


@dataclasses.dataclass(frozen=True)
class _Entry:
    """Where one stored tensor is: its file, its name there, dtype and shape."""

    file: str
    key: str
    dtype: str  # the safetensors code: "F32", "BF16", ...
    shape: tuple[int, ...]

    def read(self, index: _safetensors.Index | None = None) -> np.ndarray:
        return _safetensors.read_slice(self.file, self.key, index)


def _index(path: str) -> dict[str, _Entry]:
    """Every tensor of the directory, from the files' headers (no data read)."""
    entries: dict[str, _Entry] = {}
    for file in _weight_files(path):
        for name, info in _safetensors.read_header(file).items():
            if name == "__metadata__":
                continue
            if name in entries:
                raise HFFormatError(
                    f"tensor {name!r} appears in two shards of {path}; re-export."
                )
            entries[name] = _Entry(file, name, info["dtype"], tuple(info["shape"]))
    return entries


_FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _stored_dtype(entries: dict[str, _Entry], hf_config: dict[str, Any]) -> str:
    kinds = {_FLOATS[e.dtype] for e in entries.values() if e.dtype in _FLOATS}
    if len(kinds) == 1:
        return next(iter(kinds))
    return str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32")


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One parameter of the model and the stored tensors it is made of: one per
    index over its leading `stack` axes (`()`: one tensor; `(layers,)` when the
    layers are stacked; `(layers, experts)` for experts' weights), row-major;
    GPT-2's Conv1D weights stored transposed."""

    entries: tuple[_Entry, ...]
    stack: tuple[int, ...]
    conv1d: bool
    shape: tuple[int, ...]
    dtype: Any

    def block(self, index: _safetensors.Index) -> np.ndarray:
        """The values at `index` (slices over the parameter), read from the files:
        each stored tensor the block covers once, and only its part."""
        out = np.empty(_block_shape(self.shape, index), self.dtype)
        k = len(self.stack)
        outer = [
            range(*s.indices(n)) for s, n in zip(index[:k], self.stack, strict=True)
        ]
        for at in np.ndindex(*map(len, outer)):
            which = tuple(r[j] for r, j in zip(outer, at, strict=True))
            flat = int(np.ravel_multi_index(which, self.stack)) if k else 0
            self._read_into(self.entries[flat], index[k:], out[(*at, ...)])
        return out

    def _read_into(
        self, entry: _Entry, index: _safetensors.Index, out: np.ndarray
    ) -> None:
        """`out[...] = entry[index]`, cast, read in runs of rows of at most
        `_CHUNK` bytes: each read maps pages of the file, and they count in
        resident memory until the file is closed again."""
        if self.conv1d:
            index, out = index[::-1], out.T
        if not index:
            out[...] = entry.read()
            return
        rows = range(*index[0].indices(entry.shape[0]))
        itemsize = _safetensors.DTYPES.get(entry.dtype, np.dtype("f8")).itemsize
        row_bytes = itemsize * int(np.prod(entry.shape[1:], dtype=np.int64))
        step = max(1, _CHUNK // max(1, row_bytes))
        for k in range(0, len(rows), step):
            part = rows[k : k + step]
            chunk = (slice(part.start, part.stop, part.step), *index[1:])
            out[k : k + step] = entry.read(chunk)


_CHUNK = 16 * 2**20


def _block_shape(shape: tuple[int, ...], index: _safetensors.Index) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))


def _plan(
    template: Any, entries: dict[str, _Entry], arch: _maps.Arch, config: Any, path: str
) -> list[Any]:
    """The template's leaves with a `_Leaf` for each parameter, after checking
    every name and shape (from the headers alone)."""
    entries = _normalise_names(dict(entries), arch, config)
    out, used, missing, wrong = [], set(), [], []
    for key_path, struct in jtu.tree_flatten_with_path(template)[0]:
        if not _maps.is_struct(struct):
            out.append(struct)
            continue
        leaf_path = jtu.keystr(key_path, simple=True, separator=".")
        stack = _maps.stack_shape(arch, leaf_path, struct.shape)
        names = [n for n, _ in _maps.indexed_names(arch, leaf_path, struct.shape)]
        conv1d = _maps.is_conv1d(arch, leaf_path)
        shape = tuple(struct.shape[len(stack) :])
        shape = shape[::-1] if conv1d else shape
        for name in names:
            if name not in entries:
                missing.append(f"{name} {list(shape)}")
                continue
            used.add(name)
            if entries[name].shape != shape:
                file_shape = list(entries[name].shape)
                wrong.append(f"{name}: file {file_shape}, model {list(shape)}")
        parts = tuple(entries[n] for n in names if n in entries)
        out.append(_Leaf(parts, stack, conv1d, tuple(struct.shape), struct.dtype))
    unexpected = sorted(set(entries) - used)
    _report(path, config, missing, unexpected, wrong)
    return out


def _targets(template: Any, shardings: Shardings) -> list[Sharding | None]:
    """One sharding (or None) per leaf of `template`."""
    leaves = jtu.tree_leaves(template)
    if callable(shardings) and not isinstance(shardings, eqx.Module | Sharding):
        shardings = shardings(template)
    if shardings is None or isinstance(shardings, Sharding):
        return [shardings if _maps.is_struct(x) else None for x in leaves]
    is_sharding = lambda x: isinstance(x, Sharding)
    flat = [
        s for s in jtu.tree_leaves(shardings, is_leaf=is_sharding) if is_sharding(s)
    ]
    params = sum(map(_maps.is_struct, leaves))
    if len(flat) != params:
        raise StructureError(
            f"`shardings` has {len(flat)} shardings but the model has {params} "
            "parameters. Build them from the abstract model, e.g. "
            "`shardings=lambda m: eqtrain.sharding.state_shardings(m, mesh, rules)`."
        )
    it = iter(flat)
    return [next(it) if _maps.is_struct(x) else None for x in leaves]


def _place(leaf: _Leaf, sharding: Sharding | None) -> Any:
    """`leaf` read and placed: whole on the default device, or block by block,
    each local device's block read (once per distinct block) and put there."""
    if sharding is None:
        return _put(leaf.block(tuple(slice(None) for _ in leaf.shape)), None)
    sharding.shard_shape(leaf.shape)  # raises if the shape does not divide
    placed: dict[Any, Any] = {}
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key in placed:  # a replica: copied between devices, not read again
            arrays.append(_put(placed[key], device))
            continue
        placed[key] = _put(leaf.block(index), device)
        arrays.append(placed[key])
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays)


def _put(value: Any, device: Any) -> Any:
    """`value` copied to `device`, waited for. `None` is the default device,
    uncommitted, as `jnp.asarray` places arrays (which also makes a second,
    transient host copy). Waiting frees the host block before the next one is
    read; otherwise several asynchronous transfers hold their blocks at once."""
    return jax.device_put(value, device).block_until_ready()


def _normalise_names(
    entries: dict[str, _Entry], arch: _maps.Arch, config: Any
) -> dict[str, _Entry]:
    """Drop buffers transformers ignores too; accept GPT-2 files without the
    `transformer.` prefix (OpenAI's original upload) and a tied `lm_head.weight`
    that equals the embedding (the two are read to compare them)."""
    for name in [n for n in entries if n.endswith(_IGNORED)]:
        del entries[name]
    if arch.unprefixed and not any(n.startswith(arch.prefix) for n in entries):
        entries = {
            (n if n == "lm_head.weight" else arch.prefix + n): e
            for n, e in entries.items()
        }
    tied = getattr(config, "tie_word_embeddings", True)
    embed = arch.prefix + arch.embedding
    head = entries.get("lm_head.weight")
    if (
        tied
        and head is not None
        and embed in entries
        and head.shape == entries[embed].shape
        and np.array_equal(head.read(), entries[embed].read())
    ):
        del entries["lm_head.weight"]
    return entries


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
