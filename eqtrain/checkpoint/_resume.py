"""Resuming a run: `resume_run` reads what the run directory holds, lets
`_resume_plan.decide` choose what to restore, and does it (restore, discard,
move damaged steps aside), before anything is trained or compiled."""

import dataclasses
import functools
import os
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import jax

from .._errors import ConfigError
from . import _storage
from ._errors import CheckpointError, CheckpointWarning
from ._restore import Restored, restore
from ._resume_plan import Decision, Situation, decide
from ._tree import ShardingsArg


@dataclasses.dataclass(frozen=True)
class Resumed:
    """The state a run starts from, as decided by `resume_run`.

    Attributes:
        state: the restored (or freshly initialised) `TrainState`.
        step: the restored checkpoint's step; None when starting fresh.
        run_id: the run's identity, written in every manifest of the run: the
            restored checkpoint's when the run continues, a new one when a run
            starts (fresh, or from another run's checkpoint).
        source: the step directory restored (None when starting fresh).
        started_from: the checkpoint of another run this run started from, if any.
        moved_aside: damaged steps renamed to `<step>.damaged-<time>`.
        discarded: later steps deleted for a rollback (`overwrite=True`).
        hook_states: the states of the run's hooks that keep one, as saved with
            the restored step: pass them on, `fit(..., hook_states=...)`. Empty
            when starting fresh, and for a new run started from another run's
            checkpoint (its hooks start afresh: that run's early stop is not
            this one's).
    """

    state: Any
    step: int | None
    run_id: str
    source: Path | None = None
    started_from: str | None = None
    moved_aside: tuple[Path, ...] = ()
    discarded: tuple[int, ...] = ()
    hook_states: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def new_run_id() -> str:
    """A new run identity (uuid4 hex); process 0's in a multi-process run."""
    run_id = uuid.uuid4()
    if jax.process_count() == 1:
        return run_id.hex
    import numpy as np
    from jax.experimental import multihost_utils

    words = np.frombuffer(run_id.bytes, np.int32)
    shared = np.asarray(multihost_utils.broadcast_one_to_all(words), np.int32)
    return shared.tobytes().hex()


def _writer() -> bool:
    return jax.process_index() == 0


# -- what the run directory holds -----------------------------------------------
def _newest_manifest(directory: Path) -> dict[str, Any] | None:
    for s in reversed(_storage.steps(directory)):
        try:
            return _storage.read_json(
                directory / str(s), _storage.MANIFEST, _storage.MANIFEST_FILE
            )
        except CheckpointError:
            continue
    return None


def _same_source(started_from: Any, src_dir: Path, src_step: int | None) -> bool:
    if not isinstance(started_from, str):
        return False
    origin = Path(started_from)
    if os.path.realpath(origin.parent) != os.path.realpath(src_dir):
        return False
    return src_step is None or origin.name == str(src_step)


def _check_resume(resume: str | os.PathLike[str]) -> None:
    if str(resume) in ("", "none", "latest"):
        raise ConfigError(
            f"`resume` must be 'auto', 'never' or a checkpoint path; got {resume!r}."
        )


def _situation(directory: Path, resume: str | os.PathLike[str]) -> Situation:
    """What `decide` needs to know: the run directory's steps, and where `resume`
    points (the run itself, one of its steps, or another run's checkpoint)."""
    existing = tuple(_storage.steps(directory))
    damaged = tuple(_storage.damaged_steps(directory))
    seen = Situation(directory, "auto", existing=existing, damaged=damaged)
    if isinstance(resume, str) and resume in ("auto", "never"):
        return dataclasses.replace(seen, asked=resume)
    _check_resume(resume)
    src_dir, src_step = _storage.resolve(resume)
    if os.path.realpath(src_dir) == os.path.realpath(directory):
        asked = "auto" if src_step is None else "step"
        return dataclasses.replace(seen, asked=asked, source=resume, step=src_step)
    newest = (_newest_manifest(directory) or {}) if existing else {}
    continued = _same_source(newest.get("started_from"), src_dir, src_step)
    return dataclasses.replace(seen, asked="other", source=resume, continued=continued)


