"""Checks across fields of a `Config`, run before anything is built or compiled."""

from .._errors import ConfigError
from ..losses import CAUSAL_LM_AUX
from ._parse import _did_you_mean, explicit, schema
from ._schema import Config


# Model keys that only the Llama family reads, and those an HF directory decides.
LLAMA_ONLY = (
    "num_kv_heads",
    "head_dim",
    "rope_theta",
    "tie_embeddings",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
)
ARCH_KEYS = (
    "arch",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "max_seq_len",
    "norm_eps",
    *LLAMA_ONLY,
)


# What `eval_step(causal_lm_loss)` reports, the loss of every config-built run:
# "eval/" + "loss" and the loss's aux names.
EVAL_METRICS = ("eval/loss", *(f"eval/{name}" for name in CAUSAL_LM_AUX))


def eval_source(config: Config) -> str:
    """`data.eval` with "auto" resolved: the stdlib split for the stdlib corpus,
    "none" otherwise."""
    source = config.data.eval
    if source == "auto":
        return "stdlib" if config.data.train == "stdlib" else "none"
    return source


def validate(config: Config) -> None:
    """Raise `ConfigError` naming the keys of any inconsistent combination."""
    _model(config)
    _mesh(config)
    _batches(config)
    _loop(config)
    _lora(config)
    _export(config)


def _changed(config: Config) -> frozenset[str]:
    """The keys a file or `--set` gave a value other than the default. Restating
    a default does not count: eqtrain's own config.toml and checkpoint manifests
    state every key, and must read back (e.g. a GPT-2 run's `num_kv_heads`)."""
    fields = schema()
    out = set()
    for key in explicit(config) & fields.keys():
        value = config
        for part in key.split("."):
            value = getattr(value, part)
        if value != fields[key].default:
            out.add(key)
    return frozenset(out)


def _model(config: Config) -> None:
    m, given = config.model, _changed(config)
    if m.init_from is not None:
        clash = [k for k in ARCH_KEYS if f"model.{k}" in given]
        if clash:
            keys = ", ".join(f"`model.{k}`" for k in clash)
            raise ConfigError(
                f"{keys} cannot be set together with `model.init_from` "
                f"({m.init_from!r}): the architecture comes from its config.json. "
                "Remove them (runtime options like model.remat, model.param_dtype "
                "and model.scan_layers may stay)."
            )
        return
    if m.arch == "gpt2":
        wrong = [k for k in LLAMA_ONLY if f"model.{k}" in given]
        if wrong:
            raise ConfigError(
                f"`model.{wrong[0]}` applies to the Llama family (llama, mistral, "
                "qwen2) only; model.arch is 'gpt2'. Remove it or change the "
                "architecture."
            )
    heads = m.num_heads
    if m.head_dim is None and m.hidden_size % heads:
        raise ConfigError(
            f"`model.hidden_size` ({m.hidden_size}) must be divisible by "
            f"`model.num_heads` ({heads}), or set `model.head_dim`."
        )
    kv = m.num_kv_heads if m.arch != "gpt2" else None
    if kv is not None and heads % kv:
        raise ConfigError(
            f"`model.num_heads` ({heads}) must be a multiple of `model.num_kv_heads` "
            f"({kv}) (each key/value head serves a group of query heads)."
        )
    if m.max_seq_len is not None and m.max_seq_len < config.data.seq_len:
        raise ConfigError(
            f"`data.seq_len` ({config.data.seq_len}) exceeds `model.max_seq_len` "
            f"({m.max_seq_len}); shorten the rows or lengthen the model's positions."
        )


def _mesh(config: Config) -> None:
    sizes = {"data": config.mesh.data, "fsdp": config.mesh.fsdp}
    sizes["tensor"] = config.mesh.tensor
    zero = [k for k, v in sizes.items() if v == 0]
    if zero:
        raise ConfigError(
            f"`mesh.{zero[0]}` must be a device count >= 1, or -1 for the devices "
            "the other axes leave; got 0."
        )
    rest = [k for k, v in sizes.items() if v == -1]
    if len(rest) > 1:
        keys = " and ".join(f"`mesh.{k}`" for k in rest)
        raise ConfigError(f"{keys} are both -1; at most one mesh axis takes the rest.")


