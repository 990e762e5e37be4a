"""A store's parts on disk: one `Task` (a piece of a file, or texts from Python)
tokenized into a `.tokens` and an `.ends` file, committed by its ledger entry.
`build_part` runs the same in this process, a worker process or a Ray task.
"""

import dataclasses
import errno
import hashlib
import json
import os
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import DataError, PathLike
from .._files import file_sha256, write_json
from .._readers import Piece
from .._stream import documents
from ._encoder import Encoder


FORMAT = 2
"""The store's on-disk format; part of the content key."""
BLOCK = 1 << 16
"""Bytes per checked block of a part's tokens (a CRC-32 each, in the ledger)."""
BATCH_BYTES = 1 << 20
"""Text handed to the tokenizer at once (bounds a worker's memory)."""


@dataclasses.dataclass(frozen=True)
class Task:
    """One part to build: its index, where, and its documents (a piece of a file,
    or texts handed over from Python)."""

    index: int
    directory: str
    dtype: str
    text_column: str
    piece: dict[str, Any] | None = None
    texts: tuple[str, ...] | None = None


def _documents(task: Task, counts: dict[str, Any]) -> Iterator[str]:
    if task.texts is not None:
        return iter(task.texts)
    piece = Piece.from_json(task.piece)
    return documents(piece, text_column=task.text_column, counts=counts)


def grouped(docs: Iterable[str], limit: int) -> Iterator[list[str]]:
    """`docs` in consecutive groups of at least `limit` characters (the last one
    may hold fewer)."""
    batch: list[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def part_paths(directory: PathLike, index: int) -> dict[str, Path]:
    """The files of part `index`: its tokens, its document ends and its ledger."""
    base = Path(directory) / "parts" / f"{index:05d}"
    return {
        "tokens": base.with_suffix(".tokens"),
        "ends": base.with_suffix(".ends"),
        "ledger": base.with_suffix(".json"),
    }


class _PartWriter:
    """A part's two files being written, with their sha256s and counts."""

    def __init__(self, tmp: Mapping[str, Path], dtype: np.dtype):
        self.dtype = dtype
        self.files = {name: open(tmp[name], "wb") for name in ("tokens", "ends")}
        self.digests = {name: hashlib.sha256() for name in self.files}
        self.documents = self.tokens = self.characters = 0

    def __enter__(self) -> "_PartWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        for f in self.files.values():
            f.close()

    def add(self, batch: list[str], encoder: Encoder) -> None:
        """Append `batch`'s tokens (EOS after each document) and ends."""
        ids, lengths = encoder.encode(batch)
        flat = np.concatenate(ids).astype(self.dtype)
        ends = self.tokens + np.cumsum(np.asarray(lengths, np.int64))
        self._write("tokens", flat)
        self._write("ends", ends)
        self.documents += len(batch)
        self.tokens += len(flat)
        self.characters += sum(len(d) for d in batch)

    def _write(self, name: str, array: np.ndarray) -> None:
        data = array.tobytes()
        self.files[name].write(data)
        self.digests[name].update(data)

    def sync(self) -> None:
        """Flush both files to the disk."""
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())


def build_part(task: Task, encoder: Encoder) -> dict[str, Any]:
    """Tokenize `task`'s documents into its part files and commit its ledger
    entry (atomically, after the files); returns the entry.

    Raises:
        DataError: the disk is full (what was committed stays), or a source is
            malformed (from the reader, naming the file and line).
    """
    paths = part_paths(task.directory, task.index)
    paths["tokens"].parent.mkdir(parents=True, exist_ok=True)
    tmp = {k: p.with_name(f"{p.name}.tmp{os.getpid()}") for k, p in paths.items()}
    try:
        entry = _write_part(task, encoder, tmp)
        _commit(entry, tmp, paths)
    except BaseException as error:
        for p in tmp.values():
            p.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            raise _disk_full(task, error) from None
        raise
    return entry


