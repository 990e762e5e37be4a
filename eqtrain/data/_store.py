"""A tokenized store on disk: sources read in pieces, tokenized in parallel, written
as memory-mapped parts with a ledger, and read back by index arithmetic.

Layout of a store (one directory per source, under the cache directory, named by
the content key):

    <cache>/<key>/store.json          written last: the store is complete
    <cache>/<key>/parts/00000.tokens  the documents' token ids, each followed by EOS
    <cache>/<key>/parts/00000.ends    int64: where each document ends in the part
    <cache>/<key>/parts/00000.json    the ledger entry: the piece, counts, sha256s

A part is committed when its ledger entry exists (written atomically after its
files): a killed prepare continues with the first part without one, and a part
whose files do not match their sha256 is rebuilt, never read. The bytes of a
store depend only on its sources, tokenizer and settings, never on the number of
workers or on where it was built (one process, worker processes, Ray tasks).
"""

import dataclasses
import errno
import hashlib
import itertools
import json
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import ConfigError
from ._errors import DataError


FORMAT = 2
"""The store's on-disk format; part of the content key."""
BLOCK = 1 << 16
"""Bytes per checked block of a part's tokens (a CRC-32 each, in the ledger)."""
BATCH_BYTES = 1 << 20
"""Text handed to the tokenizer at once (bounds a worker's memory)."""
HASH_BLOCK = 1 << 22
PIECE_BYTES = 16 << 20
"""The default size of a piece (and so of a part), in bytes of source."""

PathLike = str | os.PathLike[str]


# -- tokenizers, as data a worker can rebuild ------------------------------------
def tokenizer_spec(tokenizer: Any) -> dict[str, Any]:
    """What a worker needs to encode exactly as `tokenizer.encode` does: `byte`, or
    a `tokenizers` JSON (from `HFTokenizer`), with the EOS id that ends documents.

    Raises:
        DataError: the tokenizer has no EOS id, or is neither kind.
    """
    eos = getattr(tokenizer, "eos_id", None)
    if eos is None:
        raise DataError(
            f"{tokenizer!r} has no EOS token, and the store ends every document with "
            "EOS. Use a tokenizer with one (or name it: HFTokenizer.from_file(path, "
            "eos=...))."
        )
    from ._tokenizers import ByteTokenizer, HFTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return {"kind": "byte", "eos": int(eos), "vocab_size": 259}
    if isinstance(tokenizer, HFTokenizer):
        text = tokenizer._tok.to_str()
        return {
            "kind": "hf",
            "eos": int(eos),
            "vocab_size": int(tokenizer.vocab_size),
            "json": text,
        }
    raise DataError(
        f"the store can tokenize with a ByteTokenizer or an HFTokenizer; got "
        f"{type(tokenizer).__name__}. Tokenize in memory (chunk_documents) instead."
    )


def tokenizer_key(spec: Mapping[str, Any]) -> str:
    """A short, stable name of a tokenizer spec (sha256 of its JSON)."""
    body = json.dumps(spec, sort_keys=True).encode("utf-8")
    return hashlib.sha256(body).hexdigest()


class _Encoder:
    """Encodes batches of documents into one flat stream with EOS after each."""

    def __init__(self, spec: Mapping[str, Any]):
        self.eos = int(spec["eos"])
        self.kind = spec["kind"]
        if self.kind == "hf":
            import tokenizers

            self._tok = tokenizers.Tokenizer.from_str(spec["json"])
            fast = getattr(self._tok, "encode_batch_fast", None)
            self._batch = fast or self._tok.encode_batch

    def encode(self, docs: Sequence[str]) -> tuple[list[np.ndarray], list[int]]:
        """Token ids (with EOS after each document) and each document's length."""
        if self.kind == "byte":
            pieces = [np.frombuffer(d.encode("utf-8"), np.uint8) for d in docs]
            out = []
            for p in pieces:
                ids = np.empty(len(p) + 1, np.uint32)
                ids[:-1], ids[-1] = p, self.eos
                out.append(ids)
            return out, [len(p) + 1 for p in pieces]
        encodings = self._batch(list(docs), add_special_tokens=False)
        out = []
        for e in encodings:
            ids = np.empty(len(e.ids) + 1, np.uint32)
            ids[:-1] = e.ids
            ids[-1] = self.eos
            out.append(ids)
        return out, [len(ids) for ids in out]


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


# -- building one part (in this process, a worker process or a Ray task) -----------
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


