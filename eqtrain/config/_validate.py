"""Checks across fields of a `Config`, run before anything is built or compiled.
Each check names the keys of an inconsistent combination and how to fix it: the
rules of the model and the task here, those of the rest in `_run_rules`."""

from .. import models
from .._errors import ConfigError
from . import _run_rules as run
from ._config import Config, explicit
from ._fields import schema
from ._resolve import data_format, lora_on, reference_mode, reward_names
from ._schema import PREFERENCE_TASKS


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
    "kl_bias_correction",
    "importance_sampling_level",
    "passes",
)
# The sampling keys distillation reads too (its on-policy completions).
_DISTILL_SAMPLING = ("max_completion_len", "temperature", "top_k", "top_p", "min_p")
_TASK_KEYS = {
    "beta": ("dpo", "ipo", "simpo", "grpo", "distill"),
    "label_smoothing": ("dpo", "simpo"),
    "orpo_lambda": ("orpo",),
    "simpo_gamma": ("simpo",),
    "reference": ("dpo", "ipo", "grpo"),
    **{key: ("grpo",) for key in _GRPO_KEYS},
    **{key: ("grpo", "distill") for key in _DISTILL_SAMPLING},
    **{key: ("distill",) for key in ("teacher", "lmbda", "seq_kd")},
}
_FORMATS = {
    "lm": ("text",),
    "sft": ("chat", "prompt_completion"),
    "grpo": ("chat", "prompt_completion"),  # `messages` or `prompt` (+ columns)
    "distill": ("chat", "prompt_completion"),  # SFT rows
    **{kind: ("preference",) for kind in PREFERENCE_TASKS},
}
# The [data] keys of post-training data (an lm run's plain text has none).
_POST_KEYS = (
    "data.chat_template",
    "data.chat_template_kwargs",
    "data.max_prompt_len",
    "data.pack",
)


def validate(config: Config) -> None:
    """Raise `ConfigError` naming the keys of any inconsistent combination."""
    given = _changed(config)
    for rule in _RULES:
        rule(config, given)


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


# Each rule takes the config and the keys `_changed` found, and raises
# `ConfigError` for one inconsistency.


# -- [model] ----------------------------------------------------------------------
# With `model.init_from`, the architecture keys keep their defaults (the first
# rule refuses any other), so the rules after it hold for them.
def _init_from_clash(config: Config, given: frozenset[str]) -> None:
    """With `model.init_from`, the architecture is its config.json's."""
    clash = [k for k in ARCH_KEYS if f"model.{k}" in given]
    if config.model.init_from is not None and clash:
        keys = ", ".join(f"`model.{k}`" for k in clash)
        raise ConfigError(
            f"{keys} cannot be set together with `model.init_from` "
            f"({config.model.init_from!r}): the architecture comes from its "
            "config.json. Remove them (runtime options like model.remat, "
            "model.param_dtype and model.scan_layers may stay)."
        )


def _arch_keys(config: Config, given: frozenset[str]) -> None:
    """The architecture keys set are ones the architecture's family reads."""
    family = models.family(config.model.arch)
    wrong = [k for k in ARCH_KEYS if f"model.{k}" in given]
    wrong = [k for k in wrong if k not in family.section_keys]
    if wrong:
        raise ConfigError(
            f"`model.{wrong[0]}` applies to the architectures "
            f"{_archs_reading(wrong[0])} only; model.arch is "
            f"{config.model.arch!r}. Remove it or change the architecture."
        )


def _archs_reading(key: str) -> list[str]:
    """The architectures (model types) whose family reads `model.<key>`."""
    return sorted(
        t
        for f in models.FAMILIES.values()
        if key in f.section_keys
        for t in f.model_types
    )


def _heads_divide_width(config: Config, given: frozenset[str]) -> None:
    m = config.model
    if m.head_dim is None and m.hidden_size % m.num_heads:
        raise ConfigError(
            f"`model.hidden_size` ({m.hidden_size}) must be divisible by "
            f"`model.num_heads` ({m.num_heads}), or set `model.head_dim`."
        )


