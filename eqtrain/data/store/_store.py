"""A tokenized store on disk, read back by index arithmetic: `Store` maps its
parts (checking each block against its CRC-32 when first read), and `LMRows`
cuts its token stream into pre-training rows. `_prepare` builds stores.

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

import json
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import DataError, PathLike, positive, too_few_tokens
from .._files import BuildLock
from ._encoder import Encoder
from ._parts import BLOCK, FORMAT, Task, build_part, part_paths


def _read_meta(directory: Path) -> dict[str, Any]:
    """A complete store's `store.json`, of this eqtrain's format."""
    meta_path = directory / "store.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DataError(
            f"{directory} is not a complete tokenized store ({meta_path}: "
            f"{error}). Prepare it again (`eqtrain data prepare CONFIG`)."
        ) from None
    if meta.get("format") != FORMAT:
        raise DataError(
            f"the store {directory} has format {meta.get('format')}; "
            f"this eqtrain reads format {FORMAT}. Prepare it again."
        )
    return meta


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
        self.meta = _read_meta(self.directory)
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

    def _checked_part(
        self, index: int, first: np.ndarray, stop: np.ndarray
    ) -> np.ndarray:
        """Part `index`, mapped, with the blocks of its tokens `[first, stop)`
        checked (one range per pair of `first` and `stop`)."""
        array = self._mapped(index)
        if self._verify and len(array):
            blocks = self._blocks(first, stop)
            if not self._checked[index][blocks].all():
                array = self._check(index, blocks)
        return array

    def _blocks(self, first: np.ndarray, stop: np.ndarray) -> np.ndarray:
        """The blocks that hold a part's tokens `[first, stop)` (sorted, once each)."""
        size = self.dtype.itemsize
        low = first * size // BLOCK
        high = (stop * size - 1) // BLOCK
        ranges = [np.arange(a, b + 1) for a, b in zip(low, high, strict=True)]
        return np.unique(np.concatenate(ranges))

    def _mapped(self, index: int) -> np.ndarray:
        """Part `index`, mapped (its size checked), no block checked yet."""
        if index not in self._maps:
            with self._lock:
                if index not in self._maps:  # another thread may have mapped it
                    self._maps[index] = self._open(index)
        return self._maps[index]

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
        """Map part `index` (rebuilt first when its file is missing or of the
        wrong size); none of its blocks is marked checked unless `rebuilt`."""
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
        """Build part `index` again from its piece; it must equal its ledger entry."""
        if self._spec is None or entry.get("piece") is None:
            raise self._damaged(index)
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
        with BuildLock(self.directory):  # what a builder removes it does not own
            rebuilt = build_part(task, Encoder(self._spec))
        if rebuilt["sha256"] != entry["sha256"]:
            raise DataError(
                f"part {index} of the store {self.directory} was rebuilt but differs "
                "from the ledger: its source changed since the store was prepared. "
                "Prepare the store again."
            )

    def _damaged(self, index: int) -> DataError:
        """The error that refuses a damaged part a store opened alone cannot rebuild."""
        tokens = part_paths(self.directory, index)["tokens"]
        return DataError(
            f"part {index} of the store {self.directory} is damaged (its "
            f"{tokens.name} does not match the checksums in the "
            "ledger). It is not read. Run `eqtrain data prepare CONFIG` (or fit "
            "again) to rebuild it."
        )

    def read(self, start: int, stop: int) -> np.ndarray:
        """Stream positions `[start, stop)` as int32 (across parts)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(
                f"[{start}, {stop}) is outside the {self.num_tokens} tokens"
            )
        out = np.empty(stop - start, np.int32)
        part = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            base = int(self._starts[part])
            end = min(stop, int(self._starts[part + 1]))
            if end > pos:
                first, last = np.array([pos - base]), np.array([end - base])
                array = self._checked_part(part, first, last)
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
            array = self._checked_part(int(p), local, local + width)
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
        self.store = store
        self.seq_len = positive("seq_len", seq_len)
        self.num_rows = (store.num_tokens - 1) // seq_len if store.num_tokens else 0
        if self.num_rows == 0:
            raise too_few_tokens(seq_len, store.num_documents, store.num_tokens)

    def __len__(self) -> int:
        return self.num_rows

    def take(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """Rows `indices` as `tokens`, `targets` (int32) and `loss_mask`."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        self._check_rows(indices)
        window = self.store.windows(indices * self.seq_len, self.seq_len + 1)
        return {
            "tokens": window[:, :-1],
            "targets": window[:, 1:],
            "loss_mask": np.ones((len(indices), self.seq_len), np.float32),
        }

    def _check_rows(self, indices: np.ndarray) -> None:
        if len(indices) and not (0 <= indices.min() and indices.max() < self.num_rows):
            bad = indices[(indices < 0) | (indices >= self.num_rows)][0]
            raise IndexError(f"row {bad} is outside the {self.num_rows} rows")

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
