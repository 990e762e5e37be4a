"""Streaming, partitionable readers for the sources `_sources` reads in memory.

`plan(source)` cuts a source into `Piece`s: deterministic, self-contained,
JSON-serialisable slices that worker processes read independently with
`documents(piece)`. Reading every piece in plan order gives the documents of the
in-memory reading (`load_text_dir`, `read_text`, `from_files` + `text_column`),
in the same order, holding at most a block (1 MiB) of a file in memory at a
time; the exception is a `.json` file that is one JSON document (an array of
records, not JSON Lines), which the `json` module reads whole.

`fingerprint(source)` is the content key of a source, for a cache of its tokens:
the kind of source (and a directory's `pattern`), and for each file (a
directory's files matching `pattern`, by path relative to it; a single file by
its name) its relative name, size, `mtime_ns` and the sha256 of its first and
last MiB (of the whole file when it is under 2 MiB). Renaming the source's
directory keeps the key; touching, growing or editing a file changes it (an edit
in the middle through its mtime).
"""

import codecs
import contextlib
import csv
import dataclasses
import hashlib
import io
import json
import os
import warnings
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from ._errors import DataError, DataWarning, check_exists
from ._sources import text_files


PIECE_BYTES = 16 * 2**20
"""The default target size of a piece, in bytes of source file."""
_BLOCK = 2**20  # bytes read at a time
_EDGE = 2**20  # a fingerprint hashes a file's first and last MiB
_NOTHING = "Point the config (data.train, data.eval) at a file that holds data."
_KINDS = {".txt": "text_files", ".jsonl": "jsonl", ".json": "json", ".csv": "csv"}
_COMPRESSIONS = {".gz": "gz", ".zst": "zst"}
SUFFIXES = (".parquet", *(k + c for k in _KINDS for c in ("", *_COMPRESSIONS)))
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


def plan(
    source: str | os.PathLike,
    *,
    text_column: str = "text",
    pattern: str = "**/*.txt",
    piece_bytes: int = PIECE_BYTES,
) -> list[Piece]:
    """The pieces of `source`, in document order.

    A directory gives its files matching `pattern` (one document each) in groups
    of up to `piece_bytes`; an uncompressed JSON Lines file gives byte ranges that
    start at the first line start at or after each multiple of `piece_bytes`
    (found by seeking; one more pass counts newlines, for the line numbers in
    errors); a Parquet file gives ranges of row groups; every other file (`.txt`,
    `.csv`, a `.json` array, any compressed file) is one piece.

    Raises:
        DataFileNotFoundError: `source` does not exist.
        ConfigError: its suffix is not one of `SUFFIXES`, or `piece_bytes` < 1.
        DataError: it is empty, unreadable, or holds no records.
    """
    if piece_bytes < 1:
        raise ConfigError(f"`piece_bytes` must be at least 1; got {piece_bytes}.")
    check_exists(source, "data source")
    path = Path(os.path.abspath(source))
    if path.is_dir():
        return plan_files(text_files(path, pattern), piece_bytes=piece_bytes)
    kind, compression = _format(path)
    size = _stat(path).st_size
    if size == 0:
        raise DataError(f"{path} is empty (0 bytes). {_NOTHING}")
    if kind == "parquet":
        return _plan_parquet(path, text_column, piece_bytes)
    if kind == "text_files":
        return [Piece(kind, "", 0, -1, 1, size, (str(path),), compression)]
    if kind == "json":
        kind = _json_kind(path, compression)
    if kind == "jsonl" and compression is None:
        return _plan_jsonl(path, size, piece_bytes)
    return [Piece(kind, str(path), 0, -1, 1, size, compression=compression)]


def plan_files(
    files: Sequence[str | os.PathLike], *, piece_bytes: int = PIECE_BYTES
) -> list[Piece]:
    """Pieces of text files, one document each, in the order given: consecutive
    files grouped up to `piece_bytes` (e.g. `plan_files(stdlib_files("train"))`)."""
    if not files:
        raise DataError("no text files to read. Pass at least one file.")
    paths = [os.path.abspath(f) for f in files]
    runs = _runs([_stat(p).st_size for p in paths], piece_bytes)
    return [Piece("text_files", "", 0, -1, 1, n, tuple(paths[a:b])) for a, b, n in runs]


