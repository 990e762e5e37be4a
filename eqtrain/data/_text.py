"""Text pipelines: documents or examples -> fixed-width LM rows (the batch format).

Every function returns a dict of numpy arrays with one row per example/chunk:
`tokens` and `targets` (int32 [N, S], `targets[:, t]` is the token after
`tokens[:, t]`), `loss_mask` (float32 [N, S]) and, for packed (or left-padded) rows,
`segment_ids` (int32 [N, S]). Rows are built from S + 1 tokens, split into inputs
and shifted targets. A `Loader` batches them.
"""

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from jaxtyping import Float, Int

from .._errors import ConfigError
from ._errors import DataError, positive, too_few_tokens
from ._sources import column
from ._tokenizers import Tokenizer, require_id
from ._tools import refuse_tools


Rows = dict[str, np.ndarray]
# Literal values are checked by the functions (with a ConfigError), so the
# annotations say `str`: a runtime type checker would otherwise pre-empt the message.
Example = Sequence[int] | np.ndarray

ROLES = ("system", "user", "assistant")


def chunk_documents(
    documents: Iterable[str], tokenizer: Tokenizer, *, seq_len: int
) -> Rows:
    """Pre-training rows: documents joined by EOS, cut into rows of `seq_len`.

    The token stream is `doc_0 EOS doc_1 EOS ...`; row i holds stream positions
    `[i * seq_len, (i + 1) * seq_len]` (S + 1 tokens, so consecutive rows share one
    token and every stream token but the first is a target exactly once). The tail
    that does not fill a row is dropped. `loss_mask` is all ones.

    Raises:
        DataError: no documents, or fewer than `seq_len + 1` tokens in all.
    """
    positive("seq_len", seq_len)
    eos = require_id(tokenizer, "eos", "`chunk_documents` (it ends documents with EOS)")
    stream, count = _stream(documents, tokenizer, eos)
    rows = (len(stream) - 1) // seq_len
    if rows == 0:
        raise too_few_tokens(seq_len, count, len(stream))
    used = rows * seq_len
    return {
        "tokens": stream[:used].reshape(rows, seq_len),
        "targets": stream[1 : used + 1].reshape(rows, seq_len),
        "loss_mask": np.ones((rows, seq_len), np.float32),
    }


def _stream(
    documents: Iterable[str], tokenizer: Tokenizer, eos: int
) -> tuple[np.ndarray, int]:
    """`doc_0 EOS doc_1 EOS ...` as int32 ids, and the number of documents."""
    pieces = []
    for doc in documents:
        pieces.append(np.asarray(tokenizer.encode(doc), np.int32))
        pieces.append(np.array([eos], np.int32))
    if not pieces:
        raise DataError("`chunk_documents` got no documents; pass at least one.")
    return np.concatenate(pieces), len(pieces) // 2


def pack(
    examples: Sequence[Example],
    *,
    seq_len: int,
    masks: Sequence[Example] | None = None,
    pad_id: int = 0,
    truncation: str = "keep_start",
) -> Rows:
    """Pack short examples into rows of `seq_len`, with segment ids.

    Examples are placed in order ("next fit": a new row starts when the next
    example does not fit), each whole (empty ones are skipped), numbered 1, 2,
    3, ... within its row in `segment_ids` (padding is 0). A row holds S + 1
    tokens: an example may end on the last, target-only slot but not start
    there. `loss_mask` is 1 where the target is the next token *of the same
    example* (and, with `masks`, a token to learn): never across a boundary,
    never on padding. Models use `segment_ids` so that attention never crosses
    examples.

    Args:
        examples: token sequences.
        seq_len: S, the row width.
        masks: optional, one per example, of its length: 1 where the token is a
            target to learn (e.g. from `encode_chat`); default all ones.
        pad_id: the id in padded slots (never a counted target).
        truncation: for examples longer than S + 1 tokens: keep the first
            (`"keep_start"`) or the last (`"keep_end"`) S + 1.

    Raises:
        DataError: no examples.
    """
    positive("seq_len", seq_len)
    width = seq_len + 1
    placements = _next_fit(_prepared(examples, masks, width, truncation), width)
    tok, seg, learn = _segments(placements, width, pad_id)
    same = (seg[:, :-1] == seg[:, 1:]) & (seg[:, 1:] > 0)
    return {
        "tokens": tok[:, :-1],
        "targets": tok[:, 1:],
        "loss_mask": (same * learn[:, 1:]).astype(np.float32),
        "segment_ids": seg[:, :-1],
    }


Item = tuple[np.ndarray, np.ndarray]
"""An example's ids and mask."""


