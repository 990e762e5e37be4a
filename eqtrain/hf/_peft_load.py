"""Reading PEFT's LoRA adapter directories (written by `_peft.export_adapter` or
by `peft` itself): `adapter_spec` gives their settings, `load_adapter` applies
them to an eqtrain model. Safetensors only: a pickled adapter is refused.

The tensor names must carry PEFT's `base_model.model.` prefix: without it peft
itself would keep `lora_B = 0`, an adapter that does nothing.
"""

import functools
import os
import re
from typing import Any

import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from .. import lora
from ..lora import LoRALinear
from . import _maps, _safetensors
from ._errors import HFFileNotFoundError, HFFormatError
from ._export import _num_layers
from ._json import read_object
from ._peft import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PREFIX,
    arch_of,
    exact_regex,
    module_names,
)


_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(\.default)?\.weight$")
_PARTNER = re.compile(r"\.lora_[AB](?=(\.default)?\.weight$)")
_LAYER_INDEX = re.compile(r"\.(\d+)\.")
# adapter_config.json keys eqtrain's LoRA cannot reproduce, and what they are
_UNSUPPORTED = (
    ("use_dora", "DoRA"),
    ("rank_pattern", "per-module ranks (rank_pattern)"),
    ("alpha_pattern", "per-module alphas (alpha_pattern)"),
    ("lora_bias", "adapter biases (lora_bias)"),
)

# one module's tensors: layer index (None: unstacked) -> (name in the file, tensor)
Parts = dict[int | None, tuple[str, np.ndarray]]


def adapter_spec(path: str | os.PathLike[str]) -> lora.LoRA:
    """The `lora.LoRA` settings of a PEFT adapter directory (rank, alpha,
    dropout, rsLoRA; `targets` selects exactly the modules its file adapts, in
    eqtrain's paths, with the layer index dropped)."""
    path = os.fspath(path)
    settings = _read_settings(path)
    tensors = _read_tensors(path)
    modules = {_split(k, path)[0] for k in _lora_keys(tensors)}
    # model.layers.3.self_attn.q_proj -> model.layers.self_attn.q_proj
    paths = {_LAYER_INDEX.sub(".", m, count=1) for m in modules}
    return _spec(settings, sorted(paths))


def load_adapter(
    model: Any, path: str | os.PathLike[str], *, model_type: str | None = None
) -> Any:
    """`model` (a base `Llama` or `GPT2`, without adapters) with the LoRA adapter
    of a PEFT directory applied: rank, scale (`lora_alpha / r`, or `/ sqrt(r)`
    with `use_rslora`), dropout and the adapted modules come from its files.
    Layers the file does not adapt (PEFT's `layers_to_transform`) get zero
    adapters, which compute nothing.

    Raises:
        HFFileNotFoundError, HFFormatError: missing files, a pickled adapter, a
            non-LoRA or unsupported adapter, tensor names without PEFT's prefix or
            naming modules the model lacks, a lora_A without its lora_B (or the
            reverse), shapes that do not fit the model.
    """
    path = os.fspath(path)
    settings = _read_settings(path)
    tensors = _read_tensors(path)
    arch = arch_of(model, model_type)
    adapters = {k: tensors[k] for k in _lora_keys(tensors)}
    found = _found(model, arch, adapters, path)
    adapted = lora.apply(model, _spec(settings, sorted(found)), key=jr.key(0))
    file = os.path.join(path, ADAPTER_WEIGHTS)
    adapted = lora.map_linears(adapted, lambda p, x: _filled(x, found.get(p), file))
    saved = {k[len(PREFIX) :]: v for k, v in tensors.items() if k not in adapters}
    return _with_saved_modules(adapted, saved, arch, path)


def _spec(settings: dict[str, Any], paths: list[str]) -> lora.LoRA:
    """The `lora.LoRA` of adapter_config.json's settings, adapting `paths`."""
    return lora.LoRA(
        rank=settings["r"],
        alpha=settings.get("lora_alpha", settings["r"]),
        dropout=float(settings.get("lora_dropout") or 0.0),
        targets=exact_regex(paths),
        rslora=bool(settings.get("use_rslora")),
    )


# -- the files -------------------------------------------------------------------------
def adapter_base(path: str | os.PathLike[str]) -> str | None:
    """The base model a PEFT adapter directory names (adapter_config.json's
    `base_model_name_or_path`) as written: a relative path is the working
    directory's, as `peft.AutoPeftModelForCausalLM` reads it (a Hub name is
    no local directory); None when it names none.

    Raises:
        HFFileNotFoundError, HFFormatError: no adapter_config.json, or not a
            LoRA adapter eqtrain can load.
    """
    base = _read_settings(os.fspath(path)).get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        return None
    return os.path.expanduser(base)