def documents(
    piece: Piece, *, text_column: str = "text", counts: dict | None = None
) -> Iterator[str]:
    """The documents of `piece`, in order.

    A record whose `text_column` is not a string (null, a number, a list) is
    skipped, as `text_column` does in memory, and counted in `counts`:
    `counts["skipped"]` and `counts["first_skipped"]` (`"<file>:<line>"`, set
    once), beside `counts["documents"]`; `check_counts` turns the totals into the
    in-memory reading's error and warning.

    Raises:
        DataError: a record that is not valid JSON, not an object, or lacks
            `text_column` (naming `<file>:<line>`); a file that cannot be read or
            decompressed.
    """
    counts = {} if counts is None else counts
    counts.setdefault("documents", 0)
    counts.setdefault("skipped", 0)
    for document in _READERS[piece.kind](piece, text_column, counts):
        counts["documents"] += 1
        yield document


def check_counts(source: str, counts: dict, *, text_column: str = "text") -> None:
    """After reading all of `source`: raise when it gave no document, warn once
    (a `DataWarning`) when records were skipped, as `text_column` does."""
    skipped, first = counts.get("skipped", 0), counts.get("first_skipped")
    if not counts.get("documents"):
        held = (
            f"; all {skipped} records are skipped (first: {first})" if skipped else ""
        )
        raise DataError(
            f"{source} holds no text in {text_column!r}{held}. Point data.text_column "
            "(`text_column=`) at a field of strings, or data.train at other data."
        )
    if skipped:
        warnings.warn(
            f"{source}: skipped {skipped} of {counts['documents'] + skipped} rows "
            f"whose {text_column!r} is not a string (the first: {first}).",
            DataWarning,
            stacklevel=2,
        )


def fingerprint(source: str | os.PathLike, *, pattern: str = "**/*.txt") -> dict:
    """The content key of `source` (the rule is in the module docstring)."""
    check_exists(source, "data source")
    path = Path(os.path.abspath(source))
    if path.is_dir():
        files = [
            _key(f, f.relative_to(path).as_posix()) for f in text_files(path, pattern)
        ]
        return {"kind": "text_files", "pattern": pattern, "files": files}
    kind, compression = _format(path)
    files = [_key(path, path.name)]
    return {"kind": kind, "compression": compression, "files": files}


def fingerprint_files(files: Sequence[str | os.PathLike]) -> dict:
    """The content key of a list of text files, named relative to their common
    directory (e.g. `fingerprint_files(stdlib_files("train"))`)."""
    paths = [os.path.abspath(f) for f in files]
    if not paths:
        raise DataError("no text files to read. Pass at least one file.")
    root = os.path.commonpath([os.path.dirname(p) for p in paths])
    files = [_key(Path(p), Path(os.path.relpath(p, root)).as_posix()) for p in paths]
    return {"kind": "text_files", "files": files}


# -- planning ---------------------------------------------------------------------
def _format(path: Path) -> tuple[str, str | None]:
    name = path.name.lower()
    stem, last = os.path.splitext(name)
    compression = _COMPRESSIONS.get(last)
    suffix = os.path.splitext(stem)[1] if compression else last
    kind = "parquet" if suffix == ".parquet" and not compression else _KINDS.get(suffix)
    if kind is None:
        raise ConfigError(
            f"{path} has a suffix eqtrain does not read; known: {', '.join(SUFFIXES)}. "
            "Rename the file, or convert it to one of those formats."
        )
    if compression == "zst":
        _zstd(path)  # fail at planning, not in a worker
    return kind, compression


def _runs(sizes: list[int], piece_bytes: int) -> list[tuple[int, int, int]]:
    """`(start, stop, nbytes)` of consecutive runs of `sizes` adding up to at most
    `piece_bytes` (or one item)."""
    runs, start, nbytes = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and nbytes + size > piece_bytes:
            runs.append((start, i, nbytes))
            start, nbytes = i, 0
        nbytes += size
    return [*runs, (start, len(sizes), nbytes)]


def _plan_jsonl(path: Path, size: int, piece_bytes: int) -> list[Piece]:
    starts = [0]
    with _opened(path) as f:
        for at in range(piece_bytes, size, piece_bytes):
            if at <= starts[-1]:
                continue  # still inside a line longer than a piece
            f.seek(at - 1)
            f.readline()  # to the end of the line holding byte at - 1
            if f.tell() < size:
                starts.append(f.tell())
        f.seek(0)
        lines, text = _line_numbers(f, starts)
    if not text:
        raise DataError(f"{path} holds only blank lines. {_NOTHING}")
    stops = [*starts[1:], size]
    return [
        Piece("jsonl", str(path), a, b, n, b - a)
        for a, b, n in zip(starts, stops, lines, strict=True)
    ]