# -- doing it ----------------------------------------------------------------------
def _discard(directory: Path, doomed: tuple[int, ...], why: str) -> None:
    if not doomed:
        return
    if _writer():
        for s in doomed:
            _storage.remove_step(directory, s)
    warnings.warn(
        f"discarded checkpoint(s) {list(doomed)} of {directory} ({why}).",
        CheckpointWarning,
        stacklevel=4,  # the caller of `resume_run`
    )


def _fresh(directory: Path, decision: Decision, init: Callable[[], Any]) -> Resumed:
    """`init()`, after deleting the steps `resume='never', overwrite=True` named
    and what interrupted saves and deletions left behind."""
    if _writer():
        for step in decision.discard:
            _storage.remove_step(directory, step)
        _storage.clean_leftovers(directory)
    return Resumed(init(), None, new_run_id())


def _continued(restored: Restored, **more: Any) -> Resumed:
    """The run that wrote `restored` goes on: its identity and its origin."""
    manifest = restored.manifest
    run_id = manifest.get("run_id") or new_run_id()
    started_from = manifest.get("started_from")
    return Resumed(
        restored.state,
        restored.step,
        run_id,
        restored.path,
        started_from,
        hook_states=restored.hook_states,
        **more,
    )


def _move_aside(
    directory: Path, seen: list[tuple[Path, str]], step: int
) -> tuple[Path, ...]:
    """Rename the damaged steps skipped on the way to `step`, with one warning,
    so that they never block the run again."""
    moved = []
    for step_dir, why in seen:
        target = step_dir
        if _writer() and step_dir.exists():
            target = _storage.move_aside(directory, int(step_dir.name))
        moved.append((target, why))
    if moved:
        _warn_moved(moved, step)
    return tuple(t for t, _ in moved)


def _warn_moved(moved: list[tuple[Path, str]], step: int) -> None:
    named = "; ".join(f"{why}, moved aside to {t.name}" for t, why in moved)
    warnings.warn(
        f"damaged checkpoint(s): {named}; resuming from step "
        f"{step} (the steps after it are trained again).",
        CheckpointWarning,
        stacklevel=5,  # the caller of `resume_run`
    )


Read = Callable[..., Restored]
Started = tuple[Resumed, Restored]


def _reader(
    init: Callable[[], Any], *, like: Any, shardings: ShardingsArg, base: Any
) -> Read:
    """`restore` with the arguments of `resume_run` that every start shares."""
    like = init if like is None else like
    return functools.partial(
        restore, like=like, shardings=shardings, init=init, base=base
    )


def _newest(situation: Situation, decision: Decision, read: Read) -> Started:
    """The newest readable step; damaged newer ones are moved aside."""
    directory, seen = situation.directory, list[tuple[Path, str]]()
    restored = read(directory, on_damaged=lambda d, why: seen.append((d, why)))
    moved = _move_aside(directory, seen, restored.step)
    return _continued(restored, moved_aside=moved), restored


def _rolled_back(situation: Situation, decision: Decision, read: Read) -> Started:
    """The named step of this run; later steps discarded (`overwrite=True`)."""
    restored = read(situation.directory, step=decision.step)
    why = f"overwrite: rolled back to step {decision.step}"
    _discard(situation.directory, decision.discard, why)
    return _continued(restored, discarded=decision.discard), restored


def _started_from(situation: Situation, decision: Decision, read: Read) -> Started:
    """Another run's checkpoint starts a new run (its steps here discarded)."""
    restored = read(situation.source)
    origin = str(restored.path)
    why = "overwrite: a new run starts from " + origin
    _discard(situation.directory, decision.discard, why)
    resumed = Resumed(
        restored.state, restored.step, new_run_id(), restored.path, origin
    )
    return resumed, restored