def _batches(config: Config) -> None:
    batch, accumulate = config.data.batch_size, config.optim.accumulate
    if batch % accumulate:
        raise ConfigError(
            f"`data.batch_size` ({batch}) must be divisible by `optim.accumulate` "
            f"({accumulate}): each step splits its batch into that many micro-batches."
        )


def _loop(config: Config) -> None:
    loop, ckpt = config.loop, config.checkpoint
    if config.data.eval == "none" and "loop.eval_every" in _changed(config):
        if loop.eval_every:
            raise ConfigError(
                "`loop.eval_every` is set but `data.eval` is 'none': there is "
                "nothing to evaluate. Set data.eval or loop.eval_every = 0."
            )
    if ckpt.best is not None:
        if not ckpt.best.startswith("eval/"):
            raise ConfigError(
                f"`checkpoint.best` ({ckpt.best!r}) must be an evaluation metric "
                "such as 'eval/loss' (train metrics are too noisy to rank by)."
            )
        if ckpt.best not in EVAL_METRICS:
            names = ", ".join(f"'{m}'" for m in EVAL_METRICS)
            raise ConfigError(
                f"`checkpoint.best` ({ckpt.best!r}) is not a metric this run "
                f"produces: its evaluations report {names}. A misspelt name would "
                "keep no best checkpoint at all."
                + _did_you_mean(ckpt.best, EVAL_METRICS)
            )
        if eval_source(config) == "none":
            raise ConfigError(
                f"`checkpoint.best` ({ckpt.best!r}) ranks checkpoints by an "
                f"evaluation metric, but the run has no eval data (data.eval = "
                f"{config.data.eval!r} with data.train = {config.data.train!r}). "
                "Set data.eval to a file or directory, or unset checkpoint.best."
            )
        if loop.eval_every == 0 or ckpt.every == 0 or ckpt.every % loop.eval_every:
            raise ConfigError(
                "`checkpoint.best` ranks checkpoints by an evaluation metric, so "
                "checkpoints must be saved on evaluation steps: make "
                f"`checkpoint.every` ({ckpt.every}) a positive multiple of "
                f"`loop.eval_every` ({loop.eval_every})."
            )


def lora_on(config: Config) -> bool:
    """Whether the run trains LoRA adapters (`lora.rank` > 0 or an adapter to
    continue)."""
    return config.lora.rank > 0 or config.model.adapter_from is not None


def _lora(config: Config) -> None:
    import re

    lora, given = config.lora, _changed(config)
    if config.model.adapter_from is not None and config.model.init_from is None:
        raise ConfigError(
            f"`model.adapter_from` ({config.model.adapter_from!r}) continues a PEFT "
            "adapter on its base model: set `model.init_from` to that base's "
            "Hugging Face directory."
        )
    if not lora_on(config):
        other = sorted(k for k in given if k.startswith("lora."))
        if other:
            raise ConfigError(
                f"`{other[0]}` is set but `lora.rank` is 0 (LoRA off): set "
                "lora.rank (e.g. 8) to train adapters, or remove it."
            )
        for key in ("export.adapter", "export.merged"):
            if getattr(config.export, key.split(".")[1]):
                raise ConfigError(
                    f"`{key}` exports LoRA adapters, but LoRA is off (lora.rank = "
                    "0): set lora.rank, or remove it."
                )
        return
    for key, pattern in (("targets", lora.targets), ("train_also", lora.train_also)):
        if pattern is None:
            continue
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(
                f"`lora.{key}` is not a valid regex: {pattern!r} ({e})."
            ) from None
    if config.export.adapter is False and not config.export.merged:
        if config.export.hf is not None and "export.hf" in given:
            raise ConfigError(
                "`export.hf` is set, but with LoRA on and export.adapter = false "
                "and export.merged = false there is nothing to export: set one of "
                'them, or export.hf = "".'
            )


def _export(config: Config) -> None:
    export = config.export
    if export.ema and config.loop.ema is None:
        raise ConfigError(
            "`export.ema` exports the EMA weights, but `loop.ema` is unset: set "
            "loop.ema (e.g. 0.999) or export.ema = false."
        )
    if export.every and export.hf is None:
        raise ConfigError(
            "`export.every` is set but `export.hf` is empty: name the export "
            "directory or set export.every = 0."
        )