_RAY: dict[str, Any] = {}


def build_with_spec(task: Task, spec: Mapping[str, Any]) -> dict[str, Any]:
    """`build_part` with an encoder built from `spec` (a Ray task's entry point;
    the encoder is kept for the worker's next task)."""
    key = tokenizer_key(spec)
    if _RAY.get("key") != key:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        _RAY["encoder"], _RAY["key"] = _Encoder(spec), key
    return build_part(task, _RAY["encoder"])


class _WorkerPool:
    """`workers` processes running `python -m eqtrain.data._worker`, fed JSON
    tasks on standard input (one thread per process waits on its answers)."""

    def __init__(self, workers: int, spec: Mapping[str, Any]):
        self.workers, self.spec = workers, spec
        self.processes: list[Any] = []

    def __enter__(self) -> "_WorkerPool":
        import subprocess

        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1")
        env["JAX_PLATFORMS"] = "cpu"  # a worker never touches an accelerator
        for _ in range(self.workers):
            process = subprocess.Popen(
                [sys.executable, "-m", "eqtrain.data._worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=env,
                text=True,
                encoding="utf-8",
            )
            process.stdin.write(json.dumps(dict(self.spec)) + "\n")
            process.stdin.flush()
            self.processes.append(process)
        return self

    def __exit__(self, *exc: Any) -> None:
        for process in self.processes:
            try:
                process.stdin.close()
            except OSError:
                pass
        for process in self.processes:
            try:
                process.wait(timeout=0 if exc[0] is not None else 30)
            except Exception:
                process.kill()
                process.wait()

    def run(self, tasks: Iterator[Task]) -> Iterator[tuple[dict[str, Any], Task]]:
        import queue

        lock = threading.Lock()
        answers: queue.Queue = queue.Queue()
        stop = threading.Event()

        def serve(process: Any) -> None:
            try:
                work(process)
            except BaseException as error:  # e.g. the source failed: re-raised below
                answers.put(error)
            finally:
                answers.put(None)

        def work(process: Any) -> None:
            while not stop.is_set():
                with lock:
                    task = next(tasks, None)
                if task is None:
                    break
                try:
                    body = dataclasses.asdict(task)
                    process.stdin.write(json.dumps(body) + "\n")
                    process.stdin.flush()
                    line = process.stdout.readline()
                except (OSError, ValueError) as error:
                    line = json.dumps({"error": "OSError", "message": str(error)})
                if not line:
                    code = process.poll()
                    line = json.dumps(
                        {
                            "error": "WorkerError",
                            "message": f"a store worker exited (code {code}) "
                            f"while building part {task.index}",
                        }
                    )
                answers.put((json.loads(line), task))

        threads = [
            threading.Thread(target=serve, args=(p,), daemon=True)
            for p in self.processes
        ]
        for thread in threads:
            thread.start()
        running = len(threads)
        try:
            while running:
                item = answers.get()
                if item is None:
                    running -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                answer, task = item
                if "entry" not in answer:
                    raise DataError(answer["message"])
                yield answer["entry"], task
        finally:
            stop.set()
            if running:
                for process in self.processes:
                    process.kill()


def _documents(task: Task, counts: dict[str, Any]) -> Iterator[str]:
    if task.texts is not None:
        return iter(task.texts)
    from . import _stream

    piece = _stream.Piece.from_json(task.piece)
    return _stream.documents(piece, text_column=task.text_column, counts=counts)


def _batches(docs: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def part_paths(directory: PathLike, index: int) -> dict[str, Path]:
    base = Path(directory) / "parts" / f"{index:05d}"
    return {
        "tokens": base.with_suffix(".tokens"),
        "ends": base.with_suffix(".ends"),
        "ledger": base.with_suffix(".json"),
    }


def build_part(task: Task, encoder: _Encoder) -> dict[str, Any]:
    """Tokenize `task`'s documents into its part files and commit its ledger
    entry (atomically, after the files); returns the entry.

    Raises:
        DataError: the disk is full (what was committed stays), or a source is
            malformed (from the reader, naming the file and line).
    """
    paths = part_paths(task.directory, task.index)
    paths["tokens"].parent.mkdir(parents=True, exist_ok=True)
    dtype = np.dtype(task.dtype)
    counts: dict[str, Any] = {"skipped": 0}
    tmp = {k: p.with_name(f"{p.name}.tmp{os.getpid()}") for k, p in paths.items()}
    digests = {"tokens": hashlib.sha256(), "ends": hashlib.sha256()}
    documents = tokens = chars = 0
    try:
        with open(tmp["tokens"], "wb") as ft, open(tmp["ends"], "wb") as fe:
            for batch in _batches(_documents(task, counts)):
                ids, lengths = encoder.encode(batch)
                flat = np.concatenate(ids).astype(dtype)
                ends = tokens + np.cumsum(np.asarray(lengths, np.int64))
                for f, name, array in ((ft, "tokens", flat), (fe, "ends", ends)):
                    data = array.tobytes()
                    f.write(data)
                    digests[name].update(data)
                documents += len(batch)
                tokens += len(flat)
                chars += sum(len(d) for d in batch)
            for f in (ft, fe):
                f.flush()
                os.fsync(f.fileno())
        entry = {
            "index": task.index,
            "piece": task.piece,
            "texts": None if task.texts is None else _texts_key(task.texts),
            "documents": documents,
            "tokens": tokens,
            "characters": chars,
            "skipped": counts.get("skipped", 0),
            "first_skipped": counts.get("first_skipped"),
            "sha256": {k: d.hexdigest() for k, d in digests.items()},
        }
        entry["blocks"] = block_crcs(tmp["tokens"])
        os.replace(tmp["tokens"], paths["tokens"])
        os.replace(tmp["ends"], paths["ends"])
        _write_json(paths["ledger"], entry, tmp["ledger"])
    except OSError as error:
        for p in tmp.values():
            p.unlink(missing_ok=True)
        if error.errno == errno.ENOSPC:
            raise DataError(
                f"the disk is full: part {task.index} of the store in "
                f"{task.directory} could not be written ({error.strerror}). The "
                "parts committed so far are kept; free space and prepare again "
                "to continue."
            ) from None
        raise
    except BaseException:
        for p in tmp.values():
            p.unlink(missing_ok=True)
        raise
    return entry


def block_crcs(path: Path) -> list[int]:
    """The CRC-32 of each `BLOCK` bytes of `path` (the last block may be short)."""
    out = []
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            out.append(zlib.crc32(block))
    return out


def _texts_key(texts: Iterable[str]) -> str:
    digest = hashlib.sha256()
    for t in texts:
        digest.update(t.encode("utf-8", errors="surrogatepass"))
        digest.update(b"\0")
    return digest.hexdigest()


def _write_json(path: Path, value: Any, tmp: Path | None = None) -> None:
    """Write `value` to `path` atomically (a temporary file, fsync, rename)."""
    tmp = tmp or path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def read_ledger(directory: PathLike, index: int, dtype: str) -> dict[str, Any] | None:
    """Part `index`'s ledger entry, or None when it is not committed (no entry, one
    that does not parse, or part files missing or of the wrong size)."""
    paths = part_paths(directory, index)
    try:
        entry = json.loads(paths["ledger"].read_text(encoding="utf-8"))
        sizes = {k: paths[k].stat().st_size for k in ("tokens", "ends")}
        expected = {
            "tokens": entry["tokens"] * np.dtype(dtype).itemsize,
            "ends": entry["documents"] * 8,
        }
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return entry if sizes == expected else None


def verify_part(directory: PathLike, entry: Mapping[str, Any]) -> bool:
    """Whether part `entry["index"]`'s files match their recorded sha256."""
    paths = part_paths(directory, entry["index"])
    try:
        return all(
            file_sha256(paths[name]) == entry["sha256"][name]
            for name in ("tokens", "ends")
        )
    except OSError:
        return False


# -- the store --------------------------------------------------------------------
class Store:
    """A complete tokenized store, memory-mapped: the token stream of its
    documents (each followed by EOS), read by position.

    Parts are mapped when first read, and each block of `BLOCK` bytes is checked
    against its CRC-32 the first time a read touches it (so the check costs at
    most the blocks a batch reads, whatever the corpus size); a part with a block
    that does not match is rebuilt from its piece (when the store was opened by
    `prepare`, which knows the tokenizer) or refused, never read. `verify=False`
    skips the checks.
    """

    def __init__(
        self,
        directory: PathLike,
        *,
        spec: Mapping[str, Any] | None = None,
        verify: bool = True,
        say: Callable[[str], None] | None = None,
    ):
        self.directory = Path(directory)
        meta_path = self.directory / "store.json"
        try:
            self.meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise DataError(
                f"{self.directory} is not a complete tokenized store ({meta_path}: "
                f"{error}). Prepare it again (`eqtrain data prepare CONFIG`)."
            ) from None
        if self.meta.get("format") != FORMAT:
            raise DataError(
                f"the store {self.directory} has format {self.meta.get('format')}; "
                f"this eqtrain reads format {FORMAT}. Prepare it again."
            )
        self.dtype = np.dtype(self.meta["dtype"])
        self.eos = int(self.meta["eos"])
        parts = self.meta["parts"]
        self._tokens = np.array([p["tokens"] for p in parts], np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self._tokens)])
        self.num_tokens = int(self._starts[-1])
        self.num_documents = int(sum(p["documents"] for p in parts))
        self._spec = spec
        self._verify = verify
        self._say = say
        self._maps: dict[int, np.ndarray] = {}
        self._checked: dict[int, np.ndarray] = {}  # per part: blocks checked
        self._lock = threading.Lock()

    @property
    def num_parts(self) -> int:
        return len(self._tokens)

    def __repr__(self) -> str:
        return (
            f"Store({str(self.directory)!r}, documents={self.num_documents:,}, "
            f"tokens={self.num_tokens:,}, parts={self.num_parts})"
        )

    def _part(self, index: int, first: int = 0, stop: int | None = None) -> np.ndarray:
        """Part `index`, mapped, with its tokens `[first, stop)` checked."""
        array = self._mapped(index)
        if self._verify and len(array):
            stop = len(array) if stop is None else stop
            size = self.dtype.itemsize
            blocks = np.arange(first * size // BLOCK, (stop * size - 1) // BLOCK + 1)
            if not self._checked[index][blocks].all():
                array = self._check(index, blocks)
        return array

    def _mapped(self, index: int) -> np.ndarray:
        """Part `index`, mapped (its size checked), no block checked yet."""
        array = self._maps.get(index)
        if array is None:
            with self._lock:
                if index not in self._maps:
                    self._maps[index] = self._open(index)
                array = self._maps[index]
        return array

    def _check(self, index: int, blocks: np.ndarray) -> np.ndarray:
        """Check `blocks` of part `index` (rebuilding the part if one does not
        match); returns the part's mapping, current after any rebuild."""
        with self._lock:
            array = self._maps[index]
            checked = self._checked[index]
            crcs = self.meta["parts"][index]["blocks"]
            raw = array.view(np.uint8)
            for b in blocks[~checked[blocks]]:
                block = raw[int(b) * BLOCK : (int(b) + 1) * BLOCK]
                if zlib.crc32(memoryview(block)) != crcs[b]:
                    self._rebuild(index, self.meta["parts"][index])
                    self._maps[index] = array = self._open(index, rebuilt=True)
                    return array  # rebuilt and checked whole against its sha256
                checked[b] = True
            return array

    def _open(self, index: int, *, rebuilt: bool = False) -> np.ndarray:
        entry = self.meta["parts"][index]
        paths = part_paths(self.directory, index)
        ok = paths["tokens"].is_file() and paths["tokens"].stat().st_size == (
            entry["tokens"] * self.dtype.itemsize
        )
        if not ok:
            self._rebuild(index, entry)
            rebuilt = True
        blocks = len(entry["blocks"])
        self._checked[index] = np.full(blocks, rebuilt, bool)
        if entry["tokens"] == 0:
            return np.zeros(0, self.dtype)
        return np.memmap(paths["tokens"], self.dtype, "r", shape=(entry["tokens"],))

    def _rebuild(self, index: int, entry: Mapping[str, Any]) -> None:
        paths = part_paths(self.directory, index)
        if self._spec is None or entry.get("piece") is None:
            raise DataError(
                f"part {index} of the store {self.directory} is damaged (its "
                f"{paths['tokens'].name} does not match the checksums in the "
                "ledger). It is not read. Run `eqtrain data prepare CONFIG` (or fit "
                "again) to rebuild it."
            )
        if self._say is not None:
            self._say(
                f"data: part {index} of {self.directory} is damaged; rebuilding it"
            )
        task = Task(
            index,
            str(self.directory),
            self.dtype.name,
            self.meta["settings"]["text_column"],
            piece=entry["piece"],
        )
        rebuilt = build_part(task, _Encoder(self._spec))
        if rebuilt["sha256"] != entry["sha256"]:
            raise DataError(
                f"part {index} of the store {self.directory} was rebuilt but differs "
                "from the ledger: its source changed since the store was prepared. "
                "Prepare the store again."
            )

    def read(self, start: int, stop: int) -> np.ndarray:
        """Stream positions `[start, stop)` as int32 (across parts)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(
                f"[{start}, {stop}) is outside the {self.num_tokens} tokens"
            )
        out = np.empty(stop - start, np.int32)
        first = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        part = first
        while pos < stop:
            base = int(self._starts[part])
            end = min(stop, int(self._starts[part + 1]))
            if end > pos:
                array = self._part(part, pos - base, end - base)
                out[pos - start : end - start] = array[pos - base : end - base]
            pos = end
            part += 1
        return out

    def windows(self, starts: np.ndarray, width: int) -> np.ndarray:
        """`[len(starts), width]` int32: stream positions `[start, start + width)`
        for each start; one gather per part for the windows inside it."""
        starts = np.asarray(starts, np.int64)
        out = np.empty((len(starts), width), np.int32)
        part = np.searchsorted(self._starts, starts, side="right") - 1
        inside = starts + width <= self._starts[part + 1]
        offsets = np.arange(width)
        for p in np.unique(part[inside]):
            rows = np.flatnonzero(inside & (part == p))
            local = starts[rows] - self._starts[p]
            array = self._mapped(int(p))  # then the blocks these rows touch
            if self._verify and len(array):
                size = self.dtype.itemsize
                low = local * size // BLOCK
                high = ((local + width) * size - 1) // BLOCK
                touched = np.unique(
                    np.concatenate(
                        [np.arange(a, b + 1) for a, b in zip(low, high, strict=True)]
                    )
                )
                if not self._checked[int(p)][touched].all():
                    array = self._check(int(p), touched)
            out[rows] = array[local[:, None] + offsets]
        for r in np.flatnonzero(~inside):  # windows across a part boundary
            out[r] = self.read(int(starts[r]), int(starts[r]) + width)
        return out

    def lm_rows(self, seq_len: int) -> "LMRows":
        """Pre-training rows of `seq_len` (see `LMRows`)."""
        return LMRows(self, seq_len)


class LMRows:
    """`chunk_documents`' rows, read from a store by arithmetic: row i holds
    stream positions `[i * S, (i + 1) * S]` (inputs and shifted targets); the tail
    that does not fill a row is dropped. A `Loader` takes it as a source.

    Attributes:
        num_rows: rows of `seq_len` in the store.
    """

    def __init__(self, store: Store, seq_len: int):
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ConfigError(f"`seq_len` must be an int >= 1; got {seq_len!r}.")
        self.store = store
        self.seq_len = seq_len
        self.num_rows = (store.num_tokens - 1) // seq_len if store.num_tokens else 0
        if self.num_rows == 0:
            raise DataError(
                f"seq_len={seq_len} is too large for the data: {store.num_documents} "
                f"documents hold {store.num_tokens} tokens (with EOS), and one row "
                f"needs seq_len + 1 = {seq_len + 1}. Use a smaller seq_len or more "
                "documents."
            )

    def __len__(self) -> int:
        return self.num_rows

    def take(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """Rows `indices` as `tokens`, `targets` (int32) and `loss_mask`."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        s = self.seq_len
        if len(indices) and not (0 <= indices.min() and indices.max() < self.num_rows):
            bad = indices[(indices < 0) | (indices >= self.num_rows)][0]
            raise IndexError(f"row {bad} is outside the {self.num_rows} rows")
        window = self.store.windows(indices * s, s + 1)
        return {
            "tokens": window[:, :-1],
            "targets": window[:, 1:],
            "loss_mask": np.ones((len(indices), s), np.float32),
        }

    def __repr__(self) -> str:
        return f"LMRows(rows={self.num_rows:,}, seq_len={self.seq_len}, {self.store!r})"


class MappedRows:
    """A row source whose rows pass through `fn` as they are read (e.g. adding
    the positions a sequence-parallel model reads); the order is `source`'s."""

    def __init__(self, source: Any, fn: Callable[[dict[str, np.ndarray]], Any]):
        self.source, self.fn = source, fn
        self.num_rows = source.num_rows
        if hasattr(source, "epoch_order"):
            self.epoch_order = source.epoch_order

    def take(self, indices: Sequence[int] | np.ndarray) -> Any:
        return self.fn(self.source.take(indices))

    def __getattr__(self, name: str) -> Any:
        if name == "source":
            raise AttributeError(name)
        return getattr(self.source, name)


# -- preparing --------------------------------------------------------------------
def default_cache() -> Path:
    """`$EQTRAIN_DATA_CACHE`, else `$XDG_CACHE_HOME/eqtrain/data`, else
    `~/.cache/eqtrain/data`."""
    env = os.environ.get("EQTRAIN_DATA_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "eqtrain" / "data"


def _fingerprint(source: PathLike, pattern: str) -> dict[str, Any]:
    """The content key of a path source (see `_stream.fingerprint`): stat calls
    and 2 MiB read per file, never the whole file."""
    from . import _stream
    from ._corpus import stdlib_files

    name = os.fspath(source)
    if name in ("stdlib", "stdlib:train", "stdlib:eval"):
        files = stdlib_files("eval" if name.endswith(":eval") else "train")
        return {"stdlib": name, "files": _stream.fingerprint_files(files)}
    return _stream.fingerprint(name, pattern=pattern)


def _pieces(
    source: PathLike, text_column: str, pattern: str, piece_bytes: int
) -> list[dict[str, Any]]:
    """The pieces of a path source, as JSON (planned only when a store is built:
    planning JSON Lines counts its lines)."""
    from . import _stream
    from ._corpus import stdlib_files

    name = os.fspath(source)
    if name in ("stdlib", "stdlib:train", "stdlib:eval"):
        files = stdlib_files("eval" if name.endswith(":eval") else "train")
        pieces = _stream.plan_files(files, piece_bytes=piece_bytes)
    else:
        pieces = _stream.plan(
            name, text_column=text_column, pattern=pattern, piece_bytes=piece_bytes
        )
    return [p.to_json() for p in pieces]


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
    piece_bytes = piece_bytes or PIECE_BYTES
    spec = tokenizer_spec(tokenizer)
    settings = {
        "text_column": text_column,
        "pattern": pattern,
        "piece_bytes": piece_bytes,
    }
    if isinstance(source, (str, os.PathLike)):
        fingerprint, pieces = _fingerprint(source, pattern), None
        texts = None
        label = os.fspath(source)
    else:
        fingerprint, pieces = _python_key(source, key), None
        texts = source
        label = f"a {type(source).__name__}"
    identity = {
        "format": FORMAT,
        "source": fingerprint,
        "tokenizer": tokenizer_key(spec),
        "settings": settings,
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    cache = Path(cache_dir) if cache_dir is not None else default_cache()
    directory = cache / digest[:20]
    if fingerprint is None:
        if iter(texts) is texts:  # a one-shot iterator: built once, never reused
            directory = cache / "unkeyed" / f"{os.getpid()}-{time.monotonic_ns()}"
        else:  # re-iterable without a key: its documents' hash is the key
            identity["source"] = {
                "texts": _texts_key(_python_documents(texts, text_column))
            }
            digest = hashlib.sha256(
                json.dumps(identity, sort_keys=True).encode()
            ).hexdigest()
            directory = cache / digest[:20]
    if (directory / "store.json").is_file() and not verify:
        return _opened(Store(directory, spec=spec, say=say), label, text_column)
    if not build:
        return None
    _make_dir(directory)
    with _BuildLock(directory):
        if (directory / "store.json").is_file() and not verify:
            return _opened(Store(directory, spec=spec, say=say), label, text_column)
        builder = _Builder(
            directory,
            spec,
            settings,
            identity,
            label,
            workers=workers,
            executor=executor,
            say=say,
        )
        if texts is None:
            pieces = _pieces(source, text_column, pattern, piece_bytes)
        builder.build(pieces, texts, text_column, verify=verify)
    return _opened(Store(directory, spec=spec, say=say), label, text_column)


def _opened(store: Store, label: str, text_column: str) -> Store:
    """`store`, after warning (each time it is used, as reading the source would)
    about the records its source skipped."""
    from ._stream import check_counts

    counts = {
        "documents": store.num_documents,
        "skipped": store.meta.get("skipped", 0),
        "first_skipped": store.meta.get("first_skipped"),
    }
    check_counts(label, counts, text_column=text_column)
    return store


def _python_key(source: Any, key: str | None) -> dict[str, Any] | None:
    if key is not None:
        return {"python": key}
    fingerprint = getattr(source, "_fingerprint", None)
    if isinstance(fingerprint, str) and hasattr(source, "__len__"):
        return {"dataset": fingerprint, "rows": len(source)}
    return None


def _make_dir(directory: Path) -> None:
    try:
        (directory / "parts").mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DataError(
            f"cannot create the store directory {directory}: {error.strerror}. "
            "Set data.cache (or $EQTRAIN_DATA_CACHE) to a writable directory."
        ) from None


class _BuildLock:
    """One builder per store directory (an exclusive `flock`); others wait, then
    find the store complete."""

    def __init__(self, directory: Path):
        self.path = directory / ".lock"

    def __enter__(self) -> "_BuildLock":
        import fcntl

        self._file = open(self.path, "a+")
        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: Any) -> None:
        import fcntl

        fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)
        self._file.close()


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class _Builder:
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
        if executor not in ("auto", "inline", "processes", "ray"):
            raise ConfigError(
                "`executor` must be 'auto', 'inline', 'processes' or 'ray'; got "
                f"{executor!r}."
            )
        if workers is not None and (not isinstance(workers, int) or workers < 1):
            raise ConfigError(f"`workers` must be an int >= 1; got {workers!r}.")
        self.directory = directory
        self.spec = spec
        self.settings = settings
        self.identity = identity
        self.label = label
        self.workers = workers or os.cpu_count() or 1
        self.executor = executor
        self.say = say
        self.dtype = dtype_for(spec["vocab_size"]).name

    def build(
        self,
        pieces: list[dict[str, Any]] | None,
        texts: Any,
        text_column: str,
        *,
        verify: bool,
    ) -> None:
        self.text_column = text_column
        if pieces is not None:
            entries = self._build_pieces(pieces, verify=verify)
        else:
            entries = self._build_texts(texts)
        self._finish(entries)

    # -- pieces of files ---------------------------------------------------------
    def _build_pieces(
        self, pieces: list[dict[str, Any]], *, verify: bool
    ) -> list[dict[str, Any]]:
        done: dict[int, dict[str, Any]] = {}
        for index, piece in enumerate(pieces):
            entry = read_ledger(self.directory, index, self.dtype)
            if entry is None or entry.get("piece") != piece:
                continue
            if verify and not verify_part(self.directory, entry):
                self.say(
                    f"data: part {index} of {self.directory} is damaged; rebuilding it"
                )
                continue
            done[index] = entry
        todo = [i for i in range(len(pieces)) if i not in done]
        total = sum(p["nbytes"] for p in pieces)
        progress = _Progress(self.label, len(pieces), total, self.say)
        for i in done:
            progress.skip(pieces[i]["nbytes"], done[i])
        if done and todo:
            self.say(
                f"data: {len(done)} of {len(pieces)} parts of {self.label} were "
                "prepared before; continuing"
            )
        tasks = [
            Task(i, str(self.directory), self.dtype, self.text_column, piece=pieces[i])
            for i in todo
        ]
        try:
            for entry, task in self._run(tasks):
                done[task.index] = entry
                progress.add(pieces[task.index]["nbytes"], entry)
        except DataError as error:
            if "disk is full" not in str(error):
                raise
            raise DataError(f"{error} {self._space_needed(pieces, done)}") from None
        progress.finish()
        return [done[i] for i in range(len(pieces))]

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

    def _run(self, tasks: Iterable[Task]) -> Iterator[tuple[dict[str, Any], Task]]:
        """Build `tasks`, yielding `(entry, task)` as each finishes."""
        tasks = iter(tasks)
        head = [t for _, t in zip(range(2), tasks, strict=False)]
        if not head:
            return
        tasks = itertools.chain(head, tasks)
        mode = self.executor
        if mode == "auto":
            mode = "processes" if self.workers > 1 and len(head) > 1 else "inline"
        if mode == "inline":
            encoder = _Encoder(self.spec)
            for task in tasks:
                yield build_part(task, encoder), task
        elif mode == "processes":
            yield from self._run_processes(tasks)
        else:
            yield from self._run_ray(tasks)

    def _run_processes(
        self, tasks: Iterator[Task]
    ) -> Iterator[tuple[dict[str, Any], Task]]:
        with _WorkerPool(self.workers, self.spec) as pool:
            yield from pool.run(tasks)

    def _run_ray(self, tasks: Iterator[Task]) -> Iterator[tuple[dict[str, Any], Task]]:
        import ray

        remote = ray.remote(num_cpus=1)(build_with_spec)
        spec = ray.put(dict(self.spec))
        pending: dict[Any, Task] = {}
        limit = max(2 * int(ray.cluster_resources().get("CPU", 1)), 2)
        while True:
            while len(pending) < limit and (task := next(tasks, None)) is not None:
                pending[remote.remote(task, spec)] = task
            if not pending:
                return
            ready, _ = ray.wait(list(pending), num_returns=1)
            task = pending.pop(ready[0])
            yield ray.get(ready[0]), task

    # -- texts from Python --------------------------------------------------------
    def _build_texts(self, source: Any) -> list[dict[str, Any]]:
        """Parts of a Python source's documents, grouped up to `piece_bytes`."""
        piece_bytes = self.settings["piece_bytes"]

        def new_task(index: int, batch: list[str]) -> Task:
            return Task(
                index,
                str(self.directory),
                self.dtype,
                self.text_column,
                texts=tuple(batch),
            )

        def groups() -> Iterator[Task]:
            batch: list[str] = []
            size = index = 0
            for doc in _python_documents(source, self.text_column):
                batch.append(doc)
                size += len(doc)
                if size >= piece_bytes:
                    yield new_task(index, batch)
                    batch, size, index = [], 0, index + 1
            if batch:
                yield new_task(index, batch)

        progress = _Progress(self.label, None, None, self.say)
        entries: dict[int, dict[str, Any]] = {}

        def todo() -> Iterator[Task]:
            for task in groups():  # parts committed before (same texts) are kept
                entry = read_ledger(self.directory, task.index, self.dtype)
                if entry is not None and entry.get("texts") == _texts_key(
                    task.texts or ()
                ):
                    entries[task.index] = entry
                    progress.skip(0, entry)
                    continue
                yield task

        for entry, task in self._run(todo()):
            entries[task.index] = entry
            progress.add(sum(len(t) for t in task.texts or ()), entry)
        progress.finish()
        if not entries:
            raise DataError(
                f"{self.label} holds no documents; pass a non-empty source."
            )
        return [entries[i] for i in range(len(entries))]

    def _finish(self, entries: list[dict[str, Any]]) -> None:
        from ._stream import check_counts

        documents = sum(e["documents"] for e in entries)
        skipped = sum(e.get("skipped", 0) for e in entries)
        firsts = [e["first_skipped"] for e in entries if e.get("first_skipped")]
        counts = {
            "documents": documents,
            "skipped": skipped,
            "first_skipped": firsts[0] if firsts else None,
        }
        check_counts(
            self.label, {**counts, "skipped": 0}, text_column=self.text_column
        )  # no documents is an error; skipped rows are said by `prepare`
        meta = {
            "format": FORMAT,
            "dtype": self.dtype,
            "eos": int(self.spec["eos"]),
            "vocab_size": int(self.spec["vocab_size"]),
            "source": self.label,
            "identity": self.identity,
            "settings": dict(self.settings),
            "documents": documents,
            "tokens": sum(e["tokens"] for e in entries),
            "skipped": skipped,
            "first_skipped": counts["first_skipped"],
            "parts": [
                {
                    "tokens": e["tokens"],
                    "documents": e["documents"],
                    "piece": e["piece"],
                    "sha256": e["sha256"],
                    "blocks": e["blocks"],
                }
                for e in entries
            ],
        }
        _write_json(self.directory / "store.json", meta)


def _python_documents(source: Any, text_column: str) -> Iterator[str]:
    """Documents of a Python source: strings, or records' `text_column` (a
    non-string value is skipped, as the readers do)."""
    for i, item in enumerate(source):
        if isinstance(item, str):
            yield item
        elif isinstance(item, Mapping):
            if text_column not in item:
                raise DataError(
                    f"record {i} has no field {text_column!r}; available: "
                    f"{sorted(item)}. Pass the right `text_column`."
                )
            value = item[text_column]
            if isinstance(value, str):
                yield value
        else:
            raise DataError(
                f"item {i} of the source is a {type(item).__name__}; pass strings or "
                "records (mappings) with a text field."
            )


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
        eta = ""
        if self.total and rate > 0:
            eta = f", ETA {max(self.total - self.bytes, 0) / rate:.0f} s"
        return (
            f"data: preparing {self.label}: {parts}{self.documents:,} documents, "
            f"{self.tokens:,} tokens, {rate / 1e6:.1f} MB/s{eta}"
        )

    def finish(self) -> None:
        now = time.monotonic()
        if self.new_bytes and now - self.start >= self.every:
            self.say(self.line(now) + " (done)")
