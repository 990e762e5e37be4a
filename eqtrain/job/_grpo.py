"""`task.kind = "grpo"` in a job: the prompt rows of `data.train`, the loss, and
the rollout (`eqtrain.post_training.rollout.Rollout`) that the compiled step
samples and scores with.

A prompt row is `prompt` (`[width]` int32, left-padded with the pad id, width =
`data.seq_len - task.max_completion_len`), `prompt_len` and `index` (its record in
the file). The prompts' text (a string, or a chat's messages) and the file's other
columns stay on the host: the reward functions read them by `index`.
"""

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import data as data_lib, hf
from .._errors import ConfigError
from ..config import Config, reward_names, reward_weights
from ..generate import Sampling
from ..post_training import grpo, rewards as rewards_lib, rollout as rollout_lib


@dataclasses.dataclass(frozen=True)
class Prompts:
    """The host side of GRPO's rows: each record's prompt and other columns."""

    prompts: Sequence[Any]  # a list, or a store's column read as used
    columns: dict[str, Sequence[Any]]


@dataclasses.dataclass
class Online:
    """What a GRPO run learns on the host as it goes: the prompts `rows` read
    (the reward functions score completions of them), and the `Rollout` the
    compiled step samples with (it records a reward function's failure); the
    same for `data.eval`'s held-out prompts and the evaluation's `Rollout`."""

    prompts: Prompts | None = None
    rollout: rollout_lib.Rollout | None = None
    eval_prompts: Prompts | None = None
    eval_rollout: rollout_lib.Rollout | None = None
    rewards: list[tuple[str, Any, float]] = dataclasses.field(default_factory=list)


def rewards_of(config: Config) -> list[tuple[str, Any, float]]:
    """`task.rewards` as `(name, function, weight)` triples, each function
    imported (`eqtrain.post_training.rewards.load_reward`); a config error
    names the key."""
    names = reward_names(config)
    weights = reward_weights(config.task.reward_weights, names)
    return [
        (name, _reward(name, config.task.format_regex), weight)
        for name, weight in zip(names, weights, strict=True)
    ]


def _reward(name: str, format_regex: str | None) -> Any:
    """The reward function `name` of `task.rewards`."""
    if name == "format":
        assert format_regex is not None  # `reward_names` checked it
        return rewards_lib.format_regex(format_regex)
    try:
        return rewards_lib.load_reward(name)
    except ConfigError as e:
        raise ConfigError(f"`task.rewards`: {e}") from None


def prompt_width(config: Config) -> int:
    """Tokens of a prompt row (the rest of `data.seq_len` is the completion's)."""
    return config.data.seq_len - config.task.max_completion_len


def loss(config: Config, reference: str | None, *, vocab_size: Any, chunk: int) -> Any:
    """`grpo.grpo_loss_fn` of `[task]`."""
    t = config.task
    try:
        return grpo.grpo_loss_fn(
            loss_type=t.loss_type,
            epsilon_low=t.epsilon,
            epsilon_high=t.epsilon if t.epsilon_high is None else t.epsilon_high,
            beta=t.beta or 0.0,
            kl_bias_correction=t.kl_bias_correction,
            importance_sampling_level=t.importance_sampling_level,
            reference=reference,
            max_completion_length=t.max_completion_len,
            temperature=t.temperature or 1.0,
            vocab_size=vocab_size,
            chunk=chunk or None,
        )
    except ConfigError as e:
        raise ConfigError(f"[task]: {e}") from None


def _prompt_column(path: Path, key: str) -> Callable[[list[str]], dict[str, Any]]:
    """The check of a file's columns when its store is built: a `prompt` (text)
    or `messages` (chat) column, which decides `chat`."""

    def resolve(have: list[str]) -> dict[str, Any]:
        if "messages" not in have and "prompt" not in have:
            raise ConfigError(
                f"`{key}` ({path}) has the columns {have}; task.kind = 'grpo' "
                "reads prompts from a `prompt` (text) or `messages` (a chat) "
                "column, and passes the other columns (e.g. `answer`) to the "
                "reward functions."
            )
        return {"chat": "messages" in have}

    return resolve


