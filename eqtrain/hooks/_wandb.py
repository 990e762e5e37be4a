"""`WandbLogger`: a metrics-only hook that logs `StepInfo` scalars to a Weights &
Biases run, with the tags of `TensorBoardWriter` (`_scalars.scalars`).
"""

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._hooks import StepInfo
from ._scalars import Dedup, require, scalars


def _given(**kwargs: Any) -> dict[str, Any]:
    """The keyword arguments that are not None."""
    return {k: v for k, v in kwargs.items() if v is not None}


class WandbLogger:
    """Log each step's scalars to a Weights & Biases run.

    The run starts on the first call (`wandb.init`) and ends at `close()`
    (`run.finish()`, which `fit` calls at the end). It is created with
    `reinit="create_new"` and used only through its own object (`run.log`), so it
    neither finishes nor replaces a run the caller started (`wandb.run`): several
    loggers, or several `fit` calls each with its own logger, work in one process.
    The run object is `logger.run` once started (it stays there, finished, after
    `close()`; a later call starts a new run).

    Keys are those of `TensorBoardWriter`: `train/<name>` for the step's metrics,
    names holding a `/` as they are (`eval/loss`), and `perf/step_time`,
    `perf/data_time`, `perf/tokens_per_second`, `perf/tokens_seen`, `perf/mfu` when
    known; logged with `step=info.step`. Given also to `at_end`, the final call logs
    only what the last step did not (an end-of-run evaluation).

    Args:
        project: the W&B project.
        name: the run's display name (default: chosen by W&B).
        dir: where W&B writes its local files (`<dir>/wandb/...`; created if
            missing; default: W&B's own, `./wandb` or `$WANDB_DIR`).
        mode: `"online"`, `"offline"` (sync later with `wandb sync`) or
            `"disabled"`; default: W&B's own (`$WANDB_MODE`, else online).
        config: the resolved run configuration, stored with the run.
        tags: tags for the run.
        entity: the W&B user or team (default: the account's default).
        **init_kwargs: further `wandb.init` arguments (`group`, `job_type`, `id`,
            `resume`, `settings`, ...).

    Raises:
        ConfigError: wandb is not installed.
    """

    uses_state = False

    def __init__(
        self,
        *,
        project: str,
        name: str | None = None,
        dir: str | os.PathLike[str] | None = None,
        mode: str | None = None,
        config: Mapping[str, Any] | None = None,
        tags: Sequence[str] | None = None,
        entity: str | None = None,
        **init_kwargs: Any,
    ):
        self._module = require("wandb", "WandbLogger", "wandb")
        self.dir = None if dir is None else Path(dir)
        self.init_kwargs = _given(
            project=project,
            name=name,
            mode=mode,
            config=None if config is None else dict(config),
            tags=None if tags is None else list(tags),
            entity=entity,
        )
        self.init_kwargs.update(init_kwargs)
        self.run: Any = None
        self._active = False
        self._dedup = Dedup()

    def _start(self) -> Any:
        kwargs = dict(self.init_kwargs)
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            kwargs["dir"] = str(self.dir)
        kwargs.setdefault("reinit", "create_new")
        return self._module.init(**kwargs)

    def __call__(self, info: StepInfo) -> None:
        if not self._active:
            self.run, self._active = self._start(), True
            self._dedup = Dedup()
        values = self._dedup.new(info.step, scalars(info))
        if values:
            self.run.log(values, step=info.step)

    def close(self) -> None:
        if self._active:
            self.run.finish()
            self._active = False
