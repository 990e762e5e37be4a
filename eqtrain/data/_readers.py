"""The streaming readers, one per kind of file: each reads one `Piece` (a slice
of one source) and yields its documents, counting the records it skips.
"""

import csv
import dataclasses
import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._errors import DataError
from ._source_files import BLOCK, compression_of, opened


# pandas' default missing-value strings: `datasets` reads CSV with pandas, so a
# text cell holding one of these is a missing value there (skipped), and here.
_CSV_MISSING = frozenset(
    "|#N/A|#N/A N/A|#NA|-1.#IND|-1.#QNAN|-NaN|-nan|1.#IND|1.#QNAN|<NA>|N/A|NA|NULL"
    "|NaN|None|n/a|nan|null".split("|")
)


@dataclasses.dataclass(frozen=True)
class Piece:
    """One slice of one source, read by `documents`; `to_json` makes it a task."""

    kind: str  # "jsonl" | "parquet" | "text_files" | "json" | "csv"
    path: str  # the absolute file path ("" for text_files)
    start: int  # jsonl: byte offset of the first line; parquet: first row group
    stop: int  # jsonl: byte offset after the last line; parquet: row group stop
    line: int  # jsonl: the 1-based number of the first line (for errors)
    nbytes: int  # source bytes in the piece (for progress)
    paths: tuple[str, ...] = ()  # text_files: the files, one document each
    compression: str | None = None  # None | "gz" | "zst": one whole piece

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "paths": list(self.paths)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Piece":
        return cls(**{**d, "paths": tuple(d.get("paths", ()))})


def _read_jsonl(piece: Piece, column: str, counts: dict) -> Iterator[str]:
    loads, number = json.loads, piece.line
    for lines in _jsonl_blocks(piece):
        for line in lines:
            try:
                value = loads(line)[column]
            except (ValueError, TypeError, KeyError):
                value = _bad_line(f"{piece.path}:{number}", line, column)
            if type(value) is str:
                if unpaired(value):
                    _skip(counts, f"{piece.path}:{number}", "unpaired")
                else:
                    yield value
            elif value is not _BLANK:
                _skip(counts, f"{piece.path}:{number}")
            number += 1


def _jsonl_blocks(piece: Piece) -> Iterator[list[bytes]]:
    """The lines of a JSON Lines piece, a block's worth at a time."""
    size = piece.stop - piece.start if piece.stop >= 0 else -1
    with opened(Path(piece.path), piece.compression) as f:
        if piece.start:  # a compressed stream cannot seek
            f.seek(piece.start)
        yield from _line_blocks(f, size)


_BLANK = object()


def _line_blocks(f: io.BufferedIOBase, size: int) -> Iterator[list[bytes]]:
    """The lines of the next `size` bytes of `f` (all of it when -1), a block's
    worth at a time; the last line may lack its newline."""
    rest: list[bytes] = []  # the blocks of a line not ended yet
    while size:
        block = f.read(BLOCK if size < 0 else min(size, BLOCK))
        if not block:
            break
        size -= len(block) if size > 0 else 0
        if b"\n" not in block:  # inside a long line: joined once, when it ends
            rest.append(block)
            continue
        lines = b"".join([*rest, block]).split(b"\n")
        rest = [lines.pop()]
        yield lines
    if rest and rest != [b""]:
        yield [b"".join(rest)]


def _bad_line(where: str, line: bytes, column: str) -> Any:
    """`_BLANK` for a blank line, else the DataError that says what is wrong."""
    if not line.strip():
        return _BLANK
    shown = line[:80].decode("utf-8", "replace") + ("..." if len(line) > 80 else "")
    record = _parsed_line(where, line, shown)
    if not isinstance(record, dict):
        raise DataError(
            f"{where} holds a JSON {type(record).__name__}, not an object: {shown!r}. "
            f"Each line must be an object with a {column!r} field."
        )
    raise _missing(where, column, list(record))


def _parsed_line(where: str, line: bytes, shown: str) -> Any:
    """`line`'s JSON value, or the DataError that says why it is not JSON."""
    try:
        return json.loads(line)
    except UnicodeDecodeError as e:
        raise DataError(
            f"{where} is not valid UTF-8 ({e.reason} at byte {e.start}). "
            "Re-encode the file as UTF-8."
        ) from None
    except ValueError as e:
        raise DataError(
            f"{where} is not valid JSON ({e}): {shown!r}. Each line of a JSON Lines "
            "file holds one JSON object: fix or remove that line."
        ) from None


def _missing(where: str, column: str, fields: list[str]) -> DataError:
    return DataError(
        f"{where} has no field {column!r}; its fields are {sorted(fields)}. Set "
        "data.text_column (`text_column=` in Python) to the field holding the text."
    )


