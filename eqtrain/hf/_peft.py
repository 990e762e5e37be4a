"""LoRA adapters in PEFT's format: `export_adapter` writes the directory
`peft.PeftModel.save_pretrained` would (adapter_model.safetensors and
adapter_config.json), with the tokenizer's files beside them as TRL's trainers
save them. `_peft_load` reads one back (safetensors only: a pickled
adapter is refused).

PEFT names a tensor `base_model.model.<HF module>.lora_A.weight` (`[rank, in]`)
or `.lora_B.weight` (`[out, rank]`), one per layer; GPT-2's `Conv1D` targets have
the same adapter layouts as `nn.Linear` ones (only their base weight is stored
transposed). Without the `base_model.model.` prefix PEFT skips the tensors and
keeps `lora_B = 0`, an adapter that does nothing (since peft 0.14 with a
"missing adapter keys" warning, before that silently), so the prefix is checked
on read.
"""

import math
import os
import re
from collections.abc import Mapping
from typing import Any

import jax.tree_util as jtu
import numpy as np

from .. import lora
from .._errors import ConfigError
from ..lora import LoRALinear
from . import _maps, _safetensors
from ._export import _num_layers, hf_tensors, write_tokenizer_files
from ._json import write_json
from ._target import atomic_dir, check_target


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."


def arch_of(model: Any, model_type: str | None) -> _maps.Arch:
    """The HF architecture `model`'s base is exported as."""
    return _maps.ARCHS[_maps.infer_model_type(model.config, model_type)]


def module_names(arch: _maps.Arch, path: str, num_layers: int) -> list[str]:
    """The HF module name(s) of an eqtrain linear layer path (one per layer)."""
    return _maps.hf_names(arch, path, num_layers)


def export_adapter(
    model: Any,
    out_dir: str | os.PathLike[str],
    *,
    model_type: str | None = None,
    base_model_name_or_path: str | None = None,
    spec: lora.LoRA | None = None,
    trained: Any = None,
    tokenizer: Any = None,
    chat_template: str | Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> str:
    """Write the LoRA adapters of `model` as PEFT's adapter directory, atomically.

    `peft.PeftModel.from_pretrained(hf_base, out_dir)` then loads them onto the
    `transformers` model of the same base, without warnings and with the same
    logits. Disabled adapters are written too (they hold the trained values).
    With `tokenizer`, its files go beside them, as a TRL trainer's
    `save_model` writes its tokenizer with the adapter:
    `AutoTokenizer.from_pretrained(out_dir)` loads it.

    Args:
        model: a `Llama` or `GPT2` with adapters (`eqtrain.lora.apply`).
        out_dir: the directory to create (or replace, with `overwrite`).
        model_type: the HF architecture the base is exported as (`None`: infer).
        base_model_name_or_path: recorded in adapter_config.json.
        spec: the `lora.LoRA` the adapters were made with, to record its `alpha`
            and `rslora` as written (default: `lora_alpha = scale * r`, which
            PEFT reads as the same scale).
        trained: the trainable mask (`state.trainable`): trained leaves other
            than the adapters (`lora.trainable(..., also=...)`, e.g. the norms)
            are written whole with their modules, as PEFT's `modules_to_save`.
            `None`: the adapters only.
        tokenizer: an `eqtrain.data.HFTokenizer` whose files are written too
            (the byte tokenizer has none), as `export` writes them.
        chat_template: the Jinja chat template(s) written with the tokenizer's
            files (`export`'s `chat_template`).
        overwrite: replace an earlier export at `out_dir`.

    Raises:
        ConfigError: no adapters, or adapters of different ranks, scales or
            dropout rates (PEFT's file has one of each).
    """
    arch = arch_of(model, model_type)
    found = _adapters(model)
    num_layers = _num_layers(model.config)
    modules = _trained_modules(model, trained, arch)
    tensors = _adapter_tensors(found, arch, num_layers)
    tensors.update(_saved_tensors(model, arch, modules))
    settings = _lora_settings(found, spec, base_model_name_or_path)
    settings.update(_module_settings(model, arch, found, modules))
    tokenizer_files = (tokenizer, chat_template)
    return _write_adapter(
        os.fspath(out_dir), tensors, settings, tokenizer_files, overwrite
    )


def _adapters(model: Any) -> list[tuple[str, LoRALinear]]:
    found = [(p, x) for p, x in lora.linears(model) if isinstance(x, LoRALinear)]
    if not found:
        raise ConfigError(
            "the model carries no LoRA adapters to export; wrap it with "
            "`eqtrain.lora.apply` (and train it) first."
        )
    return found


def _adapter_tensors(
    found: list[tuple[str, LoRALinear]], arch: _maps.Arch, num_layers: int
) -> dict[str, np.ndarray]:
    """Each adapter's `lora_A` and `lora_B` under PEFT's names, one per layer."""
    tensors: dict[str, np.ndarray] = {}
    for path, layer in found:
        names = module_names(arch, path, num_layers)
        for which, value in (("A", layer.lora_a), ("B", layer.lora_b)):
            for name, part in zip(names, _per_layer(value, len(names)), strict=True):
                key = f"{PREFIX}{name}.lora_{which}.weight"
                tensors[key] = np.ascontiguousarray(part)
    return tensors


def _per_layer(value: Any, num: int) -> list[np.ndarray]:
    """A stacked adapter array as its `num` layers' arrays (unstacked: itself)."""
    array = np.asarray(value)
    return [array[i] for i in range(num)] if array.ndim == 3 else [array]


def _saved_tensors(
    model: Any, arch: _maps.Arch, modules: set[str]
) -> dict[str, np.ndarray]:
    """The whole weights of PEFT's `modules_to_save` under PEFT's names."""
    if not modules:
        return {}
    whole = hf_tensors(lora.unwrap(model), arch, None)
    return {
        PREFIX + name: value
        for name, value in whole.items()
        if name.rsplit(".", 1)[0] in modules
    }


def _lora_settings(
    found: list[tuple[str, LoRALinear]], spec: lora.LoRA | None, base: str | None
) -> dict[str, Any]:
    """adapter_config.json's kind and its one rank, alpha and dropout."""
    rank, scale, dropout = _shared_settings(found)
    alpha, rslora = _alpha(rank, scale, spec)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": int(rank),
        "lora_alpha": alpha,
        "lora_dropout": float(dropout),
        "use_rslora": rslora,
    }


