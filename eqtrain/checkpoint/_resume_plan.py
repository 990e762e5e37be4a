"""What `resume_run` will do, decided from what the run directory holds (no I/O):
start fresh, continue from the newest step, roll back to a step, or start a new
run from another run's checkpoint; and which steps are discarded first."""

import dataclasses
import os
from pathlib import Path
from typing import Literal

from ._errors import CheckpointError


Asked = Literal["auto", "never", "step", "other"]
Start = Literal["fresh", "newest", "step", "other"]


@dataclasses.dataclass(frozen=True)
class Situation:
    """What the resume decision depends on, as read from disk.

    Attributes:
        directory: the run's checkpoints directory.
        asked: what `resume` names: `"auto"`, `"never"`, a `"step"` of
            `directory` itself, or a checkpoint of an `"other"` run.
        source: the `resume` path as the caller wrote it (`"step"`, `"other"`).
        step: the step of `directory` that `resume` names (`"step"`).
        existing: the committed steps of `directory`, ascending.
        damaged: the damaged steps of `directory` moved aside earlier.
        continued: `directory`'s newest checkpoint belongs to a run started from
            `source` (re-running the same command continues that run).
    """

    directory: Path
    asked: Asked
    source: str | os.PathLike[str] | None = None
    step: int | None = None
    existing: tuple[int, ...] = ()
    damaged: tuple[str, ...] = ()
    continued: bool = False


@dataclasses.dataclass(frozen=True)
class Decision:
    """What `resume_run` does: restore nothing (`"fresh"`), the `"newest"`
    readable step of the run directory, its `step` (a rollback), or the `"other"`
    run's checkpoint; `discard`: the run directory's steps deleted for it."""

    start: Start
    step: int | None = None
    discard: tuple[int, ...] = ()


def decide(situation: Situation, *, overwrite: bool) -> Decision:
    """What to restore in `situation`, or a `CheckpointError` naming what would
    mix two runs and how to go on (`overwrite=True` allows discarding steps)."""
    if situation.asked == "never":
        return _never(situation, overwrite)
    if situation.asked == "step":
        return _rollback(situation, overwrite)
    if situation.asked == "other" and not situation.continued:
        return _other(situation, overwrite)
    return _newest(situation)


def _held(situation: Situation) -> str:
    steps = list(situation.existing[-5:])
    return f"{situation.directory} already holds checkpoints (steps {steps})"


def _never(situation: Situation, overwrite: bool) -> Decision:
    if situation.existing and not overwrite:
        raise CheckpointError(
            f"{_held(situation)} and --resume never (resume='never'): refusing "
            "to mix two runs. Continue it with --resume auto (resume='auto'), "
            "delete them with --overwrite (overwrite=True), or use a new run "
            "directory."
        )
    return Decision("fresh", discard=situation.existing)


def _rollback(situation: Situation, overwrite: bool) -> Decision:
    step = situation.step
    assert step is not None
    later = tuple(s for s in situation.existing if s > step)
    if later and not overwrite:
        raise CheckpointError(
            f"resuming from {situation.directory / str(step)} rolls the run back: "
            f"it already holds the later checkpoint(s) {list(later[-5:])}, which "
            "would be mixed with the retrained steps. Pass --overwrite "
            "(overwrite=True) to discard them, or --resume auto to continue from "
            "the newest."
        )
    return Decision("step", step, discard=later)


def _other(situation: Situation, overwrite: bool) -> Decision:
    if situation.existing and not overwrite:
        raise CheckpointError(
            f"{_held(situation)} of another run; starting it over from "
            f"{situation.source} would mix two runs. Continue the run there with "
            "--resume auto (resume='auto'), pass --overwrite (overwrite=True) to "
            "discard its checkpoints, or use a new run directory."
        )
    return Decision("other", discard=situation.existing)


def _newest(situation: Situation) -> Decision:
    if situation.existing:
        return Decision("newest")
    if situation.damaged:
        raise CheckpointError(
            f"{situation.directory} holds no readable checkpoint, only damaged "
            f"ones moved aside earlier ({', '.join(situation.damaged[:3])}). "
            "Refusing to start over from step 0: move them away, or start anew "
            "with --resume never --overwrite (resume='never')."
        )
    return Decision("fresh")
