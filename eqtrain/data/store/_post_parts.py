"""One part of a post-training store: the records of one piece of a record file
(a byte range of JSON Lines, a run of Parquet row groups, or a whole `.json` /
`.csv` file), read one at a time, each encoded by `_post`'s per-record encoders
(SFT, preference pair or GRPO prompt) and written as flat files. `build_post_part`
runs the same in this process, a worker process or a Ray task; its answer (the
part's counts, skip reasons and sha256s) is plain JSON.

    parts/00000.tokens   the examples' ids back to back (uint16 or uint32)
    parts/00000.mask     uint8, one per id: 1 where the id is a target to learn
    parts/00000.ends     int64: where each example ends in the part
    parts/00000.records  GRPO only: each kept record's JSON, one per line
    parts/00000.offsets  GRPO only: int64, where each record's line ends

A preference pair is two examples (chosen, then rejected), each the prompt's ids
and the completion's (the mask 0 on the prompt).
"""

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._chat import BuiltinChatTemplate, JinjaChatTemplate
from .._errors import ChatTemplateError, DataError
from .._post import (
    _preference_encoder,
    _sft_encoder,
    _template as resolved,
    template_arguments,
)
from .._readers import Piece, _jsonl_blocks
from .._records import Skip
from .._tokenizers import ByteTokenizer, HFTokenizer
from ._parts import Task


FORMAT = 1
"""The post-training store's on-disk format; part of its key."""
KINDS = ("sft", "preference", "prompt")
"""What a store holds: SFT examples, preference pairs or GRPO prompts."""


# -- the encoder, as data a worker rebuilds -----------------------------------------
def post_spec(
    tokenizer: Any, template: Any, settings: Mapping[str, Any]
) -> dict[str, Any] | None:
    """What a worker process needs to encode as this process does: the tokenizer
    and chat template as JSON, and `settings` (`kind`, `format`, `seq_len`,
    `max_prompt_len`, `chat`). None when either cannot be rebuilt from data (a
    tokenizer or template of the caller's own class): then the parts are built
    in this process."""
    tok, tmpl = _tokenizer_spec(tokenizer), _template_spec(template)
    if tok is None or tmpl is None:
        return None
    return {"post": dict(settings), "tokenizer": tok, "template": tmpl}


def _tokenizer_spec(tokenizer: Any) -> dict[str, Any] | None:
    ids = {k: getattr(tokenizer, f"{k}_id", None) for k in ("bos", "eos", "pad")}
    if type(tokenizer) is ByteTokenizer:
        return {"kind": "byte", **ids}
    if type(tokenizer) is HFTokenizer:
        return {"kind": "hf", "json": tokenizer._tok.to_str(), **ids}
    return None


def _template_spec(template: Any) -> dict[str, Any] | None:
    if template is None or type(template) is BuiltinChatTemplate:
        return {"kind": "builtin"}
    if type(template) is JinjaChatTemplate:
        return {
            "kind": "jinja",
            "source": template.source,
            "special_tokens": dict(template.special_tokens),
            "tool_use": template.tool_use,
            "kwargs": template.kwargs,
        }
    return None


def _tokenizer(spec: Mapping[str, Any]) -> Any:
    if spec["kind"] == "byte":
        return ByteTokenizer()
    import tokenizers

    return HFTokenizer(
        tokenizers.Tokenizer.from_str(spec["json"]),
        bos_id=spec["bos"],
        eos_id=spec["eos"],
        pad_id=spec["pad"],
    )


def _template(spec: Mapping[str, Any]) -> Any:
    if spec["kind"] == "builtin":
        return BuiltinChatTemplate()
    return JinjaChatTemplate(
        spec["source"],
        spec["special_tokens"],
        tool_use=spec["tool_use"],
        kwargs=spec["kwargs"],
    )


class PostEncoder:
    """`record -> [(ids, mask), ...]` (one example, or a pair's two) for a store's
    kind and settings; a record to skip raises `Skip` (or `ChatTemplateError`)."""

    def __init__(self, tokenizer: Any, template: Any, settings: Mapping[str, Any]):
        template = resolved(template)  # None: the built-in template
        self.tokenizer, self.template = tokenizer, template
        self.settings = dict(settings)
        kind, s = settings["kind"], self.settings
        if kind == "sft":
            self._encode = _sft_example(
                _sft_encoder(
                    s["format"], tokenizer, s["seq_len"], template, s["max_prompt_len"]
                )
            )
        elif kind == "preference":
            self._encode = _pair_examples(
                _preference_encoder(
                    tokenizer, s["seq_len"], template, s["max_prompt_len"]
                )
            )
        else:
            self._encode = _prompt_example(tokenizer, template, s["chat"])

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> "PostEncoder":
        template = _template(spec["template"])
        return cls(_tokenizer(spec["tokenizer"]), template, spec["post"])

    def __call__(self, record: Any) -> list[tuple[np.ndarray, np.ndarray]]:
        return self._encode(record)