def _kv_heads_divide_heads(config: Config, given: frozenset[str]) -> None:
    """Each key/value head serves a group of query heads (Llama family)."""
    m = config.model
    kv = (
        m.num_kv_heads if "num_kv_heads" in models.family(m.arch).section_keys else None
    )
    if kv is not None and m.num_heads % kv:
        raise ConfigError(
            f"`model.num_heads` ({m.num_heads}) must be a multiple of "
            f"`model.num_kv_heads` ({kv}) (each key/value head serves a group of "
            "query heads)."
        )


def _rows_fit_positions(config: Config, given: frozenset[str]) -> None:
    m, seq_len = config.model, config.data.seq_len
    if m.max_seq_len is not None and m.max_seq_len < seq_len:
        raise ConfigError(
            f"`data.seq_len` ({seq_len}) exceeds `model.max_seq_len` "
            f"({m.max_seq_len}); shorten the rows or lengthen the model's positions."
        )


def _remat(config: Config, given: frozenset[str]) -> None:
    """The remat preset, and the names it saves or offloads."""
    m = config.model
    models.check_remat(m.remat, m.remat_save, m.remat_offload, prefix="model.")


def _mlp_chunks(config: Config, given: frozenset[str]) -> None:
    """The tiled MLP's pieces divide the sequence."""
    chunks, seq = config.model.mlp_chunks, config.data.seq_len
    if chunks != "auto" and seq % chunks:
        fits = [d for d in range(2, min(seq, 64) + 1) if seq % d == 0][:6]
        raise ConfigError(
            f"`model.mlp_chunks` ({chunks}) must divide `data.seq_len` ({seq}) so "
            f"that every piece of the sequence has the same length; e.g. "
            f"{', '.join(map(str, fits)) or 1}, or 'auto'."
        )


# -- [task] -----------------------------------------------------------------------
def _task_keys(config: Config, given: frozenset[str]) -> None:
    """The task keys set are ones task.kind reads."""
    kind = config.task.kind
    for key, kinds in _TASK_KEYS.items():
        if f"task.{key}" in given and kind not in kinds:
            raise ConfigError(
                f"`task.{key}` is set but task.kind = {kind!r} does not use it (it "
                f"applies to {', '.join(kinds)}); remove it or change task.kind."
            )


def _task_format(config: Config, given: frozenset[str]) -> None:
    """The data's format is one the task trains on."""
    kind, fmt = config.task.kind, data_format(config)
    if fmt != "auto" and fmt not in _FORMATS[kind]:
        wants = " or ".join(f"'{f}'" for f in _FORMATS[kind])
        raise ConfigError(
            f"task.kind = {kind!r} trains on {wants} data, but data.format = "
            f"{config.data.format!r}. Set data.format to match the data (or leave "
            "it `auto`), or change task.kind."
        )


def _task_data(config: Config, given: frozenset[str]) -> None:
    """Post-training reads a data file, not the standard library's text."""
    kind = config.task.kind
    if kind != "lm" and config.data.train == "stdlib":
        raise ConfigError(
            f"task.kind = {kind!r} needs {_FORMATS[kind][0]!r} data, but data.train "
            "is 'stdlib' (plain text). Point data.train at a .jsonl/.json/.parquet "
            "file with the columns the task reads."
        )


def _adapters_off_needs_lora(config: Config, given: frozenset[str]) -> None:
    if reference_mode(config) == "adapters_off" and not lora_on(config):
        raise ConfigError(
            "`task.reference` = 'adapters_off' uses the policy with its LoRA "
            "adapters switched off as the reference, but LoRA is off (lora.rank = "
            "0): set lora.rank, or task.reference = 'copy' or 'precomputed'."
        )


