"""`prepare`: the tokenized store of a source, opened when a complete one is in the
cache under the source's content key, else built (resumably, in parallel).
"""

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._corpus import stdlib_files
from .._errors import PathLike
from .._files import (
    BuildLock,
    default_cache,
    json_sha256,
    make_dir,
    remove_unfinished,
    write_json,
)
from .._stream import (
    Memo,
    check_counts,
    fingerprint as path_fingerprint,
    fingerprint_files,
    plan,
    plan_files,
)
from ._builder import Builder, python_documents
from ._encoder import tokenizer_key, tokenizer_spec
from ._parts import FORMAT, texts_key
from ._store import Store


PIECE_BYTES = 16 << 20
"""The default size of a piece (and so of a part), in bytes of source."""


def prepare(
    source: Any,
    tokenizer: Any,
    *,
    cache_dir: PathLike | None = None,
    workers: int | None = None,
    text_column: str = "text",
    pattern: str = "**/*.txt",
    piece_bytes: int | None = None,
    key: str | None = None,
    executor: str = "auto",
    verify: bool = False,
    build: bool = True,
    say: Callable[[str], None] | None = None,
) -> Store | None:
    """The tokenized store of `source`, built if it is missing or incomplete.

    The store lives in `cache_dir` (default `default_cache()`) under a key made of
    the source's content fingerprint (see `_stream.fingerprint`), the tokenizer
    (its whole definition and EOS id), `text_column`, `pattern`, `piece_bytes` and
    the store format: a second call with the same inputs opens it at once; a
    changed input builds another. A killed build continues where it stopped.

    Args:
        source: a path (a JSON Lines/Parquet/CSV/text file, also `.gz`/`.zst`,
            or a directory of text files), `"stdlib"`/`"stdlib:eval"` (the
            built-in corpus), or from Python a `datasets.Dataset`,
            `datasets.IterableDataset` or iterable of records/strings.
        tokenizer: a `ByteTokenizer` or `HFTokenizer`.
        workers: processes that tokenize (default: the CPU count); 1 builds in
            this process.
        key: a Python source's identity (default: a `datasets.Dataset`'s
            fingerprint; an iterable without one is hashed as it is read, so it
            is read again each time).
        executor: `"auto"` (processes when there are several parts and
            workers), `"inline"`, `"processes"` or `"ray"` (Ray tasks on the
            connected cluster).
        verify: check every committed part's sha256 now (rebuild those that do
            not match); otherwise each part is checked when it is first read.
        build: False: only open a complete store, None when there is none.
        say: progress lines (default: standard error).

    Raises:
        DataError: a source is missing or malformed (naming the file and line),
            or the disk is full (what was committed is kept).
    """
    say = say if say is not None else _stderr
    spec = tokenizer_spec(tokenizer)
    settings = {
        "text_column": text_column,
        "pattern": pattern,
        "piece_bytes": piece_bytes or PIECE_BYTES,
    }
    cache = Path(cache_dir) if cache_dir is not None else default_cache()
    if _is_path(source):
        source_key = _fingerprint(source, pattern, cache)
    else:  # None for a Python source without a key
        source_key = _python_key(source, key)
    identity = _identity(source_key, spec, settings)
    directory, identity = _located(cache, identity, source, text_column)
    label = os.fspath(source) if _is_path(source) else f"a {type(source).__name__}"
    complete = (directory / "store.json").is_file() and not verify
    if not (complete or build):
        return None
    if not complete:
        builder = Builder(
            directory,
            spec,
            settings,
            identity,
            label,
            workers=workers,
            executor=executor,
            say=say,
        )
        _build(builder, source, verify=verify)
    return _opened(Store(directory, spec=spec, say=say), label, text_column)


def _identity(
    source_key: dict[str, Any] | None,
    spec: dict[str, Any],
    settings: dict[str, Any],
) -> dict[str, Any]:
    """What names a store: the source's content, the tokenizer, the settings and
    the store's format."""
    return {
        "format": FORMAT,
        "source": source_key,
        "tokenizer": tokenizer_key(spec),
        "settings": settings,
    }


