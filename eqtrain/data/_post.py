"""Post-training rows: SFT rows (the LM batch format, loss on completions only)
and preference pairs (what
`eqtrain.post_training.preference.preference_loss_fn` reads), built
from chat, prompt/completion or preference records with a chat template
(`_chat.py`); bad rows are skipped and counted in a `SkipReport` (`_records.py`).

    rows, report = sft_rows(from_files("sft.jsonl"), tok, seq_len=512, format="chat")
    pairs, report = preference_rows(from_files("prefs.parquet"), tok, seq_len=512)
    print(report)   # "3 of 200 rows skipped: 3 with chosen == rejected (first: row 7)"

Formats (TRL's): `"chat"` (`messages`), `"prompt_completion"` (`prompt`,
`completion`: both strings or both message lists) and `"preference"` (`prompt`,
`chosen`, `rejected`; or, implicitly, `chosen`/`rejected` conversations whose
shared leading messages are the prompt). A record of message lists may carry
`tools` (function definitions, or a JSON string of them) and
`chat_template_kwargs` (extra template variables, e.g. `{"enable_thinking":
false}`), which the chat template is given with every render of it
(`_chat.check_tools`, `check_template_kwargs`); string records are text already
and do not use them.
"""

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .._errors import ConfigError
from . import _text
from ._chat import BuiltinChatTemplate, ChatTemplate, chat_template, check_tools
from ._errors import positive
from ._records import (
    Skip,
    SkipReport,
    collect,
    field,
    infer_format,
    is_empty,
    preference_fields,
    record_rows,
    same_kind,
)
from ._template_kwargs import FIELD as KWARGS_FIELD, check_template_kwargs
from ._tokenizers import Tokenizer, require_id


FORMATS = ("chat", "prompt_completion", "preference", "text")
SFT_FORMATS = ("chat", "prompt_completion")
Rows = dict[str, np.ndarray]
# (prompt ids, completion ids, completion mask)
Encoded = tuple[np.ndarray, np.ndarray, np.ndarray]
TemplateLike = ChatTemplate | str | os.PathLike[str] | None


def sft_rows(
    records: Any,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    format: str | None = None,
    template: TemplateLike = None,
    max_prompt_len: int | None = None,
    pack: bool = True,
) -> tuple[Rows, SkipReport]:
    """SFT rows in the LM batch format (`tokens`, `targets`, `loss_mask`,
    `segment_ids`: int32/float32 `[N, seq_len]`), with loss only on the tokens
    of completions (or assistant turns) and their end of turn.

    String prompt/completion: `[BOS] + prompt + completion + EOS` (BOS when the
    tokenizer has one), learning the completion and EOS. Message lists go through
    `template`.

    Truncation: a prompt longer than `max_prompt_len` tokens is cut from its
    start (TRL's `keep_end`; a leading BOS is kept); completions are never cut,
    and a row still longer than `seq_len + 1` tokens is skipped. A `chat`
    conversation longer than `seq_len + 1` tokens keeps its start and is skipped
    if no learned token remains.

    Args:
        records: a `datasets.Dataset` (e.g. `from_files("sft.jsonl")`), a list of
            dicts or a mapping of columns; a record of message lists may carry
            `tools`, given to the template (`check_tools`).
        tokenizer: any `Tokenizer`; a Jinja template needs `encode_with_offsets`.
        seq_len: S, the row width (rows hold S + 1 tokens: inputs and targets).
        format: `"chat"` or `"prompt_completion"`; inferred from the columns when
            omitted.
        template: a `ChatTemplate`, or a path for `chat_template` (a tokenizer
            directory or a `.jinja` file); None: the built-in template.
        max_prompt_len: default `seq_len // 2`.
        pack: pack examples into rows (`pack`, with segment ids) or put one per
            row (`collate`, padding masked, `segment_ids` 1 on the example).

    Returns:
        `(rows, report)`: the rows and the `SkipReport` of the bad records.

    Raises:
        DataError: no records, or every record was skipped (the error lists why).
        ConfigError: `format` is not an SFT format, or `max_prompt_len` is not in
            `[1, seq_len]`.
    """
    positive("seq_len", seq_len)
    rows = record_rows(records)
    format = _sft_format(format or infer_format(rows))
    encode = _sft_encoder(format, tokenizer, seq_len, template, max_prompt_len)
    examples, report = collect(rows, encode)
    ids, masks = [e[0] for e in examples], [e[1] for e in examples]
    pad = tokenizer.pad_id or 0
    if pack:
        return _text.pack(ids, masks=masks, seq_len=seq_len, pad_id=pad), report
    rows = _text.collate(
        ids, masks=masks, max_length=seq_len, pad_id=pad, segment_ids=True
    )
    return rows, report


def _sft_format(format: str) -> str:
    if format not in SFT_FORMATS:
        raise ConfigError(
            f"SFT `format` must be one of {SFT_FORMATS}; got {format!r}. For "
            "preference data use `preference_rows`, for plain text `chunk_documents`."
        )
    return format


