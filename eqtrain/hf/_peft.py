"""LoRA adapters in PEFT's format: `export_adapter` writes the directory
`peft.PeftModel.save_pretrained` would (adapter_model.safetensors and
adapter_config.json); `load_adapter` reads one back onto an eqtrain model, and
`adapter_spec` reads its settings. Safetensors only: a pickled adapter is refused.

PEFT names a tensor `base_model.model.<HF module>.lora_A.weight` (`[rank, in]`)
or `.lora_B.weight` (`[out, rank]`), one per layer; GPT-2's `Conv1D` targets have
the same adapter layouts as `nn.Linear` ones (only their base weight is stored
transposed). Without the `base_model.model.` prefix PEFT skips the tensors and
keeps `lora_B = 0`, an adapter that does nothing (since peft 0.14 with a
"missing adapter keys" warning, before that silently), so the prefix is checked
on read.
"""

import json
import math
import os
import re
from typing import Any

import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np

from .. import lora
from .._errors import ConfigError
from ..lora import LoRALinear
from . import _maps, _safetensors
from ._errors import HFFileNotFoundError, HFFormatError
from ._export import _atomic_dir, _check_target, _num_layers, _write_json, hf_tensors


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(\.default)?\.weight$")


def _arch(model: Any, model_type: str | None) -> _maps.Arch:
    return _maps.ARCHS[_maps.infer_model_type(model.config, model_type)]


def _adapters(model: Any) -> list[tuple[str, LoRALinear]]:
    found = [(p, x) for p, x in lora.linears(model) if isinstance(x, LoRALinear)]
    if not found:
        raise ConfigError(
            "the model carries no LoRA adapters to export; wrap it with "
            "`eqtrain.lora.apply` (and train it) first."
        )
    return found


def _module_names(arch: _maps.Arch, path: str, num_layers: int) -> list[str]:
    """The HF module name(s) of an eqtrain linear layer path (one per layer)."""
    return _maps.hf_names(arch, path, num_layers)


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
    modules = sorted(
        name for p in adapted for name in _module_names(arch, p, num_layers)
    )
    return "^(" + "|".join(re.escape(m) for m in modules) + ")$"


def export_adapter(
    model: Any,
    out_dir: str | os.PathLike[str],
    *,
    model_type: str | None = None,
    base_model_name_or_path: str | None = None,
    spec: lora.LoRA | None = None,
    trained: Any = None,
    overwrite: bool = False,
) -> str:
    """Write the LoRA adapters of `model` as PEFT's adapter directory, atomically.

    `peft.PeftModel.from_pretrained(hf_base, out_dir)` then loads them onto the
    `transformers` model of the same base, without warnings and with the same
    logits. Disabled adapters are written too (they hold the trained values).

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
        overwrite: replace an earlier export at `out_dir`.

    Raises:
        ConfigError: no adapters, or adapters of different ranks, scales or
            dropout rates (PEFT's file has one of each).
    """
    arch = _arch(model, model_type)
    found = _adapters(model)
    num_layers = _num_layers(model.config)
    ranks = {x.lora_a.shape[-2] for _, x in found}
    scales = {x.scale for _, x in found}
    drops = {x.dropout for _, x in found}
    if len(ranks) > 1 or len(scales) > 1 or len(drops) > 1:
        raise ConfigError(
            "PEFT's adapter_config.json has one rank, alpha and dropout for all "
            f"adapters; this model's differ (ranks {sorted(ranks)}, scales "
            f"{sorted(scales)}, dropout {sorted(drops)})."
        )
    rank, scale, dropout = ranks.pop(), scales.pop(), drops.pop()
    tensors: dict[str, np.ndarray] = {}
    for path, layer in found:
        names = _module_names(arch, path, num_layers)
        for which, value in (("A", layer.lora_a), ("B", layer.lora_b)):
            array = np.asarray(value)
            per_layer = (
                [array[i] for i in range(len(names))] if array.ndim == 3 else [array]
            )
            for name, part in zip(names, per_layer, strict=True):
                tensors[f"{PREFIX}{name}.lora_{which}.weight"] = np.ascontiguousarray(
                    part
                )
    modules = _trained_modules(model, trained, arch)
    if modules:
        whole = hf_tensors(lora.unwrap(model), arch, None)
        for name, value in whole.items():
            if name.rsplit(".", 1)[0] in modules:
                tensors[PREFIX + name] = value
    adapted = {p for p, _ in found}
    alpha, rslora = _clean(scale * rank), False
    if spec is not None and spec.rank == rank and math.isclose(spec.scale, scale):
        alpha, rslora = _clean(float(spec.alpha or spec.rank)), spec.rslora
    settings = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": int(rank),
        "lora_alpha": alpha,
        "lora_dropout": float(dropout),
        "use_rslora": rslora,
        "target_modules": _target_modules(model, arch, adapted, num_layers),
        "fan_in_fan_out": bool(arch.conv1d),
        "bias": "none",
        "modules_to_save": sorted(modules) or None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    out_dir = os.fspath(out_dir)
    _check_target(out_dir, overwrite)
    with _atomic_dir(out_dir, overwrite) as tmp:
        _safetensors.write(
            os.path.join(tmp, ADAPTER_WEIGHTS), tensors, {"format": "pt"}
        )
        _write_json(os.path.join(tmp, ADAPTER_CONFIG), settings)
    return out_dir