def _skip(counts: dict, where: str, why: str = "skipped") -> None:
    """Count a skipped record: `"skipped"` (its text is not a string) or
    `"unpaired"` (its text holds an unpaired surrogate)."""
    counts[why] = counts.get(why, 0) + 1
    counts.setdefault(f"first_{why}", where)


_SURROGATE = re.compile("[\ud800-\udfff]")


def unpaired(text: str) -> bool:
    """Whether `text` holds a surrogate code point (JSON's `"\\ud800"` escape
    alone, not as half of a pair): not Unicode text, so no tokenizer can encode it
    (UTF-8 has no bytes for it)."""
    return not text.isascii() and _SURROGATE.search(text) is not None


def _read_json(piece: Piece, column: str, counts: dict) -> Iterator[str]:
    """A `.json` file that is one document, read whole: an array of records (or of
    strings, read as `{"text": s}` as `datasets` does)."""
    for i, record in enumerate(_json_array(piece), 1):
        where = f"{piece.path} (record {i})"
        value = _json_record(record, where, column)[column]
        if not isinstance(value, str):
            _skip(counts, where)
        elif unpaired(value):
            _skip(counts, where, "unpaired")
        else:
            yield value


def _json_record(record: Any, where: str, column: str) -> dict:
    """A record of a JSON array (a string stands for `{"text": s}`), with `column`."""
    record = {"text": record} if isinstance(record, str) else record
    if not isinstance(record, dict):
        raise DataError(f"{where} is a {type(record).__name__}, not an object.")
    if column not in record:
        raise _missing(where, column, list(record))
    return record


def _json_array(piece: Piece) -> list:
    """The array that a `.json` piece's one document holds."""
    with opened(Path(piece.path), piece.compression) as f:
        try:
            data = json.load(f)
        except ValueError as e:
            line = f":{e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
            raise DataError(
                f"{piece.path}{line} is neither JSON Lines nor one JSON document "
                f"({e}). Write one JSON object per line, or one array of objects."
            ) from None
    if not isinstance(data, list):
        raise DataError(
            f"{piece.path} holds one JSON {type(data).__name__}, not an array of "
            "records. Write one JSON object per line (JSON Lines), or an array."
        )
    return data


def _read_text_files(piece: Piece, column: str, counts: dict) -> Iterator[str]:
    """Each file of the piece is one document (undecodable bytes replaced), a
    `.gz` or `.zst` file decompressed (in a directory as when given alone)."""
    for path in piece.paths:
        with opened(Path(path), piece.compression or compression_of(path)) as f:
            data = f.read()
        yield data.decode("utf-8", errors="replace")


def _read_csv(piece: Piece, column: str, counts: dict) -> Iterator[str]:
    """Rows through `csv.DictReader` (so a text may span lines); an empty cell, a
    short row or a pandas missing-value string is skipped, as `datasets` reads."""
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))  # long documents
    with opened(Path(piece.path), piece.compression) as raw:
        reader = csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8-sig", newline=""))
        try:
            if column not in (reader.fieldnames or ()):
                raise _missing(f"{piece.path}:1", column, list(reader.fieldnames or ()))
            for row in reader:
                value = row[column]
                if value is None or value in _CSV_MISSING:
                    _skip(counts, f"{piece.path}:{reader.line_num}")
                else:
                    yield value
        except (csv.Error, UnicodeDecodeError) as e:
            raise DataError(
                f"{piece.path} (near line {reader.line_num + 1}) is not UTF-8 CSV "
                f"({e}). Fix the file, or convert it to JSON Lines."
            ) from None


def _read_parquet(piece: Piece, column: str, counts: dict) -> Iterator[str]:
    import pyarrow as pa

    file = parquet(Path(piece.path), column)
    row = sum(file.metadata.row_group(g).num_rows for g in range(piece.start))
    groups = range(piece.start, piece.stop)
    try:
        for batch in file.iter_batches(row_groups=groups, columns=[column]):
            for value in batch.column(0).to_pylist():
                if isinstance(value, str):
                    yield value
                else:
                    _skip(counts, f"{piece.path} (row {row})")
                row += 1
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"cannot read {piece.path} (near row {row}): {e}.") from None


def parquet(path: Path, column: str) -> Any:
    """`path` open as a `pyarrow.parquet.ParquetFile` that has `column`."""
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not a readable Parquet file ({e}).") from None
    if column not in file.schema_arrow.names:
        raise _missing(str(path), column, file.schema_arrow.names)
    return file


READERS = {
    "jsonl": _read_jsonl,
    "json": _read_json,
    "text_files": _read_text_files,
    "csv": _read_csv,
    "parquet": _read_parquet,
}
