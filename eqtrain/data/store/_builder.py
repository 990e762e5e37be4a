"""Building one store: the parts not committed before (pieces of files, or texts
from Python grouped into parts), run where `_workers` says, with a progress line,
then its `store.json`, written last.
"""

import contextlib
import errno
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..._errors import ConfigError
from .._errors import DataError, positive
from .._files import write_json
from .._readers import unpaired
from .._stream import check_counts
from ._encoder import dtype_for
from ._parts import (
    FORMAT,
    Task,
    grouped,
    ledger,
    read_ledger,
    texts_key,
    verify_part,
)
from ._workers import Built, run_tasks


def _check_executor(executor: str, workers: int | None) -> None:
    if executor not in ("auto", "inline", "processes", "ray"):
        raise ConfigError(
            "`executor` must be 'auto', 'inline', 'processes' or 'ray'; got "
            f"{executor!r}."
        )
    if workers is not None:
        positive("workers", workers)


class Builder:
    """Builds the missing parts of one store and writes its `store.json`."""

    def __init__(
        self,
        directory: Path,
        spec: Mapping[str, Any],
        settings: Mapping[str, Any],
        identity: Mapping[str, Any],
        label: str,
        *,
        workers: int | None,
        executor: str,
        say: Callable[[str], None],
    ):
        _check_executor(executor, workers)
        self.directory = directory
        self.spec = spec
        self.settings = settings
        self.identity = identity
        self.label = label
        self.text_column = settings["text_column"]
        self.workers = workers or os.cpu_count() or 1
        self.executor = executor
        self.say = say
        self.dtype = dtype_for(spec["vocab_size"]).name

    def _task(self, index: int, **documents: Any) -> Task:
        """Part `index`'s task, of `piece=` or `texts=`."""
        return Task(
            index, str(self.directory), self.dtype, self.text_column, **documents
        )

    def _run(self, tasks: Iterable[Task]) -> Built:
        """Build `tasks`, yielding `(entry, task)` as each finishes."""
        return run_tasks(
            tasks, executor=self.executor, workers=self.workers, spec=self.spec
        )

    # -- pieces of files ---------------------------------------------------------
    def build_pieces(self, pieces: list[dict[str, Any]], *, verify: bool) -> None:
        """Build the store of a path source's `pieces` (one part each)."""
        done = self._committed(pieces, verify=verify)
        progress = self._progress(pieces, done)
        tasks = [self._task(i, piece=p) for i, p in enumerate(pieces) if i not in done]
        try:
            with contextlib.closing(self._run(tasks)) as built:
                for entry, task in built:
                    done[task.index] = entry
                    progress.add(pieces[task.index]["nbytes"], entry)
        except DataError as error:
            if "disk is full" not in str(error):
                raise
            raise DataError(f"{error} {self._space_needed(pieces, done)}") from None
        progress.finish()
        self._finish([done[i] for i in range(len(pieces))])

    def _committed(
        self, pieces: list[dict[str, Any]], *, verify: bool
    ) -> dict[int, dict[str, Any]]:
        """The parts of `pieces` committed before (with `verify`, those whose
        files still match their sha256), by index."""
        done: dict[int, dict[str, Any]] = {}
        for index, piece in enumerate(pieces):
            entry, damage = ledger(self.directory, index, self.dtype)
            if entry is None or entry.get("piece") != piece:
                continue
            if damage is None and verify and not verify_part(self.directory, entry):
                damage = "its files do not match their sha256"
            if damage is not None:
                self.say(
                    f"data: part {index} of {self.directory} is damaged ({damage}); "
                    "rebuilding it"
                )
                continue
            done[index] = entry
        return done

    def _progress(
        self, pieces: list[dict[str, Any]], done: Mapping[int, Mapping[str, Any]]
    ) -> "_Progress":
        """The progress of building `pieces`, counting those `done` before (and
        saying so when some are left)."""
        total = sum(p["nbytes"] for p in pieces)
        progress = _Progress(self.label, len(pieces), total, self.say)
        for i in done:
            progress.skip(pieces[i]["nbytes"], done[i])
        if done and len(done) < len(pieces):
            self.say(
                f"data: {len(done)} of {len(pieces)} parts of {self.label} were "
                "prepared before; continuing"
            )
        return progress

    def _space_needed(
        self, pieces: list[dict[str, Any]], done: Mapping[int, Mapping[str, Any]]
    ) -> str:
        """How much more disk the store needs, estimated from the parts built."""
        left = sum(p["nbytes"] for i, p in enumerate(pieces) if i not in done)
        read = sum(pieces[i]["nbytes"] for i in done)
        itemsize = np.dtype(self.dtype).itemsize
        if read:
            tokens = sum(e["tokens"] for e in done.values())
            docs = sum(e["documents"] for e in done.values())
            per_byte = (tokens * itemsize + docs * 8) / read
            basis = f"at the {per_byte:.2f} bytes per source byte of the parts built"
        else:  # nothing built yet: a token per ~3 bytes of text, at most
            per_byte, basis = itemsize / 3 + 0.01, "assuming ~3 source bytes per token"
        need, parts = left * per_byte, len(pieces) - len(done)
        return (
            f"About {need / 1e6:,.0f} MB more are needed for the {parts} parts left "
            f"({basis}) in {self.directory}."
        )

    # -- texts from Python --------------------------------------------------------
    def build_texts(self, source: Any) -> None:
        """Build the store of a Python source's documents, grouped into parts of
        up to `piece_bytes`."""
        progress = _Progress(self.label, None, None, self.say)
        entries: dict[int, dict[str, Any]] = {}
        todo = self._texts_todo(source, entries, progress)
        with contextlib.closing(self._run(todo)) as built:
            for entry, task in built:
                entries[task.index] = entry
                progress.add(sum(len(t) for t in task.texts or ()), entry)
        progress.finish()
        if not entries:
            raise DataError(
                f"{self.label} holds no documents; pass a non-empty source."
            )
        self._finish([entries[i] for i in range(len(entries))])

    def _texts_todo(
        self, source: Any, entries: dict[int, dict[str, Any]], progress: "_Progress"
    ) -> Iterator[Task]:
        """The tasks of `source`'s parts not committed before (with the same
        texts); those that were go into `entries`."""
        docs = python_documents(source, self.text_column)
        for index, batch in enumerate(grouped(docs, self.settings["piece_bytes"])):
            task = self._task(index, texts=tuple(batch))
            entry = read_ledger(self.directory, index, self.dtype)
            if entry is not None and entry.get("texts") == texts_key(task.texts):
                entries[index] = entry
                progress.skip(0, entry)
                continue
            yield task

    # -- the end ------------------------------------------------------------------
    def _finish(self, entries: list[dict[str, Any]]) -> None:
        """Write `store.json` over the parts' `entries`: the store is complete."""
        counts = _counts(entries)
        check_counts(
            self.label,
            {**counts, "skipped": 0, "unpaired": 0},
            text_column=self.text_column,
        )  # no documents is an error; skipped rows are said by `prepare`
        path = self.directory / "store.json"
        try:
            write_json(path, self._meta(entries, counts))
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise  # it names the file
            raise DataError(
                f"the disk is full: {path} could not be written ({error.strerror}). "
                "Every part is committed and kept; free space and prepare again "
                "to finish the store."
            ) from None

    def _meta(
        self, entries: list[dict[str, Any]], counts: Mapping[str, Any]
    ) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "dtype": self.dtype,
            "eos": int(self.spec["eos"]),
            "vocab_size": int(self.spec["vocab_size"]),
            "source": self.label,
            "identity": self.identity,
            "settings": dict(self.settings),
            "documents": counts["documents"],
            "tokens": sum(e["tokens"] for e in entries),
            "skipped": counts["skipped"],
            "first_skipped": counts["first_skipped"],
            "unpaired": counts["unpaired"],
            "first_unpaired": counts["first_unpaired"],
            "parts": [_part_meta(e) for e in entries],
        }