def _trained_modules(model: Any, trained: Any, arch: _maps.Arch) -> set[str]:
    """The HF module names holding trained leaves other than the adapters."""
    if trained is None:
        return set()
    flat_mask = jtu.tree_leaves(trained)
    flat, _ = jtu.tree_flatten_with_path(model, is_leaf=lambda x: x is None)
    if len(flat) != len(flat_mask):
        raise ConfigError(
            "`trained` must be the model's trainable mask (`state.trainable`); its "
            "structure does not match the model's."
        )
    out: set[str] = set()
    for (keys, leaf), flag in zip(flat, flat_mask, strict=True):
        path = jtu.keystr(keys, simple=True, separator=".")
        if not flag or lora.is_adapter_path(path):
            continue
        if path.rsplit(".", 1)[0] in set(lora.adapter_paths(model)):
            raise ConfigError(
                f"`{path}` trains besides its adapter; PEFT files cannot hold a "
                "trained base weight of an adapted layer. Leave it frozen, or "
                "export the merged model instead."
            )
        for name, _ in _maps.indexed_names(arch, path, np.shape(leaf)):
            out.add(name.rsplit(".", 1)[0])
    return out


def _clean(x: float) -> float | int:
    """An integral float as an int (PEFT writes `lora_alpha: 16`)."""
    return int(round(x)) if abs(x - round(x)) < 1e-9 else float(x)


# -- reading --------------------------------------------------------------------------
def _read_settings(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise HFFileNotFoundError(
            f"{path} is not a directory; pass a PEFT adapter directory (holding "
            f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})."
        )
    file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(file):
        raise HFFileNotFoundError(
            f"{path} has no {ADAPTER_CONFIG}, so it is not a PEFT adapter "
            "directory (`PeftModel.save_pretrained` writes one)."
        )
    try:
        with open(file, encoding="utf-8") as f:
            settings = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HFFormatError(f"{file} is not valid JSON: {e}.") from None
    if not isinstance(settings, dict):
        raise HFFormatError(f"{file} must hold a JSON object.")
    kind = settings.get("peft_type")
    if kind != "LORA":
        raise HFFormatError(
            f"{file} describes a {kind!r} adapter; eqtrain reads LoRA adapters "
            "(peft_type 'LORA') only."
        )
    for key, what in (
        ("use_dora", "DoRA"),
        ("rank_pattern", "per-module ranks (rank_pattern)"),
        ("alpha_pattern", "per-module alphas (alpha_pattern)"),
        ("lora_bias", "adapter biases (lora_bias)"),
    ):
        if settings.get(key):
            raise HFFormatError(
                f"{file} uses {what}, which eqtrain's LoRA does not support; "
                "merge the adapter with peft (`merge_and_unload`) and import the "
                "result as a base model instead."
            )
    rank = settings.get("r")
    alpha = settings.get("lora_alpha", rank)
    if not isinstance(rank, int) or rank < 1:
        raise HFFormatError(f"{file}: `r` must be a positive integer; got {rank!r}.")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise HFFormatError(f"{file}: `lora_alpha` must be > 0; got {alpha!r}.")
    return settings


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        pickled = os.path.join(path, "adapter_model.bin")
        if os.path.isfile(pickled):
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
    return _safetensors.read(file)[0]


def adapter_spec(path: str | os.PathLike[str]) -> lora.LoRA:
    """The `lora.LoRA` settings of a PEFT adapter directory (rank, alpha,
    dropout, rsLoRA; `targets` selects exactly the modules its file adapts, in
    eqtrain's paths, with the layer index dropped)."""
    path = os.fspath(path)
    settings = _read_settings(path)
    tensors = _read_tensors(path)
    modules = sorted({_split(k, path)[0] for k in _lora_keys(tensors, path)})
    paths = sorted({_unindexed(m) for m in modules})
    return lora.LoRA(
        rank=settings["r"],
        alpha=settings.get("lora_alpha", settings["r"]),
        dropout=float(settings.get("lora_dropout") or 0.0),
        targets="^(" + "|".join(re.escape(p) for p in paths) + ")$",
        rslora=bool(settings.get("use_rslora")),
    )