def _read_settings(path: str) -> dict[str, Any]:
    """adapter_config.json, checked to describe a LoRA adapter eqtrain can load."""
    settings = read_object(
        path,
        ADAPTER_CONFIG,
        kind=f"a PEFT adapter directory (holding {ADAPTER_CONFIG} and "
        f"{ADAPTER_WEIGHTS})",
        missing="so it is not a PEFT adapter directory "
        "(`PeftModel.save_pretrained` writes one).",
    )
    file = os.path.join(path, ADAPTER_CONFIG)
    _check_kind(settings, file)
    _check_supported(settings, file)
    _check_rank(settings, file)
    return settings


def _check_kind(settings: dict[str, Any], file: str) -> None:
    kind = settings.get("peft_type")
    if kind != "LORA":
        raise HFFormatError(
            f"{file} describes a {kind!r} adapter; eqtrain reads LoRA adapters "
            "(peft_type 'LORA') only."
        )


def _check_supported(settings: dict[str, Any], file: str) -> None:
    """No option eqtrain's LoRA lacks."""
    for key, what in _UNSUPPORTED:
        if settings.get(key):
            raise HFFormatError(
                f"{file} uses {what}, which eqtrain's LoRA does not support; "
                "merge the adapter with peft (`merge_and_unload`) and import the "
                "result as a base model instead."
            )


def _check_rank(settings: dict[str, Any], file: str) -> None:
    rank = settings.get("r")
    alpha = settings.get("lora_alpha", rank)
    if not isinstance(rank, int) or rank < 1:
        raise HFFormatError(f"{file}: `r` must be a positive integer; got {rank!r}.")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise HFFormatError(f"{file}: `lora_alpha` must be > 0; got {alpha!r}.")


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    file = os.path.join(path, ADAPTER_WEIGHTS)
    if os.path.isfile(file):
        return _safetensors.read(file)[0]
    if os.path.isfile(os.path.join(path, "adapter_model.bin")):
        raise HFFormatError(
            f"{path} holds only a pickled adapter (adapter_model.bin); eqtrain "
            "reads safetensors only, because loading a pickle can run arbitrary "
            "code. Where you trust the file, `PeftModel.from_pretrained(...)"
            ".save_pretrained(new_dir)` writes adapter_model.safetensors."
        )
    raise HFFileNotFoundError(
        f"{path} has no {ADAPTER_WEIGHTS}, so it holds no adapter weights "
        "(`PeftModel.save_pretrained` writes them there)."
    )


def _lora_keys(tensors: dict[str, np.ndarray]) -> list[str]:
    """The adapter tensors' names (the others are `modules_to_save` weights)."""
    return [k for k in tensors if ".lora_" in k or not k.startswith(PREFIX)]


def _split(key: str, path: str) -> tuple[str, str]:
    """`(HF module name, "A" | "B")` of a tensor name in an adapter file."""
    if not key.startswith(PREFIX):
        raise HFFormatError(
            f"tensor {key!r} in {os.path.join(path, ADAPTER_WEIGHTS)} lacks PEFT's "
            f"{PREFIX!r} prefix; peft itself would skip it and keep lora_B at zero "
            "(silently before peft 0.14, since then with only a missing-keys "
            "warning), so the adapter would do nothing. Rename it to "
            f"{PREFIX + key!r} (and the file's other keys likewise)."
        )
    match = _KEY.match(key[len(PREFIX) :])
    if match is None:
        raise HFFormatError(
            f"tensor {key!r} in {os.path.join(path, ADAPTER_WEIGHTS)} is not a LoRA "
            "weight (`<module>.lora_A.weight` or `<module>.lora_B.weight`)."
        )
    return match["module"], match["which"]


# -- the adapters ----------------------------------------------------------------------
def _found(
    model: Any, arch: _maps.Arch, tensors: dict[str, np.ndarray], path: str
) -> dict[str, dict[str, Parts]]:
    """The adapter `tensors` by eqtrain path, then `"A"` | `"B"`, then layer index;
    checked: every module is the model's, and every lora_A has its lora_B."""
    where = _module_places(model, arch)
    file = os.path.join(path, ADAPTER_WEIGHTS)
    found: dict[str, dict[str, Parts]] = {}
    for key, value in tensors.items():
        module, which = _split(key, path)
        if module not in where:
            raise HFFormatError(
                f"tensor {key!r} in {file} adapts the module {module!r}, which this "
                f"{type(model).__name__} does not have (its linear layers are named "
                f"like {', '.join(sorted(where)[:4])}, ...). Is it an adapter for "
                "another base model?"
            )
        p, index = where[module]
        found.setdefault(p, {}).setdefault(which, {})[index] = (key, value)
    if not found:
        raise HFFormatError(
            f"{file} holds no LoRA tensors (`...lora_A.weight`, `...lora_B.weight`); "
            "there is no adapter to load."
        )
    for parts in found.values():
        _check_pairs(parts, file)
    return found