Examples = Callable[[Any], list[tuple[np.ndarray, np.ndarray]]]


def _sft_example(encode: Callable[[Any], tuple[np.ndarray, np.ndarray]]) -> Examples:
    return lambda record: [encode(record)]


def _pair_examples(fit: Callable[[Any], tuple[np.ndarray, ...]]) -> Examples:
    """Chosen and rejected, each as prompt + completion with its mask (what
    `_post._pair_rows` writes into a row)."""

    def examples(record: Any) -> list[tuple[np.ndarray, np.ndarray]]:
        prompt, c, cm, r, rm = fit(record)
        zeros = np.zeros(len(prompt), np.float32)
        return [
            (np.concatenate([prompt, c]), np.concatenate([zeros, cm])),
            (np.concatenate([prompt, r]), np.concatenate([zeros, rm])),
        ]

    return examples


def prompt_ids(record: Any, chat: bool, tokenizer: Any, template: Any) -> np.ndarray:
    """A GRPO record's prompt ids: BOS and the `prompt` text, or the `messages`
    chat rendered up to the assistant's turn (with the record's `tools` and
    `chat_template_kwargs`); `Skip` when it has no usable prompt (an empty one
    included)."""
    if chat:
        messages = record.get("messages") if isinstance(record, Mapping) else None
        if not isinstance(messages, list):
            raise Skip("whose 'messages' is not a list")
        turn = [{"role": "assistant", "content": ""}]
        try:
            extra = template_arguments(record, messages)
            ids, _, _ = template.encode_prompt_completion(
                messages, turn, tokenizer, **extra
            )
        except DataError as e:
            reason = getattr(e, "reason", None)  # a chat the template refuses
            if reason is None:
                raise
            raise Skip(reason) from None
        ids = np.asarray(ids, np.int32)
    else:
        prompt = record.get("prompt") if isinstance(record, Mapping) else None
        if not isinstance(prompt, str):
            raise Skip("whose 'prompt' is not a string")
        try:
            text = tokenizer.encode(prompt)
        except UnicodeEncodeError:
            raise Skip("whose 'prompt' is not valid Unicode") from None
        bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
        ids = np.concatenate([np.asarray(bos, np.int32), text]).astype(np.int32)
    if len(ids) == 0:
        raise Skip("with an empty prompt")
    return ids


def _prompt_example(tokenizer: Any, template: Any, chat: bool) -> Examples:
    def examples(record: Any) -> list[tuple[np.ndarray, np.ndarray]]:
        ids = prompt_ids(record, chat, tokenizer, template)
        return [(ids, np.zeros(len(ids), np.float32))]

    return examples


# -- records ------------------------------------------------------------------------
def records(piece: Piece) -> Iterator[tuple[Any, str]]:
    """The records of `piece` in file order, each with where it is (`file:line`
    for JSON Lines, else `file (record n)`); one record in memory at a time
    (a Parquet batch, a `.json`/`.csv` file through `datasets`)."""
    if piece.kind == "jsonl":
        yield from _jsonl_records(piece)
    elif piece.kind == "parquet":
        yield from _parquet_records(piece)
    else:
        from .._sources import from_files

        for i, record in enumerate(from_files(piece.path)):
            yield record, f"{piece.path} (record {i + 1})"


def _jsonl_records(piece: Piece) -> Iterator[tuple[Any, str]]:
    number = piece.line
    for lines in _jsonl_blocks(piece):
        for line in lines:
            if line.strip():
                yield _parsed(line, piece.path, number), f"{piece.path}:{number}"
            number += 1


def _parsed(line: bytes, path: str, number: int) -> Any:
    try:
        return json.loads(line)
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}:{number} is not valid UTF-8 ({e.reason} at byte {e.start}). "
            "Re-encode the file as UTF-8."
        ) from None
    except ValueError as e:
        shown = line[:80].decode("utf-8", "replace") + ("..." if len(line) > 80 else "")
        raise DataError(
            f"{path}:{number} is not valid JSON ({e}): {shown!r}. Each line of a "
            "JSON Lines file holds one JSON object: fix or remove that line."
        ) from None


def _parquet_records(piece: Piece) -> Iterator[tuple[Any, str]]:
    import pyarrow.parquet as pq

    file = pq.ParquetFile(piece.path)
    first = sum(file.metadata.row_group(g).num_rows for g in range(piece.start))
    groups = list(range(piece.start, piece.stop))
    n = first
    for batch in file.iter_batches(batch_size=1024, row_groups=groups):
        for record in batch.to_pylist():
            n += 1
            yield record, f"{piece.path} (record {n})"


# -- one part -----------------------------------------------------------------------
def post_part_paths(directory: str | os.PathLike, index: int) -> dict[str, Path]:
    base = Path(directory) / "parts" / f"{index:05d}"
    names = ("tokens", "mask", "ends", "records", "offsets")
    return {name: base.with_suffix(f".{name}") for name in names}


FLUSH_TOKENS = 1 << 20
"""Tokens a part's writer buffers before writing them (bounds its memory)."""


