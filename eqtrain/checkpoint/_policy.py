"""When to save and which checkpoints to keep: every N steps / T minutes; the last
N, every K-th permanently, and the best k by a named metric."""

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

from .._errors import ConfigError


def _count(value: Any) -> bool:
    return isinstance(value, int) and value >= 1


# (setting, what it must be, the check): the errors name the setting and the value
_CHECKS = (
    ("every_steps", "an int >= 1 or None", lambda v: v is None or _count(v)),
    ("keep_last", "an int >= 1 or None", lambda v: v is None or _count(v)),
    ("keep_every", "an int >= 1 or None", lambda v: v is None or _count(v)),
    ("every_minutes", "> 0 or None", lambda v: v is None or v > 0),
    ("best_mode", "'min' or 'max'", lambda v: v in ("min", "max")),
    ("keep_best", "an int >= 1", _count),
)


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
        for name, want, ok in _CHECKS:
            value = getattr(self, name)
            if not ok(value):
                raise ConfigError(f"`{name}` must be {want}; got {value!r}.")

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
