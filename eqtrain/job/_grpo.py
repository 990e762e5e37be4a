"""`task.kind = "grpo"` in a job: the prompt rows of `data.train`, the loss, and
the rollout (`eqtrain.rollout.Rollout`) that the compiled step samples and scores
with.

A prompt row is `prompt` (`[width]` int32, left-padded with the pad id, width =
`data.seq_len - task.max_completion_len`), `prompt_len` and `index` (its record in
the file). The prompts' text (a string, or a chat's messages) and the file's other
columns stay on the host: the reward functions read them by `index`.
"""

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from .. import data as data_lib, grpo, hf, rollout as rollout_lib
from .._errors import ConfigError
from ..config import Config, rewards_of
from ..generate import Sampling


@dataclasses.dataclass(frozen=True)
class Prompts:
    """The host side of GRPO's rows: each record's prompt and other columns."""

    prompts: list[Any]
    columns: dict[str, list[Any]]


@dataclasses.dataclass
class Online:
    """What a GRPO run learns on the host as it goes: the prompts `rows` read
    (the reward functions score completions of them), and the `Rollout` the
    compiled step samples with (it records a reward function's failure)."""

    prompts: Prompts | None = None
    rollout: rollout_lib.Rollout | None = None


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
            reference=reference,
            max_completion_length=t.max_completion_len,
            temperature=t.temperature or 1.0,
            vocab_size=vocab_size,
            chunk=chunk or None,
        )
    except ConfigError as e:
        raise ConfigError(f"[task]: {e}") from None


def _encode(record: dict[str, Any], chat: bool, job: Any) -> np.ndarray:
    tokenizer = job.tokenizer
    if chat:
        turn = [{"role": "assistant", "content": ""}]
        ids, _, _ = job.template.encode_prompt_completion(
            record["messages"], turn, tokenizer
        )
        return np.asarray(ids, np.int32)
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return np.concatenate(
        [np.asarray(bos, np.int32), tokenizer.encode(record["prompt"])]
    )


def _records(path: Path, key: str) -> tuple[Any, bool]:
    """The file's records, and whether its prompts are chats (`messages`)."""
    try:
        records = data_lib.from_files(path)
    except data_lib.DataError as e:
        raise ConfigError(f"`{key}` ({path}): {e}") from None
    have = list(records.column_names)
    if "messages" not in have and "prompt" not in have:
        raise ConfigError(
            f"`{key}` ({path}) has the columns {have}; task.kind = 'grpo' reads "
            "prompts from a `prompt` (text) or `messages` (a chat) column, and "
            "passes the other columns (e.g. `answer`) to the reward functions."
        )
    return records, "messages" in have


def rows(job: Any, source: str, key: str) -> dict[str, np.ndarray]:
    """The prompt rows of the record file `source`; prompts longer than the
    width are skipped (noted in `job.notes`); sets `job.grpo.prompts`."""
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"`{key}` names {source!r}, which is not a file.")
    records, chat = _records(path, key)
    width = prompt_width(job.config)
    kept, ids = _fitting(records, chat, job, width, f"`{key}` ({path})")
    if len(kept) < len(records):
        job.notes.append(
            f"{key} ({path.name}): skipped {len(records) - len(kept)} of "
            f"{len(records)} prompts longer than {width} tokens (data.seq_len - "
            "task.max_completion_len)"
        )
    columns = {c: [records[i][c] for i in kept] for c in records.column_names}
    job.grpo.prompts = Prompts(columns.pop("messages" if chat else "prompt"), columns)
    return _prompt_rows(ids, width, pad_id(job.tokenizer))


def _fitting(
    records: Any, chat: bool, job: Any, width: int, where: str
) -> tuple[list[int], list[np.ndarray]]:
    """The records whose prompts fit `width` tokens, and their token ids."""
    kept, ids = [], []
    for i, record in enumerate(records):
        try:
            encoded = _encode(record, chat, job)
        except data_lib.DataError as e:
            raise ConfigError(f"{where}, record {i}: {e}") from None
        if 0 < len(encoded) <= width:
            kept.append(i)
            ids.append(encoded)
    return kept, ids


def _prompt_rows(ids: list[np.ndarray], width: int, pad: int) -> dict[str, np.ndarray]:
    """The prompts left-padded to `width`, their lengths and their indices."""
    out = np.full((len(ids), width), pad, np.int32)
    for r, p in enumerate(ids):
        out[r, width - len(p) :] = p
    return {
        "prompt": out,
        "prompt_len": np.array([len(p) for p in ids], np.int32),
        "index": np.arange(len(ids), dtype=np.int32),
    }


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
    """The config error of a reward function's failure during training, if any
    (`Rollout.failures`: the step stopped the run there)."""
    rollout = None if job.grpo is None else job.grpo.rollout
    if rollout is None or not rollout.failures:
        return None
    error = rollout.failures[0]
    if isinstance(error, ConfigError):
        return ConfigError(f"`task.rewards`: {error}")
    return ConfigError(
        f"`task.rewards`: scoring the completions failed with "
        f"{type(error).__name__}: {error}"
    )


def make_rollout(job: Any) -> rollout_lib.Rollout:
    """The run's `Rollout`: sampling from `[task]`, scoring with `task.rewards` on
    the prompts `rows` read (call it after them)."""
    prompts = job.grpo.prompts
    if prompts is None:
        raise RuntimeError("make_rollout before the prompt rows were read")
    rewards = rewards_of(job.config)
    job.grpo.rollout = rollout_lib.Rollout(
        score=rollout_lib.text_scorer(
            job.tokenizer, prompts.prompts, prompts.columns, rewards
        ),
        reward_names=tuple(name for name, _, _ in rewards),
        stop_ids=stop_ids(job),
        pad_id=pad_id(job.tokenizer),
        vocab_size=job.vocab_size,
        **_sampling(job.config.task),
    )
    return job.grpo.rollout


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
