"""`run(config)`: the whole job `eqtrain fit` runs — `prepare` (data, model,
optimizer, placement on the mesh, resume, hooks, checkpoints, evaluation,
export), then `eqtrain.fit`, then what the run did, as a `RunResult`."""

import dataclasses
from collections.abc import Callable
from pathlib import Path

from .._fit import FitResult, fit
from .._hooks import StopKind, StopReason
from ..config import Config
from . import _grpo, _preflight
from ._prepare import Prepared, prepare, stderr


@dataclasses.dataclass
class RunResult:
    """What `run` did.

    Attributes:
        fit: the `FitResult` (final state, stop reason, history).
        run_dir: the run directory.
        resumed_from: the checkpoint step the run continued from, or None.
        export_dir: the final Hugging Face export, or None.
        config: the resolved config.
    """

    fit: FitResult
    run_dir: Path
    resumed_from: int | None
    export_dir: Path | None
    config: Config


def run(
    config: Config,
    *,
    resume: str | None = None,
    overwrite: bool = False,
    echo: Callable[[str], None] | None = None,
    export: bool = True,
) -> RunResult:
    """Train as `config` says: the Python form of `eqtrain fit`.

    Args:
        config: a validated `Config` (`eqtrain.config.load(...)`).
        resume: overrides `checkpoint.resume` (`"auto"`, `"never"` or a path).
        overwrite: with resume `"never"`, delete the run's old checkpoints.
        echo: where progress notes go (default: standard error).
        export: False: write no Hugging Face export (`export.hf`), also not in a
            multi-process run; a launcher (`eqtrain.ray`) writes it from the last
            checkpoint once all processes have ended.

    Returns:
        A `RunResult`.

    Raises:
        ConfigError: a bad config, missing files, an unwritable run directory,
            or a tokenizer that does not fit the model — all before compiling.
    """
    say = echo or stderr
    prepared = prepare(
        config, resume=resume, overwrite=overwrite, echo=say, export=export
    )
    config = prepared.job.config
    done = prepared.resumed_from
    if done is not None:
        say(f"resumed from {prepared.source}")
    if done is not None and done >= config.loop.steps:
        return _nothing_to_do(prepared, say)
    result = _fit(prepared)
    export_dir = _export_dir(config) if export else None
    return RunResult(result, Path(config.run_dir), done, export_dir, config)


def _fit(prepared: Prepared) -> FitResult:
    """`eqtrain.fit` on the prepared run; a device out of memory is said with
    what lowers memory, a reward function's failure as the config error it is."""
    try:
        result = fit(
            prepared.state, prepared.step, prepared.loader, **prepared.fit_kwargs
        )
    except Exception as e:
        if _preflight.is_out_of_memory(e):  # device OOM: say what lowers memory
            raise _preflight.out_of_memory_error(e, prepared) from e
        raise
    finally:
        prepared.close()
    failed = _grpo.reward_failure(prepared.job)
    if failed is not None:  # the step stopped the run, its state intact
        raise failed
    return result


def _export_dir(config: Config) -> Path | None:
    """The run's final Hugging Face export, if `export.hf` names one that exists."""
    if config.export.hf is None:
        return None
    target = Path(config.run_dir) / config.export.hf
    return target if target.exists() else None


def _nothing_to_do(prepared: Prepared, say: Callable[[str], None]) -> RunResult:
    """A finished run run again: no training, no hooks, no new files."""
    config = prepared.job.config
    done = prepared.resumed_from or 0
    message = (
        f"already at step {done} of {config.loop.steps}; nothing to do (raise "
        "loop.steps to train further)"
    )
    say(message)
    try:
        prepared.fit_kwargs["checkpointer"].close()
    finally:
        prepared.close()
    reason = StopReason(StopKind.MAX_STEPS, done, message)
    result = FitResult(state=prepared.state, stop_reason=reason, history=[])
    return RunResult(result, Path(config.run_dir), done, _export_dir(config), config)
