"""`Loader`: deterministic, resumable batches over in-memory rows, per-process
slicing, and background prefetch onto devices.

The order of an epoch is a permutation drawn from `(seed, epoch)`, so the batch at
position `(epoch, index)` is computed directly: restoring a position is O(1) in the
number of batches already consumed.
"""

import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.tree_util as jtu
import numpy as np

from .._errors import ConfigError
from ._errors import DataError, positive
from ._prefetch import Prefetcher
from ._table import Table


Position = dict[str, int]
Sharding = jax.sharding.Sharding | Mapping[str, jax.sharding.Sharding]


class Loader:
    """Deterministic, resumable batches with per-process slicing and prefetch.

    A **train** loader (`mode="train"`) walks epochs `0, 1, ...` (forever, or
    `num_epochs`); epoch e visits the rows in the order of a permutation drawn from
    `(seed, e)`, so every row appears once per epoch. `iter(loader)` continues from
    `loader.position`, the number of batches already *yielded* (not prefetched):
    a small JSON-able dict `{"epoch": e, "index": i}`. A loader built with that
    position (or after `seek(position)`) yields exactly what the original would
    have yielded next, without replaying anything.

    An **eval** loader (`mode="eval"`) is finite and re-iterable: each `iter()` is
    one full pass from the start, in order unless `shuffle=True`.

    With P processes (`process_count`), each global batch of `batch_size` rows is
    split into P equal slices and process p yields only slice p; all processes
    agree on the order. A last, short global batch (`drop_last=False`) is padded to
    full size with all-zero rows, which have `loss_mask` 0; a batch without
    `loss_mask` then also gets `weights` (float32 [B], 0 on padding) so that
    weighted averages stay exact and shapes stay static.

    Args:
        source: a dict of equal-length arrays (rows along axis 0), a
            `datasets.Dataset`, a sequence of examples (with `transform`), or a
            row source: an object with `num_rows` and `take(indices)` returning
            a dict of arrays, such as a tokenized store's `LMRows` or a
            `Mixture` (which may define `epoch_order(epoch, seed=, shuffle=)`;
            it then decides each epoch's order; and `take_in_batch(indices,
            batch_rows)`, which then reads this process's rows knowing the
            whole global batch's, as `PromptBuckets` does). Rows are read only
            when a batch needs them, in the prefetch thread.
        batch_size: the global batch size B (all processes together).
        mode: `"train"` or `"eval"` (see above).
        seed: the data-order seed (independent of the model's key).
        shuffle: permute each epoch (default: True for train, False for eval).
        drop_last: drop a last, short batch (default: True for train, False for
            eval, where it is padded instead).
        num_epochs: train loaders stop after this many epochs (default: never).
        position: where a train loader starts, as returned by `position`.
        transform: applied to each process's fetched rows (a dict of arrays, a
            dataset's dict of columns, or a list of examples) to make the batch,
            e.g. `lambda ex: collate(ex, max_length=512)`.
        sharding: place each batch on devices with this sharding (or a dict of
            them, one per batch entry): `jax.device_put` in one process,
            `jax.make_array_from_process_local_data` across several. Default:
            numpy batches.
        prefetch: batches prepared ahead in a background thread (0: none).
        process_index: this process's slice (default `jax.process_index()`).
        process_count: number of slices (default `jax.process_count()`); must
            divide `batch_size`.

    Raises:
        DataError: the source is empty, or `batch_size` exceeds its rows with
            `drop_last=True`.
    """

    def __init__(
        self,
        source: Any,
        batch_size: int,
        *,
        mode: str = "train",
        seed: int = 0,
        shuffle: bool | None = None,
        drop_last: bool | None = None,
        num_epochs: int | None = None,
        position: Mapping[str, int] | None = None,
        transform: Callable[[Any], Any] | None = None,
        sharding: Sharding | None = None,
        prefetch: int = 2,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        if mode not in ("train", "eval"):
            raise ConfigError(f"`mode` must be 'train' or 'eval'; got {mode!r}.")
        self._table = Table(source)
        self.mode = mode
        self.batch_size = positive("batch_size", batch_size)
        self.seed = seed
        self.shuffle = mode == "train" if shuffle is None else shuffle
        self.drop_last = mode == "train" if drop_last is None else drop_last
        self.num_epochs = _epochs(num_epochs, mode)
        self.transform = transform
        self.sharding = sharding
        self.prefetch = _prefetch(prefetch)
        self.process_index, self.process_count = self._processes(
            process_index, process_count
        )
        self.local_batch_size = self.batch_size // self.process_count
        self.num_batches = self._count_batches()
        rows = self._table.num_rows
        self._pads = not self.drop_last and rows % self.batch_size != 0
        self._position = (0, 0)
        self._active: weakref.ref[_LoaderIterator] | None = None
        if position is not None:
            self.seek(position)  # an eval loader refuses it

    def _processes(self, index: int | None, count: int | None) -> tuple[int, int]:
        """This process's slice and the number of slices (default: JAX's)."""
        count = positive(
            "process_count", jax.process_count() if count is None else count
        )
        index = jax.process_index() if index is None else index
        if not isinstance(index, int) or not 0 <= index < count:
            raise ConfigError(
                f"`process_index` must be in [0, {count}); got {index!r}."
            )
        if self.batch_size % count:
            raise ConfigError(
                f"`batch_size` ({self.batch_size}) must be a multiple of the process "
                f"count ({count}): each process reads batch_size / process_count "
                "rows of every global batch."
            )
        return index, count

    def _count_batches(self) -> int:
        """Batches per epoch: a last, short one is dropped or padded."""
        rows = self._table.num_rows
        if not self.drop_last:
            return -(-rows // self.batch_size)
        if rows < self.batch_size:
            raise DataError(
                f"batch_size={self.batch_size} is larger than the data ({rows} rows), "
                "so drop_last=True leaves no batch. Use a batch size <= "
                f"{rows}, more data, or drop_last=False."
            )
        return rows // self.batch_size

    @property
    def source(self) -> Any:
        """What the loader reads (as given, or its arrays)."""
        return self._table.data

    # -- positions -------------------------------------------------------------
    @property
    def position(self) -> Position:
        """Batches yielded so far, as `{"epoch": e, "index": i}`: the next batch is
        batch i of epoch e. Save it with the model; pass it back as `position=`."""
        if self.mode == "eval":
            raise ConfigError(
                "an eval loader has no position: each `iter()` is a full pass."
            )
        epoch, index = self._position
        return {"epoch": epoch, "index": index}

    def seek(self, position: Mapping[str, int]) -> None:
        """Continue from `position` (from `Loader.position`); stops any running
        iterator of this loader (its prefetched batches belong to the old one)."""
        if self.mode == "eval":
            raise ConfigError("an eval loader always starts at the beginning.")
        self._position = self._normalized(position)
        self._supersede()

    def _normalized(self, position: Mapping[str, int]) -> tuple[int, int]:
        epoch, index = _epoch_and_index(position)
        valid = (
            isinstance(epoch, int)
            and isinstance(index, int)
            and epoch >= 0
            and 0 <= index <= self.num_batches
        )
        if not valid:
            raise ConfigError(
                f"position {dict(position)} is outside this loader, which has "
                f"{self.num_batches} batches per epoch (index 0..{self.num_batches}). "
                "Was it saved with another data, batch size or process count?"
            )
        return (epoch + 1, 0) if index == self.num_batches else (epoch, index)

    def add_columns(self, columns: Mapping[str, Any]) -> None:
        """Add per-row arrays to a loader over a dict of arrays (e.g. values
        computed from the rows once, such as a reference model's log-probs); the
        position is kept, and the next iterator's batches carry them.

        Raises:
            ConfigError: the loader is not over a dict of arrays, a name is
                taken, or an array's leading length is not the number of rows.
        """
        self._table.add_columns(columns)
        self._supersede()

    def __len__(self) -> int:
        """Batches per epoch (per pass for an eval loader)."""
        return self.num_batches

    # -- iteration --------------------------------------------------------------
    def __iter__(self) -> "_LoaderIterator":
        if self.mode == "eval":
            return _LoaderIterator(self, self._batches((0, 0), 1), tracked=False)
        self._supersede()
        batches = self._batches(self._position, self.num_epochs)
        it = _LoaderIterator(self, batches, tracked=True)
        self._active = weakref.ref(it)
        return it

    def peek(self) -> Any:
        """The batch the next `next()` would yield, without advancing (e.g. to
        initialise a model's shapes)."""
        if self.mode == "eval":
            start, epochs = (0, 0), 1
        else:
            start, epochs = self._position, self.num_epochs
        for batch, _ in self._batches(start, epochs):
            return batch
        raise DataError(
            f"the loader is past its last epoch ({self.num_epochs}); nothing to peek."
        )

    def close(self) -> None:
        """Stop the running iterator of this train loader (and its prefetch
        thread). The position stays: a later `iter()` continues from it. Dropping
        an iterator stops its thread too; `close` does it at once."""
        self._supersede()

    def _supersede(self) -> None:
        previous = self._active() if self._active is not None else None
        if previous is not None:
            previous._superseded()
        self._active = None

    def _batches(
        self, start: tuple[int, int], num_epochs: int | None
    ) -> Iterator[tuple[Any, tuple[int, int]]]:
        """`(batch, position after it)` from `start`; runs in the prefetch thread."""
        epoch, index = start
        while num_epochs is None or epoch < num_epochs:
            order = self.epoch_order(epoch)
            for i in range(index, self.num_batches):
                batch = self._batch(order, i)
                after = (epoch, i + 1) if i + 1 < self.num_batches else (epoch + 1, 0)
                yield batch, after
            epoch, index = epoch + 1, 0

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The order of the rows in `epoch`: a permutation drawn from
        `(seed, epoch)` (or `arange` without shuffling)."""
        rows = self._table.num_rows
        custom = getattr(self._table.data, "epoch_order", None)
        if self._table.kind == "rows" and custom is not None:  # e.g. a mixture
            return custom(epoch, seed=self.seed, shuffle=self.shuffle)
        if not self.shuffle:
            return np.arange(rows)
        return np.random.default_rng([self.seed, epoch]).permutation(rows)

    def _batch(self, order: np.ndarray, index: int) -> Any:
        """Batch `index` of the epoch whose order is `order`: this process's slice,
        transformed, padded and placed."""
        b, p = self.local_batch_size, self.process_index
        rows = order[index * self.batch_size : (index + 1) * self.batch_size]
        local = rows[p * b : (p + 1) * b]  # may be short (or empty) on a last batch
        if len(local):
            batch = self._transformed(self._take(local, rows))
        else:  # this process's slice is all padding: zero rows of the right shapes
            batch = jtu.tree_map(
                lambda x: np.zeros_like(x[:0]),
                self._transformed(self._take(order[:1], rows)),
            )
        if self._pads:
            batch = _padded(batch, len(local), b)
        return self._placed(batch)

    def _take(self, indices: np.ndarray, batch_rows: np.ndarray) -> Any:
        """Rows `indices` of the global batch `batch_rows`: a row source with
        `take_in_batch(indices, batch_rows)` shapes them by the whole batch
        (e.g. `PromptBuckets` cuts prompts to the batch's width, the same in
        every process)."""
        custom = getattr(self._table.data, "take_in_batch", None)
        if self._table.kind == "rows" and custom is not None:
            return custom(indices, batch_rows)
        return self._table.take(indices)

    def _transformed(self, rows: Any) -> Any:
        if self.transform is not None:
            return self.transform(rows)
        if self._table.kind == "dataset":
            return {k: np.asarray(v) for k, v in rows.items()}
        if self._table.kind == "sequence":
            return np.asarray(rows)
        return rows

    def _placed(self, batch: Any) -> Any:
        if self.sharding is None:
            return batch
        if jax.process_count() == 1:
            return jax.device_put(batch, self.sharding)
        shardings = self.sharding
        if isinstance(shardings, jax.sharding.Sharding):
            shardings = jtu.tree_map(lambda _: self.sharding, batch)
        return jtu.tree_map(
            lambda x, s: jax.make_array_from_process_local_data(
                s, x, (self.batch_size, *np.shape(x)[1:])
            ),
            batch,
            shardings,
        )

    def __repr__(self) -> str:
        where = "" if self.mode == "eval" else f", position={self.position}"
        return (
            f"Loader(rows={self._table.num_rows}, batch_size={self.batch_size}, "
            f"mode={self.mode!r}, batches={self.num_batches}{where})"
        )


class _LoaderIterator:
    """One pass over a `Loader`, possibly prefetched; updates a train loader's
    position as each batch is yielded."""

    def __init__(
        self,
        loader: Loader,
        batches: Iterator[tuple[Any, tuple[int, int]]],
        *,
        tracked: bool,
    ):
        self._loader = loader
        self._tracked = tracked
        self._state = "open"
        self._batches = batches
        self._prefetcher = (
            Prefetcher(batches, loader.prefetch) if loader.prefetch > 0 else None
        )

    def __iter__(self) -> "_LoaderIterator":
        return self

    def __next__(self) -> Any:
        if self._state == "superseded":
            raise DataError(
                "this loader iterator was superseded by a newer `iter(loader)` or "
                "`loader.seek(...)`; iterate the newest one (a train loader has one "
                "position, so only one iterator can advance it)."
            )
        if self._state == "closed":
            raise StopIteration
        try:
            batch, after = self._next()
        except BaseException:
            self.close()
            raise
        if self._tracked:
            self._loader._position = after
        return batch

    def _next(self) -> tuple[Any, tuple[int, int]]:
        if self._prefetcher is not None:
            return self._prefetcher.get()
        return next(self._batches)

    def close(self) -> None:
        """Stop prefetching; the iterator then ends. Safe to call twice."""
        if self._state == "open":
            self._state = "closed"
        if self._prefetcher is not None:
            self._prefetcher.close()

    def _superseded(self) -> None:
        self.close()
        self._state = "superseded"

    def __del__(self, _exiting: Any = sys.is_finalizing) -> None:
        if getattr(self, "_prefetcher", None) is not None and not _exiting():
            self._prefetcher.close()  # not at interpreter exit: see `Prefetcher`


def _padded(batch: Any, real: int, size: int) -> Any:
    """`batch` (of `real` rows) padded to `size` rows with zeros; adds `weights`
    to a mapping without a `loss_mask`."""
    if isinstance(batch, Mapping) and "loss_mask" not in batch:
        batch = {**batch, "weights": np.ones(real, np.float32)}

    def pad(x: Any) -> np.ndarray:
        x = np.asarray(x)
        if x.shape[0] != real:
            raise DataError(
                f"`transform` returned a leaf with leading size {x.shape[0]} for "
                f"{real} rows; each batch entry must have one row per example."
            )
        return np.concatenate([x, np.zeros((size - real, *x.shape[1:]), x.dtype)])

    return jtu.tree_map(pad, batch)


def _epoch_and_index(position: Mapping[str, int]) -> tuple[Any, Any]:
    try:
        return position["epoch"], position["index"]
    except (KeyError, TypeError):
        raise ConfigError(
            f"a position is a dict {{'epoch': e, 'index': i}}; got {position!r}."
        ) from None


def _epochs(num_epochs: int | None, mode: str) -> int | None:
    """`num_epochs`, checked: a train loader's setting."""
    if num_epochs is not None:
        positive("num_epochs", num_epochs)
        if mode == "eval":
            raise ConfigError(
                "`num_epochs` is for train loaders; an eval loader makes one pass "
                "per `iter()`."
            )
    return num_epochs


def _prefetch(prefetch: int) -> int:
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ConfigError(f"`prefetch` must be an int >= 0; got {prefetch!r}.")
    return prefetch