def _alpha(
    rank: int, scale: float | int, spec: lora.LoRA | None
) -> tuple[float | int, bool]:
    """`lora_alpha` and `use_rslora` as `spec` wrote them when it made these
    adapters, else `scale * r` (which PEFT reads as the same scale)."""
    if spec is not None and spec.rank == rank and math.isclose(spec.scale, scale):
        return _clean(float(spec.alpha or spec.rank)), spec.rslora
    return _clean(scale * rank), False


def _shared_settings(
    found: list[tuple[str, LoRALinear]],
) -> tuple[int, float | int, float | int]:
    """`(rank, scale, dropout)`, the same for every adapter (PEFT has one of each)."""
    ranks = {x.lora_a.shape[-2] for _, x in found}
    scales = {x.scale for _, x in found}
    drops = {x.dropout for _, x in found}
    if len(ranks) > 1 or len(scales) > 1 or len(drops) > 1:
        raise ConfigError(
            "PEFT's adapter_config.json has one rank, alpha and dropout for all "
            f"adapters; this model's differ (ranks {sorted(ranks)}, scales "
            f"{sorted(scales)}, dropout {sorted(drops)})."
        )
    return ranks.pop(), scales.pop(), drops.pop()


def _module_settings(
    model: Any,
    arch: _maps.Arch,
    found: list[tuple[str, LoRALinear]],
    modules: set[str],
) -> dict[str, Any]:
    """adapter_config.json's modules: the adapted ones and those saved whole."""
    adapted = {p for p, _ in found}
    targets = _target_modules(model, arch, adapted, _num_layers(model.config))
    return {
        "target_modules": targets,
        "fan_in_fan_out": bool(arch.conv1d),
        "bias": "none",
        "modules_to_save": sorted(modules) or None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def _target_modules(
    model: Any, arch: _maps.Arch, adapted: set[str], num_layers: int
) -> Any:
    """PEFT's `target_modules`: the wrapped layers' last names when those select
    exactly the wrapped layers, else a regex PEFT full-matches against module
    names that selects exactly them."""
    paths = lora.linear_paths(model)
    names = sorted({p.rsplit(".", 1)[-1] for p in adapted})
    selected = {p for p in paths if p.rsplit(".", 1)[-1] in names}
    if selected == adapted:
        return names
    modules = (name for p in adapted for name in module_names(arch, p, num_layers))
    return exact_regex(sorted(modules))


def exact_regex(names: list[str]) -> str:
    """A regex that full-matches exactly `names`."""
    return "^(" + "|".join(re.escape(name) for name in names) + ")$"


def _trained_modules(model: Any, trained: Any, arch: _maps.Arch) -> set[str]:
    """The HF module names holding trained leaves other than the adapters."""
    if trained is None:
        return set()
    adapted = set(lora.adapter_paths(model))
    out: set[str] = set()
    for path, leaf in _trained_leaves(model, trained):
        _check_frozen_base(path, adapted)
        names = _maps.indexed_names(arch, path, np.shape(leaf))
        out.update(name.rsplit(".", 1)[0] for name, _ in names)
    return out


def _check_frozen_base(path: str, adapted: set[str]) -> None:
    if path.rsplit(".", 1)[0] in adapted:
        raise ConfigError(
            f"`{path}` trains besides its adapter; PEFT files cannot hold a "
            "trained base weight of an adapted layer. Leave it frozen, or "
            "export the merged model instead."
        )


def _trained_leaves(model: Any, trained: Any) -> list[tuple[str, Any]]:
    """`(path, leaf)` of the leaves `trained` marks, the adapters' left out."""
    flat_mask = jtu.tree_leaves(trained)
    flat, _ = jtu.tree_flatten_with_path(model, is_leaf=lambda x: x is None)
    if len(flat) != len(flat_mask):
        raise ConfigError(
            "`trained` must be the model's trainable mask (`state.trainable`); its "
            "structure does not match the model's."
        )
    paths = [(jtu.keystr(k, simple=True, separator="."), x) for k, x in flat]
    return [
        (path, leaf)
        for (path, leaf), flag in zip(paths, flat_mask, strict=True)
        if flag and not lora.is_adapter_path(path)
    ]


def _clean(x: float) -> float | int:
    """An integral float as an int (PEFT writes `lora_alpha: 16`)."""
    return int(round(x)) if abs(x - round(x)) < 1e-9 else float(x)


def _write_adapter(
    out_dir: str,
    tensors: dict[str, np.ndarray],
    settings: dict[str, Any],
    tokenizer_files: tuple[Any, Any],
    overwrite: bool,
) -> str:
    """The adapter directory (and the tokenizer's files: `(tokenizer,
    chat_template)`) written atomically; `out_dir`."""
    check_target(out_dir, overwrite)
    with atomic_dir(out_dir, overwrite) as tmp:
        weights = os.path.join(tmp, ADAPTER_WEIGHTS)
        _safetensors.write(weights, tensors, {"format": "pt"})
        write_json(os.path.join(tmp, ADAPTER_CONFIG), settings)
        write_tokenizer_files(tmp, *tokenizer_files)
    return out_dir
