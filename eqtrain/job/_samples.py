"""`[log] samples`: the prompts file read and tokenized (checked before any data
is read); `_run_hooks` makes the run's `SamplesWriter` of them."""

import dataclasses
import json
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from ..config import data_format
from . import _build, _resolve
from ._generate import Generator, Options, chat_stop_ids, check_fits, prompt_tokens


@dataclasses.dataclass(frozen=True)
class Prompts:
    """The prompts of `log.samples`: as written, as tokens, and how to stop."""

    prompts: list[Any]
    tokens: list[Any]
    stop_ids: tuple[int, ...]
    multiple: int


def read_prompts(path: Path) -> tuple[list[Any], list[dict[str, Any]]]:
    """A .txt file's non-empty lines, or a .jsonl file's `prompt` strings and
    `messages` lists; with each prompt what else its line gives the chat
    template (`{"tools": ..., "chat_template_kwargs": ...}`, None where the line
    has no such field). `ConfigError` naming `log.samples` otherwise."""
    where = f"`log.samples` ({path})"
    if not path.is_file():
        raise ConfigError(f"{where} does not exist (or is not a file).")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix == ".txt":
        rows = [(line, _extra({})) for line in lines if line.strip()]
    elif path.suffix == ".jsonl":
        rows = [_jsonl_prompt(line, n, where) for n, line in _numbered(lines)]
    else:
        raise ConfigError(f"{where} must be a .txt or .jsonl file of prompts.")
    if not rows:
        raise ConfigError(f"{where} holds no prompt.")
    return [prompt for prompt, _ in rows], [extra for _, extra in rows]


def _numbered(lines: list[str]) -> list[tuple[int, str]]:
    return [(n, line) for n, line in enumerate(lines, 1) if line.strip()]


_KWARGS = "chat_template_kwargs"


def _extra(row: dict[str, Any]) -> dict[str, Any]:
    """A line's fields for the chat template, as `prompt_tokens` takes them."""
    return {"tools": row.get("tools"), _KWARGS: row.get(_KWARGS)}


def _jsonl_prompt(line: str, n: int, where: str) -> tuple[Any, dict[str, Any]]:
    try:
        row = json.loads(line)
    except ValueError:
        row = None
    if isinstance(row, dict) and isinstance(row.get("prompt"), str):
        return row["prompt"], _extra(row)
    if isinstance(row, dict) and isinstance(row.get("messages"), list):
        return row["messages"], _extra(row)
    raise ConfigError(
        f'{where}, line {n}: each line must be {{"prompt": "..."}} or '
        '{"messages": [...]}.'
    )


def prompts_of(job: _build.Job) -> Prompts | None:
    """`log.samples` read and tokenized for `job` (None when unset): strings are
    chat-templated when `data.format = "chat"`, messages always (a line's
    `tools` and `chat_template_kwargs` with them); refused when a prompt does not
    fit GPT-2's positions. In a multi-process run every process generates (the
    prompts replicated) and the first one writes."""
    log = job.config.log
    if log.samples is None:
        return None
    prompts, extras = read_prompts(Path(log.samples))
    model = _generator(job)
    try:
        tokens = _tokens(job, model, prompts, extras)
        multiple = check_fits(model, tokens, Options(log.samples_max_new_tokens))
    except ConfigError as e:
        raise ConfigError(f"`log.samples` ({log.samples}): {e}") from None
    stops = chat_stop_ids(model) if model.template is not None else model.stop_ids
    return Prompts(prompts, tokens, stops, multiple)


def _tokens(
    job: _build.Job,
    model: Generator,
    prompts: list[Any],
    extras: list[dict[str, Any]],
) -> list[Any]:
    """Each prompt's tokens: strings chat-templated when `data.format = "chat"`,
    messages always, each with its `tools` and `chat_template_kwargs`."""
    chat = data_format(job.config) == "chat"
    return [
        prompt_tokens(model, p, chat=chat or not isinstance(p, str), **extra)
        for p, extra in zip(prompts, extras, strict=True)
    ]


def _generator(job: _build.Job) -> Generator:
    """What tokenizing the prompts needs of a `Generator` (no model yet)."""
    template = job.template
    if template is None and job.config.task.kind != "lm":
        template = _resolve.chat_template_of(job.config)
    positions = getattr(job.model_config, "n_positions", None)
    eos = job.tokenizer.eos_id
    stops = () if eos is None else (int(eos),)
    source = Path(job.config.run_dir)
    return Generator(None, job.tokenizer, stops, source, template, positions)