def _line_numbers(f: io.BufferedReader, starts: list[int]) -> tuple[list[int], bool]:
    """The 1-based line number at each offset in `starts` (sorted), from one pass
    counting newlines a block at a time, and whether the file is not all blank."""
    lines, newlines, pos, text = [], 0, 0, False
    while block := f.read(_BLOCK):
        while len(lines) < len(starts) and starts[len(lines)] <= pos + len(block):
            lines.append(newlines + block.count(b"\n", 0, starts[len(lines)] - pos) + 1)
        newlines += block.count(b"\n")
        text = text or bool(block.strip())
        pos += len(block)
    return lines, text


def _json_kind(path: Path, compression: str | None) -> str:
    """Whether a `.json` file is JSON Lines ("jsonl": its first non-blank line is
    an object) or one document ("json"), as `datasets` decides."""
    with _opened(path, compression) as f:
        for line in f:
            line = line.strip().removeprefix(codecs.BOM_UTF8)
            if line:
                try:
                    return "jsonl" if isinstance(json.loads(line), dict) else "json"
                except ValueError:
                    return "json"
    raise DataError(f"{path} holds only blank lines. {_NOTHING}")


def _plan_parquet(path: Path, column: str, piece_bytes: int) -> list[Piece]:
    meta = _parquet(path, column).metadata
    if meta.num_rows == 0:
        raise DataError(f"{path} holds no rows. {_NOTHING}")
    groups = [meta.row_group(g) for g in range(meta.num_row_groups)]
    sizes = [
        sum(g.column(c).total_compressed_size for c in range(g.num_columns))
        for g in groups
    ]
    runs = _runs(sizes, piece_bytes)
    return [Piece("parquet", str(path), a, b, 1, n) for a, b, n in runs]


# -- reading ----------------------------------------------------------------------
def _read_jsonl(piece: Piece, column: str, counts: dict) -> Iterator[str]:
    loads, number = json.loads, piece.line
    size = piece.stop - piece.start if piece.stop >= 0 else -1
    with _opened(Path(piece.path), piece.compression) as f:
        if piece.start:  # a compressed stream cannot seek
            f.seek(piece.start)
        for lines in _line_blocks(f, size):
            for line in lines:
                try:
                    value = loads(line)[column]
                except (ValueError, TypeError, KeyError):
                    value = _bad_line(f"{piece.path}:{number}", line, column)
                if type(value) is str:
                    yield value
                elif value is not _BLANK:
                    _skip(counts, f"{piece.path}:{number}")
                number += 1


_BLANK = object()


def _line_blocks(f: io.BufferedIOBase, size: int) -> Iterator[list[bytes]]:
    """The lines of the next `size` bytes of `f` (all of it when -1), a block's
    worth at a time; the last line may lack its newline."""
    rest = b""
    while size:
        block = f.read(_BLOCK if size < 0 else min(size, _BLOCK))
        if not block:
            break
        size -= len(block) if size > 0 else 0
        lines = (rest + block).split(b"\n")
        rest = lines.pop()
        yield lines
    if rest:
        yield [rest]


def _bad_line(where: str, line: bytes, column: str) -> Any:
    """`_BLANK` for a blank line, else the DataError that says what is wrong."""
    if not line.strip():
        return _BLANK
    shown = line[:80].decode("utf-8", "replace") + ("..." if len(line) > 80 else "")
    try:
        record = json.loads(line)
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
    if not isinstance(record, dict):
        raise DataError(
            f"{where} holds a JSON {type(record).__name__}, not an object: {shown!r}. "
            f"Each line must be an object with a {column!r} field."
        )
    raise _missing(where, column, list(record))


def _missing(where: str, column: str, fields: list[str]) -> DataError:
    return DataError(
        f"{where} has no field {column!r}; its fields are {sorted(fields)}. Set "
        "data.text_column (`text_column=` in Python) to the field holding the text."
    )


def _skip(counts: dict, where: str) -> None:
    counts["skipped"] = counts.get("skipped", 0) + 1
    counts.setdefault("first_skipped", where)


def _read_json(piece: Piece, column: str, counts: dict) -> Iterator[str]:
    """A `.json` file that is one document, read whole: an array of records (or of
    strings, read as `{"text": s}` as `datasets` does)."""
    with _opened(Path(piece.path), piece.compression) as f:
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
    for i, record in enumerate(data, 1):
        where = f"{piece.path} (record {i})"
        record = {"text": record} if isinstance(record, str) else record
        if not isinstance(record, dict):
            raise DataError(f"{where} is a {type(record).__name__}, not an object.")
        if column not in record:
            raise _missing(where, column, list(record))
        if isinstance(record[column], str):
            yield record[column]
        else:
            _skip(counts, where)


