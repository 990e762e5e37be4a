"""What a `Config` means where a key says `auto` or depends on others: the eval
metrics a run reports, its data format, reference model, eval data, whether LoRA
is on, its reward functions, and where it exports."""

from pathlib import Path

from .._errors import ConfigError
from ..losses import CAUSAL_LM_AUX
from ._config import Config
from ._schema import PREFERENCE_TASKS


# What `eval_step(causal_lm_loss)` reports, the loss of lm and sft runs:
# "eval/" + "loss" and the loss's aux names.
EVAL_METRICS = ("eval/loss", *(f"eval/{name}" for name in CAUSAL_LM_AUX))
# What a preference run's evaluations report
# (`eqtrain.post_training.preference`'s metrics).
PREFERENCE_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)
# A GRPO evaluation's length metrics, as its training step reports them.
GRPO_EVAL_LENGTHS = (
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
)


def eval_metrics(config: Config) -> tuple[str, ...]:
    """The metrics the run's evaluations report."""
    kind = config.task.kind
    if kind == "grpo":  # `eqtrain.post_training.rollout.grpo_eval_step`'s
        per_fn = tuple(f"rewards/{name}/mean" for name in reward_names(config))
        names = ("reward", *per_fn, *GRPO_EVAL_LENGTHS, "weight")
        return tuple(f"eval/{name}" for name in names)
    if kind not in PREFERENCE_TASKS:
        return EVAL_METRICS
    extra = ("log_odds_ratio",) if kind == "orpo" else ()
    names = ("loss", *PREFERENCE_METRICS, *extra, "weight")
    return tuple(f"eval/{name}" for name in names)


def best_mode(config: Config) -> str:
    """`checkpoint.best_mode` with `auto` resolved: `max` for a metric that is
    better higher (`_HIGHER_IS_BETTER`), else `min`."""
    mode, best = config.checkpoint.best_mode, config.checkpoint.best
    if mode != "auto":
        return mode
    return "max" if best is not None and higher_is_better(best) else "min"


def higher_is_better(metric: str) -> bool:
    """Whether a higher `metric` is better: a reward (`eval/reward`,
    `eval/rewards/{fn}/mean`), an accuracy or a preference margin."""
    name = metric.removeprefix("eval/")
    per_fn = name.startswith("rewards/") and name.endswith("/mean")
    return name == "reward" or per_fn or name.endswith(_HIGHER_IS_BETTER)


_HIGHER_IS_BETTER = ("accuracy", "accuracies", "margins")


def data_format(config: Config) -> str:
    """`data.format`, with `auto` resolved as far as the config alone tells:
    `text` for lm, `preference` for the preference tasks, and `auto` (the data's
    columns decide) for sft."""
    given, kind = config.data.format, config.task.kind
    if given != "auto":
        return given
    if kind == "lm":
        return "text"
    return "preference" if kind in PREFERENCE_TASKS else "auto"


def reference_mode(config: Config) -> str | None:
    """`task.reference` resolved: None for the tasks without a reference model,
    `auto` becomes adapters_off with LoRA, else copy."""
    kind = config.task.kind
    if kind not in ("dpo", "ipo") and not (kind == "grpo" and config.task.beta):
        return None
    ref = config.task.reference
    if ref == "auto":
        return "adapters_off" if lora_on(config) else "copy"
    return ref


def eval_source(config: Config) -> str:
    """`data.eval` with "auto" resolved: the stdlib split for the stdlib corpus,
    "none" otherwise."""
    source = config.data.eval
    if source == "auto":
        text = config.task.kind == "lm"
        return "stdlib" if config.data.train == "stdlib" and text else "none"
    return source


def lora_on(config: Config) -> bool:
    """Whether the run trains LoRA adapters (`lora.rank` > 0 or an adapter to
    continue)."""
    return config.lora.rank > 0 or config.model.adapter_from is not None


def reward_names(config: Config) -> list[str]:
    """`task.rewards`' names, each with its weight checked (`task.reward_weights`)
    and `format` with its pattern; the functions themselves are imported where
    the job resolves them (`eqtrain.job`)."""
    names = [n for n in config.task.rewards.split(",") if n]
    if not names:
        raise ConfigError("`task.rewards` is empty: name at least one reward.")
    reward_weights(config.task.reward_weights, names)
    if "format" in names and config.task.format_regex is None:
        raise ConfigError(
            "task.rewards names `format`, which needs task.format_regex "
            "(the pattern a completion must match)."
        )
    return names


def reward_weights(text: str, names: list[str]) -> list[float]:
    """`task.reward_weights`, one per reward (1 each when empty)."""
    weights = [w for w in text.split(",") if w]
    if weights and len(weights) != len(names):
        raise ConfigError(
            f"`task.reward_weights` has {len(weights)} weights for the "
            f"{len(names)} functions of task.rewards ({', '.join(names)}); give "
            "one each, or none (1 each)."
        )
    try:
        return [float(w) for w in weights] or [1.0] * len(names)
    except ValueError:
        raise ConfigError(
            f"`task.reward_weights` must be numbers; got {text!r}."
        ) from None


def export_targets(config: Config, run_dir: Path) -> dict[str, Path]:
    """What a run exports where, by form: `{"full": <hf>}` without LoRA; with
    LoRA `{"adapter": <hf>}` (PEFT files; unless export.adapter = false) and,
    with export.merged, `{"merged": <hf>-merged}` (<hf> itself without the
    adapter)."""
    export = config.export
    if export.hf is None:
        return {}
    target = run_dir / export.hf
    if not lora_on(config):
        return {"full": target}
    out: dict[str, Path] = {}
    if export.adapter is not False:
        out["adapter"] = target
    if export.merged:
        out["merged"] = target.with_name(target.name + "-merged") if out else target
    return out


def steps_export_dir(target: Path) -> Path:
    """Where `export.every` puts its `step_<k>` exports: `<hf>-steps`, beside the
    final export (which replaces `<hf>` whole, so it cannot hold them)."""
    return target.with_name(target.name + "-steps")
