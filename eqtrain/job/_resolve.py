"""Resolving a config into a run's pieces: the tokenizer, the model's
architecture (from `[model]` or `model.init_from`'s config.json), the optimizer,
the chat template and the LoRA spec. Each is a function of the config;
`_build.build` assembles them into a `Job` (and resolves its loss, which needs
the traced model)."""

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import jax

from .. import (
    data as data_lib,
    hf,
    lora as lora_lib,
    models,
    optim,
    quantize as quantize_lib,
)
from .._errors import ConfigError
from ..config import Config, explicit
from ..cpu import layers_scanned


# -- tokenizer ------------------------------------------------------------------
def make_tokenizer(config: Config, init_from: str | None = None) -> Any:
    """The tokenizer `data.tokenizer` names (`auto`: the one in `init_from`, by
    default `model.init_from`)."""
    name = tokenizer_name(config, init_from)
    if name == "byte":
        return data_lib.ByteTokenizer()
    return data_lib.HFTokenizer.from_file(name)


def tokenizer_name(config: Config, init_from: str | None = None) -> str:
    """`data.tokenizer` resolved, without reading the tokenizer: `"byte"` or the
    path of its tokenizer.json (`auto`: `init_from`'s, as `make_tokenizer`)."""
    name = config.data.tokenizer
    if name == "auto":
        init_from = init_from or config.model.init_from
        name = hf.tokenizer_for(init_from) if init_from else "byte"
    return name if name == "byte" else str(_tokenizer_file(name))


def _tokenizer_file(name: str) -> Path:
    """The tokenizer.json `name` is, or holds."""
    path = Path(name)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"`data.tokenizer` names {name!r}, but {path} does not exist. Pass "
            "'byte', a tokenizer.json file, or a directory holding one."
        )
    return path


# -- model ------------------------------------------------------------------------
def architecture_source(config: Config, recorded: Path | None) -> str | None:
    """Where the architecture and tokenizer files are read: the run's record of
    `model.init_from` when it holds a config.json, else `model.init_from`."""
    init_from = config.model.init_from
    if init_from is None or recorded is None:
        return init_from
    return str(recorded) if (recorded / "config.json").is_file() else init_from


def scan_layers(config: Config) -> Config:
    """`model.scan_layers = "auto"` made true or false: scanned on GPUs and
    TPUs; on the CPU, as `eqtrain.cpu.tune_cpu` measured on this processor
    (unrolled without a measurement)."""
    m = config.model
    if m.scan_layers != "auto":
        return config
    scanned = jax.default_backend() != "cpu" or layers_scanned()
    return dataclasses.replace(
        config, model=dataclasses.replace(m, scan_layers=scanned)
    )


def architecture(
    config: Config, tokenizer: Any, source: str | None
) -> tuple[Config, Any, str]:
    """`(config, model_config, model_type)`: the model `[model]` describes, or
    `model.init_from`'s (read from `source`), with the config's architecture
    fields filled in from it, and `model.scan_layers = "auto"` resolved
    (`scan_layers`)."""
    config = scan_layers(config)
    if config.model.init_from is not None:
        return _loaded_architecture(config, tokenizer, source)
    model_config, model_type = _section_architecture(config, tokenizer)
    return config, model_config, model_type


def _loaded_architecture(
    config: Config, tokenizer: Any, source: str | None
) -> tuple[Config, Any, str]:
    config, model_config, model_type = loaded_model(config, source)
    config = _fit_seq_len(config)
    _check_vocab(config, tokenizer, model_config.vocab_size, "model.init_from")
    return config, model_config, model_type


def loaded_model(config: Config, source: str | None) -> tuple[Config, Any, str]:
    """`(config, model_config, model_type)` of `model.init_from`'s config.json
    (read from `source`): `config` with its `[model]` architecture keys filled
    in from it, and the model config with the `[model]` runtime options."""
    m = config.model
    model_config, hf_type = hf.load_config(source, dtype=m.param_dtype)
    # the [model] runtime options, as `base_model` applies them to the weights
    model_config = dataclasses.replace(
        model_config,
        **models.runtime_options(m),
        **models.moe_options(m, model_config),
    )
    model_type = hf.infer_model_type(model_config, hf_type)
    section = model_section(model_config, model_type, base=m)
    return dataclasses.replace(config, model=section), model_config, model_type


