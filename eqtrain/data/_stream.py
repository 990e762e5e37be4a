"""Streaming, partitionable readers for the sources `_sources` reads in memory.

`plan(source)` cuts a source into `Piece`s: deterministic, self-contained,
JSON-serialisable slices that worker processes read independently with
`documents(piece)`. Reading every piece in plan order gives the documents of the
in-memory reading (`load_text_dir`, `read_text`, `from_files` + `text_column`),
in the same order, holding at most a block (1 MiB) of a file in memory at a
time; the exception is a `.json` file that is one JSON document (an array of
records, not JSON Lines), which the `json` module reads whole. The reader of
each kind of file is in `_readers`; opening (and decompressing) in `_source_files`.

`fingerprint(source)` is the content key of a source, for a cache of its tokens:
the kind of source (and a directory's `pattern`), and for each file (a
directory's files matching `pattern`, by path relative to it; a single file by
its name) its relative name, size, `mtime_ns` and the sha256 of its first and
last MiB (of the whole file when it is under 2 MiB). Renaming the source's
directory keeps the key; touching, growing or editing a file changes it (an edit
in the middle through its mtime). A `Memo` keeps the hashes of a directory's files
between starts, so that files whose status did not change are not read again.
"""

import codecs
import hashlib
import io
import json
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from ._errors import DataError, DataWarning, check_exists
from ._readers import READERS, Piece, parquet
from ._source_files import (
    BLOCK,
    COMPRESSIONS,
    compression_of,
    opened,
    stat,
    zstd_module,
)
from ._sources import named_files, text_files


