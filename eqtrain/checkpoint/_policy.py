"""When to save and which checkpoints to keep: every N steps / T minutes; the last
N, every K-th permanently, and the best k by a named metric."""

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

from .._errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Policy:
    """Save and retention rules (all optional; see `Checkpointer`)."""

    every_steps: int | None = None
    every_minutes: float | int | None = None
    keep_last: int | None = 3
    keep_every: int | None = None
    best: str | None = None
    best_mode: str = "min"
    keep_best: int = 1

    def __post_init__(self) -> None:
        for name in ("every_steps", "keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(
                    f"`{name}` must be an int >= 1 or None; got {value!r}."
                )
        if self.every_minutes is not None and not self.every_minutes > 0:
            raise ConfigError(
                f"`every_minutes` must be > 0 or None; got {self.every_minutes!r}."
            )
        if self.best_mode not in ("min", "max"):
            raise ConfigError(
                f"`best_mode` must be 'min' or 'max'; got {self.best_mode!r}."
            )
        if not isinstance(self.keep_best, int) or self.keep_best < 1:
            raise ConfigError(
                f"`keep_best` must be an int >= 1; got {self.keep_best!r}."
            )

    def due(self, step: int, last_save_time: float) -> bool:
        if self.every_steps is not None and step % self.every_steps == 0:
            return True
        if self.every_minutes is not None:
            return time.monotonic() - last_save_time >= 60.0 * self.every_minutes
        return False

    def score(self, metrics: Mapping[str, Any]) -> float | None:
        """The best-k metric of a step, or None if absent or not finite."""
        if self.best is None:
            return None
        value = metrics.get(self.best)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return float(value)

    def missing_best(self, metrics: Mapping[str, Any]) -> str | None:
        """Why `best` can never be scored, judged from one step's metrics: the
        step reports metrics of the same family (`eval/...` for `eval/loss`, or
        the step's own for an unprefixed name) but not `best` (a typo)."""
        if self.best is None or self.best in metrics:
            return None
        prefix = self.best.rpartition("/")[0]
        family = sorted(
            k for k in metrics if k.rpartition("/")[0] == prefix and k != "step"
        )
        if not family:
            return None  # not a step that reports this family (e.g. no evaluation)
        return (
            f"checkpoint best metric {self.best!r} is not among the metrics the run "
            f"reports ({', '.join(family)}), so no best checkpoint would ever be "
            "kept. Set `best` to one of them."
        )

    def keep(self, steps: list[int], scores: Mapping[int, float | None]) -> set[int]:
        """The steps to keep among `steps` (committed ones); the newest always."""
        if not steps:
            return set()
        ordered = sorted(steps)
        kept = {ordered[-1]}
        if self.keep_last is None:
            kept.update(ordered)
        else:
            kept.update(ordered[-self.keep_last :])
        if self.keep_every is not None:
            kept.update(s for s in ordered if s % self.keep_every == 0)
        if self.best is not None:
            scored = [(scores[s], s) for s in ordered if scores.get(s) is not None]
            scored.sort(reverse=self.best_mode == "max")
            kept.update(s for _, s in scored[: self.keep_best])
        return kept