def _is_path(source: Any) -> bool:
    return isinstance(source, (str, os.PathLike))


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _stdlib(name: str) -> list[Path] | None:
    """The built-in corpus's files when `name` is `stdlib`, `stdlib:train` or
    `stdlib:eval`."""
    if name not in ("stdlib", "stdlib:train", "stdlib:eval"):
        return None
    return stdlib_files("eval" if name.endswith(":eval") else "train")


def _fingerprint(source: PathLike, pattern: str, cache: Path) -> dict[str, Any]:
    """The content key of a path source (see `_stream.fingerprint`): a stat call
    per file, and up to 2 MiB read of each file not hashed before at the same
    status (remembered under `<cache>/fingerprints/`)."""
    name = os.fspath(source)
    files = _stdlib(name)
    if files is None and not os.path.isdir(name):
        return path_fingerprint(name, pattern=pattern)  # one file: 2 MiB at most
    memo_path = (
        cache
        / "fingerprints"
        / f"{json_sha256([os.path.abspath(name), pattern])[:20]}.json"
    )
    memo = Memo(_read_memo(memo_path))
    if files is not None:
        key = {"stdlib": name, "files": fingerprint_files(files, memo=memo)}
    else:
        key = path_fingerprint(name, pattern=pattern, memo=memo)
    if memo.used != memo.known:
        with contextlib.suppress(OSError):  # a cache: reading the files again is fine
            memo_path.parent.mkdir(parents=True, exist_ok=True)
            write_json(memo_path, memo.used)
    return key


def _read_memo(path: Path) -> dict[str, Any] | None:
    """The hashes a `Memo` remembered at `path`, if they can be read."""
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return known if isinstance(known, dict) else None


def _python_key(source: Any, key: str | None) -> dict[str, Any] | None:
    if key is not None:
        return {"python": key}
    fingerprint = getattr(source, "_fingerprint", None)
    if isinstance(fingerprint, str) and hasattr(source, "__len__"):
        return {"dataset": fingerprint, "rows": len(source)}
    return None


def _located(
    cache: Path, identity: dict[str, Any], source: Any, text_column: str
) -> tuple[Path, dict[str, Any]]:
    """The store's directory under `cache`, and its identity: a Python source
    without a key is keyed by its documents' hash (read once more to make it),
    but a one-shot iterator is built once, never reused."""
    if identity["source"] is None:
        if iter(source) is source:
            unkeyed = f"{os.getpid()}-{time.monotonic_ns()}"
            return cache / "unkeyed" / unkeyed, identity
        texts = texts_key(python_documents(source, text_column))
        identity = {**identity, "source": {"texts": texts}}
    return cache / json_sha256(identity)[:20], identity


def _build(builder: Builder, source: Any, *, verify: bool) -> None:
    """Build the store in `builder.directory` under its lock, unless another
    process completed it while this one waited."""
    make_dir(builder.directory)
    with BuildLock(builder.directory):
        if (builder.directory / "store.json").is_file() and not verify:
            return
        files, nbytes = remove_unfinished(builder.directory)
        if files:
            builder.say(
                f"data: removed {files} unfinished files ({nbytes / 1e6:,.1f} MB) "
                f"that an interrupted build left in {builder.directory}"
            )
        if _is_path(source):
            pieces = _pieces(source, builder.settings)
            builder.build_pieces(pieces, verify=verify)
        else:
            builder.build_texts(source)


def _pieces(source: PathLike, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The pieces of a path source, as JSON (planned only when a store is built:
    planning JSON Lines counts its lines)."""
    files = _stdlib(os.fspath(source))
    if files is not None:
        pieces = plan_files(files, piece_bytes=settings["piece_bytes"])
    else:
        pieces = plan(source, **settings)  # text_column, pattern and piece_bytes
    return [p.to_json() for p in pieces]


def _opened(store: Store, label: str, text_column: str) -> Store:
    """`store`, after warning (each time it is used, as reading the source would)
    about the records its source skipped."""
    meta = store.meta
    counts = {
        "documents": store.num_documents,
        **{k: meta.get(k, 0) for k in ("skipped", "unpaired")},
        **{k: meta.get(k) for k in ("first_skipped", "first_unpaired")},
    }
    check_counts(label, counts, text_column=text_column)
    return store