PIECE_BYTES = 16 * 2**20
"""The default target size of a piece, in bytes of source file."""
_EDGE = 2**20  # a fingerprint hashes a file's first and last MiB
_NOTHING = "Point the config (data.train, data.eval) at a file that holds data."
_KINDS = {".txt": "text_files", ".jsonl": "jsonl", ".json": "json", ".csv": "csv"}
SUFFIXES = (".parquet", *(k + c for k in _KINDS for c in ("", *COMPRESSIONS)))


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
    size = stat(path).st_size
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
    files grouped up to `piece_bytes` (e.g. `plan_files(stdlib_files("train"))`).
    A `.gz` or `.zst` file is decompressed when read, as a single file is."""
    if not files:
        raise DataError("no text files to read. Pass at least one file.")
    paths = [os.path.abspath(f) for f in files]
    zst = next((p for p in paths if compression_of(p) == "zst"), None)
    if zst is not None:
        zstd_module(Path(zst))  # fail at planning, not in a worker
    runs = _runs([stat(p).st_size for p in paths], piece_bytes)
    return [Piece("text_files", "", 0, -1, 1, n, tuple(paths[a:b])) for a, b, n in runs]


def documents(
    piece: Piece, *, text_column: str = "text", counts: dict | None = None
) -> Iterator[str]:
    """The documents of `piece`, in order.

    A record whose `text_column` is not a string (null, a number, a list) is
    skipped, as `text_column` does in memory, and counted in `counts`:
    `counts["skipped"]` and `counts["first_skipped"]` (`"<file>:<line>"`, set
    once), beside `counts["documents"]`; `check_counts` turns the totals into the
    in-memory reading's error and warning. A text that is not valid Unicode (a
    JSON string with an unpaired surrogate escape such as `"\\ud800"`, which no
    tokenizer can encode) is skipped the same way, counted in `counts["unpaired"]`
    and `counts["first_unpaired"]`.

    Raises:
        DataError: a record that is not valid JSON, not an object, or lacks
            `text_column` (naming `<file>:<line>`); a file that cannot be read or
            decompressed.
    """
    counts = {} if counts is None else counts
    counts.setdefault("documents", 0)
    counts.setdefault("skipped", 0)
    for document in READERS[piece.kind](piece, text_column, counts):
        counts["documents"] += 1
        yield document


def check_counts(source: str, counts: dict, *, text_column: str = "text") -> None:
    """After reading all of `source`: raise when it gave no document, warn once
    (a `DataWarning`) when records were skipped, as `text_column` does."""
    skipped = counts.get("skipped", 0) + counts.get("unpaired", 0)
    first = counts.get("first_skipped") or counts.get("first_unpaired")
    if not counts.get("documents"):
        raise _no_text(source, skipped, first, text_column)
    if skipped:
        warnings.warn(
            f"{source}: skipped {skipped} of {counts['documents'] + skipped} rows"
            f"{_why_skipped(counts, text_column)}.",
            DataWarning,
            stacklevel=2,
        )


def _why_skipped(counts: dict, text_column: str) -> str:
    """Why the rows `counts` holds were skipped, with the first row of each kind."""
    kinds = [
        (
            counts.get("skipped", 0),
            f"whose {text_column!r} is not a string (the first: "
            f"{counts.get('first_skipped')})",
        ),
        (
            counts.get("unpaired", 0),
            f"whose {text_column!r} is not valid Unicode: it holds an unpaired "
            f'surrogate escape such as "\\ud800" (the first: '
            f"{counts.get('first_unpaired')}; fix those rows to train on them)",
        ),
    ]
    kinds = [(n, why) for n, why in kinds if n]
    if len(kinds) == 1:
        return " " + kinds[0][1]
    return ": " + " and ".join(f"{n} {why}" for n, why in kinds)


def _no_text(source: str, skipped: int, first: Any, text_column: str) -> DataError:
    held = f"; all {skipped} records are skipped (first: {first})" if skipped else ""
    return DataError(
        f"{source} holds no text in {text_column!r}{held}. Point data.text_column "
        "(`text_column=`) at a field of strings, or data.train at other data."
    )


class Memo:
    """The edge hashes of files already fingerprinted, by absolute path, with the
    status they were hashed at: size, `mtime_ns`, `ctime_ns` and inode. A file
    whose status is the same is not read again (its content cannot have changed
    without its `ctime`, which no program can set back, changing too).

    `known` is what an earlier `used` held; `used` collects the hashes of the
    files fingerprinted now (so files gone from the source are forgotten)."""

    def __init__(self, known: dict[str, list] | None = None):
        self.known = known or {}
        self.used: dict[str, list] = {}

    def sha256(self, path: Path, info: os.stat_result) -> str:
        status = [info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino]
        entry = self.known.get(str(path))
        if isinstance(entry, list) and entry[:4] == status and len(entry) == 5:
            sha = entry[4]
        else:
            sha = _edges_sha256(path, info.st_size)
        self.used[str(path)] = [*status, sha]
        return sha


def fingerprint(
    source: str | os.PathLike,
    *,
    pattern: str = "**/*.txt",
    memo: Memo | None = None,
) -> dict:
    """The content key of `source` (the rule is in the module docstring). With
    `memo` (see `Memo`), a file whose status has not changed since it was
    hashed is not read again."""
    check_exists(source, "data source")
    path = Path(os.path.abspath(source))
    if path.is_dir():
        files = [_key(f, name, memo=memo) for name, f in named_files(path, pattern)]
        return {"kind": "text_files", "pattern": pattern, "files": files}
    kind, compression = _format(path)
    files = [_key(path, path.name, member=False, memo=memo)]
    return {"kind": kind, "compression": compression, "files": files}


def fingerprint_files(
    files: Sequence[str | os.PathLike], *, memo: Memo | None = None
) -> dict:
    """The content key of a list of text files, named relative to their common
    directory (e.g. `fingerprint_files(stdlib_files("train"))`)."""
    paths = [os.path.abspath(f) for f in files]
    if not paths:
        raise DataError("no text files to read. Pass at least one file.")
    root = os.path.commonpath([os.path.dirname(p) for p in paths])
    return {
        "kind": "text_files",
        "files": [
            _key(Path(p), Path(os.path.relpath(p, root)).as_posix(), memo=memo)
            for p in paths
        ],
    }


# -- planning ---------------------------------------------------------------------
def _format(path: Path) -> tuple[str, str | None]:
    """A file's kind and compression, from its suffixes."""
    name = path.name.lower()
    stem, last = os.path.splitext(name)
    compression = COMPRESSIONS.get(last)
    suffix = os.path.splitext(stem)[1] if compression else last
    kind = "parquet" if suffix == ".parquet" and not compression else _KINDS.get(suffix)
    if kind is None:
        raise ConfigError(
            f"{path} has a suffix eqtrain does not read; known: {', '.join(SUFFIXES)}. "
            "Rename the file, or convert it to one of those formats."
        )
    if compression == "zst":
        zstd_module(path)  # fail at planning, not in a worker
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
    """Byte ranges of whole lines, about `piece_bytes` each, with line numbers."""
    with opened(path) as f:
        starts = _line_starts(f, size, piece_bytes)
        f.seek(0)
        lines, text = _line_numbers(f, starts)
    if not text:
        raise DataError(f"{path} holds only blank lines. {_NOTHING}")
    stops = [*starts[1:], size]
    return [
        Piece("jsonl", str(path), a, b, n, b - a)
        for a, b, n in zip(starts, stops, lines, strict=True)
    ]