_STARTS = {"newest": _newest, "step": _rolled_back, "other": _started_from}


def resume_run(
    run_dir: str | os.PathLike[str],
    init: Callable[[], Any],
    *,
    resume: str | os.PathLike[str] = "auto",
    overwrite: bool = False,
    shardings: ShardingsArg = None,
    data: Any = None,
    like: Any = None,
    base: Any = None,
) -> Resumed:
    """The state a run starts from, by an explicit resume policy, with what a
    writer of `run_dir` needs to know: the run's identity (pass `run_id` to
    `Checkpointer`), where it came from, and which damaged steps were moved
    aside. Every refusal happens here, before anything is trained or compiled.

        resumed = resume_run(run_dir, init, resume="auto", data=loader)
        ckpt = Checkpointer(run_dir, every_steps=500, run_id=resumed.run_id)
        eqtrain.fit(resumed.state, step, loader, num_steps=10_000,
                    checkpointer=ckpt, hooks=hooks, hook_states=resumed.hook_states)

    Args:
        run_dir: the run directory (checkpoints under `run_dir/checkpoints`).
        init: builds a fresh state; only evaluated abstractly when restoring.
        resume: one of
            - `"auto"`: the newest readable step of `run_dir`, or `init()` if it
              has none. Damaged newer steps (unreadable, incomplete, checksums
              that differ) are renamed to `<step>.damaged-<time>` with one
              `CheckpointWarning` naming them, so they never block the run
              again. Only damaged ones: `CheckpointError` (never a silent
              restart from step 0).
            - `"never"`: `init()`; refuses if `run_dir` holds checkpoints, unless
              `overwrite=True` (they are deleted).
            - a step of `run_dir` itself (a rollback): refused before training if
              later steps exist, unless `overwrite=True` (they are discarded,
              with a warning).
            - another run's checkpoint (a run, checkpoints or step directory):
              starts a new run from it (the new checkpoints still go to
              `run_dir`); refused if `run_dir` already holds checkpoints of a
              different run, unless `overwrite=True`. When `run_dir`'s
              checkpoints are those of a run started from that very checkpoint,
              that run is continued (re-running the same command resumes).
        overwrite: delete existing checkpoints that would be mixed with the new
            ones (with `resume="never"`, a rollback, or another run's path).
        shardings: target shardings of restored arrays, as in `restore` (a fresh
            `init()` places its own arrays).
        data: a train `Loader`: it is moved to the checkpoint's position (`seek`).
        like: the structure to restore into (an abstract or concrete state, or a
            function building one); default: `init`, evaluated abstractly. Pass
            it when `init` is costly even abstractly (e.g. it reads weights).
        base: the reference of the frozen base `init` builds, for runs whose
            checkpoints store only trained leaves (`Checkpointer(base=...)`,
            LoRA): a checkpoint recording another base hash is refused
            (`BaseChangedError`).

    Returns:
        A `Resumed`: `state`, and `step` (None when starting fresh), `run_id`,
        `hook_states` (for `fit(hook_states=...)`), ...
    """
    directory = _storage.checkpoints_dir(run_dir)
    _storage.check_path(directory)
    situation = _situation(directory, resume)
    decision = decide(situation, overwrite=overwrite)
    if decision.start == "fresh":
        return _fresh(directory, decision, init)
    read = _reader(init, like=like, shardings=shardings, base=base)
    resumed, restored = _STARTS[decision.start](situation, decision, read)
    if data is not None and restored.data_position is not None:
        data.seek(restored.data_position)
    jax.block_until_ready(resumed.state)
    return resumed


def restore_or_init(*args: Any, **kwargs: Any) -> NoReturn:
    """Removed: `resume_run` takes the same arguments."""
    raise ConfigError(
        "`restore_or_init` was removed after eqtrain 0.1.0: call `resume_run` with "
        "the same arguments and read `.state` and `.step` from its result (it also "
        "gives the run's identity, for `Checkpointer(run_id=...)`)."
    )
