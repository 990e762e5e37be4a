"""A source's files, opened for the streaming readers: `stat` and `opened`
(decompressing gzip and zstd streams) turn every error into a DataError that
names the file and says what to do.
"""

import contextlib
import gzip
import io
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._errors import DataError, check_exists


BLOCK = 2**20
"""Bytes read at a time."""
COMPRESSIONS = {".gz": "gz", ".zst": "zst"}
"""A file's last suffix -> how it is compressed."""


def compression_of(path: str | os.PathLike) -> str | None:
    """`"gz"` or `"zst"` when `path`'s last suffix says it is compressed, else None
    (the rule for a single file and for each file of a directory alike)."""
    tail = os.fspath(path)[-4:].lower()  # (cheap: called for every file)
    return next((c for s, c in COMPRESSIONS.items() if tail.endswith(s)), None)


def stat(path: str | os.PathLike) -> os.stat_result:
    """`os.stat(path)`; an error is a DataError naming the file."""
    try:
        return os.stat(path)
    except OSError as e:
        raise unreadable(path, e) from None


def unreadable(path: str | os.PathLike, error: OSError) -> Exception:
    """The error for a file that cannot be read (a missing one's is `check_exists`')."""
    if isinstance(error, FileNotFoundError):  # gone since it was planned
        check_exists(path, "data file")
    return DataError(f"cannot read {path}: {error}. Check its permissions.")


@contextlib.contextmanager
def opened(path: Path, compression: str | None = None) -> Iterator[Any]:
    """`path` open for binary reading (decompressed); an error reading it is a
    DataError naming it."""
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise unreadable(path, e) from None
    f = _decompressed(raw, path, compression)
    try:
        with raw, f:
            yield f
    except (OSError, EOFError, zlib.error) as e:
        what = f"a valid {compression} stream" if compression else "readable"
        raise DataError(
            f"cannot read {path}: {e}. It is not {what} (corrupt, truncated or "
            "still being written): replace it, or leave it out of the source."
        ) from None


def _decompressed(raw: io.BufferedReader, path: Path, compression: str | None) -> Any:
    """`raw`, read through its decompressor (itself when `compression` is None)."""
    if compression == "gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "zst":
        return io.BufferedReader(_Zstd(raw, zstd_module(path)), BLOCK)
    return raw


def zstd_module(path: Path) -> Any:
    """The `zstandard` module, or a DataError naming `path` and the package."""
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