def _write_part(
    task: Task, encoder: Encoder, tmp: Mapping[str, Path]
) -> dict[str, Any]:
    """Write `task`'s part to the `tmp` files; its ledger entry, less `blocks`."""
    counts: dict[str, Any] = {"skipped": 0}
    with _PartWriter(tmp, np.dtype(task.dtype)) as writer:
        for batch in grouped(_documents(task, counts), BATCH_BYTES):
            writer.add(batch, encoder)
        writer.sync()
    return {
        "index": task.index,
        "piece": task.piece,
        "texts": None if task.texts is None else texts_key(task.texts),
        "documents": writer.documents,
        "tokens": writer.tokens,
        "characters": writer.characters,
        "skipped": counts.get("skipped", 0),
        "first_skipped": counts.get("first_skipped"),
        "unpaired": counts.get("unpaired", 0),
        "first_unpaired": counts.get("first_unpaired"),
        "sha256": {k: d.hexdigest() for k, d in writer.digests.items()},
    }


def _commit(
    entry: dict[str, Any], tmp: Mapping[str, Path], paths: Mapping[str, Path]
) -> None:
    """Move the part's files in place, then write its ledger entry (with its
    blocks' CRC-32s): from then on the part is committed."""
    entry["blocks"] = block_crcs(tmp["tokens"])
    os.replace(tmp["tokens"], paths["tokens"])
    os.replace(tmp["ends"], paths["ends"])
    write_json(paths["ledger"], entry, tmp["ledger"])


def _disk_full(task: Task, error: OSError) -> DataError:
    return DataError(
        f"the disk is full: part {task.index} of the store in "
        f"{task.directory} could not be written ({error.strerror}). The "
        "parts committed so far are kept; free space and prepare again "
        "to continue."
    )


def block_crcs(path: Path) -> list[int]:
    """The CRC-32 of each `BLOCK` bytes of `path` (the last block may be short)."""
    out = []
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            out.append(zlib.crc32(block))
    return out


def texts_key(texts: Iterable[str]) -> str:
    """The sha256 of `texts`, each followed by a null byte."""
    digest = hashlib.sha256()
    for t in texts:
        digest.update(t.encode("utf-8", errors="surrogatepass"))
        digest.update(b"\0")
    return digest.hexdigest()


def read_ledger(directory: PathLike, index: int, dtype: str) -> dict[str, Any] | None:
    """Part `index`'s ledger entry, or None when it is not committed (no entry, one
    that does not parse, or part files missing or of the wrong size)."""
    entry, damage = ledger(directory, index, dtype)
    return entry if damage is None else None


def ledger(
    directory: PathLike, index: int, dtype: str
) -> tuple[dict[str, Any] | None, str | None]:
    """Part `index`'s ledger entry (None when there is none, or it does not
    parse) and, when its files are missing or not of the sizes it records, what
    is wrong with them (a part damaged since it was committed)."""
    paths = part_paths(directory, index)
    try:
        entry = json.loads(paths["ledger"].read_text(encoding="utf-8"))
        expected = {
            "tokens": entry["tokens"] * np.dtype(dtype).itemsize,
            "ends": entry["documents"] * 8,
        }
    except (OSError, ValueError, KeyError, TypeError):
        return None, None
    for name, size in expected.items():
        try:
            found = f"{paths[name].stat().st_size} bytes"
        except OSError as error:
            found = f"unreadable ({error.strerror})"
        if found != f"{size} bytes":
            return entry, f"its {paths[name].name} is {found}, the ledger says {size}"
    return entry, None


def verify_part(directory: PathLike, entry: Mapping[str, Any]) -> bool:
    """Whether part `entry["index"]`'s files match their recorded sha256."""
    paths, sha256 = part_paths(directory, entry["index"]), entry["sha256"]
    try:
        return all(file_sha256(paths[k]) == sha256[k] for k in ("tokens", "ends"))
    except OSError:
        return False
