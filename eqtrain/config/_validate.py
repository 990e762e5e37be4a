"""Checks across fields of a `Config`, run before anything is built or compiled.
Each check names the keys of an inconsistent combination and how to fix it."""

import re

from .. import models
from .._errors import ConfigError
from .._names import did_you_mean
from ._config import Config, explicit
from ._fields import schema
from ._model import ModelConfig
from ._resolve import (
    data_format,
    eval_metrics,
    eval_source,
    lora_on,
    reference_mode,
    rewards_of,
)
from ._schema import PREFERENCE_TASKS
from ._units import parse_resources


# The [model] keys an HF directory decides (which of them an architecture reads:
# its family's `section_keys`).
ARCH_KEYS = (
    "arch",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "max_seq_len",
    "norm_eps",
    "tie_embeddings",
    "num_kv_heads",
    "head_dim",
    "rope_theta",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "num_experts",
    "experts_per_token",
    "expert_size",
    "shared_expert_size",
    "norm_topk_prob",
)
# The task keys each kind reads; setting one that the kind ignores is a mistake.
_GRPO_KEYS = (
    "group_size",
    "max_completion_len",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "rewards",
    "reward_weights",
    "format_regex",
    "scale_rewards",
    "loss_type",
    "epsilon",
    "epsilon_high",
    "passes",
)
_TASK_KEYS = {
    "beta": ("dpo", "ipo", "simpo", "grpo"),
    "label_smoothing": ("dpo", "simpo"),
    "orpo_lambda": ("orpo",),
    "simpo_gamma": ("simpo",),
    "reference": ("dpo", "ipo", "grpo"),
    **{key: ("grpo",) for key in _GRPO_KEYS},
}
_FORMATS = {
    "lm": ("text",),
    "sft": ("chat", "prompt_completion"),
    "grpo": ("chat", "prompt_completion"),  # `messages` or `prompt` (+ columns)
    **{kind: ("preference",) for kind in PREFERENCE_TASKS},
}
# The [data] keys of post-training data (an lm run's plain text has none).
_POST_KEYS = ("data.chat_template", "data.max_prompt_len", "data.pack")


def validate(config: Config) -> None:
    """Raise `ConfigError` naming the keys of any inconsistent combination."""
    _model(config)
    _memory(config)
    _mesh(config)
    _batches(config)
    _loop(config)
    _lora(config)
    _task(config)
    _export(config)
    _distributed(config)


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


# -- [model] ----------------------------------------------------------------------
def _model(config: Config) -> None:
    m, given = config.model, _changed(config)
    if m.init_from is not None:
        return _init_from(config, given)
    family = models.family(m.arch)
    _arch_keys(m.arch, family, given)
    _heads(m, family)
    if m.max_seq_len is not None and m.max_seq_len < config.data.seq_len:
        raise ConfigError(
            f"`data.seq_len` ({config.data.seq_len}) exceeds `model.max_seq_len` "
            f"({m.max_seq_len}); shorten the rows or lengthen the model's positions."
        )


def _init_from(config: Config, given: frozenset[str]) -> None:
    """With `model.init_from`, the architecture is its config.json's."""
    clash = [k for k in ARCH_KEYS if f"model.{k}" in given]
    if clash:
        keys = ", ".join(f"`model.{k}`" for k in clash)
        raise ConfigError(
            f"{keys} cannot be set together with `model.init_from` "
            f"({config.model.init_from!r}): the architecture comes from its "
            "config.json. Remove them (runtime options like model.remat, "
            "model.param_dtype and model.scan_layers may stay)."
        )


def _arch_keys(arch: str, family: models.Family, given: frozenset[str]) -> None:
    """The architecture keys set are ones `family` reads."""
    wrong = [k for k in ARCH_KEYS if f"model.{k}" in given]
    wrong = [k for k in wrong if k not in family.section_keys]
    if wrong:
        others = sorted(
            t
            for f in models.FAMILIES.values()
            if wrong[0] in f.section_keys
            for t in f.model_types
        )
        raise ConfigError(
            f"`model.{wrong[0]}` applies to the architectures {others} only; "
            f"model.arch is {arch!r}. Remove it or change the architecture."
        )