def preference_rows(
    records: Any,
    tokenizer: Tokenizer,
    *,
    seq_len: int,
    template: TemplateLike = None,
    max_prompt_len: int | None = None,
) -> tuple[Rows, SkipReport]:
    """One row per preference pair: `chosen_tokens`, `chosen_targets`,
    `chosen_mask` and the same for `rejected_` (int32 tokens/targets, float32
    masks, `[N, seq_len]`), as
    `eqtrain.post_training.preference.preference_loss_fn` reads them.

    Each sequence is prompt + completion (at most `seq_len + 1` ids): tokens are
    `ids[:-1]`, targets `ids[1:]`, the mask is 1 where the target is a completion
    token (or its end of turn); padding on the right has the tokenizer's pad id,
    target 0 and mask 0. Both sequences of a pair start with the same prompt ids.

    Truncation: a prompt longer than `max_prompt_len` tokens is cut from its
    start (TRL's `keep_end`; a leading BOS is kept); completions are never cut,
    and a pair whose prompt plus longer completion is still over `seq_len + 1`
    tokens is skipped.

    Args:
        records: with `prompt`, `chosen`, `rejected` (strings, or message lists:
            the conversation so far and the assistant replies), or `chosen` and
            `rejected` conversations whose shared leading messages are the prompt;
            and `tools` for message lists, as for `sft_rows`.
        tokenizer: as for `sft_rows`.
        seq_len: S, the row width.
        template: as for `sft_rows`.
        max_prompt_len: default `seq_len // 2`.

    Returns:
        `(rows, report)`.

    Raises:
        DataError: no records, or every record was skipped (the error lists why).
    """
    positive("seq_len", seq_len)
    fit = _preference_encoder(tokenizer, seq_len, template, max_prompt_len)
    pairs, report = collect(record_rows(records), fit)
    return _pair_rows(pairs, seq_len, tokenizer.pad_id or 0), report


# -- encoders ---------------------------------------------------------------------
def _preference_encoder(
    tokenizer: Tokenizer,
    seq_len: int,
    template: TemplateLike,
    max_prompt_len: int | None,
) -> Callable[[Any], tuple[np.ndarray, ...]]:
    """`row -> (prompt, chosen, chosen mask, rejected, rejected mask)`, the prompt
    truncated to fit a row (or the row skipped)."""
    limit = _prompt_limit(seq_len, max_prompt_len)
    pair = _pair_encoder(tokenizer, _template(template))

    def fit(row: Any) -> tuple[np.ndarray, ...]:
        prompt, chosen, rejected = preference_fields(row)
        extra = template_arguments(row, prompt)
        p, c, cm = pair(prompt, chosen, extra)
        q, r, rm = pair(prompt, rejected, extra)
        if not np.array_equal(p, q):
            raise Skip("with chosen and rejected prompts that tokenize differently")
        _check_learned(cm)
        _check_learned(rm)
        p = _truncate_prompt(p, limit, tokenizer.bos_id)
        if len(p) + max(len(c), len(r)) > seq_len + 1:
            raise Skip(_too_long(seq_len))
        return p, c, cm, r, rm

    return fit


def _sft_encoder(
    format: str,
    tokenizer: Tokenizer,
    seq_len: int,
    template: TemplateLike,
    max_prompt_len: int | None,
) -> Callable[[Any], tuple[np.ndarray, np.ndarray]]:
    """`row -> (ids, mask)` for `format`, truncated (or skipped) to fit a row."""
    resolved = _template(template)
    if format == "chat":
        return lambda row: _chat_example(row, tokenizer, seq_len, resolved)
    limit = _prompt_limit(seq_len, max_prompt_len)
    return _prompt_completion_encoder(tokenizer, seq_len, resolved, limit)


def _prompt_completion_encoder(
    tokenizer: Tokenizer, seq_len: int, template: ChatTemplate, limit: int
) -> Callable[[Any], tuple[np.ndarray, np.ndarray]]:
    """`row -> (ids, mask)` of a prompt/completion row, its prompt cut to `limit`."""
    pair = _pair_encoder(tokenizer, template)

    def encode(row: Any) -> tuple[np.ndarray, np.ndarray]:
        prompt, completion = field(row, "prompt"), field(row, "completion")
        same_kind(("prompt", prompt), ("completion", completion))
        if is_empty(completion):
            raise Skip("with an empty completion")
        p, c, mask = pair(prompt, completion, template_arguments(row, prompt))
        _check_learned(mask)
        p = _truncate_prompt(p, limit, tokenizer.bos_id)
        if len(p) + len(c) > seq_len + 1:
            raise Skip(_too_long(seq_len))
        return np.concatenate([p, c]), np.concatenate(
            [np.zeros(len(p), np.float32), mask]
        )

    return encode


