"""What a Ray launch hands back: `LaunchResult` when the run ended, `LaunchError`
when it failed for good."""

import dataclasses
from pathlib import Path
from typing import Any

from .._errors import EqtrainError
from .._hooks import StopKind, StopReason
from ..config import Config


class LaunchError(EqtrainError, RuntimeError):
    """The launched run failed: a worker failed more often than
    `distributed.max_restarts` allows, or failed in a way a restart cannot mend."""


@dataclasses.dataclass
class LaunchResult:
    """What `eqtrain.ray.fit` did (and `eqtrain fit --launcher ray` prints).

    Attributes:
        stop_reason: why the run stopped (agreed by all workers), and at which
            step (`step`).
        metrics: the last step's metrics, as process 0 reported them.
        run_dir: the run directory.
        export_dir: the final Hugging Face export, or None.
        config: the resolved config.
        restarts: how many times the whole group was restarted.
        resumed_from: the checkpoint step the last attempt continued from.
    """

    stop_reason: StopReason
    metrics: dict[str, Any]
    run_dir: Path
    export_dir: Path | None
    config: Config
    restarts: int = 0
    resumed_from: int | None = None

    @property
    def step(self) -> int:
        """The last completed step."""
        return self.stop_reason.step


def _stop_reason(report: dict[str, Any]) -> StopReason:
    """The stop reason a worker's `eqtrain fit` reported."""
    stop = report.get("stop_reason") or {}
    return StopReason(
        StopKind(stop.get("kind", "max_steps")),
        int(stop.get("step", 0)),
        stop.get("message", ""),
    )


def _export_dir(config: Config) -> Path | None:
    """`export.hf` of the run directory, if it was written."""
    run_dir = Path(config.run_dir)
    if config.export.hf is not None and (run_dir / config.export.hf).exists():
        return run_dir / config.export.hf
    return None


def launch_result(
    config: Config, results: dict[int, dict[str, Any]], restarts: int
) -> LaunchResult:
    """The run's result from the workers' reports (process 0's, if it made one)."""
    report = results.get(0) or next(iter(results.values()), {})
    return LaunchResult(
        stop_reason=_stop_reason(report),
        metrics=dict(report.get("metrics") or {}),
        run_dir=Path(config.run_dir),
        export_dir=_export_dir(config),
        config=config,
        restarts=restarts,
        resumed_from=report.get("resumed_from"),
    )