def _heads(m: ModelConfig, family: models.Family) -> None:
    """The heads divide the width, and the key/value heads the query heads."""
    heads = m.num_heads
    if m.head_dim is None and m.hidden_size % heads:
        raise ConfigError(
            f"`model.hidden_size` ({m.hidden_size}) must be divisible by "
            f"`model.num_heads` ({heads}), or set `model.head_dim`."
        )
    kv = m.num_kv_heads if "num_kv_heads" in family.section_keys else None
    if kv is not None and heads % kv:
        raise ConfigError(
            f"`model.num_heads` ({heads}) must be a multiple of `model.num_kv_heads` "
            f"({kv}) (each key/value head serves a group of query heads)."
        )


def _memory(config: Config) -> None:
    """The memory options: remat presets and names, the tiled MLP's pieces."""
    m = config.model
    models.check_remat(m.remat, m.remat_save, m.remat_offload, prefix="model.")
    chunks, seq = m.mlp_chunks, config.data.seq_len
    if chunks != "auto" and seq % chunks:
        fits = [d for d in range(2, min(seq, 64) + 1) if seq % d == 0][:6]
        raise ConfigError(
            f"`model.mlp_chunks` ({chunks}) must divide `data.seq_len` ({seq}) so "
            f"that every piece of the sequence has the same length; e.g. "
            f"{', '.join(map(str, fits)) or 1}, or 'auto'."
        )


# -- devices and batches ----------------------------------------------------------
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


def _distributed(config: Config) -> None:
    parse_resources(config.distributed.resources_per_worker)
    address = config.distributed.ray_address
    if address is None or address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"`distributed.ray_address` must be `auto`, `HOST:PORT` or "
            f"`ray://HOST:PORT`; got {address!r}. `ray status` on the head node "
            "prints the address; leave it unset to start a local Ray."
        )


# -- [loop] and checkpoint.best ---------------------------------------------------
def _loop(config: Config) -> None:
    if config.data.eval == "none" and "loop.eval_every" in _changed(config):
        if config.loop.eval_every:
            raise ConfigError(
                "`loop.eval_every` is set but `data.eval` is 'none': there is "
                "nothing to evaluate. Set data.eval or loop.eval_every = 0."
            )
    if config.checkpoint.best is not None:
        _best(config, config.checkpoint.best)


def _best(config: Config, best: str) -> None:
    """`checkpoint.best` names an eval metric of the run, saved when evaluated."""
    _best_metric(config, best)
    if eval_source(config) == "none":
        raise ConfigError(
            f"`checkpoint.best` ({best!r}) ranks checkpoints by an "
            f"evaluation metric, but the run has no eval data (data.eval = "
            f"{config.data.eval!r} with data.train = {config.data.train!r}). "
            "Set data.eval to a file or directory, or unset checkpoint.best."
        )
    every, eval_every = config.checkpoint.every, config.loop.eval_every
    if eval_every == 0 or every == 0 or every % eval_every:
        raise ConfigError(
            "`checkpoint.best` ranks checkpoints by an evaluation metric, so "
            "checkpoints must be saved on evaluation steps: make "
            f"`checkpoint.every` ({every}) a positive multiple of "
            f"`loop.eval_every` ({eval_every})."
        )


def _best_metric(config: Config, best: str) -> None:
    if not best.startswith("eval/"):
        raise ConfigError(
            f"`checkpoint.best` ({best!r}) must be an evaluation metric "
            "such as 'eval/loss' (train metrics are too noisy to rank by)."
        )
    metrics = eval_metrics(config)
    if best not in metrics:
        names = ", ".join(f"'{m}'" for m in metrics)
        raise ConfigError(
            f"`checkpoint.best` ({best!r}) is not a metric this run "
            f"produces: its evaluations report {names}. A misspelt name would "
            "keep no best checkpoint at all." + did_you_mean(best, metrics, code=True)
        )


# -- [lora] and [export] ----------------------------------------------------------
def _lora(config: Config) -> None:
    given = _changed(config)
    if config.model.adapter_from is not None and config.model.init_from is None:
        raise ConfigError(
            f"`model.adapter_from` ({config.model.adapter_from!r}) continues a PEFT "
            "adapter on its base model: set `model.init_from` to that base's "
            "Hugging Face directory."
        )
    if not lora_on(config):
        return _lora_off(config, given)
    _lora_patterns(config)
    exports = config.export
    if exports.adapter is False and not exports.merged:
        if exports.hf is not None and "export.hf" in given:
            raise ConfigError(
                "`export.hf` is set, but with LoRA on and export.adapter = false "
                "and export.merged = false there is nothing to export: set one of "
                'them, or export.hf = "".'
            )