def _counts(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The documents and skipped records of all the parts."""
    out: dict[str, Any] = {"documents": sum(e["documents"] for e in entries)}
    for why in ("skipped", "unpaired"):
        firsts = [e[f"first_{why}"] for e in entries if e.get(f"first_{why}")]
        out[why] = sum(e.get(why, 0) for e in entries)
        out[f"first_{why}"] = firsts[0] if firsts else None
    return out


def _part_meta(entry: Mapping[str, Any]) -> dict[str, Any]:
    """What `store.json` keeps of a part's ledger entry."""
    keys = ("tokens", "documents", "piece", "sha256", "blocks")
    return {k: entry[k] for k in keys}


def python_documents(source: Any, text_column: str) -> Iterator[str]:
    """Documents of a Python source: strings, or records' `text_column` (a
    non-string value is skipped, as the readers do; a string that is not valid
    Unicode is an error naming the item)."""
    for i, item in enumerate(source):
        if isinstance(item, str):
            yield _valid(item, i)
        elif isinstance(item, Mapping):
            if text_column not in item:
                raise DataError(
                    f"record {i} has no field {text_column!r}; available: "
                    f"{sorted(item)}. Pass the right `text_column`."
                )
            value = item[text_column]
            if isinstance(value, str):
                yield _valid(value, i)
        else:
            raise DataError(
                f"item {i} of the source is a {type(item).__name__}; pass strings or "
                "records (mappings) with a text field."
            )


def _valid(text: str, i: int) -> str:
    """`text`, item `i` of a Python source, checked to be Unicode text."""
    if unpaired(text):
        at = next(n for n, c in enumerate(text) if "\ud800" <= c <= "\udfff")
        raise DataError(
            f"item {i} of the source holds an unpaired surrogate "
            f"({text[at]!r} at character {at}), which is not Unicode text and "
            "cannot be encoded. Repair it first, e.g. with "
            "`text.encode('utf-8', 'replace').decode('utf-8')`."
        )
    return text


class _Progress:
    """One progress line per few seconds: parts, documents, tokens, MB/s, ETA."""

    def __init__(
        self,
        label: str,
        parts: int | None,
        total_bytes: int | None,
        say: Callable[[str], None],
        every: float = 2.0,
    ):
        self.label, self.parts, self.total, self.say = label, parts, total_bytes, say
        self.every = every
        self.start = self.last = time.monotonic()
        self.done_parts = self.documents = self.tokens = 0
        self.bytes = self.new_bytes = 0
        self.announced = False

    def skip(self, nbytes: int, entry: Mapping[str, Any]) -> None:
        self.done_parts += 1
        self.bytes += nbytes
        self.documents += entry["documents"]
        self.tokens += entry["tokens"]

    def add(self, nbytes: int, entry: Mapping[str, Any]) -> None:
        self.skip(nbytes, entry)
        self.new_bytes += nbytes
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self.say(self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.new_bytes / elapsed
        parts = f"{self.done_parts}/{self.parts} parts, " if self.parts else ""
        return (
            f"data: preparing {self.label}: {parts}{self.documents:,} documents, "
            f"{self.tokens:,} tokens, {rate / 1e6:.1f} MB/s{self._eta(rate)}"
        )

    def _eta(self, rate: float) -> str:
        if not (self.total and rate > 0):
            return ""
        return f", ETA {max(self.total - self.bytes, 0) / rate:.0f} s"

    def finish(self) -> None:
        now = time.monotonic()
        if self.new_bytes and now - self.start >= self.every:
            self.say(self.line(now) + " (done)")