def _read_text_files(piece: Piece, column: str, counts: dict) -> Iterator[str]:
    for path in piece.paths:
        with _opened(Path(path), piece.compression) as f:
            data = f.read()
        yield data.decode("utf-8", errors="replace")


def _read_csv(piece: Piece, column: str, counts: dict) -> Iterator[str]:
    """Rows through `csv.DictReader` (so a text may span lines); an empty cell, a
    short row or a pandas missing-value string is skipped, as `datasets` reads."""
    csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))  # long documents
    with _opened(Path(piece.path), piece.compression) as raw:
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

    file = _parquet(Path(piece.path), column)
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


def _parquet(path: Path, column: str) -> Any:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not a readable Parquet file ({e}).") from None
    if column not in file.schema_arrow.names:
        raise _missing(str(path), column, file.schema_arrow.names)
    return file


_READERS = {
    "jsonl": _read_jsonl,
    "json": _read_json,
    "text_files": _read_text_files,
    "csv": _read_csv,
    "parquet": _read_parquet,
}


# -- files ------------------------------------------------------------------------
def _stat(path: str | os.PathLike) -> os.stat_result:
    try:
        return os.stat(path)
    except OSError as e:
        raise _unreadable(path, e) from None


def _unreadable(path: str | os.PathLike, error: OSError) -> Exception:
    if isinstance(error, FileNotFoundError):  # gone since it was planned
        check_exists(path, "data file")
    return DataError(f"cannot read {path}: {error}. Check its permissions.")


@contextlib.contextmanager
def _opened(path: Path, compression: str | None = None) -> Iterator[Any]:
    """`path` open for binary reading (decompressed); an error reading it is a
    DataError naming it."""
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise _unreadable(path, e) from None
    f = raw
    if compression == "gz":
        import gzip

        f = gzip.GzipFile(fileobj=raw, mode="rb")
    elif compression == "zst":
        f = io.BufferedReader(_Zstd(raw, _zstd(path)), _BLOCK)
    try:
        with raw, f:
            yield f
    except (OSError, EOFError, zlib.error) as e:
        what = f"a valid {compression} stream" if compression else "readable"
        raise DataError(
            f"cannot read {path}: {e}. It is not {what} (corrupt, truncated or "
            "still being written): replace it, or leave it out of the source."
        ) from None


def _zstd(path: Path) -> Any:
    try:
        import zstandard
    except ImportError:
        raise DataError(
            f"{path} is zstd-compressed, and reading it needs the zstandard package: "
            "pip install zstandard (or eqtrain[zstd])."
        ) from None
    return zstandard


class _Zstd(io.RawIOBase):
    """A zstd stream of any number of frames that raises `EOFError` when it ends
    inside a frame (zstandard's `stream_reader` returns the truncated data), and
    `OSError` for corrupt data."""

    def __init__(self, raw: io.BufferedReader, zstandard: Any):
        self._raw, self._new = raw, zstandard.ZstdDecompressor().decompressobj
        self._error = zstandard.ZstdError
        self._obj, self._open, self._out, self._at = self._new(), False, b"", 0

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._raw.close()
        super().close()

    def readinto(self, buffer: Any) -> int:
        while self._at == len(self._out):
            data = self._raw.read(2**17)  # bounds the output of one call
            if not data:
                if self._open:
                    raise EOFError("the stream ends inside a zstd frame (truncated)")
                return 0
            try:
                self._out, self._at = self._decompress(data), 0
            except self._error as e:
                raise OSError(str(e)) from None
        n = min(len(buffer), len(self._out) - self._at)
        buffer[:n] = memoryview(self._out)[self._at : self._at + n]
        self._at += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            if self._obj.eof:  # the next frame
                self._obj = self._new()
            out.append(self._obj.decompress(data))
            self._open = not self._obj.eof
            data = self._obj.unused_data if self._obj.eof else b""
        return b"".join(out)


def _key(path: Path, name: str) -> dict:
    stat = _stat(path)
    digest = hashlib.sha256()
    with _opened(path) as f:
        if stat.st_size < 2 * _EDGE:
            digest.update(f.read())
        else:
            digest.update(f.read(_EDGE))
            f.seek(-_EDGE, os.SEEK_END)
            digest.update(f.read(_EDGE))
    return {
        "name": name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sha256": digest.hexdigest(),
    }