def _module_places(model: Any, arch: _maps.Arch) -> dict[str, tuple[str, int | None]]:
    """HF module name -> (eqtrain path, layer index; None: not stacked)."""
    num_layers = _num_layers(model.config)
    where: dict[str, tuple[str, int | None]] = {}
    for p in lora.linear_paths(model):
        stacked = p.startswith(arch.layers + ".")
        for i, name in enumerate(module_names(arch, p, num_layers)):
            where[name] = (p, i if stacked else None)
    return where


def _check_pairs(parts: dict[str, Parts], file: str) -> None:
    """Every lora_A tensor of a module has its lora_B, and the reverse."""
    a, b = parts.get("A", {}), parts.get("B", {})
    for have, other, want in ((a, b, "B"), (b, a, "A")):
        for index in set(have) - set(other):
            key = have[index][0]
            raise HFFormatError(
                f"tensor {key!r} in {file} has no lora_{want} partner "
                f"({_PARTNER.sub(f'.lora_{want}', key)!r} is missing); the file is "
                "incomplete. Save the adapter again."
            )


def _filled(layer: Any, parts: dict[str, Parts] | None, file: str) -> Any:
    """An adapted layer with the file's `parts` in its adapters (None: as it is)."""
    if parts is None:
        return layer
    return LoRALinear(
        weight=layer.weight,
        bias=layer.bias,
        lora_a=_stack(parts["A"], layer.lora_a, file),
        lora_b=_stack(parts["B"], layer.lora_b, file),
        scale=layer.scale,
        dropout=layer.dropout,
    )


def _check_shapes(parts: Parts, per_layer: tuple[int, ...], file: str) -> None:
    for key, value in parts.values():
        if tuple(value.shape) != per_layer:
            raise HFFormatError(
                f"tensor {key!r} in {file} has shape {tuple(value.shape)}, but this "
                f"model needs {per_layer}: the adapter was made for another base "
                "model or rank."
            )


def _stack(parts: Parts, like: Any, file: str) -> Any:
    """One eqtrain adapter array from PEFT's per-layer tensors (missing layers:
    zeros, in both A and B, so the layer's update is zero), in `like`'s dtype."""
    shape = tuple(like.shape)
    stacked = len(shape) == 3
    _check_shapes(parts, shape[1:] if stacked else shape, file)
    if not stacked:
        return jnp.asarray(parts[None][1], like.dtype)
    out = np.zeros(shape, np.float32)
    for index, (_, value) in parts.items():
        out[index] = np.asarray(value, np.float32)
    return jnp.asarray(out, like.dtype)


# -- modules_to_save -------------------------------------------------------------------
# eqtrain path -> index over the stacked axes (None: unstacked) -> HF tensor
Updates = dict[str, dict[tuple[int, ...] | None, np.ndarray]]


def _with_saved_modules(
    model: Any, saved: dict[str, np.ndarray], arch: _maps.Arch, path: str
) -> Any:
    """`model` with the weights of PEFT's `modules_to_save` (HF names) put in."""
    if not saved:
        return model
    file = os.path.join(path, ADAPTER_WEIGHTS)
    targets = _saved_targets(model, arch)
    updates: Updates = {}  # by the eqtrain leaf they go to, in eqtrain's layout
    for name, value in saved.items():
        if name not in targets:
            raise HFFormatError(
                f"tensor {PREFIX + name!r} in {file} (a module to save) names a "
                f"weight this {type(model).__name__} does not have."
            )
        p, index = targets[name]
        updates.setdefault(p, {})[index] = (
            value.T if _maps.is_conv1d(arch, p) else value
        )
    put = functools.partial(_put_saved, updates=updates, file=file)
    return jtu.tree_map_with_path(put, model)


def _saved_targets(
    model: Any, arch: _maps.Arch
) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """HF name -> (eqtrain path, index over the stacked axes; None: unstacked)."""
    targets: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for p, leaf in _maps.leaves(lora.unwrap(model)):
        for name, at in _maps.indexed_names(arch, p, leaf.shape):
            targets[name] = (p, at or None)
    return targets


def _put_saved(keys: Any, leaf: Any, updates: Updates, file: str) -> Any:
    """`leaf` with its saved values put in, if it has any."""
    p = jtu.keystr(keys, simple=True, separator=".")
    if p not in updates:
        return leaf
    out = np.array(leaf, np.float32)
    for index, value in updates[p].items():
        want = out.shape if index is None else out.shape[len(index) :]
        if tuple(value.shape) != tuple(want):
            raise HFFormatError(
                f"the saved module weight for `{p}` in {file} has shape "
                f"{tuple(value.shape)}; this model needs {tuple(want)}."
            )
        out[... if index is None else index] = value
    return jnp.asarray(out, leaf.dtype)
