"""`Mixture`: several row sources interleaved by weight, deterministically, at
the row level, so that every batch's composition follows the weights and any
position is computed directly (exact resume in O(1) batches).

The order is a fixed schedule of `PERIOD` rows: source `s` fills `quota[s]`
slots of each period (its weight times `PERIOD`, rounded so they sum to
`PERIOD`), placed by largest deficit, so that after any prefix of `j` rows each
source has had `j * quota[s] / PERIOD` rows give or take one. The `k`-th row a
source contributes is row `k % n` of its own epoch `k // n` (a permutation drawn
from `(seed, source, epoch)`): a small source with a large weight repeats, a large
one with a small weight is read partially per mixture epoch, and neither's order
depends on the other's.
"""

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import ConfigError
from ._errors import DataError, DataWarning


PERIOD = 4096
"""Rows in one period of the schedule (weights are honoured to 1 / PERIOD)."""
CHUNK = 1 << 16
"""Rows of an epoch's order computed at once."""


class Mixture:
    """Row sources (each with `num_rows` and `take`, e.g. `LMRows`) mixed by
    weight; a `Loader` source.

    One mixture epoch is `num_rows` rows, the sum of the sources' rows; the
    `Loader` asks `epoch_order(epoch, seed=, shuffle=)` for its order.

    Args:
        sources: the row sources; their rows must have the same columns and
            shapes (the same `seq_len`).
        weights: one per source, positive; normalised to sum to 1.
        names: one per source, for metrics (default `source0`, `source1`, ...).

    Raises:
        ConfigError: weights that are not positive finite numbers, or not one per
            source.
        DataError: sources whose rows differ in columns or shapes.
    """

    def __init__(
        self,
        sources: Sequence[Any],
        weights: Sequence[float],
        *,
        names: Sequence[str] | None = None,
    ):
        _check_weights(sources, weights)
        self.names = _names(names, len(sources))
        self.sources = list(sources)
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        _warn_tiny(self.names, self.weights)
        self.sizes = np.array([int(s.num_rows) for s in sources], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        self.num_rows = int(self.offsets[-1])
        self._check_layout()
        self.quota = _quotas(self.weights, PERIOD)
        self.schedule, self.rank = _schedule(self.quota)
        # rows of source s among the first j rows of a period: prefix[s][j]
        self.prefix = np.zeros((len(sources), PERIOD + 1), np.int64)
        for s in range(len(sources)):
            self.prefix[s, 1:] = np.cumsum(self.schedule == s)

    def _check_layout(self) -> None:
        first = None
        for name, source in zip(self.names, self.sources, strict=True):
            row = source.take(np.zeros(1, np.int64))
            layout = {k: (np.shape(v)[1:], np.asarray(v).dtype) for k, v in row.items()}
            if first is None:
                first = (name, layout)
            elif layout != first[1]:
                raise DataError(
                    f"the mixture's sources must give rows of one layout; "
                    f"{first[0]} gives {first[1]} and {name} gives {layout}. Use one "
                    "data.seq_len and one kind of data for every source."
                )

    def __len__(self) -> int:
        return self.num_rows

    def epoch_order(self, epoch: int, *, seed: int, shuffle: bool) -> np.ndarray:
        """Row ids (into the concatenated sources) of mixture epoch `epoch`.

        Memory: the result (8 bytes per row) and, while it is made, one pass's
        order of each source (4 bytes per row of the sources), computed
        `CHUNK` rows at a time."""
        out = np.empty(self.num_rows, np.int64)
        passes = _Passes(self.sizes, seed=seed, shuffle=shuffle)
        for low in range(0, self.num_rows, CHUNK):
            high = min(low + CHUNK, self.num_rows)
            g = np.arange(low, high, dtype=np.int64) + epoch * self.num_rows
            slot = g % PERIOD
            source = self.schedule[slot]
            k = (g // PERIOD) * self.quota[source] + self.rank[slot]
            for s in range(len(self.sources)):
                where = source == s
                if where.any():
                    out[low:high][where] = self.offsets[s] + passes.rows(s, k[where])
        return out

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `indices` (ids as `epoch_order` gives), in that order."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        source = np.searchsorted(self.offsets, indices, side="right") - 1
        parts: dict[int, dict[str, np.ndarray]] = {}
        for s in np.unique(source):
            where = source == s
            parts[int(s)] = self.sources[s].take(indices[where] - self.offsets[s])
        template = next(iter(parts.values()))
        out = {
            k: np.empty((len(indices), *np.shape(v)[1:]), np.asarray(v).dtype)
            for k, v in template.items()
        }
        for s, rows in parts.items():
            where = source == s
            for k, v in rows.items():
                out[k][where] = v
        return out

    def rows_per_source(self, rows: int) -> dict[str, int]:
        """How many of the first `rows` rows (counted over every epoch, as
        `epoch * num_rows + index * batch_size`) came from each source."""
        full, rest = divmod(int(rows), PERIOD)
        return {
            name: int(full * self.quota[s] + self.prefix[s, rest])
            for s, name in enumerate(self.names)
        }

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{n}: {w:.3g} of {int(r):,} rows"
            for n, w, r in zip(self.names, self.weights, self.sizes, strict=True)
        )
        return f"Mixture({parts})"


def _check_weights(sources: Sequence[Any], weights: Sequence[float]) -> None:
    """One positive, finite weight per source (and at least one source)."""
    if not sources:
        raise ConfigError("a mixture needs at least one source.")
    if len(weights) != len(sources):
        raise ConfigError(
            f"a mixture needs one weight per source; got {len(weights)} weights "
            f"for {len(sources)} sources."
        )
    for i, w in enumerate(weights):
        if not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise ConfigError(
                f"the weight of source {i} is {w!r}; weights must be positive "
                "numbers (they are normalised to sum to 1)."
            )


def _warn_tiny(names: Sequence[str], weights: Sequence[float]) -> None:
    """Warn about each weight the schedule raises to its resolution, 1 / PERIOD."""
    for name, weight in zip(names, weights, strict=True):
        if weight < 1 / PERIOD:
            warnings.warn(
                f"the mixture's source {name!r} has weight {weight:.3g} (of the "
                f"weights' sum), below 1/{PERIOD}, the finest share the mixture's "
                f"schedule gives: it is raised to 1/{PERIOD} = {1 / PERIOD:.3g} "
                "(the other sources give up that much). Give it a larger weight, or "
                "leave it out.",
                DataWarning,
                stacklevel=3,
            )


def _names(names: Sequence[str] | None, count: int) -> list[str]:
    """The sources' names: `names`, distinct and one per source, or `source<i>`."""
    out = list(names) if names is not None else [f"source{i}" for i in range(count)]
    if len(out) != count or len(set(out)) != count:
        raise ConfigError(f"a mixture needs one distinct name per source; got {names}.")
    return out


class _Passes:
    """Each source's rows for its draws (the k-th row it gives, over all epochs):
    each pass over its `n` rows in an order from `(seed, source, pass)`, the
    last pass's order kept (a source's draws come in increasing order)."""

    def __init__(self, sizes: np.ndarray, *, seed: int, shuffle: bool):
        self.sizes, self.seed, self.shuffle = sizes, seed, shuffle
        self._orders: dict[int, tuple[int, np.ndarray] | None] = {}

    def rows(self, s: int, ks: np.ndarray) -> np.ndarray:
        n = int(self.sizes[s])
        passes, index = np.divmod(ks, n)
        if not self.shuffle:
            return index
        rows = np.empty_like(ks)
        for e in np.unique(passes):
            here = passes == e
            rows[here] = self._order(s, int(e), n)[index[here]]
        return rows

    def _order(self, s: int, e: int, n: int) -> np.ndarray:
        """`default_rng([seed, s, e]).permutation(n)`, as int32 when it fits (the
        same draws: `permutation` shuffles an `arange`)."""
        kept = self._orders.get(s)
        if kept is not None and kept[0] == e:
            return kept[1]
        kept = self._orders[s] = None  # the last pass's: not needed again
        order = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
        np.random.default_rng([self.seed, s, e]).shuffle(order)
        self._orders[s] = (e, order)
        return order


def _quotas(weights: Sequence[float], period: int) -> np.ndarray:
    """Slots per period for each weight: largest remainders, summing to `period`;
    every source gets at least one slot."""
    exact = np.array(weights) * period
    quota = np.maximum(np.floor(exact).astype(np.int64), 1)
    while quota.sum() > period:  # only when tiny weights were raised to 1
        quota[int(np.argmax(quota))] -= 1
    remainder = exact - np.floor(exact)
    for s in np.argsort(-remainder, kind="stable")[: period - int(quota.sum())]:
        quota[s] += 1
    return quota


def _schedule(quota: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The source of each slot of a period (largest deficit first, ties to the
    lower index) and the slot's rank among its source's slots."""
    period = int(quota.sum())
    taken = np.zeros(len(quota), np.int64)
    schedule = np.empty(period, np.int64)
    rank = np.empty(period, np.int64)
    for j in range(period):
        deficit = (j + 1) * quota / period - taken
        s = int(np.argmax(deficit))
        schedule[j], rank[j] = s, taken[s]
        taken[s] += 1
    return schedule, rank