def _section_architecture(config: Config, tokenizer: Any) -> tuple[Any, str]:
    m = config.model
    vocab = m.vocab_size if m.vocab_size is not None else tokenizer.vocab_size
    _check_vocab(config, tokenizer, vocab, "model.vocab_size")
    seq = m.max_seq_len or config.data.seq_len
    given = {k.split(".", 1)[1] for k in explicit(config) if k.startswith("model.")}
    family = models.family(m.arch)
    try:
        model_config = family.from_section(
            m, vocab_size=vocab, max_seq_len=seq, given=given
        )
        # A family's own name lets the config pick the architecture: `llama` with
        # a sliding window is exported as Mistral, which has one.
        own = None if m.arch == family.name else m.arch
        return model_config, hf.infer_model_type(model_config, own)
    except ConfigError as e:
        raise _section_error(e, m.arch == family.name) from None


def _section_error(e: ConfigError, own_name: bool) -> ConfigError:
    """What a `[model]` section no family can build says."""
    if own_name and "cannot express" in str(e):
        what = str(e).split(" has ", 1)[-1].split(", which")[0]
        return ConfigError(
            f"no Hugging Face architecture expresses this [model] section (it "
            f"has {what}); set model.arch to the architecture you mean (the "
            "model types of docs/models.md, 'Decoder families')."
        )
    return ConfigError(f"the [model] section is inconsistent: {e}")


def _fit_seq_len(config: Config) -> Config:
    """Rows no longer than the loaded model's positions: the default `data.seq_len`
    shrinks to fit; an explicit one that does not fit is an error."""
    limit, seq = config.model.max_seq_len, config.data.seq_len
    if limit is None or seq <= limit:
        return config
    if "data.seq_len" in explicit(config):
        raise ConfigError(
            f"`data.seq_len` ({seq}) exceeds the positions of `model.init_from`'s "
            f"model ({limit}); use data.seq_len <= {limit}."
        )
    data = dataclasses.replace(config.data, seq_len=limit)
    return dataclasses.replace(config, data=data)


def model_section(model_config: Any, model_type: str, *, base: Any) -> Any:
    """The `[model]` section describing `model_config` (an HF model's), keeping
    `base`'s runtime options and `init_from`."""
    fields = models.family(model_type).to_section(model_config)
    return dataclasses.replace(base, arch=model_type, **fields)


def _check_vocab(config: Config, tokenizer: Any, vocab: int, source: str) -> None:
    if tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"the tokenizer ({config.data.tokenizer!r}: {tokenizer.vocab_size} ids) "
            f"does not fit the model's vocabulary of {vocab} ({source}): token ids "
            "past the embedding table would be silently wrong. Use the model's own "
            "tokenizer (data.tokenizer) or a model with a large enough vocabulary."
        )


def optim_defaults(config: Config) -> Config:
    """`optim.weight_decay`'s default is AdamW's; `adam` takes no decoupled
    weight decay, so unless the key was set there it is 0 (and the run's
    config.toml says so)."""
    optim_ = config.optim
    if optim_.name != "adam" or "optim.weight_decay" in explicit(config):
        return config
    return dataclasses.replace(
        config, optim=dataclasses.replace(optim_, weight_decay=0.0)
    )


def optimizer(config: Config) -> Any:
    """The optax transformation of `[optim]`, scheduled over the run's updates
    (GRPO makes `task.passes` updates per step)."""
    grpo = config.task.kind == "grpo"
    updates = config.loop.steps * (config.task.passes if grpo else 1)
    fields = dataclasses.asdict(config.optim.resolved(updates))
    fields.pop("accumulate")
    return optim.build(**fields, total_steps=updates)


