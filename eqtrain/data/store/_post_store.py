"""The post-training store: the SFT examples, preference pairs or GRPO prompts of
a record file, encoded once (in parallel, in parts: `_post_parts`) with the
run's tokenizer and chat template, and read back by index (`PostRows`).

    <cache>/post-<key>/rows.json       the index: kind, layout, counts, skip report,
                                       each part's examples, tokens and sha256s
    <cache>/post-<key>/parts/00000.*   the parts (see `_post_parts`)
    <cache>/post-<key>/packed.starts   packed SFT: int64, the first example of
                                       each row (and one past the last)

The key is a hash of the identity (the record file's fingerprint, the tokenizer,
the template and the rule that renders a record with it, the settings, the
eqtrain version); the records' `tools` are part of the file, so its fingerprint
covers them. A store is built in `post-<key>.tmp<pid>/` and renamed into place
when complete, so a killed or failed build never leaves a store that opens (its
temporary directory is removed by the next build). Opening reads `rows.json`
only; the parts are mapped when a batch first reads them.

The rows equal `sft_rows` / `preference_rows` of the same records, row by row;
`PostRows` (`_post_rows`) builds a batch's rows from the stored examples.
"""

import contextlib
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._chat import template_identity
from .._errors import DataError, PathLike, positive
from .._files import BuildLock, default_cache, json_sha256, write_json
from .._post import _prompt_limit
from .._readers import Piece
from .._records import SkipReport, _all_skipped
from .._stream import PIECE_BYTES, plan
from ._builder import _check_executor, _Progress
from ._encoder import dtype_for
from ._parts import Task
from ._post_parts import (
    FORMAT,
    KINDS,
    PostEncoder,
    build_post_part,
    post_part_paths,
    post_spec,
    records,
)
from ._post_rows import PostRows, _read_meta
from ._workers import WorkerPool


def prepare_post(
    path: PathLike,
    tokenizer: Any,
    *,
    kind: str,
    seq_len: int,
    format: str | None = None,
    template: Any = None,
    resolve: Callable[[list[str]], Mapping[str, Any]] | None = None,
    max_prompt_len: int | None = None,
    pack: bool = True,
    width: int | None = None,
    chat: bool | None = None,
    pad: int | None = None,
    identity: Mapping[str, Any] | None = None,
    cache_dir: PathLike | None = None,
    workers: int | None = None,
    executor: str = "auto",
    piece_bytes: int | None = None,
    verify: bool = False,
    say: Callable[[str], None] | None = None,
) -> "PostRows":
    """The rows of the record file `path`, from its store (built when missing).

    Args:
        path: a `.jsonl`/`.json`/`.parquet`/`.csv` file of records.
        tokenizer: a `Tokenizer` (a `ByteTokenizer` or `HFTokenizer` is rebuilt
            in worker processes; any other builds in this process).
        kind: `"sft"` (`format` `"chat"` or `"prompt_completion"`, `pack`ed or
            one example per row), `"preference"` (pairs) or `"prompt"` (GRPO
            prompts of at most `width` tokens; `chat`: from `messages`).
        seq_len, template, max_prompt_len: as for `sft_rows`.
        format, chat: None (or `format="auto"`): from the file's columns, read
            when the store is built (never when it opens).
        resolve: called with the file's columns when the store is built;
            returns the settings they decide (`format`, `chat`) or raises
            (e.g. the job's check of the format against the task).
        pad: the id of padded slots (default: the tokenizer's pad id, else 0).
        identity: what the rows depend on besides the settings (the job passes
            the file's fingerprint, the tokenizer, the template's identity and
            the eqtrain version); default: the fingerprint, the tokenizer's
            identity and `template_identity(template)` (its class, source,
            `tool_use` template and `MASK_RULE`, the rule that makes a
            record's render, its tools included).
        workers: processes that encode (default: the CPU count).
        executor: `"auto"`, `"inline"` or `"processes"`.
        piece_bytes: bytes of the file per part (default 16 MiB).
        verify: check the parts' sha256s of an existing store (rebuilt if one
            does not match).
        say: progress lines (default: standard error).

    Raises:
        DataError: the file is missing or malformed (naming the file and line),
            or every record was skipped (saying why).
    """
    if kind not in KINDS:
        raise DataError(f"`kind` must be one of {KINDS}; got {kind!r}.")
    positive("seq_len", seq_len)
    _check_executor(executor, workers)
    say = say or _stderr
    settings = _settings(kind, format, seq_len, max_prompt_len, pack, width, chat)
    if pad is None:
        pad = getattr(tokenizer, "pad_id", None) or 0
    settings["pad"] = int(pad)
    key = {
        "format": FORMAT,
        "identity": dict(identity or _identity(path, tokenizer, template)),
        "settings": settings,
    }
    cache = Path(cache_dir) if cache_dir is not None else default_cache()
    directory = cache / f"post-{json_sha256(key)[:20]}"
    damaged = _complete(directory) and verify and not _verified(directory)
    if _complete(directory) and not damaged:
        return PostRows(directory)
    dtype = dtype_for(int(getattr(tokenizer, "vocab_size", 1 << 32))).name
    build = _Build(
        Path(path), directory, tokenizer, template, settings, key, dtype, say
    )
    build.resolve = resolve
    workers = workers or os.cpu_count() or 1
    build.run(workers, executor, piece_bytes or PIECE_BYTES, damaged=damaged)
    return PostRows(directory)