def rows(
    job: Any, source: str, key: str, options: dict[str, Any] | None = None
) -> data_lib.PostRows:
    """The prompt rows of the record file `source`, from its store (prepared in
    worker processes at the first start: `options`, from `_rows`); sets
    `job.grpo.prompts` (the kept records' prompts and other columns, read from
    the store as the rewards use them; `job.grpo.eval_prompts` for `key` =
    "data.eval"). Records without a usable prompt (null,
    not text, a chat the template refuses) are skipped with one `DataWarning`
    naming the file and the first line of each reason, as text and SFT data
    are; none left is an error. Prompts longer than the width are skipped too
    (noted in `job.notes`)."""
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"`{key}` names {source!r}, which is not a file.")
    width = prompt_width(job.config)
    options = dict(options or {}, seq_len=job.config.data.seq_len)
    try:
        out = data_lib.prepare_post(
            path,
            job.tokenizer,
            kind="prompt",
            width=width,
            resolve=_prompt_column(path, key),
            pad=pad_id(job.tokenizer),
            **options,
        )
    except data_lib.DataError as e:
        raise ConfigError(f"`{key}` ({path}): {e}") from None
    _unusable(out, path, key)
    long, total = int(out.meta["long"]), out.report.total
    if long:
        job.notes.append(
            f"{key} ({path.name}): skipped {long} of {total} prompts longer than "
            f"{width} tokens (data.seq_len - task.max_completion_len)"
        )
    prompt = "messages" if out.settings["chat"] else "prompt"
    others = {c: out.column(c) for c in out.settings["columns"] if c != prompt}
    read = Prompts(out.column(prompt), others)
    if key == "data.eval":
        _same_columns(job.grpo.prompts, read, path)
        job.grpo.eval_prompts = read
    else:
        job.grpo.prompts = read
    return out


def _same_columns(train: Prompts | None, held_out: Prompts, path: Path) -> None:
    """The eval prompts carry the training prompts' columns: the same reward
    functions read them (said before anything compiles)."""
    missing = sorted(set(train.columns) - set(held_out.columns)) if train else []
    if missing:
        raise ConfigError(
            f"`data.eval` ({path}) lacks the column(s) {missing} of data.train, "
            "which the reward functions (task.rewards) are given: add them to "
            "the eval file, or point data.eval at one that has them."
        )


def _unusable(rows: data_lib.PostRows, path: Path, key: str) -> None:
    """One warning for the skipped records; an error when none is left."""
    report, where = rows.report, rows.meta["where"]
    skipped = sum(report.reasons.values())
    if not skipped:
        return
    why = "; ".join(
        f"{count} {reason} (the first: {where[reason]})"
        for reason, count in report.reasons.items()
    )
    if skipped == report.total:
        raise ConfigError(
            f"`{key}` ({path}) holds no usable prompt: all {report.total} rows "
            f"were skipped: {why}. task.kind = 'grpo' reads a `prompt` string "
            "(or a `messages` chat) from each row."
        )
    warnings.warn(
        f"{path}: skipped {skipped} of {report.total} rows: {why}.",
        data_lib.DataWarning,
        stacklevel=3,
    )


def pad_id(tokenizer: Any) -> int:
    """What fills a prompt's left and a completion's end: the pad id, else EOS,
    else 0 (never attended to either way)."""
    for value in (tokenizer.pad_id, tokenizer.eos_id):
        if value is not None:
            return int(value)
    return 0


def stop_ids(job: Any) -> tuple[int, ...]:
    """Where a completion ends: the tokenizer's EOS, and the model's own end ids
    (`generation_config.json` of `model.init_from`)."""
    ids = [] if job.tokenizer.eos_id is None else [int(job.tokenizer.eos_id)]
    init_from = job.config.model.init_from
    if init_from is not None:
        ids += hf.generation_eos(init_from)
    return tuple(dict.fromkeys(ids))


