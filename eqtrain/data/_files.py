"""The data cache on disk, shared by the tokenized store and the rows cache: where
it lives, atomic JSON writes, sha256 of files, a directory made with a message,
one builder per directory (an exclusive lock), and the removal of the temporary
files a killed builder left.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .._files import replace_durably
from ._errors import DataError


HASH_BLOCK = 1 << 22
"""Bytes read at once while hashing a file."""


def default_cache() -> Path:
    """`$EQTRAIN_DATA_CACHE`, else `$XDG_CACHE_HOME/eqtrain/data`, else
    `~/.cache/eqtrain/data`."""
    env = os.environ.get("EQTRAIN_DATA_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "eqtrain" / "data"


def json_sha256(value: Any) -> str:
    """The sha256 of `value`'s JSON with sorted keys: a stable name for it."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode("utf-8")).hexdigest()


def write_json(path: Path, value: Any, tmp: Path | None = None) -> None:
    """Write `value` to `path` atomically (a temporary file, fsync, rename). A
    failed write leaves no temporary file, and its `OSError` names `path` (a
    failed `write()` names no file, and the caller's message would guess)."""
    tmp = tmp or path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(value, indent=1, sort_keys=True) + "\n")
        replace_durably(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.errno is not None:
            raise type(error)(error.errno, error.strerror, str(path)) from None
        raise


def remove_unfinished(directory: Path) -> tuple[int, int]:
    """Remove the temporary files (`*.tmp<pid>`) in a store `directory` and its
    parts: call it holding the directory's `BuildLock`, which every writer holds,
    so any there are left by a build that was killed. Returns (files, bytes)."""
    removed = size = 0
    for tmp in [*directory.glob("*.tmp*"), *directory.glob("parts/*.tmp*")]:
        try:
            nbytes = tmp.stat().st_size
            tmp.unlink()
        except FileNotFoundError:
            continue
        removed, size = removed + 1, size + nbytes
    return removed, size


def file_sha256(path: Path) -> str:
    """The sha256 of `path`'s bytes, read `HASH_BLOCK` at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def make_dir(directory: Path) -> None:
    """Create `directory/parts` (and so `directory`), naming the setting to change
    when it cannot be."""
    try:
        (directory / "parts").mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DataError(
            f"cannot create the store directory {directory}: {error.strerror}. "
            "Set data.cache (or $EQTRAIN_DATA_CACHE) to a writable directory."
        ) from None


class BuildLock:
    """One builder per store directory (an exclusive `flock`); others wait, then
    find the store complete."""

    def __init__(self, directory: Path):
        self.path = directory / ".lock"

    def __enter__(self) -> "BuildLock":
        import fcntl

        self._file = open(self.path, "a+")
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        import fcntl

        fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
        self._file.close()