def _settings(
    kind: str,
    format: str | None,
    seq_len: int,
    max_prompt_len: int | None,
    pack: bool,
    width: int | None,
    chat: bool | None,
) -> dict[str, Any]:
    """The encoders' settings of a store of `kind` (only what its rows use)."""
    if kind == "prompt":
        if width is None:
            raise DataError("a store of GRPO prompts needs `width`.")
        return {"kind": kind, "seq_len": seq_len, "width": width, "chat": chat}
    _prompt_limit(seq_len, max_prompt_len)  # checked before any record is read
    out = {"kind": kind, "seq_len": seq_len, "max_prompt_len": max_prompt_len}
    if kind == "sft":
        out.update(format=format or "auto", pack=bool(pack))
    return out


def _identity(path: PathLike, tokenizer: Any, template: Any) -> dict[str, Any]:
    from .._rows_cache import tokenizer_identity
    from .._stream import fingerprint

    return {
        "source": fingerprint(path),
        "tokenizer": tokenizer_identity(tokenizer),
        "template": template_identity(template),
    }


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _complete(directory: Path) -> bool:
    return (directory / "rows.json").is_file()


def _verified(directory: Path) -> bool:
    """Whether every file of the store matches its sha256 in `rows.json`."""
    from .._files import file_sha256

    meta = _read_meta(directory)
    for index, part in enumerate(meta["parts"]):
        paths = post_part_paths(directory, index)
        for name, digest in part["sha256"].items():
            if not paths[name].is_file() or file_sha256(paths[name]) != digest:
                return False
    return True