def _line_starts(f: io.BufferedReader, size: int, piece_bytes: int) -> list[int]:
    """The first line start at or after each multiple of `piece_bytes` (and 0),
    found by seeking."""
    starts = [0]
    for at in range(piece_bytes, size, piece_bytes):
        if at <= starts[-1]:
            continue  # still inside a line longer than a piece
        f.seek(at - 1)
        f.readline()  # to the end of the line holding byte at - 1
        if f.tell() < size:
            starts.append(f.tell())
    return starts


def _line_numbers(f: io.BufferedReader, starts: list[int]) -> tuple[list[int], bool]:
    """The 1-based line number at each offset in `starts` (sorted), from one pass
    counting newlines a block at a time, and whether the file is not all blank."""
    lines, newlines, pos, text = [], 0, 0, False
    while block := f.read(BLOCK):
        while len(lines) < len(starts) and starts[len(lines)] <= pos + len(block):
            lines.append(newlines + block.count(b"\n", 0, starts[len(lines)] - pos) + 1)
        newlines += block.count(b"\n")
        text = text or bool(block.strip())
        pos += len(block)
    return lines, text


def _json_kind(path: Path, compression: str | None) -> str:
    """Whether a `.json` file is JSON Lines ("jsonl": its first non-blank line is
    an object) or one document ("json"), as `datasets` decides."""
    with opened(path, compression) as f:
        for line in f:
            line = line.strip().removeprefix(codecs.BOM_UTF8)
            if line:
                try:
                    return "jsonl" if isinstance(json.loads(line), dict) else "json"
                except ValueError:
                    return "json"
    raise DataError(f"{path} holds only blank lines. {_NOTHING}")


def _plan_parquet(path: Path, column: str, piece_bytes: int) -> list[Piece]:
    """Runs of row groups of about `piece_bytes` compressed bytes."""
    meta = parquet(path, column).metadata
    if meta.num_rows == 0:
        raise DataError(f"{path} holds no rows. {_NOTHING}")
    sizes = [_compressed_size(meta.row_group(g)) for g in range(meta.num_row_groups)]
    runs = _runs(sizes, piece_bytes)
    return [Piece("parquet", str(path), a, b, 1, n) for a, b, n in runs]


def _compressed_size(group: Any) -> int:
    """A Parquet row group's bytes on disk."""
    return sum(group.column(c).total_compressed_size for c in range(group.num_columns))


def _key(
    path: Path, name: str, *, member: bool = True, memo: Memo | None = None
) -> dict:
    """A file's part of a fingerprint: name, size, mtime, sha256 of its edges (and
    for a compressed file of a directory, its compression: such files were once
    read undecompressed, and their stores must not be reused)."""
    info = stat(path)
    key = {
        "name": name,
        "size": info.st_size,
        "mtime_ns": info.st_mtime_ns,
        "sha256": (
            _edges_sha256(path, info.st_size)
            if memo is None
            else memo.sha256(path, info)
        ),
    }
    compression = compression_of(name)
    if compression is not None and member:
        key["compression"] = compression
    return key


def _edges_sha256(path: Path, size: int) -> str:
    """The sha256 of a file's first and last `_EDGE` bytes (all of a small one)."""
    digest = hashlib.sha256()
    with opened(path) as f:
        if size < 2 * _EDGE:
            digest.update(f.read())
        else:
            digest.update(f.read(_EDGE))
            f.seek(-_EDGE, os.SEEK_END)
            digest.update(f.read(_EDGE))
    return digest.hexdigest()
