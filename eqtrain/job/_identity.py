"""What identifies a run: the config keys that change what its saved arrays
mean. Every checkpoint's manifest records them (`"identity"`), and every resume
compares them with the config it continues under (`_resumable`): a Llama's
weights read as a Gemma have the same shapes and mean something else.

The keys are derived from the config's structure, so that a new key is part of
the identity unless it is said not to be: every key of `[model]` and `[lora]`
but those of `NOT_IDENTITY`, the tokenizer (by the content of its file) and a
distillation's teacher (by the content of its weights: `task.teacher`)."""

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..config import Config, to_dict
from . import _distill, _resolve


MANIFEST_ENTRY = "identity"
"""The manifests' entry of the run's identity: `{dotted key: value}`."""
SECTIONS = ("model", "lora")
"""The sections whose every key identifies the run, but those of `NOT_IDENTITY`."""
NOT_IDENTITY = frozenset(
    {
        # Where the step-0 weights came from: what they resolve to (the
        # architecture in [model], an adapter's settings) is compared instead.
        "model.init_from",
        "model.adapter_from",
        # How the model computes, never what its arrays are (the models'
        # runtime options, `Decoder.with_options`).
        "model.remat",
        "model.remat_save",
        "model.remat_offload",
        "model.mlp_chunks",
        "model.attention_chunk",
        "model.attention_impl",
        "model.scan_layers",
        "model.sequence_parallel",
        "model.sequence_layout",
        "model.loss_chunk",
        # Mixture-of-experts training options: dispatch, capacity, loss terms.
        "model.moe_impl",
        "model.capacity_factor",
        "model.router_aux_loss_coef",
        "model.router_z_loss_coef",
        # Only a new state reads it.
        "model.init_std",
        # The longest sequence: no weight of a RoPE model depends on it (a
        # position table's size is a shape, which the restore checks).
        "model.max_seq_len",
        # Applied in training steps only.
        "lora.dropout",
    }
)
TOKENIZER = "data.tokenizer"
"""The identity's entry of the tokenizer: `"byte"` or the sha256 of its file."""
_ADAPTER_KEYS = ("rank", "alpha", "targets", "rslora")


def of_config(config: Config, recorded: Path | None = None) -> dict[str, Any]:
    """The identity of the run `config` describes, before its job is built:
    its `[model]` resolved as `_build.build` resolves it (with `model.init_from`,
    from its config.json, or the run's `recorded` copy of it), its tokenizer by
    content, and a continued adapter's settings (`model.adapter_from`)."""
    source = _resolve.architecture_source(config, recorded)
    if config.model.init_from is not None:
        config, _, _ = _resolve.loaded_model(config, source)
    adapter = _resolve.lora_spec(config) if config.model.adapter_from else None
    return _entries(config, _resolve.tokenizer_name(config, source), adapter)


def of_job(job: Any) -> dict[str, Any]:
    """The identity of a built `Job` (what `of_config` gives for its config),
    read from its pieces: the resolved config, the file its tokenizer was read
    from, its LoRA spec."""
    config = job.config
    adapter = job.lora if config.model.adapter_from else None
    return _entries(config, _tokenizer_file(config, job.tokenizer), adapter)


def _entries(config: Config, tokenizer: str, adapter: Any) -> dict[str, Any]:
    """The identity of a resolved `config` read with the `tokenizer` file (or
    `"byte"`), and `adapter`, the LoRA spec of `model.adapter_from` (else None),
    whose settings are the run's."""
    out = of_settings(to_dict(config)) | {TOKENIZER: tokenizer_digest(tokenizer)}
    out |= _distill.identity(config)  # a distillation's teacher, by content
    if adapter is not None:
        out |= _lora({f"lora.{k}": getattr(adapter, k) for k in _ADAPTER_KEYS}, None)
    return _plain(out)


def _tokenizer_file(config: Config, tokenizer: Any) -> str:
    """The file a job's tokenizer was read from (`_resolve.tokenizer_name`):
    `"byte"`, or `data.tokenizer`'s file (`auto` or a directory: the
    tokenizer.json in the tokenizer's directory)."""
    directory = getattr(tokenizer, "directory", None)
    if directory is None:
        return "byte"
    name = config.data.tokenizer
    if name == "auto" or Path(name).is_dir():
        return os.path.join(directory, "tokenizer.json")
    return name


def of_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The identity entries a config's settings hold (`to_dict`, a manifest's
    `"config"` or a `config.toml`): the keys of `SECTIONS` but `NOT_IDENTITY`,
    with LoRA's resolved (`_lora`)."""
    out = {
        f"{section}.{name}": value
        for section in SECTIONS
        for name, value in (settings.get(section) or {}).items()
        if f"{section}.{name}" not in NOT_IDENTITY
    }
    lora = {k: out.pop(k) for k in list(out) if k.startswith("lora.")}
    adapter = (settings.get("model") or {}).get("adapter_from")
    return _plain({**out, **_lora(lora, adapter)})


def _lora(entries: dict[str, Any], adapter: str | None) -> dict[str, Any]:
    """The `lora.*` entries: `lora.rank = 0` alone without LoRA, `lora.alpha`
    unset as the rank it means, and none of the settings an adapter's
    adapter_config.json decides (`model.adapter_from`, see `of_config`)."""
    if adapter is not None:
        return {k: v for k, v in entries.items() if k[5:] not in _ADAPTER_KEYS}
    rank = entries.get("lora.rank")
    if not rank:
        return {"lora.rank": 0}
    alpha = entries.get("lora.alpha")
    return {**entries, "lora.alpha": rank if alpha is None else alpha}


def tokenizer_digest(name: str) -> str:
    """`"byte"`, or `"sha256:<hex>"` of the tokenizer file `name`."""
    if name == "byte":
        return name
    digest = hashlib.sha256()
    with open(name, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def differences(
    recorded: Mapping[str, Any], new: Mapping[str, Any]
) -> list[tuple[str, Any, Any]]:
    """`(key, recorded value, new value)` of each key both identities hold with
    different values (a key one of them lacks, e.g. an older manifest's, is not
    compared)."""
    new = _plain(dict(new))
    return [
        (key, value, new[key])
        for key, value in recorded.items()
        if key in new and value != new[key]
    ]


def _plain(entries: dict[str, Any]) -> dict[str, Any]:
    """As JSON has them (a tuple as a list), like the manifests' copy."""
    return json.loads(json.dumps(entries, default=str))