class _Build:
    """Building one store beside its place, then renaming it there."""

    def __init__(
        self,
        path: Path,
        directory: Path,
        tokenizer: Any,
        template: Any,
        settings: dict[str, Any],
        key: dict[str, Any],
        dtype: str,
        say: Callable[[str], None],
    ):
        self.path, self.directory = path, directory
        self.tokenizer, self.template = tokenizer, template
        self.settings, self.key, self.dtype, self.say = settings, key, dtype, say

    def run(
        self, workers: int, executor: str, piece_bytes: int, *, damaged: bool
    ) -> None:
        """Build under the store's lock, unless another process built it while
        this one waited; a `damaged` store, and a killed build's leftovers, are
        removed first."""
        cache = self.directory.parent
        try:
            cache.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise DataError(
                f"cannot create the data cache {cache}: {error.strerror}. Set "
                "data.cache (or $EQTRAIN_DATA_CACHE) to a writable directory."
            ) from None
        lock = BuildLock(cache)
        lock.path = cache / f"{self.directory.name}.lock"
        with lock:
            if _complete(self.directory):
                if not damaged:
                    return  # built by another process while this one waited
                self.say(f"data: {self.directory} is damaged; preparing it again")
                _remove(self.directory)
            for stale in cache.glob(f"{self.directory.name}.tmp*"):
                _remove(stale)  # a killed build's: its builder held this lock
            tmp = cache / f"{self.directory.name}.tmp{os.getpid()}"
            (tmp / "parts").mkdir(parents=True)
            try:
                meta = self._build(tmp, workers, executor, piece_bytes)
                write_json(tmp / "rows.json", meta)
                os.replace(tmp, self.directory)
            except BaseException:
                _remove(tmp)
                raise

    resolve: Callable[[list[str]], Mapping[str, Any]] | None = None

    def _resolved(self) -> dict[str, Any]:
        """What the file's columns decide: `format` (sft, when "auto"), `chat`
        (prompts, when None), and the columns (GRPO's rewards read them)."""
        columns = record_columns(self.path)
        out: dict[str, Any] = {"columns": columns}
        s = self.settings
        if s["kind"] == "sft" and s["format"] == "auto":
            from .._records import infer_format

            out["format"] = infer_format(dict.fromkeys(columns))
        if s["kind"] == "prompt" and s["chat"] is None:
            out["chat"] = "messages" in columns
        if self.resolve is not None:
            out.update(self.resolve(columns))
        return out

    def _build(
        self, tmp: Path, workers: int, executor: str, piece_bytes: int
    ) -> dict[str, Any]:
        resolved = self._resolved()
        self.settings = {**self.settings, **resolved}  # what the encoders use
        if self.settings["kind"] == "sft":
            from .._post import _sft_format

            _sft_format(self.settings["format"])
        pieces = [p.to_json() for p in _pieces(self.path, piece_bytes)]
        tasks = [Task(i, str(tmp), self.dtype, "", p) for i, p in enumerate(pieces)]
        progress = _Progress(
            str(self.path), len(pieces), sum(p["nbytes"] for p in pieces), self.say
        )
        entries: dict[int, dict[str, Any]] = {}
        for entry, task in self._run(tasks, workers, executor):
            entries[task.index] = entry
            progress.add(pieces[task.index]["nbytes"], entry)
        progress.finish()
        parts = [entries[i] for i in range(len(pieces))]
        report, where = _report(parts)
        if not report.kept and self.settings["kind"] != "prompt":
            raise (
                _all_skipped(report)
                if report.total
                else DataError(
                    f"{self.path} holds no records; pass a file with at least one."
                )
            )
        meta = {
            "format": FORMAT,
            "source": str(self.path),
            "key": self.key,
            "dtype": self.dtype,
            "settings": self.settings,  # with what the columns decided
            "report": _report_json(report),
            "where": where,
            "long": sum(p["long"] for p in parts),  # GRPO prompts left out
            "parts": [
                {k: p[k] for k in ("examples", "tokens", "sha256", "total", "kept")}
                for p in parts
            ],
        }
        if self.settings.get("pack"):
            meta["packed_rows"] = _write_packing(tmp, parts, self.settings["seq_len"])
        return meta

    def _run(self, tasks: list[Task], workers: int, executor: str) -> Any:
        """`(entry, task)` of each part as it is built."""
        spec = post_spec(self.tokenizer, self.template, self.settings)
        if executor == "auto":
            many = workers > 1 and len(tasks) > 1 and spec is not None
            executor = "processes" if many else "inline"
        if executor == "processes" and spec is None:
            raise DataError(
                "worker processes rebuild a ByteTokenizer or HFTokenizer and the "
                "built-in or a Jinja chat template; got "
                f"{type(self.tokenizer).__name__} and "
                f"{type(self.template).__name__}. Use executor='inline'."
            )
        if executor == "inline":
            encoder = PostEncoder(self.tokenizer, self.template, self.settings)
            return ((build_post_part(t, encoder), t) for t in tasks)
        if executor != "processes":
            raise DataError(
                f"post-training stores are built inline or by worker processes; "
                f"got executor={executor!r}."
            )
        return _pooled(tasks, min(workers, len(tasks)), spec)


def _pooled(tasks: list[Task], workers: int, spec: dict[str, Any]) -> Any:
    with WorkerPool(workers, spec) as pool:
        yield from pool.run(iter(tasks))


