"""`EarlyStopping`: stop the run once a metric has stopped improving. Its best value
and its count are its state (`state_dict`), which every checkpoint keeps, so a
resumed run stops where the uninterrupted one would, and a run it stopped stays
stopped."""

import math
from typing import Any

from .._errors import ConfigError, StopTraining
from .._hooks import StepInfo
from .._names import did_you_mean


class EarlyStopping:
    """Raise `StopTraining` when `metric` has not improved for `patience` reports.

        stopper = eqtrain.hooks.EarlyStopping("eval/loss", patience=3)
        eqtrain.fit(..., hooks=[stopper], evaluation=eqtrain.Evaluation(..., every=500))

    It reads metrics only. Steps without `metric` (for an `eval/...` metric, the
    steps between evaluations) are not counted; on the steps that have it, an
    evaluation stops the run at its very step (the loop waits for an evaluation's
    step anyway). A non-finite value never counts as an improvement.

    Its state (`state_dict()`: the best value, its step, the reports since it,
    the step it stopped at) goes into every checkpoint under `state_key`; give it
    back with `fit(hook_states=resume_run(...).hook_states)`. A run it stopped,
    resumed, stops again before its first step and says so (`stopped`); to train
    on, pass a new hook without that state.

    Args:
        metric: the metric to watch, e.g. `"eval/loss"`.
        patience: how many reports of `metric` without an improvement end the run.
        mode: `"min"` (lower is better) or `"max"`.
        min_delta: an improvement must beat the best by more than this.
        state_key: the name its state is saved under (default
            `"EarlyStopping[<metric>]"`).
    """

    uses_state = False

    def __init__(
        self,
        metric: str,
        *,
        patience: int,
        mode: str = "min",
        min_delta: float = 0.0,
        state_key: str | None = None,
    ):
        if not isinstance(patience, int) or patience < 1:
            raise ConfigError(f"`patience` must be an int >= 1; got {patience!r}.")
        if mode not in ("min", "max"):
            raise ConfigError(f"`mode` must be 'min' or 'max'; got {mode!r}.")
        if not min_delta >= 0:
            raise ConfigError(f"`min_delta` must be >= 0; got {min_delta!r}.")
        self.metric, self.patience = metric, patience
        self.mode, self.min_delta = mode, float(min_delta)
        self.state_key = state_key or f"EarlyStopping[{metric}]"
        self.best: float | None = None
        self.best_step: int | None = None
        self.since_best = 0  # reports of `metric` since the best one
        self.stopped_at: int | None = None

    def __call__(self, info: StepInfo) -> None:
        if info.stop_reason is not None:  # the end: nothing new to judge
            return
        value = self._value(info.metrics)
        if value is None:
            return
        if self._improves(value):
            self.best, self.best_step, self.since_best = value, info.step, 0
        else:
            self.since_best += 1
        if self.since_best >= self.patience:
            self.stopped_at = info.step
            raise StopTraining(self._why())

    @property
    def stopped(self) -> str | None:
        """Why and where it stopped the run; None while the run may go on."""
        if self.stopped_at is None:
            return None
        return f"{self._why()}; stopped at step {self.stopped_at}"

    def state_dict(self) -> dict[str, Any]:
        return {
            "best": self.best,
            "best_step": self.best_step,
            "since_best": self.since_best,
            "stopped_at": self.stopped_at,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state.get("best")
        self.best_step = state.get("best_step")
        self.since_best = int(state.get("since_best", 0))
        self.stopped_at = state.get("stopped_at")

    # -- internals -------------------------------------------------------------
    def _value(self, metrics: dict[str, Any]) -> float | None:
        """`metric` of this step, or None when the step does not report it;
        `ConfigError` when the step reports its family but not it (a typo)."""
        if self.metric in metrics:
            value = metrics[self.metric]
            return float(value) if isinstance(value, (int, float)) else math.nan
        prefix = self.metric.rpartition("/")[0]
        family = [k for k in metrics if k.rpartition("/")[0] == prefix]
        if family:
            raise ConfigError(
                f"EarlyStopping watches {self.metric!r}, which is not among the "
                f"metrics the run reports ({', '.join(sorted(family))}), so it "
                "would never stop the run." + did_you_mean(self.metric, family)
            )
        return None

    def _improves(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def _why(self) -> str:
        reports = f"{self.since_best} report{'s' if self.since_best != 1 else ''}"
        if self.best is None:
            return f"early stopping: {self.metric} had no finite value in {reports}"
        return (
            f"early stopping: {self.metric} did not improve on {self.best:.6g} "
            f"(step {self.best_step}) in {reports}"
        )