def padded_vocab(config: Config, vocab: int) -> int:
    """With tensor parallelism, `vocab` rounded up to a multiple of the tensor x
    FSDP size, so that the embedding and head split over both (the padded logits
    are masked out, and exports cut the rows off again); unchanged without
    tensor parallelism or when it already splits."""
    sizes = _axis_sizes(config)
    if sizes["tensor"] <= 1:
        return vocab
    multiple = sizes["tensor"] * sizes["fsdp"]
    return -(-vocab // multiple) * multiple


def _axis_sizes(config: Config) -> dict[str, int]:
    """The data, FSDP and tensor axes' sizes, the one set to -1 given the
    devices the other axes leave."""
    sizes = {"data": config.mesh.data, "fsdp": config.mesh.fsdp}
    sizes["tensor"] = config.mesh.tensor
    rest = [k for k, v in sizes.items() if v == -1]
    if rest:
        known = math.prod(v for v in sizes.values() if v > 0)
        sizes[rest[0]] = max(1, jax.device_count() // known)
    return sizes


def chat_template(config: Config, init_from: str | None) -> Any:
    """`data.chat_template` resolved: a `.jinja` file, the built-in template, or
    (`auto`) the tokenizer directory's template when it has one; a Jinja one
    given `data.chat_template_kwargs` in every render (the built-in one reads no
    variables)."""
    template = _named_template(config, init_from)
    kwargs = config.data.chat_template_kwargs
    if kwargs and isinstance(template, data_lib.JinjaChatTemplate):
        return template.with_kwargs(json.loads(kwargs))  # checked by the config
    return template


def _named_template(config: Config, init_from: str | None) -> Any:
    name = config.data.chat_template
    if name == "builtin":
        return data_lib.BuiltinChatTemplate()
    if name != "auto":
        return _template_file(name)
    tokenizer = config.data.tokenizer
    if tokenizer == "auto":
        tokenizer = init_from or "byte"
    if tokenizer == "byte":
        return data_lib.BuiltinChatTemplate()
    return _template_from(Path(tokenizer), "data.tokenizer")


def _template_file(name: str) -> Any:
    """The `.jinja` file `data.chat_template` names."""
    path = Path(name)
    if not path.is_file() or path.suffix != ".jinja":
        raise ConfigError(
            f"`data.chat_template` names {name!r}, which is not a .jinja file. "
            "Pass a .jinja file, 'builtin' or 'auto'."
        )
    return _template_from(path, "data.chat_template")


def chat_template_of(config: Config) -> Any:
    """The chat template `data.chat_template` names for `config` (also for a
    run that trains on plain text: what its conversations would be made of)."""
    return chat_template(config, config.model.init_from)


def _template_from(path: Path, key: str) -> Any:
    try:
        return data_lib.chat_template(path)
    except data_lib.DataError as e:
        raise ConfigError(f"the chat template of `{key}` ({path}): {e}") from None


def quantize_spec(config: Config) -> quantize_lib.Quantize | None:
    """`model.quantize`'s spec (None: full precision). Quantized weights are
    frozen, so they need LoRA adapters to train."""
    m = config.model
    if m.quantize is None:
        return None
    if config.lora.rank == 0 and m.adapter_from is None:
        raise ConfigError(
            f"model.quantize = {m.quantize!r} keeps the base weights in "
            f"{'8' if m.quantize == 'int8' else '4'} bits, frozen: they take no "
            "update, so the run needs LoRA adapters to train. Set lora.rank "
            "(e.g. lora.rank = 16), or unset model.quantize."
        )
    try:
        return quantize_lib.Quantize(
            m.quantize, skip=m.quantize_skip or None, double=m.quantize_double
        )
    except ConfigError as e:
        raise ConfigError(f"[model]: {e}") from None


def lora_spec(config: Config) -> lora_lib.LoRA:
    """The adapters a LoRA run trains: `model.adapter_from`'s, else `[lora]`'s."""
    if config.model.adapter_from is not None:
        return _adapter_spec(config)
    c = config.lora
    try:
        return lora_lib.LoRA(
            rank=c.rank,
            alpha=c.alpha,
            dropout=c.dropout,
            targets=c.targets,
            rslora=c.rslora,
        )
    except ConfigError as e:
        raise ConfigError(f"[lora]: {e}") from None


def _adapter_spec(config: Config) -> lora_lib.LoRA:
    """`model.adapter_from`'s adapter_config.json (`lora.rank` may only agree)."""
    adapter = config.model.adapter_from
    try:
        spec = hf.adapter_spec(adapter)
    except (hf.HFFormatError, hf.HFFileNotFoundError) as e:
        raise ConfigError(f"`model.adapter_from` ({adapter}): {e}") from None
    if config.lora.rank not in (0, spec.rank):
        raise ConfigError(
            f"`lora.rank` is {config.lora.rank} but the adapter in "
            f"`model.adapter_from` ({adapter}) has rank {spec.rank}; unset "
            "lora.rank (the adapter decides it)."
        )
    return spec