def _lora_keys(tensors: dict[str, np.ndarray], path: str) -> list[str]:
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


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _unindexed(module: str) -> str:
    """`model.layers.3.self_attn.q_proj` -> `model.layers.self_attn.q_proj`."""
    return _LAYER_INDEX.sub(".", module, count=1)


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
    arch = _arch(model, model_type)
    num_layers = _num_layers(model.config)
    # HF module name -> (eqtrain path, layer index or None)
    where: dict[str, tuple[str, int | None]] = {}
    for p in lora.linear_paths(model):
        names = _module_names(arch, p, num_layers)
        stacked = p.startswith(arch.layers + ".")
        for i, name in enumerate(names):
            where[name] = (p, i if stacked else None)
    file = os.path.join(path, ADAPTER_WEIGHTS)
    # eqtrain path -> "A" | "B" -> layer index (None: unstacked) -> (key, tensor)
    found: dict[str, dict[str, dict[int | None, tuple[str, np.ndarray]]]] = {}
    lora_keys = _lora_keys(tensors, path)
    saved = {k[len(PREFIX) :]: v for k, v in tensors.items() if k not in lora_keys}
    for key in lora_keys:
        module, which = _split(key, path)
        if module not in where:
            shown = ", ".join(sorted(where)[:4])
            raise HFFormatError(
                f"tensor {key!r} in {file} adapts the module {module!r}, which this "
                f"{type(model).__name__} does not have (its linear layers are named "
                f"like {shown}, ...). Is it an adapter for another base model?"
            )
        p, index = where[module]
        found.setdefault(p, {}).setdefault(which, {})[index] = (key, tensors[key])
    if not found:
        raise HFFormatError(
            f"{file} holds no LoRA tensors (`...lora_A.weight`, `...lora_B.weight`); "
            "there is no adapter to load."
        )
    for parts in found.values():
        _check_pairs(parts, file)
    rank = settings["r"]
    spec = lora.LoRA(
        rank=rank,
        alpha=settings.get("lora_alpha", rank),
        dropout=float(settings.get("lora_dropout") or 0.0),
        targets="^(" + "|".join(re.escape(p) for p in sorted(found)) + ")$",
        rslora=bool(settings.get("use_rslora")),
    )
    adapted = lora.apply(model, spec, key=jr.key(0))

    def fill(p: str, layer: Any) -> Any:
        if p not in found:
            return layer
        parts = found[p]
        new = {}
        for which, name in (("A", "lora_a"), ("B", "lora_b")):
            current = getattr(layer, name)
            new[name] = _stack(parts[which], current, file)
        return LoRALinear(
            weight=layer.weight,
            bias=layer.bias,
            lora_a=new["lora_a"],
            lora_b=new["lora_b"],
            scale=layer.scale,
            dropout=layer.dropout,
        )

    adapted = lora.map_linears(adapted, fill)
    return _with_saved_modules(adapted, saved, arch, path)


def _with_saved_modules(
    model: Any,
    saved: dict[str, np.ndarray],
    arch: _maps.Arch,
    path: str,
) -> Any:
    """`model` with the weights of PEFT's `modules_to_save` (HF names) put in."""
    if not saved:
        return model
    file = os.path.join(path, ADAPTER_WEIGHTS)
    # HF name -> (eqtrain path, index over the stacked axes, None: unstacked)
    targets: dict[str, tuple[str, tuple[int, ...] | None]] = {}
    for p, leaf in _maps.leaves(lora.unwrap(model)):
        for name, at in _maps.indexed_names(arch, p, leaf.shape):
            targets[name] = (p, at or None)
    updates: dict[str, dict[tuple[int, ...] | None, np.ndarray]] = {}
    for name, value in saved.items():
        if name not in targets:
            raise HFFormatError(
                f"tensor {PREFIX + name!r} in {file} (a module to save) names a "
                f"weight this {type(model).__name__} does not have."
            )
        p, index = targets[name]
        if _maps.is_conv1d(arch, p):
            value = value.T
        updates.setdefault(p, {})[index] = value

    def put(keys: Any, leaf: Any) -> Any:
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
            if index is None:
                out[...] = value
            else:
                out[index] = value
        return jnp.asarray(out, leaf.dtype)

    return jtu.tree_map_with_path(put, model)


def _check_pairs(
    parts: dict[str, dict[int | None, tuple[str, np.ndarray]]], file: str
) -> None:
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


_PARTNER = re.compile(r"\.lora_[AB](?=(\.default)?\.weight$)")


def _stack(
    parts: dict[int | None, tuple[str, np.ndarray]], like: Any, file: str
) -> Any:
    """One eqtrain adapter array from PEFT's per-layer tensors (missing layers:
    zeros, in both A and B, so the layer's update is zero), in `like`'s dtype."""
    shape = tuple(like.shape)
    stacked = len(shape) == 3
    per_layer = shape[1:] if stacked else shape
    for key, value in parts.values():
        if tuple(value.shape) != per_layer:
            raise HFFormatError(
                f"tensor {key!r} in {file} has shape {tuple(value.shape)}, but this "
                f"model needs {per_layer}: the adapter was made for another base "
                "model or rank."
            )
    if not stacked:
        return jnp.asarray(parts[None][1], like.dtype)
    out = np.zeros(shape, np.float32)
    for index, (_, value) in parts.items():
        out[index] = np.asarray(value, np.float32)
    return jnp.asarray(out, like.dtype)