class _Writer:
    """A part's files being written (as `.tmp<pid>`), with their sha256s; the
    examples are buffered and written `FLUSH_TOKENS` at a time."""

    def __init__(self, paths: Mapping[str, Path], dtype: np.dtype, names: tuple):
        self.dtype, self.paths = dtype, paths
        self.limit = np.iinfo(dtype).max
        self.tmp = {
            n: paths[n].with_name(f"{paths[n].name}.tmp{os.getpid()}") for n in names
        }
        self.files = {n: open(self.tmp[n], "wb") for n in names}
        self.digests = {n: hashlib.sha256() for n in names}
        self.tokens = self.examples = self.record_bytes = 0
        self._ids: list[np.ndarray] = []
        self._masks: list[np.ndarray] = []
        self._ends: list[int] = []
        self._buffered = 0

    def _write(self, name: str, data: bytes) -> None:
        self.files[name].write(data)
        self.digests[name].update(data)

    def example(self, ids: np.ndarray, mask: np.ndarray) -> None:
        ids = np.asarray(ids)
        if len(ids) and (ids.min() < 0 or ids.max() > self.limit):
            raise DataError(
                f"a token id ({int(ids.max())}) does not fit the store's "
                f"{self.dtype.name}: the tokenizer's vocab_size is too small for "
                "its ids. Check the tokenizer's added tokens."
            )
        bits = np.asarray(mask).astype(np.uint8)
        if (bits != mask).any():
            raise DataError(
                "a chat template returned a loss mask with values other than 0 "
                "and 1, which the store keeps as bytes. Use a template whose mask "
                "is 0 or 1."
            )
        self._ids.append(ids.astype(self.dtype))
        self._masks.append(bits)
        self.tokens += len(ids)
        self.examples += 1
        self._ends.append(self.tokens)
        self._buffered += len(ids)
        if self._buffered >= FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if self._ends:
            self._write("tokens", np.concatenate(self._ids).tobytes())
            self._write("mask", np.concatenate(self._masks).tobytes())
            self._write("ends", np.asarray(self._ends, np.int64).tobytes())
        self._ids, self._masks, self._ends, self._buffered = [], [], [], 0

    def record(self, value: Any) -> None:
        line = (json.dumps(value, ensure_ascii=False) + "\n").encode("utf-8")
        self._write("records", line)
        self.record_bytes += len(line)
        self._write("offsets", np.int64(self.record_bytes).tobytes())

    def commit(self) -> dict[str, str]:
        self._flush()
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        for name, tmp in self.tmp.items():
            os.replace(tmp, self.paths[name])
        return {n: d.hexdigest() for n, d in self.digests.items()}

    def abort(self) -> None:
        for name, f in self.files.items():
            f.close()
            self.tmp[name].unlink(missing_ok=True)


def build_post_part(task: Task, encoder: PostEncoder) -> dict[str, Any]:
    """Read, encode and write part `task.index` (a `Task` of a piece; its
    `text_column` unused); its counts as JSON:
    `total`/`kept` records, skip `reasons` with each one's `first` record (in
    the part) and `where` (`file:line`), `examples`, `tokens`, `long` (GRPO
    prompts longer than the width, left out) and the files' `sha256`."""
    piece = Piece.from_json(task.piece)
    prompts = encoder.settings["kind"] == "prompt"
    names = ("tokens", "mask", "ends") + (("records", "offsets") if prompts else ())
    paths = post_part_paths(task.directory, task.index)
    writer = _Writer(paths, np.dtype(task.dtype), names)
    try:
        counts = _encode_piece(piece, encoder, writer)
        sha256 = writer.commit()
    except BaseException:
        writer.abort()
        raise
    return {
        **counts,
        "examples": writer.examples,
        "tokens": writer.tokens,
        "documents": counts["kept"],  # what the progress line counts
        "sha256": sha256,
    }


def _encode_piece(piece: Piece, encoder: PostEncoder, writer: _Writer) -> dict:
    """Every record of `piece` through `encoder` into `writer`; the counts."""
    total = kept = long = 0
    reasons: dict[str, int] = {}
    first: dict[str, int] = {}
    where: dict[str, str] = {}
    width = encoder.settings.get("width")
    for record, at in records(piece):
        try:
            examples = encoder(record)
        except (Skip, ChatTemplateError) as skip:
            reasons[skip.reason] = reasons.get(skip.reason, 0) + 1
            first.setdefault(skip.reason, total)
            where.setdefault(skip.reason, at)
            total += 1
            continue
        except DataError as e:
            raise DataError(f"{at}: {e}") from None
        total += 1
        if width is not None and len(examples[0][0]) > width:
            long += 1  # a GRPO prompt longer than its row: noted, not a skip
            continue
        kept += 1
        for ids, mask in examples:
            writer.example(ids, mask)
        if width is not None:
            writer.record(record)
    return {
        "total": total,
        "kept": kept,
        "long": long,
        "reasons": reasons,
        "first": first,
        "where": where,
    }