def _chat_example(
    row: Any, tokenizer: Tokenizer, seq_len: int, template: ChatTemplate
) -> tuple[np.ndarray, np.ndarray]:
    messages = field(row, "messages")
    if isinstance(messages, (list, tuple)) and not any(
        isinstance(m, Mapping) and m.get("role") == "assistant" for m in messages
    ):
        raise Skip("with no assistant message")
    ids, mask = template.encode(
        messages, tokenizer, **template_arguments(row, messages)
    )
    ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]  # keep the start
    if not mask[1:].any():  # the first token is never a target
        raise Skip(f"with no assistant token in the first {seq_len + 1} tokens")
    return ids, mask


def _pair_encoder(
    tokenizer: Tokenizer, template: ChatTemplate
) -> Callable[[Any, Any, Any], Encoded]:
    """`(prompt, completion, extra) -> (prompt ids, completion ids, completion
    mask)` for strings (BOS + prompt, completion + EOS) or message lists
    (`template`, given the record's `template_arguments` as `extra`)."""

    def encode(prompt: Any, completion: Any, extra: dict[str, Any]) -> Encoded:
        if isinstance(prompt, str):
            return _encode_text(prompt, completion, tokenizer)
        return template.encode_prompt_completion(prompt, completion, tokenizer, **extra)

    return encode


def template_arguments(row: Any, messages: Any) -> dict[str, Any]:
    """The keywords that give a template what a record whose `messages` (or
    prompt) it renders carries besides them: `tools` (`check_tools`) and
    `chat_template_kwargs` (`check_template_kwargs`), checked (a malformed value
    skips the record), each only when the record has some, so that a
    `ChatTemplate` of the caller's own that takes neither still works on records
    without them. None for text records, which no template renders."""
    if isinstance(messages, str) or not isinstance(row, Mapping):
        return {}
    tools = check_tools(row.get("tools"))
    kwargs = check_template_kwargs(row.get(KWARGS_FIELD))
    return ({} if tools is None else {"tools": tools}) | (
        {KWARGS_FIELD: kwargs} if kwargs else {}
    )


def _encode_text(prompt: str, completion: str, tokenizer: Tokenizer) -> Encoded:
    eos = require_id(tokenizer, "eos", "string completions (they end with EOS)")
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    p = np.concatenate([np.asarray(bos, np.int32), tokenizer.encode(prompt)])
    c = np.concatenate([tokenizer.encode(completion), np.asarray([eos], np.int32)])
    return p.astype(np.int32), c.astype(np.int32), np.ones(len(c), np.float32)


def _template(template: TemplateLike) -> ChatTemplate:
    if template is None:
        return BuiltinChatTemplate()
    if isinstance(template, (str, os.PathLike)):
        return chat_template(template)
    if not isinstance(template, ChatTemplate):
        raise ConfigError(
            f"`template` must be a ChatTemplate, a path (a tokenizer directory or a "
            f"`.jinja` file) or None; got {type(template).__name__}. Build one with "
            "`eqtrain.data.chat_template(path)`."
        )
    return template


# -- rows -------------------------------------------------------------------------
def _prompt_limit(seq_len: int, max_prompt_len: int | None) -> int:
    limit = max(1, seq_len // 2) if max_prompt_len is None else max_prompt_len
    if not isinstance(limit, int) or not 1 <= limit <= seq_len:
        raise ConfigError(
            f"`max_prompt_len` must be an int in [1, seq_len={seq_len}]; got "
            f"{max_prompt_len!r}. Leave it unset for seq_len // 2."
        )
    return limit


def _truncate_prompt(ids: np.ndarray, limit: int, bos: int | None) -> np.ndarray:
    """The last `limit` tokens of a prompt (keep_end), keeping a leading BOS."""
    if len(ids) <= limit:
        return ids
    if bos is not None and ids[0] == bos and limit > 1:
        return np.concatenate([ids[:1], ids[len(ids) - limit + 1 :]])
    return ids[len(ids) - limit :]


def _check_learned(mask: np.ndarray) -> None:
    if not mask.any():  # e.g. a completion of tool messages only
        raise Skip("with no completion token to learn")


def _too_long(seq_len: int) -> str:
    return f"longer than {seq_len + 1} tokens after truncating the prompt"


def _pair_rows(pairs: list[tuple[np.ndarray, ...]], seq_len: int, pad: int) -> Rows:
    n = len(pairs)
    rows: Rows = {}
    for side in ("chosen", "rejected"):
        rows[f"{side}_tokens"] = np.full((n, seq_len), pad, np.int32)
        rows[f"{side}_targets"] = np.zeros((n, seq_len), np.int32)
        rows[f"{side}_mask"] = np.zeros((n, seq_len), np.float32)
    for i, (prompt, c, cm, r, rm) in enumerate(pairs):
        for side, completion, mask in (("chosen", c, cm), ("rejected", r, rm)):
            ids = np.concatenate([prompt, completion])
            learn = np.concatenate([np.zeros(len(prompt), np.float32), mask])
            width = len(ids) - 1
            rows[f"{side}_tokens"][i, :width] = ids[:-1]
            rows[f"{side}_targets"][i, :width] = ids[1:]
            rows[f"{side}_mask"][i, :width] = learn[1:]
    return rows
