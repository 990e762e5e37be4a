"""The memory a run's training step needs on each device, as XLA reports it for
the compiled step (`compiled.memory_analysis()`): compiled from abstract inputs,
so nothing is allocated or run. Used by `eqtrain fit --dry-run` and, with
`--memory-budget`, to find the longest `data.seq_len` that fits."""

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .. import sharding
from .._errors import ConfigError
from ..config import Config
from . import _build, _place, _rows, _steps
from ._reference import OUT_KEYS


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Per-device bytes of one compiled training step (XLA's figures).

    Attributes:
        arguments: the state and the batch going in.
        outputs: the new state and the metrics coming out.
        aliased: outputs written over donated arguments (the state).
        temp: everything else the step holds at once: gradients, activations
            kept for the backward pass, workspace.
        host_temp: temporaries in host memory (offloaded activations, on
            backends that honour the move).
    """

    arguments: int
    outputs: int
    aliased: int
    temp: int
    host_temp: int = 0

    @property
    def peak(self) -> int:
        """Device bytes the step needs at once: arguments, the outputs that do
        not reuse a donated argument, and the temporaries."""
        return self.arguments + self.outputs - self.aliased + self.temp

    @classmethod
    def of(cls, compiled: Any) -> "StepMemory":
        stats = compiled.memory_analysis()
        if stats is None:  # a backend without the analysis
            raise ConfigError(
                "this backend gives no memory analysis of compiled programs, so "
                "the step's memory cannot be measured here."
            )
        return cls(
            arguments=int(stats.argument_size_in_bytes),
            outputs=int(stats.output_size_in_bytes),
            aliased=int(stats.alias_size_in_bytes),
            temp=int(stats.temp_size_in_bytes),
            host_temp=int(getattr(stats, "host_temp_size_in_bytes", 0) or 0),
        )


def abstract_batch(
    job: _build.Job, rows: Any, rows_seq_len: int | None = None
) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes and dtypes of one global batch of `rows`' columns (with the
    precomputed reference's columns when the run adds them). `rows_seq_len`:
    the `data.seq_len` the rows were made with, when it is not `job`'s; every
    dimension that follows it is resized to `job`'s."""
    config = job.config
    size, new = config.data.batch_size, config.data.seq_len
    old = new if rows_seq_len is None else rows_seq_len

    def resized(d: int) -> int:
        return {old: new, old + 1: new + 1}.get(d, d)

    out = {
        k: jax.ShapeDtypeStruct((size, *map(resized, v.shape[1:])), v.dtype)
        for k, v in _rows.first_rows(rows, 1).items()
    }
    if job.reference == "precomputed":
        for k in OUT_KEYS:
            out[k] = jax.ShapeDtypeStruct((size,), np.float32)
    return out


def step_memory(
    job: _build.Job, placement: _place.Placement, batch: dict[str, Any]
) -> StepMemory:
    """`StepMemory` of `job`'s training step on `placement` for `batch` (abstract
    shapes): traced and compiled, not run."""
    step = _steps.train_step(job, placement)
    return StepMemory.of(step.lower(job.abstract, batch).compile())


@dataclasses.dataclass(frozen=True)
class Fit:
    """The outcome of `longest_seq_len`.

    Attributes:
        seq_len: the longest length found that fits (None: not even the
            shortest tried).
        peak: its per-device peak bytes.
        tried: `(seq_len, peak bytes)` of every length compiled, in order.
        limit: why the search stopped going up, if not the budget (a model
            with learned positions cannot go past them).
    """

    seq_len: int | None
    peak: int | None
    tried: list[tuple[int, int]]
    limit: str | None = None


def _granularity(config: Config) -> int:
    """Lengths the search tries are multiples of this: 64, and of
    `model.mlp_chunks` (the tiled MLP's pieces stay equal) and of the sequence
    axis (twice it for the zigzag layout) so that the length splits."""
    chunks = config.model.mlp_chunks
    ways = max(1, config.mesh.sequence)
    if config.model.sequence_layout == "zigzag":
        ways *= 2
    return math.lcm(64, chunks if isinstance(chunks, int) else 1, ways)


def _position_limit(job: _build.Job) -> int | None:
    """The longest sequence a model with learned positions takes when they are
    fixed (`model.init_from`, or `model.max_seq_len` set), else None."""
    m = job.config.model
    positions = getattr(job.model_config, "n_positions", None)
    if positions is not None and (m.init_from is not None or m.max_seq_len):
        return int(positions)
    return None


def longest_seq_len(
    config: Config,
    budget: int,
    rows: Any,
    *,
    say: Callable[[str], None] = lambda _: None,
    max_compiles: int = 10,
) -> Fit:
    """The longest `data.seq_len` whose training step fits `budget` bytes per
    device, everything else as `config` says: lengths are compiled (not run),
    doubling from `data.seq_len` (or halving, if it does not fit), then
    bisected to a multiple of `_granularity`; at most `max_compiles` compiles.
    `rows`: the run's rows at `data.seq_len` (their columns' layout)."""
    search = _Search(config, budget, rows, say, max_compiles)
    low, high, limit = search.bracket()
    low = search.bisect(low, high)
    order = list(search.tried.items())
    return Fit(low, None if low is None else search.tried[low], order, limit)


class _Search:
    """`longest_seq_len`'s search: each length's peak, compiled once."""

    def __init__(
        self,
        config: Config,
        budget: int,
        rows: Any,
        say: Callable[[str], None],
        max_compiles: int,
    ):
        self.config, self.budget, self.rows, self.say = config, budget, rows, say
        self.max_compiles = max_compiles
        self.step = _granularity(config)
        self.cap = _position_limit(_build.build(config))
        self.tried: dict[int, int] = {}

    def fits(self, length: int) -> bool:
        """Whether the step at `length` fits the budget (compiled once)."""
        if length not in self.tried:
            self.tried[length] = self._peak(length)
            bytes_ = sharding.format_bytes(self.tried[length])
            self.say(f"  seq_len {length:>7,}: {bytes_} per device")
        return self.tried[length] <= self.budget

    def _peak(self, length: int) -> int:
        config = self.config
        data = dataclasses.replace(config.data, seq_len=length)
        job = _build.build(dataclasses.replace(config, data=data))
        batch = abstract_batch(job, self.rows, config.data.seq_len)
        return step_memory(job, _place.placement(job), batch).peak

    def _start(self) -> int:
        step = self.step
        start = max(step, self.config.data.seq_len // step * step)
        return start if self.cap is None else min(start, self.cap)

    def bracket(self) -> tuple[int | None, int | None, str | None]:
        """`(low, high, limit)`: the largest length known to fit and the smallest
        known not to, doubling up or halving down from `data.seq_len`; `limit`
        says why the search stopped going up, if not the budget."""
        low, high, step, cap = None, None, self.step, self.cap
        length = self._start()
        while len(self.tried) < self.max_compiles:
            if self.fits(length):
                low = length
                if high is not None:
                    break
                if cap is not None and length >= cap:
                    return low, high, f"the model's {cap} learned positions"
                length = length * 2 if cap is None else min(length * 2, cap)
            else:
                high = length
                if low is not None or length <= step:
                    break
                length = max(step, length // 2 // step * step)
        return low, high, None

    def bisect(self, low: int | None, high: int | None) -> int | None:
        """The longest fitting length between `low` and `high`, to a multiple
        of the granularity (within the compile budget)."""
        step = self.step
        while low is not None and high is not None and high - low > step:
            if len(self.tried) >= self.max_compiles:
                break
            mid = (low + high) // 2 // step * step
            if mid in (low, high):
                break
            if self.fits(mid):
                low = mid
            else:
                high = mid
        return low