def _next_fit(items: list[Item], width: int) -> list[list[Item]]:
    """The examples of each row: a row takes examples until the next one does not
    fit, or would start on the last, target-only slot; empty ones are skipped."""
    placements: list[list[Item]] = []
    pos = width
    for ids, mask in items:
        if len(ids) == 0:  # nothing to place, and no segment number to spend
            continue
        if pos + len(ids) > width or pos >= width - 1:
            placements.append([])
            pos = 0
        placements[-1].append((ids, mask))
        pos += len(ids)
    return placements


def _segments(
    placements: list[list[Item]], width: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ids, segment numbers (1, 2, ... in each row) and masks of rows
    holding `placements`' examples one after the other."""
    tok = np.full((len(placements), width), pad_id, np.int32)
    seg = np.zeros((len(placements), width), np.int32)
    learn = np.zeros((len(placements), width), np.float32)
    for r, row in enumerate(placements):
        pos = 0
        for segment, (ids, mask) in enumerate(row, start=1):
            end = pos + len(ids)
            tok[r, pos:end], seg[r, pos:end], learn[r, pos:end] = ids, segment, mask
            pos = end
    return tok, seg, learn


def collate(
    examples: Sequence[Example],
    *,
    max_length: int,
    masks: Sequence[Example] | None = None,
    pad_id: int = 0,
    truncation: str = "keep_start",
    padding_side: str = "right",
    segment_ids: bool | None = None,
) -> Rows:
    """One example per row, truncated and padded to `max_length` (S).

    An example keeps at most S + 1 tokens (S inputs plus the last target):
    `truncation="keep_start"` keeps the first ones, `"keep_end"` the last ones (use
    it for chat data, whose answer is at the end). Padding goes after
    (`padding_side="right"`) or before (`"left"`) the tokens; padded targets have
    `loss_mask` 0, as do tokens whose `masks` entry is 0.

    With `segment_ids` (default: only for left padding) rows also carry
    `segment_ids`: 1 on the example, 0 on padding, so that a model's attention
    skips left padding.

    Use it on a whole dataset up front, or per batch as a `Loader`'s `transform`.

    Raises:
        DataError: no examples.
    """
    positive("max_length", max_length)
    if padding_side not in ("right", "left"):
        raise ConfigError(
            f"`padding_side` must be 'right' or 'left'; got {padding_side!r}."
        )
    width = max_length + 1
    items = _prepared(examples, masks, width, truncation)
    tok, real, learn = _padded_rows(items, width, pad_id, padding_side)
    rows = {
        "tokens": tok[:, :-1],
        "targets": tok[:, 1:],
        "loss_mask": (real[:, :-1] & real[:, 1:] & (learn[:, 1:] > 0)).astype(
            np.float32
        ),
    }
    if segment_ids if segment_ids is not None else padding_side == "left":
        rows["segment_ids"] = real[:, :-1].astype(np.int32)
    return rows


def _padded_rows(
    items: list[Item], width: int, pad_id: int, padding_side: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ids, where they are real (not padding), and the masks: one row each."""
    tok = np.full((len(items), width), pad_id, np.int32)
    real = np.zeros((len(items), width), bool)
    learn = np.zeros((len(items), width), np.float32)
    for i, (ids, mask) in enumerate(items):
        n = len(ids)
        where = slice(0, n) if padding_side == "right" else slice(width - n, width)
        tok[i, where], real[i, where], learn[i, where] = ids, True, mask
    return tok, real, learn


def _prepared(
    examples: Sequence[Example],
    masks: Sequence[Example] | None,
    width: int,
    truncation: str,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) pairs, truncated to `width` tokens."""
    _check_examples(examples, masks, truncation)
    cut = slice(0, width) if truncation == "keep_start" else slice(-width, None)
    items = []
    for i, example in enumerate(examples):
        ids, mask = _with_mask(example, None if masks is None else masks[i], i)
        items.append((ids[cut], mask[cut]))
    return items


def _check_examples(
    examples: Sequence[Example], masks: Sequence[Example] | None, truncation: str
) -> None:
    if truncation not in ("keep_start", "keep_end"):
        raise ConfigError(
            f"`truncation` must be 'keep_start' or 'keep_end'; got {truncation!r}."
        )
    if len(examples) == 0:
        raise DataError("no examples were given; pass at least one.")
    if masks is not None and len(masks) != len(examples):
        raise ConfigError(
            f"`masks` must have one entry per example; got {len(masks)} masks for "
            f"{len(examples)} examples."
        )


def _with_mask(example: Example, mask: Example | None, i: int) -> Item:
    """Example `i`'s ids and its mask (all ones by default), of one length."""
    ids = np.asarray(example, np.int32).reshape(-1)
    if mask is None:
        return ids, np.ones(len(ids), np.float32)
    mask = np.asarray(mask, np.float32).reshape(-1)
    if len(mask) != len(ids):
        raise ConfigError(
            f"example {i} has {len(ids)} tokens but its mask has {len(mask)} "
            "entries; they must match."
        )
    return ids, mask


def encode_chat(
    messages: Sequence[Mapping[str, Any]], tokenizer: Tokenizer
) -> tuple[Int[np.ndarray, " n"], Float[np.ndarray, " n"]]:
    """Tokens of one conversation and the mask of the tokens to learn.

    The template, with `<BOS>` only when the tokenizer has one:

        <BOS><|system|>\\n{system}\\n<|user|>\\n{user}\\n<|assistant|>\\n{answer}<EOS>...

    Each message is a header `<|{role}|>\\n` followed by its content; a system or
    user content is followed by `\\n`, an assistant content by EOS. The mask is 1
    exactly on assistant contents and their EOS (the model learns to answer and to
    stop), 0 on everything else.

    Raises:
        DataError: a message is not a `{"role", "content"}` mapping with a role
            among system/user/assistant and a string content.
    """
    eos = require_id(tokenizer, "eos", "`encode_chat` (assistant turns end with EOS)")
    pieces = list(_chat_pieces(messages, tokenizer, eos))
    if not pieces:
        return np.zeros(0, np.int32), np.zeros(0, np.float32)
    ids = [np.asarray(piece, np.int32) for piece, _ in pieces]
    learn = [np.full(len(piece), value, np.float32) for piece, value in pieces]
    return np.concatenate(ids), np.concatenate(learn)


def _chat_pieces(
    messages: Sequence[Mapping[str, Any]], tokenizer: Tokenizer, eos: int
) -> Iterator[tuple[Any, float]]:
    """The template's pieces of a conversation, each with its mask value."""
    if tokenizer.bos_id is not None:
        yield np.array([tokenizer.bos_id]), 0.0
    for i, message in enumerate(messages):
        role, content = _role_and_content(message, i)
        yield tokenizer.encode(f"<|{role}|>\n"), 0.0
        if role == "assistant":
            yield tokenizer.encode(content), 1.0
            yield np.array([eos]), 1.0
        else:
            yield tokenizer.encode(content + "\n"), 0.0


def _role_and_content(message: Any, i: int) -> tuple[str, str]:
    """Message `i`'s role (one of `ROLES`) and content (a string), checked: it
    must be a mapping with `role` and `content`."""
    mapping = isinstance(message, Mapping)
    if not (mapping and "role" in message and "content" in message):
        keys = sorted(message) if mapping else type(message).__name__
        raise DataError(
            f"message {i} must be a mapping with 'role' and 'content'; got {keys}. "
            'Write messages as {"role": "user", "content": "..."}.'
        )
    role, content = message["role"], message["content"]
    if role not in ROLES:
        raise DataError(
            f"message {i} has role {role!r}; the chat template knows {list(ROLES)}."
        )
    if not isinstance(content, str):
        raise DataError(
            f"message {i} ({role}) has content of type {type(content).__name__}; "
            "it must be a string."
        )
    return role, content


def chat_examples(
    records: Any, tokenizer: Tokenizer, *, field: str = "messages"
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """`encode_chat` over every record's `field` (a list of messages).

    `records` is a `datasets.Dataset` (e.g. `from_files("chat.jsonl")`), a list of
    dicts, or a mapping of columns. Returns `(examples, masks)` for `pack` or
    `collate`.

    Raises:
        DataError: `field` is missing (the error lists the fields there are), the
            data is empty, a message is malformed, or a record has `tools`, which
            this template cannot write (the error names the record).
    """
    if not isinstance(records, Mapping) and not hasattr(records, "column_names"):
        records = list(records)  # read twice: the messages, then the tools
    conversations = column(records, field)
    tools = _tools_column(records, len(conversations))
    encoded = [
        _encoded_record(r, messages, tokenizer, tools[r])
        for r, messages in enumerate(conversations)
    ]
    return [ids for ids, _ in encoded], [mask for _, mask in encoded]


def _tools_column(records: Any, n: int) -> list[Any]:
    """Each record's `tools` (None where it has none)."""
    if isinstance(records, Mapping):
        values = records.get("tools")
        return [None] * n if values is None else list(values)
    if hasattr(records, "column_names"):  # datasets.Dataset
        return list(records["tools"]) if "tools" in records.column_names else [None] * n
    return [r.get("tools") if isinstance(r, Mapping) else None for r in records]


def _encoded_record(r: int, messages: Any, tokenizer: Tokenizer, tools: Any) -> Item:
    """`encode_chat` of record `r`'s messages; an error names the record (one with
    tools among them: the built-in template cannot write them)."""
    try:
        refuse_tools(tools)
        return encode_chat(messages, tokenizer)
    except DataError as error:
        raise DataError(f"record {r}: {error}") from error