def _pieces(path: Path, piece_bytes: int) -> list[Piece]:
    """The pieces of a record file: JSON Lines by byte ranges of whole lines,
    Parquet by row groups, anything else whole."""
    if not path.is_file():
        raise DataError(f"{path} does not exist or is not a file.")
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        try:
            column = pq.ParquetFile(path).schema_arrow.names[0]
        except (OSError, ValueError, IndexError) as e:
            raise DataError(f"{path} is not a readable Parquet file ({e}).") from None
        return plan(path, text_column=column, piece_bytes=piece_bytes)
    if path.suffix.lower() in (".jsonl", ".json"):
        pieces = plan(path, piece_bytes=piece_bytes)
        if pieces[0].kind == "jsonl":
            return pieces
    size = path.stat().st_size
    if size == 0:
        raise DataError(f"{path} is empty (0 bytes); pass a file that holds records.")
    kind = path.suffix.lower().lstrip(".")
    return [Piece(kind, str(path.absolute()), 0, -1, 1, size)]


def record_columns(path: PathLike, *, sample: int = 1000) -> list[str]:
    """The columns of a record file, without reading it all: a Parquet file's
    schema, the fields of a JSON Lines file's first `sample` records (in order
    of appearance), or a `.json` array's / `.csv` file's columns.

    Raises:
        DataError: the file is missing, empty or malformed (naming the line).
    """
    path = Path(path)
    piece = _pieces(path, PIECE_BYTES)[0]
    if piece.kind == "parquet":
        import pyarrow.parquet as pq

        return list(pq.ParquetFile(path).schema_arrow.names)
    if piece.kind != "jsonl":
        from .._sources import from_files

        return list(from_files(path).column_names)
    names: dict[str, None] = {}
    for n, (record, _) in enumerate(records(piece)):
        if n >= sample:
            break
        if isinstance(record, Mapping):
            names.update(dict.fromkeys(record))
    return list(names)


def _report(parts: Sequence[Mapping[str, Any]]) -> tuple[SkipReport, dict[str, str]]:
    """The skip report of the whole file (record numbers across parts), and
    where each reason's first record is."""
    reasons: dict[str, int] = {}
    first: dict[str, int] = {}
    where: dict[str, str] = {}
    total = kept = 0
    for part in parts:
        for reason, count in part["reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + count
            first.setdefault(reason, total + part["first"][reason])
            where.setdefault(reason, part["where"][reason])
        total += part["total"]
        kept += part["kept"]
    report = SkipReport(total=total, kept=kept, reasons=reasons, first=first)
    return report, where


def _report_json(report: SkipReport) -> dict[str, Any]:
    return {
        "total": report.total,
        "kept": report.kept,
        "reasons": report.reasons,
        "first": report.first,
    }


def _write_packing(tmp: Path, parts: Sequence[Mapping[str, Any]], seq_len: int) -> int:
    """`packed.starts`: the first example of each packed row, placed as
    `_text.pack` places them (next fit, an example never starting on the last,
    target-only slot, empty ones skipped), and one past the last example; the
    lengths are read one part at a time. Returns the number of rows."""
    width = seq_len + 1
    pos, example, rows = width, 0, 0
    with open(tmp / "packed.starts", "wb") as out:
        for index in range(len(parts)):
            ends = np.fromfile(post_part_paths(tmp, index)["ends"], np.int64)
            lengths = np.diff(ends, prepend=0).tolist()
            starts = []
            for n in lengths:
                if n:
                    if pos + n > width or pos >= width - 1:
                        starts.append(example)
                        pos = 0
                    pos += n
                example += 1
            np.asarray(starts, np.int64).tofile(out)
            rows += len(starts)
        np.asarray([example], np.int64).tofile(out)
        out.flush()
        os.fsync(out.fileno())
    return rows


def _remove(directory: Path) -> None:
    """Remove `directory`, first renamed out of the way (a kill mid-removal then
    leaves no half store under a store's name)."""
    if not directory.exists():
        return
    gone = directory.with_name(f"{directory.name}.removing{os.getpid()}")
    with contextlib.suppress(OSError):
        os.replace(directory, gone)
        directory = gone
    shutil.rmtree(directory, ignore_errors=True)