def _lora_off(config: Config, given: frozenset[str]) -> None:
    """Without LoRA, no [lora] key nor adapter export is set."""
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


def _lora_patterns(config: Config) -> None:
    lora = config.lora
    for key, pattern in (("targets", lora.targets), ("train_also", lora.train_also)):
        if pattern is None:
            continue
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(
                f"`lora.{key}` is not a valid regex: {pattern!r} ({e})."
            ) from None


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


# -- [task] -----------------------------------------------------------------------
def _task(config: Config) -> None:
    kind, given = config.task.kind, _changed(config)
    _task_keys(kind, given)
    _task_data(config, kind)
    if reference_mode(config) == "adapters_off" and not lora_on(config):
        raise ConfigError(
            "`task.reference` = 'adapters_off' uses the policy with its LoRA "
            "adapters switched off as the reference, but LoRA is off (lora.rank = "
            "0): set lora.rank, or task.reference = 'copy' or 'precomputed'."
        )
    if kind == "grpo":
        _grpo(config, given)
    if kind == "lm":
        other = sorted(k for k in given if k.startswith("data.") and k in _POST_KEYS)
        if other:
            raise ConfigError(
                f"`{other[0]}` applies to post-training data, but task.kind = 'lm' "
                "trains on plain text; remove it or set task.kind."
            )


def _task_keys(kind: str, given: frozenset[str]) -> None:
    """The task keys set are ones `kind` reads."""
    for key, kinds in _TASK_KEYS.items():
        if f"task.{key}" in given and kind not in kinds:
            raise ConfigError(
                f"`task.{key}` is set but task.kind = {kind!r} does not use it (it "
                f"applies to {', '.join(kinds)}); remove it or change task.kind."
            )


def _task_data(config: Config, kind: str) -> None:
    """The data's format is one the task trains on."""
    fmt = data_format(config)
    if fmt != "auto" and fmt not in _FORMATS[kind]:
        wants = " or ".join(f"'{f}'" for f in _FORMATS[kind])
        raise ConfigError(
            f"task.kind = {kind!r} trains on {wants} data, but data.format = "
            f"{config.data.format!r}. Set data.format to match the data (or leave "
            "it `auto`), or change task.kind."
        )
    if kind != "lm" and config.data.train == "stdlib":
        raise ConfigError(
            f"task.kind = {kind!r} needs {_FORMATS[kind][0]!r} data, but data.train "
            "is 'stdlib' (plain text). Point data.train at a .jsonl/.json/.parquet "
            "file with the columns the task reads."
        )


def _grpo(config: Config, given: frozenset[str]) -> None:
    """GRPO's settings together: its rows' budget, the reference, the rewards."""
    t, data = config.task, config.data
    if t.max_completion_len >= data.seq_len:
        raise ConfigError(
            f"`task.max_completion_len` ({t.max_completion_len}) leaves no room for "
            f"a prompt in `data.seq_len` ({data.seq_len}) tokens per row (prompt "
            "and completion); raise data.seq_len or lower task.max_completion_len."
        )
    for key in ("data.max_prompt_len", "data.pack"):
        if key in given:
            raise ConfigError(
                f"`{key}` does not apply to task.kind = 'grpo' (its prompts get "
                "data.seq_len - task.max_completion_len tokens); remove it."
            )
    _grpo_run(config)
    rewards_of(config)


def _grpo_run(config: Config) -> None:
    """What a GRPO run cannot do yet: a precomputed reference, several
    processes, evaluation."""
    if reference_mode(config) == "precomputed":
        raise ConfigError(
            "task.reference = 'precomputed' cannot serve grpo: its completions are "
            "sampled during training. Use 'copy', or 'adapters_off' with [lora]."
        )
    if config.distributed.processes > 1:
        raise ConfigError(
            "task.kind = 'grpo' runs in one process for now (each step scores its "
            "completions in a host callback of that process): set "
            "distributed.processes = 1; any number of local devices works."
        )
    if config.data.eval not in ("auto", "none"):
        raise ConfigError(
            "task.kind = 'grpo' has no evaluation pass yet: set data.eval = "
            "'none' (the rewards of every step are its measure)."
        )