def reward_failure(job: Any) -> ConfigError | None:
    """The config error of a reward function's failure during training or an
    evaluation, if any (`Rollout.failures`: the step stopped the run there)."""
    online = job.grpo
    rollouts = () if online is None else (online.rollout, online.eval_rollout)
    failures = [
        (e, r is online.eval_rollout)
        for r in rollouts
        if r is not None
        for e in r.failures
    ]
    if not failures:
        return None
    error, held_out = failures[0]
    where = " (on data.eval's prompts)" if held_out else ""
    if isinstance(error, ConfigError):
        return ConfigError(f"`task.rewards`{where}: {error}")
    return ConfigError(
        f"`task.rewards`{where}: scoring the completions failed with "
        f"{type(error).__name__}: {error}"
    )


class RewardCheck:
    """A hook for every step of a GRPO run: a reward function's failure
    (`Rollout.failures`) ends the run as the exception it is, at the first step
    whose metrics show it, as any exception ends `fit`: no end hooks (no final
    export), no "nonfinite" record. The failing step left the state as it was
    (`halted`), so nothing after the last checkpoint is saved either. Put it
    before the metrics writers: the failed step is then not logged."""

    def __init__(self, job: Any):
        self.job = job

    def __call__(self, info: Any) -> None:
        failed = reward_failure(self.job)
        if failed is not None:
            raise failed


def make_rollout(job: Any) -> rollout_lib.Rollout:
    """The run's `Rollout`: sampling from `[task]`, scoring with `task.rewards` on
    the prompts `rows` read (call it after them)."""
    prompts = job.grpo.prompts
    if prompts is None:
        raise RuntimeError("make_rollout before the prompt rows were read")
    job.grpo.rollout = _rollout(job, prompts, _sampling(job.config.task))
    return job.grpo.rollout


def _rollout(job: Any, prompts: Any, sampling: dict[str, Any]) -> rollout_lib.Rollout:
    """A `Rollout` over `prompts` (their rows and columns), scored with
    `task.rewards`, sampling as `sampling` (`_sampling`'s keys) says."""
    rewards = job.grpo.rewards or rewards_of(job.config)
    return rollout_lib.Rollout(
        score=rollout_lib.text_scorer(
            job.tokenizer, prompts.prompts, prompts.columns, rewards
        ),
        reward_names=tuple(name for name, _, _ in rewards),
        stop_ids=stop_ids(job),
        pad_id=pad_id(job.tokenizer),
        vocab_size=job.vocab_size,
        **sampling,
    )


def make_eval_rollout(job: Any) -> rollout_lib.Rollout:
    """The evaluation's `Rollout` (`rollout.grpo_eval_step`): `data.eval`'s
    prompts completed at `task.eval_temperature` (0: greedy, one completion per
    prompt; else `task.group_size` of them), scored with `task.rewards`."""
    prompts = job.grpo.eval_prompts
    if prompts is None:
        raise RuntimeError("make_eval_rollout before the eval rows were read")
    t = job.config.task
    sampling = dict(_sampling(t), passes=1, group_size=t.group_size)
    sampling["sampling"] = dataclasses.replace(
        sampling["sampling"], temperature=t.eval_temperature
    )
    if not t.eval_temperature:  # greedy: every completion of a prompt is the same
        sampling["group_size"] = 1
    job.grpo.eval_rollout = _rollout(job, prompts, sampling)
    return job.grpo.eval_rollout


def padded_eval_rows(rows: dict[str, Any], batch: int) -> dict[str, Any]:
    """The eval prompt rows with `valid` (1; 0 on padding), padded with copies
    of the first row to whole batches of `batch`: every batch has the compiled
    shape, and the padding is not counted (`rollout.grpo_eval_step`)."""
    n = len(rows["index"])
    pad = -n % batch
    take = np.concatenate([np.arange(n), np.zeros(pad, np.int64)])
    out = {k: np.asarray(v)[take] for k, v in rows.items()}
    out["valid"] = (np.arange(n + pad) < n).astype(np.float32)
    return out


def _sampling(t: Any) -> dict[str, Any]:
    """The `Rollout` settings of the `[task]` section `t`."""
    return dict(
        group_size=t.group_size,
        max_new_tokens=t.max_completion_len,
        sampling=Sampling(
            temperature=t.temperature, top_k=t.top_k, top_p=t.top_p, min_p=t.min_p
        ),
        scale=t.scale_rewards,
        passes=t.passes,
    )
