"""Finished rows kept on disk: post-training rows (SFT, preference pairs) are made
once from their records, written as `.npy` files (no pickle) under the data cache,
and memory-mapped by later runs, so a second start reads no records and tokenizes
nothing, and the process holds only the pages its batches touch.

    <cache>/rows-<key>/rows.json     written last: columns, shapes, sha256s, report
    <cache>/rows-<key>/<column>.npy  one array per column, rows along axis 0
"""

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .._files import replace_durably
from ._errors import DataError, PathLike
from ._files import (
    BuildLock,
    default_cache,
    file_sha256,
    json_sha256,
    make_dir,
    write_json,
)


FORMAT = 1


def tokenizer_identity(tokenizer: Any) -> dict[str, Any]:
    """What makes a tokenizer's ids: its whole definition and special ids."""
    special = {k: getattr(tokenizer, f"{k}_id", None) for k in ("bos", "eos", "pad")}
    inner = getattr(tokenizer, "_tok", None)
    if inner is not None and hasattr(inner, "to_str"):
        body = hashlib.sha256(inner.to_str().encode("utf-8")).hexdigest()
        return {"kind": "hf", "sha256": body, **special}
    return {"kind": type(tokenizer).__name__, **special}


def cached_rows(
    identity: Mapping[str, Any],
    build: Callable[[], tuple[Mapping[str, np.ndarray], dict[str, Any]]],
    *,
    cache_dir: PathLike | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """`build()`'s rows and report, memory-mapped from the cache when an earlier
    call with the same `identity` (JSON-able: the source's fingerprint, the
    tokenizer, the template and the settings) wrote them; else built, written
    (atomically: `rows.json` last) and mapped.

    Every file is checked against its sha256 when opened; a mismatch rebuilds.

    Raises:
        DataError: the cache directory cannot be written.
    """
    directory = _directory(identity, cache_dir)
    opened = _open(directory)
    if opened is None:
        make_dir(directory)
        with BuildLock(directory):
            opened = _open(directory)  # another process may have written them
            if opened is None:
                _write(directory, *build())
                opened = _open(directory)
    if opened is None:
        raise DataError(f"the rows written to {directory} do not read back.")
    return opened


def _directory(identity: Mapping[str, Any], cache_dir: PathLike | None) -> Path:
    """`rows-<key>` under the cache, the key a hash of `identity`."""
    key = json_sha256({"format": FORMAT, **identity})[:20]
    cache = Path(cache_dir) if cache_dir is not None else default_cache()
    return cache / f"rows-{key}"


def _write(
    directory: Path, rows: Mapping[str, np.ndarray], report: dict[str, Any]
) -> None:
    """Each column to its `.npy` file, then `rows.json` (the rows are complete)."""
    columns = {name: _save(directory / f"{name}.npy", a) for name, a in rows.items()}
    write_json(directory / "rows.json", {"columns": columns, "report": report})


def _save(path: Path, array: np.ndarray) -> dict[str, Any]:
    """Write `array` to `path` atomically (no pickle); its entry in `rows.json`."""
    array = np.ascontiguousarray(array)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    replace_durably(tmp, path)
    return {"sha256": file_sha256(path), "shape": list(array.shape)}


def _open(directory: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]] | None:
    """The mapped rows and report in `directory`, or None when missing, torn or
    damaged (then they are built again)."""
    try:
        meta = json.loads((directory / "rows.json").read_text(encoding="utf-8"))
        rows = {}
        for name, entry in meta["columns"].items():
            path = directory / f"{name}.npy"
            if file_sha256(path) != entry["sha256"]:
                return None
            rows[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        return rows, meta["report"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