def _grpo_room_for_prompts(config: Config, given: frozenset[str]) -> None:
    longest, seq_len = config.task.max_completion_len, config.data.seq_len
    if config.task.kind == "grpo" and longest >= seq_len:
        raise ConfigError(
            f"`task.max_completion_len` ({longest}) leaves no room for "
            f"a prompt in `data.seq_len` ({seq_len}) tokens per row (prompt "
            "and completion); raise data.seq_len or lower task.max_completion_len."
        )


def _grpo_data_keys(config: Config, given: frozenset[str]) -> None:
    for key in ("data.max_prompt_len", "data.pack"):
        if config.task.kind == "grpo" and key in given:
            raise ConfigError(
                f"`{key}` does not apply to task.kind = 'grpo' (its prompts get "
                "data.seq_len - task.max_completion_len tokens); remove it."
            )


def _grpo_reference(config: Config, given: frozenset[str]) -> None:
    """GRPO's completions are sampled in training: no precomputed reference."""
    if config.task.kind == "grpo" and reference_mode(config) == "precomputed":
        raise ConfigError(
            "task.reference = 'precomputed' cannot serve grpo: its completions are "
            "sampled during training. Use 'copy', or 'adapters_off' with [lora]."
        )


def _grpo_rewards(config: Config, given: frozenset[str]) -> None:
    """task.rewards names functions, with a weight each (they are imported
    when the job is planned)."""
    if config.task.kind == "grpo":
        reward_names(config)


def _distill_keys(config: Config, given: frozenset[str]) -> None:
    """Distillation has a teacher, a beta in [0, 1], and unpacked rows (its
    rows are never packed: `job._distill.resolved`)."""
    task = config.task
    if task.kind != "distill":
        return
    if task.teacher is None:
        raise ConfigError(
            "task.kind = 'distill' needs a teacher: set task.teacher to a Hugging "
            "Face directory or an eqtrain run directory (with its export in hf/)."
        )
    if task.beta is not None and task.beta > 1:
        raise ConfigError(
            f"task.beta = {task.beta} is outside [0, 1], where distillation's "
            "generalised JSD is defined (0: forward KL, 1: reverse KL); unset it "
            "for 0.5."
        )
    if config.data.pack and "data.pack" in explicit(config):
        raise ConfigError(
            "data.pack = true puts several examples in a row, but task.kind = "
            "'distill' keeps one example per row (a step may sample a new "
            "completion after each row's prompt): remove data.pack, or set it "
            "to false."
        )


def _lm_data_keys(config: Config, given: frozenset[str]) -> None:
    """Plain text has no post-training data keys."""
    other = sorted(k for k in given if k in _POST_KEYS)
    if config.task.kind == "lm" and other:
        raise ConfigError(
            f"`{other[0]}` applies to post-training data, but task.kind = 'lm' "
            "trains on plain text; remove it or set task.kind."
        )


# In the order of the checks: the first inconsistency found is the one reported.
_RULES = (
    _init_from_clash,
    _arch_keys,
    _heads_divide_width,
    _kv_heads_divide_heads,
    _rows_fit_positions,
    _remat,
    _mlp_chunks,
    run.mesh_no_zero,
    run.mesh_one_rest,
    run.batches_split,
    run.eval_every_with_eval,
    run.best_is_eval,
    run.best_is_reported,
    run.best_has_eval,
    run.best_on_eval_steps,
    run.adapter_has_base,
    run.lora_keys_need_lora,
    run.adapter_exports_need_lora,
    run.lora_patterns,
    run.lora_exports_something,
    _task_keys,
    _task_format,
    _task_data,
    _adapters_off_needs_lora,
    _grpo_room_for_prompts,
    _grpo_data_keys,
    _grpo_reference,
    _grpo_rewards,
    _distill_keys,
    _lm_data_keys,
    run.export_ema,
    run.export_every,
    run.resources,
    run.ray_address,
)
