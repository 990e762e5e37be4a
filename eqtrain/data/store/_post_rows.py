"""Reading a post-training store (`_post_store` builds them): `PostRows` opens
its `rows.json` and builds the rows a batch asks for from the memory-mapped
examples of its parts, as the in-memory pipelines (`_text.pack`, `_text.collate`,
`_post._pair_rows`, GRPO's prompt rows) would have made them; `StoredColumn` is
a field of a GRPO store's kept records, read as the rewards use it.
"""

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import DataError, PathLike
from .._records import SkipReport
from ._post_parts import FORMAT, post_part_paths


def _read_meta(directory: Path) -> dict[str, Any]:
    path = directory / "rows.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DataError(
            f"{directory} is not a complete post-training store ({path}: {error}). "
            "Prepare it again (`eqtrain data prepare CONFIG`)."
        ) from None
    if meta.get("format") != FORMAT:
        raise DataError(
            f"the store {directory} has format {meta.get('format')}; this eqtrain "
            f"reads format {FORMAT}. Prepare it again."
        )
    return meta


class PostRows:
    """The rows of a post-training store, built by index as a `Loader` reads
    them: SFT rows (`tokens`, `targets`, `loss_mask`, `segment_ids`), preference
    pairs (`chosen_*`, `rejected_*`) or GRPO prompts (`prompt`, `prompt_len`,
    `index`), equal to the in-memory pipelines' rows of the same records.

    Attributes:
        num_rows: rows (pairs, prompts) in the store.
        report: the `SkipReport` of the records skipped while preparing it.
    """

    def __init__(self, directory: PathLike):
        self.directory = Path(directory)
        self.meta = meta = _read_meta(self.directory)
        self.settings = settings = meta["settings"]
        self.kind, self.seq_len = settings["kind"], int(settings["seq_len"])
        self.dtype, self.pad = np.dtype(meta["dtype"]), int(settings["pad"])
        self.report = SkipReport(**meta["report"])
        counts = [p["examples"] for p in meta["parts"]]
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_examples = int(self._first[-1])
        self._parts: dict[int, tuple[np.ndarray, ...]] = {}
        self._starts: np.ndarray | None = None
        self._added: dict[str, np.ndarray] = {}  # `add_columns`' arrays
        self._columns: dict[str, np.ndarray] = {}  # whole columns, once asked for
        if self.kind == "preference":
            self.num_rows = self.num_examples // 2
        elif settings.get("pack"):
            self.num_rows = int(meta["packed_rows"])
        else:
            self.num_rows = self.num_examples

    def __len__(self) -> int:
        return self.num_rows

    def __repr__(self) -> str:
        return (
            f"PostRows({str(self.directory)!r}, kind={self.kind!r}, "
            f"rows={self.num_rows:,})"
        )

    # -- the stored examples ----------------------------------------------------
    def _part(self, index: int) -> tuple[np.ndarray, ...]:
        """Part `index`'s tokens, mask and ends, mapped (their sizes checked)."""
        if index not in self._parts:
            entry = self.meta["parts"][index]
            paths = post_part_paths(self.directory, index)
            sizes = {
                "tokens": (entry["tokens"], self.dtype),
                "mask": (entry["tokens"], np.dtype(np.uint8)),
                "ends": (entry["examples"], np.dtype(np.int64)),
            }
            arrays = []
            for name, (n, dtype) in sizes.items():
                path = paths[name]
                if not path.is_file() or path.stat().st_size != n * dtype.itemsize:
                    raise DataError(
                        f"{path} is missing or has the wrong size: the store "
                        f"{self.directory} is damaged. Remove it and prepare again "
                        "(`eqtrain data prepare CONFIG`, or fit again)."
                    )
                arrays.append(
                    np.memmap(path, dtype, "r", shape=(n,)) if n else np.zeros(0, dtype)
                )
            self._parts[index] = tuple(arrays)
        return self._parts[index]

    def example(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Example `e`'s ids (int32) and mask (float32)."""
        if not 0 <= e < self.num_examples:
            raise IndexError(f"example {e} is outside the {self.num_examples}")
        p = int(np.searchsorted(self._first, e, side="right")) - 1
        tokens, mask, ends = self._part(p)
        local = e - int(self._first[p])
        start = int(ends[local - 1]) if local else 0
        stop = int(ends[local])
        return (
            tokens[start:stop].astype(np.int32),
            mask[start:stop].astype(np.float32),
        )

    def lengths(self) -> np.ndarray:
        """Every example's token count (`int64 [num_examples]`; a prompt
        store's: each prompt's length), from the parts' ends, without reading a
        token."""
        out = []
        for p in range(len(self.meta["parts"])):
            ends = np.asarray(self._part(p)[2], np.int64)
            out.append(np.diff(ends, prepend=0))
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def record(self, r: int) -> Any:
        """GRPO: kept record `r` (its prompt and other columns), read from its part."""
        p = int(np.searchsorted(self._first, r, side="right")) - 1
        local = r - int(self._first[p])
        paths = post_part_paths(self.directory, p)
        offsets = np.memmap(paths["offsets"], np.int64, "r")
        start = int(offsets[local - 1]) if local else 0
        with open(paths["records"], "rb") as f:
            f.seek(start)
            return json.loads(f.read(int(offsets[local]) - start))

    # -- rows -------------------------------------------------------------------
    def add_columns(self, columns: Mapping[str, Any]) -> None:
        """Add per-row arrays (e.g. a reference model's log-probs of each pair),
        returned by `take` with the stored rows (see `Loader.add_columns`)."""
        for name, value in columns.items():
            array = np.asarray(value)
            if array.ndim == 0 or array.shape[0] != self.num_rows:
                raise DataError(
                    f"column {name!r} has shape {array.shape}; it needs one entry "
                    f"per row ({self.num_rows} rows)."
                )
            self._added[name] = array

    def keys(self) -> list[str]:
        """The names of the columns `take` returns (`dict(rows)`-style use)."""
        return list(self.take(np.arange(min(1, self.num_rows))))

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __getitem__(self, name: str) -> np.ndarray:
        """The whole column `name`, made once (all rows in memory: for code
        that reads every row, e.g. the reference pass; batches use `take`)."""
        if name not in self._columns:
            self._columns.update(self.take(np.arange(self.num_rows)))
        return self._columns[name]

    def take(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
        """Rows `indices` as a dict of arrays (`[len(indices), ...]`)."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        if len(indices) and not (0 <= indices.min() and indices.max() < self.num_rows):
            bad = indices[(indices < 0) | (indices >= self.num_rows)][0]
            raise IndexError(f"row {bad} is outside the {self.num_rows} rows")
        rows = self._stored(indices)
        return {**rows, **{k: v[indices] for k, v in self._added.items()}}

    def _stored(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        if self.kind == "preference":
            return self._pairs(indices)
        if self.kind == "prompt":
            return self._prompts(indices)
        if self.settings.get("pack"):
            return self._packed(indices)
        return self._collated(indices)

    def _collated(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """`_text.collate(..., segment_ids=True)` of one example per row."""
        width = self.seq_len + 1
        tok = np.full((len(indices), width), self.pad, np.int32)
        real = np.zeros((len(indices), width), bool)
        learn = np.zeros((len(indices), width), np.float32)
        for i, e in enumerate(indices):
            ids, mask = self.example(int(e))
            ids, mask = ids[:width], mask[:width]
            n = len(ids)
            tok[i, :n], real[i, :n], learn[i, :n] = ids, True, mask
        return {
            "tokens": tok[:, :-1],
            "targets": tok[:, 1:],
            "loss_mask": (real[:, :-1] & real[:, 1:] & (learn[:, 1:] > 0)).astype(
                np.float32
            ),
            "segment_ids": real[:, :-1].astype(np.int32),
        }

    def _packed(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """`_text.pack`'s rows `indices`, from the examples each one holds."""
        if self._starts is None:
            path = self.directory / "packed.starts"
            self._starts = np.memmap(path, np.int64, "r", shape=(self.num_rows + 1,))
        width = self.seq_len + 1
        tok = np.full((len(indices), width), self.pad, np.int32)
        seg = np.zeros((len(indices), width), np.int32)
        learn = np.zeros((len(indices), width), np.float32)
        for i, r in enumerate(indices):
            pos, segment = 0, 0
            for e in range(int(self._starts[r]), int(self._starts[r + 1])):
                ids, mask = self.example(e)
                ids, mask = ids[:width], mask[:width]
                if not len(ids):
                    continue
                segment += 1
                end = pos + len(ids)
                tok[i, pos:end], seg[i, pos:end], learn[i, pos:end] = ids, segment, mask
                pos = end
        same = (seg[:, :-1] == seg[:, 1:]) & (seg[:, 1:] > 0)
        return {
            "tokens": tok[:, :-1],
            "targets": tok[:, 1:],
            "loss_mask": (same * learn[:, 1:]).astype(np.float32),
            "segment_ids": seg[:, :-1],
        }

    def _pairs(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """`_post._pair_rows`' rows: pair i is examples 2i (chosen), 2i + 1."""
        n, s = len(indices), self.seq_len
        rows: dict[str, np.ndarray] = {}
        for side in ("chosen", "rejected"):
            rows[f"{side}_tokens"] = np.full((n, s), self.pad, np.int32)
            rows[f"{side}_targets"] = np.zeros((n, s), np.int32)
            rows[f"{side}_mask"] = np.zeros((n, s), np.float32)
        for i, r in enumerate(indices):
            for offset, side in enumerate(("chosen", "rejected")):
                ids, learn = self.example(2 * int(r) + offset)
                w = len(ids) - 1
                rows[f"{side}_tokens"][i, :w] = ids[:-1]
                rows[f"{side}_targets"][i, :w] = ids[1:]
                rows[f"{side}_mask"][i, :w] = learn[1:]
        return rows

    def _prompts(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """GRPO's prompt rows: left-padded to the width, lengths, indices."""
        width = int(self.settings["width"])
        out = np.full((len(indices), width), self.pad, np.int32)
        lengths = np.zeros(len(indices), np.int32)
        for i, r in enumerate(indices):
            ids, _ = self.example(int(r))
            out[i, width - len(ids) :] = ids
            lengths[i] = len(ids)
        return {"prompt": out, "prompt_len": lengths, "index": indices.astype(np.int32)}

    def column(self, name: str) -> "StoredColumn":
        """GRPO: the field `name` of every kept record (None where a record has
        none), read from the parts as it is used."""
        return StoredColumn(self, name)


class StoredColumn(Sequence):
    """A field of a GRPO store's kept records, by index or in order, read from
    the parts' `.records` files (nothing held in memory)."""

    def __init__(self, rows: PostRows, name: str):
        self.rows, self.name = rows, name

    def __len__(self) -> int:
        return self.rows.num_rows

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = int(i) + (len(self) if int(i) < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"record {i} is outside the {len(self)}")
        return _field(self.rows.record(i), self.name)

    def __iter__(self) -> Any:
        for index in range(len(self.rows.meta["parts"])):
            path = post_part_paths(self.rows.directory, index)["records"]
            with open(path, "rb") as f:
                for line in f:
                    yield _field(json.loads(line), self.name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StoredColumn({self.name!r}, {len(self):,} records)"


def _field(record: Any, name: str) -> Any:
    return record.get(name) if isinstance(record, Mapping) else None
