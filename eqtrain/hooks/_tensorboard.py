"""`TensorBoardWriter`: a metrics-only hook that writes `StepInfo` scalars to
TensorBoard event files, tagged by `_scalars` (as `WandbLogger` is).
"""

import os
import time
from pathlib import Path
from typing import Any

from .._hooks import StepInfo
from ._scalars import Dedup, require, scalars


def summary_writer(
    module: Any, log_dir: str | os.PathLike[str], start: int | None, **kwargs: Any
) -> Any:
    """A tensorboardX `SummaryWriter` in its own file, dropping the events after
    step `start` (a resumed run redoes them); `kwargs`: its other options (a
    `filename_suffix` is appended to the file's unique name)."""
    # tensorboardX names files by the second and the host only and opens them
    # with "wb": two writers started in the same second would share (and
    # truncate) one file. A nanosecond suffix keeps them apart and in order.
    suffix = f".{time.time_ns()}.{os.getpid()}" + kwargs.pop("filename_suffix", "")
    purge_step = None if start is None else start + 1
    return module.SummaryWriter(
        str(log_dir), filename_suffix=suffix, purge_step=purge_step, **kwargs
    )


class TensorBoardWriter:
    """Write each step's scalars to TensorBoard event files in `log_dir`.

    Tags: the step's metrics as `train/<name>` (`train/loss`, `train/grad_norm`,
    `train/learning_rate`, ...); names that already hold a `/` as they are
    (`eval/loss`); and `perf/step_time`, `perf/data_time`,
    `perf/tokens_per_second`, `perf/tokens_seen`, `perf/mfu` when known. The global
    step is `info.step` (1-based). Non-numeric metrics are skipped; NaN and
    infinities are written as they are. Given also to `at_end`, the final call
    writes only what the last step did not (an end-of-run evaluation).

    The event file is created on the first call. Each writer starts a new file;
    with `start=k` (a run resumed from step k, 0 for a fresh start) its first
    event tells TensorBoard to hide the earlier files' events after step k, so a
    resumed run's redone steps replace the old ones (as in `metrics.jsonl`).
    Steps whose update was not applied (`halted`) are not written.

    Args:
        log_dir: the run's TensorBoard directory (created if missing).
        flush_secs: how often, in seconds, pending events are flushed to disk
            (`close()` flushes the rest).
        start: the step the run starts from; None: add to the earlier events.

    Raises:
        ConfigError: tensorboardX is not installed.
    """

    uses_state = False

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        flush_secs: float | int = 30,
        start: int | None = None,
    ):
        self._module = require("tensorboardX", "TensorBoardWriter", "tensorboard")
        self.log_dir = Path(log_dir)
        self.flush_secs = flush_secs
        self.start = start
        self._writer: Any = None
        self._dedup = Dedup()

    def _open(self) -> Any:
        return summary_writer(
            self._module, self.log_dir, self.start, flush_secs=self.flush_secs
        )

    def __call__(self, info: StepInfo) -> None:
        if info.stop_reason is None and info.metrics.get("halted"):
            return  # not trained: the state stayed at the last finite step
        if self._writer is None:
            self._writer = self._open()
        for tag, value in self._dedup.new(info.step, scalars(info)).items():
            self._writer.add_scalar(tag, value, info.step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
