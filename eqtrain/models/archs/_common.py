"""What every Llama-like architecture's Hugging Face mapping shares: reading the
common `config.json` keys (sizes, norms, rotary embeddings, windows), writing
them back, and checking that a `DecoderConfig` is expressible as a model type.

A family file (`llama.py`, `gemma.py`, ...) declares one `Arch` per
`model_type`: the switches it fixes, the fields it can vary, and the few keys
of its own it reads and writes.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ..._errors import ConfigError
from .._decoder_config import MOE_OPTIONS, DecoderConfig
from .._options import RUNTIME_OPTIONS
from .._rope import Rope, rope_from_hf


class HFConfigError(ConfigError):
    """A `config.json` eqtrain cannot load exactly (`eqtrain.hf` raises it as
    its `HFFormatError`)."""


# Fields any architecture can hold: sizes, rotary embeddings, runtime options
# (the sparse MLPs' too: a dense model ignores them).
COMMON_FREE = frozenset(
    {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"}
    | {"num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps"}
    | {"rope_theta", "rope", "tie_word_embeddings", "max_position_embeddings"}
    | {"initializer_range", "param_dtype", "model_type", "hidden_act"}
    | RUNTIME_OPTIONS
    | MOE_OPTIONS
)
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DecoderConfig)}


class Reader:
    """A parsed `config.json` and where it came from, for clear errors."""

    def __init__(self, hf: Mapping[str, Any], path: str):
        self.hf, self.path = dict(hf), path

    def get(self, key: str, default: Any = None) -> Any:
        value = self.hf.get(key)
        return default if value is None else value

    def need(self, key: str) -> Any:
        if self.hf.get(key) is None:
            raise HFConfigError(
                f"{self.path}: the {self.hf.get('model_type')} config has no "
                f"{key!r}; it is needed to build the model. Add it to config.json."
            )
        return self.hf[key]

    def require(self, what: str, ok: bool, got: Any) -> None:
        """Refuse a value the model cannot honour, by name."""
        if not ok:
            raise HFConfigError(
                f"{self.path}: eqtrain's model does not support {what} (got "
                f"{got!r}); this checkpoint cannot be loaded exactly."
            )


Switch = Any | Callable[[DecoderConfig], Any]


@dataclasses.dataclass(frozen=True)
class Arch:
    """One Hugging Face architecture of the shared decoder.

    Attributes:
        model_type: `config.json`'s `model_type`.
        architecture: its `architectures` entry (`LlamaForCausalLM`).
        switches: `DecoderConfig` fields this architecture fixes (a value, or a
            function of the config: Gemma's embedding scale of its size,
            Qwen2-MoE's o_proj bias of its q/k/v biases).
        free: fields (beyond `COMMON_FREE`) that it can hold with any value.
        read: `(reader, common) -> {field: value}`: its own keys of
            `config.json` (after the common ones, which it may override).
        write: `config -> {key: value}`: its own `config.json` keys.
        check: `config -> [problem]`: what `switches`/`free` cannot say.
        theta: `rope_theta` when a config.json has none (transformers' default).
        act: the key of the MLP's activation in config.json and its default.
        original_default: for configs with a top-level
            `original_max_position_embeddings` (Phi-3), its default.
        rope_aliases: rope types its config class renames (Phi-3 reads the
            legacy `su` and `yarn` as `longrope`).
        defaults: transformers' defaults of common keys where they are not
            Llama's (`tie_word_embeddings`, `head_dim`, `rms_norm_eps`,
            `max_position_embeddings`).
        renames: the layers' tensors whose Hugging Face names differ from
            eqtrain's paths, as `(path under the layers, Hugging Face name)`
            pairs (Mixtral's `mlp.gate.weight` is `block_sparse_moe.gate.weight`);
            `{expert}` in a name marks a tensor per expert (the leaf's axis
            after the layers'). See `eqtrain.models.HFNames`.
    """

    model_type: str
    architecture: str
    switches: Mapping[str, Switch] = dataclasses.field(default_factory=dict)
    free: frozenset[str] = frozenset()
    read: Callable[[Reader, dict[str, Any]], dict[str, Any]] = lambda r, c: {}
    write: Callable[[DecoderConfig], dict[str, Any]] = lambda c: {}
    check: Callable[[DecoderConfig], list[str]] = lambda c: []
    theta: float = 10000.0
    act: tuple[str, str] = ("hidden_act", "silu")
    original_default: int | None = None
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    rope_aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    renames: tuple[tuple[str, str], ...] = ()

    def fixed(self, config: DecoderConfig) -> dict[str, Any]:
        """The switches' values for (the sizes of) `config`."""
        return {k: v(config) if callable(v) else v for k, v in self.switches.items()}

    def problems(self, config: DecoderConfig) -> list[str]:
        """What in `config` this architecture cannot express (empty: all of it)."""
        out = []
        fixed = self.fixed(config)
        for field, default in _DEFAULTS.items():
            value = getattr(config, field)
            if field in fixed:
                if value != fixed[field]:
                    out.append(f"{field}={value!r} (it has {fixed[field]!r})")
            elif field not in COMMON_FREE | self.free and value != default:
                out.append(f"{field}={value!r}")
        return out + self.check(config)

    def from_hf(self, reader: Reader, param_dtype: str) -> DecoderConfig:
        try:
            common = read_common(reader, self)
            fields = {**common, **self.fixed_from(common), **self.read(reader, common)}
            config = DecoderConfig(param_dtype=param_dtype, **fields)
        except HFConfigError:
            raise
        except ConfigError as error:
            text = str(error)
            where = "" if reader.path in text else f"{reader.path}: "
            raise HFConfigError(where + text) from None
        # What export could not write back as this model type (e.g. Qwen2's
        # sliding layers before full ones) is refused here too.
        problems = self.problems(config)
        if problems:
            raise HFConfigError(
                f"{reader.path}: eqtrain does not support {'; '.join(problems)} "
                f"in a {self.model_type} model; this checkpoint cannot be loaded "
                "exactly."
            )
        return config

    def fixed_from(self, fields: dict[str, Any]) -> dict[str, Any]:
        probe = DecoderConfig(**{k: v for k, v in fields.items() if k in _SIZE_FIELDS})
        return self.fixed(probe)

    def to_hf(self, config: DecoderConfig) -> dict[str, Any]:
        out = write_common(config)
        del out["hidden_act"]
        return {**out, self.act[0]: config.hidden_act, **self.write(config)}


_SIZE_FIELDS = {
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
}


# -- config.json -> fields -----------------------------------------------------------
def read_common(r: Reader, arch: Arch) -> dict[str, Any]:
    """The `DecoderConfig` fields every Llama-like config.json gives."""
    heads = int(r.need("num_attention_heads"))
    hidden = int(r.need("hidden_size"))
    kv = int(r.get("num_key_value_heads") or heads)
    head_dim = _read_head_dim(r, arch, hidden, heads)
    out = _read_shape(r, arch)
    out.update(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=None if kv == heads else kv,
        head_dim=None if head_dim is None else int(head_dim),
    )
    size = head_dim or hidden // heads
    out.update(read_rope(r, arch, size))
    key, default = arch.act
    out["hidden_act"] = r.get(key, default)
    return out


def _read_head_dim(r: Reader, arch: Arch, hidden: int, heads: int) -> Any:
    """`head_dim`, None when it is the default `hidden // heads`: values equal
    to their defaults are written as `None`, as a hand-written config would
    have them, so that a round trip gives an equal config."""
    head_dim = r.get("head_dim", arch.defaults.get("head_dim"))
    if head_dim is not None and hidden % heads == 0 and head_dim == hidden // heads:
        return None
    return head_dim


def _read_shape(r: Reader, arch: Arch) -> dict[str, Any]:
    """The sizes and options besides the heads' that every config.json gives."""
    default = arch.defaults.get
    layers = int(r.need("num_hidden_layers"))
    return dict(
        vocab_size=int(r.need("vocab_size")),
        intermediate_size=int(r.need("intermediate_size")),
        num_hidden_layers=layers,
        rms_norm_eps=float(r.get("rms_norm_eps", default("rms_norm_eps", 1e-6))),
        tie_word_embeddings=bool(
            r.get("tie_word_embeddings", default("tie_word_embeddings", False))
        ),
        max_position_embeddings=int(
            r.get("max_position_embeddings", default("max_position_embeddings", 2048))
        ),
        initializer_range=float(r.get("initializer_range", 0.02)),
        model_type=arch.model_type,
    )


def read_rope(
    r: Reader, arch: Arch, head_dim: int, layer_type: str | None = None
) -> dict[str, Any]:
    """`rope_theta`/`rope`/`partial_rotary_factor` from `rope_parameters`
    (transformers 5; Gemma 3's per layer type with `layer_type`), else from
    `rope_scaling` and `rope_theta` (4.x files)."""
    params, name = _rope_source(r, layer_type)
    params = _rope_params(r, arch, params, layer_type)
    partial = float(
        params.get("partial_rotary_factor", r.get("partial_rotary_factor", 1.0))
    )
    original = None
    if arch.original_default is not None:
        original = int(r.get("original_max_position_embeddings", arch.original_default))
    longest = r.get(
        "max_position_embeddings", arch.defaults.get("max_position_embeddings", 2048)
    )
    rope = rope_from_hf(
        params, head_dim=head_dim, max_position_embeddings=int(longest),
        partial_rotary_factor=partial, original_max_position_embeddings=original,
        where=r.path, name=name,
    )  # fmt: skip
    return _rope_fields(rope, partial, head_dim)


def _rope_source(r: Reader, layer_type: str | None) -> tuple[Any, str]:
    """The rotary parameters as the file gives them, and their key's name:
    `rope_parameters` (Gemma 3's for `layer_type`), else `rope_scaling`."""
    params, name = r.get("rope_parameters"), "rope_parameters"
    scaling = r.get("rope_scaling") or {}
    if layer_type is not None:
        # Gemma 3: a dict per layer type; a 4.x `rope_scaling` is the full
        # layers' alone (the sliding ones keep the default type).
        nested = params if isinstance(params, Mapping) else {}
        params, name = dict(nested.get(layer_type) or {}), f"{name}.{layer_type}"
        if layer_type == "full_attention" and scaling:
            params, name = {**params, **scaling}, "rope_scaling"
    elif not isinstance(params, Mapping):
        params, name = scaling, "rope_scaling"
    return params, name


def _rope_params(
    r: Reader, arch: Arch, params: Any, layer_type: str | None
) -> dict[str, Any]:
    """`params` with the architecture's rope type names resolved and its
    `rope_theta` (the file's top-level one, or Gemma 3's local base frequency
    for sliding layers) filled in."""
    params = dict(params)
    kind = params.get("rope_type", params.get("type"))
    if kind in arch.rope_aliases:
        params["rope_type"] = arch.rope_aliases[kind]
    if "rope_theta" not in params:
        local = layer_type == "sliding_attention"
        params["rope_theta"] = r.get(
            "rope_local_base_freq" if local else "rope_theta", arch.theta
        )
    return params


def _rope_fields(rope: Rope, partial: float, head_dim: int) -> dict[str, Any]:
    """The `DecoderConfig` fields of a rotary embedding: `rope_theta`, and
    `partial_rotary_factor` and `rope` where they are not the defaults."""
    out: dict[str, Any] = {"rope_theta": float(rope.theta)}
    if partial != 1.0:
        out["partial_rotary_factor"] = partial
    if rope != Rope(theta=rope.theta, dim=int(head_dim * partial)):
        out["rope"] = rope
    return out


def read_layer_types(r: Reader, layers: int) -> tuple[str, ...] | None:
    """`layer_types` as config.json gives it (None when absent or all full)."""
    types = r.get("layer_types")
    if types is None:
        return None
    r.require(
        f"layer_types of {len(types)} entries for {layers} layers",
        len(types) == layers,
        types,
    )
    return tuple(types)


# -- fields -> config.json -----------------------------------------------------------
def write_common(c: DecoderConfig) -> dict[str, Any]:
    theta = float(c.rope_theta)
    out: dict[str, Any] = {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_size,
        "hidden_act": c.hidden_act,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": float(c.rms_norm_eps),
        "rope_parameters": rope_parameters(c.global_rope, c.partial_rotary_factor),
        "rope_theta": theta,
        "attention_dropout": 0.0,
        "tie_word_embeddings": c.tie_word_embeddings,
    }
    return out


def rope_parameters(rope: Rope, partial: float = 1.0) -> dict[str, Any]:
    out = dict(rope.to_hf())
    if partial != 1.0:
        out["partial_rotary_factor"] = partial
    return out


def layer_types(c: DecoderConfig) -> list[str]:
    """Every layer's type, spelled out (as transformers 5 writes them)."""
    return [
        "sliding_attention" if c.window(i) is not None else "full_attention"
        for i in range(c.num_hidden_layers)
    ]
