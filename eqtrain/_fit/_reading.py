"""Reading metrics off the device: `Reading` (how often `fit` reads, how much it
keeps), one transfer for many steps' metrics, and the tokens, step times and MFU
that `StepInfo` reports for the steps read."""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .._errors import ConfigError
from .._hooks import Scheduled, StepInfo, StopReason, now
from .._state import TrainState
from .._types import Batch


@dataclasses.dataclass(frozen=True)
class Reading:
    """How `fit` reads metrics from the device, and how many it keeps.

    Attributes:
        history: keep at most this many entries in `FitResult.history`
            (default: all).
        every: metrics that no state-using work needs are read from the device
            in batches, one transfer for up to `every` steps...
        seconds: ...or for the steps dispatched over `seconds`, whichever comes
            first. `every=1` reads each step's metrics as soon as the next step is
            dispatched.
    """

    history: int | None = None
    every: int = 10
    seconds: float | int = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"`read_every` must be an int >= 1; got {self.every!r}.")
        if not self.seconds >= 0:
            raise ConfigError(f"`read_seconds` must be >= 0; got {self.seconds!r}.")


TOKEN_KEYS = ("tokens", "input_ids")


def count_tokens(batch: Batch) -> int | None:
    """Tokens in a batch: the size of its `tokens`/`input_ids` entry, or the sum
    over its `*_tokens` entries (a preference batch's `chosen_tokens` and
    `rejected_tokens`); shapes only, no device access. `None` when there is none."""
    if not isinstance(batch, Mapping):
        return None
    for name in TOKEN_KEYS:
        if name in batch:
            return _size(batch[name])
    sizes = [
        _size(v)
        for k, v in batch.items()
        if isinstance(k, str) and k.endswith("_tokens")
    ]
    return sum(sizes) if sizes else None


def _size(x: Any) -> int:
    return int(math.prod(np.shape(x)))


def to_host(metrics: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Fetch several steps' metrics with one transfer, as Python numbers."""
    host = jax.device_get([dict(m) for m in metrics])
    return [{name: _number(v) for name, v in step.items()} for step in host]


def _number(value: Any) -> Any:
    """A fetched metric as a Python number (or nested list, for an array)."""
    value = np.asarray(value)
    return value.item() if value.ndim == 0 else value.tolist()


@dataclasses.dataclass
class Pending:
    """A dispatched step whose metrics have not been read yet."""

    step: int
    metrics: Any
    due: list[Scheduled]
    data_time: float
    tokens: int | None
    dispatched: float


class Throughput:
    """Step times, tokens and MFU, and the `StepInfo` built from them."""

    def __init__(
        self,
        flops_per_token: float | int | None,
        peak_flops: float | int | None,
        tokens_seen: int,
        num_steps: int,
    ):
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.tokens_seen, self.num_steps = tokens_seen, num_steps
        self.start = self.last_done = now()

    def restart(self) -> None:
        self.last_done = now()

    def tick(self, steps: int) -> float:
        """The mean time of the `steps` steps completed since the last tick."""
        done = now()
        step_time = (done - self.last_done) / steps
        self.last_done = done
        return step_time

    def info(
        self,
        pending: Pending,
        metrics: dict[str, Any],
        step_time: float,
        state: TrainState | None,
    ) -> StepInfo:
        """The `StepInfo` of a step just read (counting its tokens as seen)."""
        tokens = pending.tokens
        rate = None if tokens is None or step_time <= 0 else tokens / step_time
        if tokens is not None:
            self.tokens_seen += tokens
        return StepInfo(
            step=pending.step,
            metrics=metrics,
            num_steps=self.num_steps,
            step_time=step_time,
            data_time=pending.data_time,
            tokens=tokens,
            tokens_per_second=rate,
            tokens_seen=self.tokens_seen if tokens is not None else None,
            mfu=self.mfu(rate),
            elapsed=self.last_done - self.start,
            _state=state,
        )

    def mfu(self, rate: float | None) -> float | None:
        """Model FLOPs utilization at `rate` tokens/s (None when unknown)."""
        if None in (rate, self.flops_per_token, self.peak_flops):
            return None
        return rate * self.flops_per_token / self.peak_flops

    def final_info(
        self, state: TrainState, step: int, metrics: dict[str, Any], reason: StopReason
    ) -> StepInfo:
        """The `StepInfo` the end hooks and the final checkpoint receive."""
        return StepInfo(
            step=step,
            metrics=metrics,
            num_steps=self.num_steps,
            tokens_seen=self.tokens_seen or None,
            elapsed=now() - self.start,
            stop_reason=reason,
            _state=state,
        )
