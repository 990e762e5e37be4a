"""Restoring: the latest (or a chosen) step into a template from
`eqx.filter_eval_shape`, with target shardings; falling back past damaged steps;
and `restore_or_init`, the explicit resume policy shared by scripts and the CLI."""

import dataclasses
import inspect
import logging
import os
import re
import sys
import traceback
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import orbax.checkpoint as ocp

from .._errors import ConfigError
from . import _integrity, _storage
from ._errors import (
    BaseChangedError,
    CheckpointError,
    CheckpointWarning,
    IncompatibleCheckpointError,
)
from ._tree import (
    ShardingsArg,
    abstract_on_disk,
    check_compatible,
    from_disk,
    path_name,
    trained_part,
    unnest,
    with_frozen,
)


@dataclasses.dataclass(frozen=True)
class Restored:
    """A restored checkpoint.

    Attributes:
        state: the restored `TrainState` (arrays placed on the target shardings).
        step: the checkpoint's step.
        data_position: the data loader's position at that step (or None).
        manifest: the run manifest (config, versions, mesh, metrics, ...).
        path: the step's directory.
    """

    state: Any
    step: int
    data_position: dict[str, int] | None
    manifest: dict[str, Any]
    path: Path


def _template(like: Any) -> Any:
    """An abstract state from an init function or a (concrete or abstract) state."""
    if callable(like) and not isinstance(like, eqx.Module):
        return eqx.filter_eval_shape(like)
    return eqx.filter_eval_shape(lambda: like)


class DamagedCheckpointError(CheckpointError):
    """A step's files are unreadable, incomplete, or do not match the checksums
    recorded when it was written."""


# An Orbax read error quotes the array's whole TensorStore spec (as the repr of a
# bound method, in this Orbax); the array's key in it is the relative `path`.
_ARRAY_PATH = re.compile(r"'path': '([^'/][^']*)/'")


def _innermost(e: BaseException) -> BaseException:
    while e.__cause__ is not None:
        e = e.__cause__
    return e


def _summary(e: BaseException) -> str:
    """One readable line: the array (when the error names one) and the innermost
    cause, without TensorStore's specs, source locations or database paths."""
    array = _ARRAY_PATH.search(str(e))
    cause = _innermost(e)
    line = (str(cause).strip().splitlines() or [""])[0]
    for cut in (" [tensorstore_spec", " [source locations", " See full", " <bound"):
        line = line.split(cut)[0]
    line = re.sub(r' in OCDBT database at [^"]*"[^"]*"', "", line).rstrip(" .:")
    if array and line:  # TensorStore's message starts with its status code
        line = f"array {array.group(1)}: {line}"
    else:
        line = f"{type(cause).__name__}: {line}" if line else type(cause).__name__
    return line[:300] + ("..." if len(line) > 300 else "")


def _orbax_code(code: Any) -> bool:
    return f"{os.sep}orbax{os.sep}" in getattr(code, "co_filename", "")


def _abandoned(unraisable: Any) -> bool:
    """Noise left by a failed Orbax restore or save, reported when Python drops
    it: the reads still in flight when Orbax gave up and closed its event loop
    (their coroutines, closed unfinished, turn the close into an error naming
    the array), and TensorStore's threads finding that loop closed."""
    value, obj = unraisable.exc_value, unraisable.object
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
        return True
    return inspect.iscoroutine(obj) and _orbax_code(obj.cr_code)


class _QuietAbandonedTasks(logging.Filter):
    """asyncio's "Task was destroyed but it is pending" and "exception was never
    retrieved" for the tasks a failed Orbax restore left behind (the failure
    itself is reported, in one paragraph)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "never retrieved" not in text and "destroyed but it is pending" not in text:
            return True
        if "orbax" in text:
            return False
        tb = record.exc_info[2] if record.exc_info else None
        return not any(_orbax_code(f.f_code) for f, _ in traceback.walk_tb(tb))


def quiet_closed_loop() -> None:
    """Drop what a failed Orbax restore or save leaves behind on standard error
    after eqtrain reported the failure: tracebacks of its abandoned reads (as
    unraisable exceptions, when Python collects them) and asyncio's log records
    about them. Anything else still reaches the previous hook and the log."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _QuietAbandonedTasks) for f in logger.filters):
        logger.addFilter(_QuietAbandonedTasks())
    previous = sys.unraisablehook
    if getattr(previous, "_eqtrain_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        if not _abandoned(unraisable):
            previous(unraisable)

    hook._eqtrain_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _describe_base(base: Any) -> str:
    where = base.get("path") or "a random initialisation"
    extra = f" with seed {base['seed']}" if base.get("seed") is not None else ""
    return f"{where}{extra}, sha256 {str(base.get('sha256'))[:12]}..."


@dataclasses.dataclass
class _Frozen:
    """How a step that stores only trained leaves gets its frozen ones back:
    `init()` rebuilds the whole state (the base included), called at most once;
    `expected` is the reference of the base `init` builds (checked first)."""

    init: Callable[[], Any] | None
    expected: Any = None
    _state: Any = None

    def check(self, recorded: Any, step_dir: Path) -> None:
        if self.init is None:
            raise CheckpointError(
                f"{step_dir} stores only the trained leaves of a run over a frozen "
                f"base ({_describe_base(recorded)}); restore it with a function "
                "that rebuilds that base: resume_run / restore_or_init with `init`, "
                "or restore(..., init=...)."
            )
        expected = self.expected
        if expected is not None and expected.get("sha256") != recorded.get("sha256"):
            raise BaseChangedError(
                f"{step_dir} was trained on the base {_describe_base(recorded)}, but "
                f"the base now is {_describe_base(expected)}: its content changed, "
                "so the adapters would be applied to other weights. "
                + (
                    "Restore the original base files"
                    if recorded.get("path")
                    else "Use the seed it was trained with"
                )
                + ", or start a new run directory."
            )

    def state(self) -> Any:
        if self._state is None:
            assert self.init is not None
            self._state = self.init()
        return self._state


def _restore_step(
    step_dir: Path,
    template: Any,
    shardings: ShardingsArg,
    frozen: _Frozen | None = None,
) -> Restored:
    """Read and verify one step; `DamagedCheckpointError` for anything unreadable
    or not as written, `IncompatibleCheckpointError` for another model,
    `BaseChangedError` for a trained-leaves-only step whose base changed."""
    quiet_closed_loop()  # before Orbax starts: the noise comes from its threads
    if not step_dir.is_dir():
        raise DamagedCheckpointError(f"{step_dir} does not exist.")
    try:
        manifest = _storage.read_json(
            step_dir, _storage.MANIFEST, _storage.MANIFEST_FILE
        )
    except CheckpointError as e:
        raise DamagedCheckpointError(str(e)) from None
    base = manifest.get("base")
    if base is not None:
        frozen = frozen or _Frozen(None)
        frozen.check(base, step_dir)
        template = trained_part(template)
        if isinstance(shardings, eqx.Module):  # a state-shaped pytree
            shardings = trained_part(shardings)
    check_compatible(manifest.get("leaves", {}), template, str(step_dir))
    # Missing or cut-short array files are found from the index, without
    # starting Orbax's reads (which name no file, and leave reads behind).
    problem = _storage.step_problems(step_dir)
    if problem is not None:
        raise DamagedCheckpointError(f"{step_dir} is unreadable: {problem}")
    try:
        data = _storage.read_json(step_dir, _storage.DATA, _storage.DATA_FILE)
        target, paths, _, targets = abstract_on_disk(template, shardings)
        with ocp.StandardCheckpointer() as checkpointer:
            arrays = checkpointer.restore(step_dir / _storage.STATE, target)
    except Exception as e:  # damaged files surface as many error types
        raise DamagedCheckpointError(
            f"{step_dir} is unreadable ({_summary(e)})"
        ) from None
    recorded = manifest.get("checksums")
    if recorded:
        names = [path_name(p) for p in paths]
        actual = _integrity.checksums(names, unnest(arrays, paths))
        bad = _integrity.mismatches(recorded, actual)
        if bad:
            shown = ", ".join(bad[:5]) + (
                f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            )
            raise DamagedCheckpointError(
                f"{step_dir} does not hold what was written: the checksums of "
                f"{len(bad)} array(s) differ ({shown})"
            )
    state = from_disk(template, arrays, targets)
    if base is not None:
        assert frozen is not None
        state = with_frozen(state, frozen.state())
    return Restored(
        state=state,
        step=int(step_dir.name),
        data_position=data.get("position"),
        manifest=manifest,
        path=step_dir,
    )


def _agreed(ok: bool) -> bool:
    """In a multi-process run, a step counts as read only if every process read it
    (each reads its own shards)."""
    if jax.process_count() == 1:
        return ok
    from ..distributed import agree

    return not bool(agree([0 if ok else 1])[0])


def restore(
    path: str | os.PathLike[str],
    like: Any,
    *,
    step: int | None = None,
    shardings: ShardingsArg = None,
    on_damaged: Callable[[Path, str], None] | None = None,
    init: Callable[[], Any] | None = None,
    base: Any = None,
) -> Restored:
    """Restore a checkpoint into the structure of `like`.

    Args:
        path: a run directory, its `checkpoints/` directory, or one step's
            directory.
        like: a function building the state (evaluated abstractly with
            `eqx.filter_eval_shape`: nothing is allocated) or a state (concrete or
            abstract) of the same structure.
        step: the step to restore; default: the latest readable one. A damaged
            latest step (unreadable, incomplete, or with arrays whose checksums
            differ from those recorded when it was written) is reported (a
            `CheckpointWarning` naming it) and the previous one used; a chosen
            `step` (or a step directory as `path`) never falls back. A step
            pruned by a run still writing the directory is skipped silently.
        shardings: where to put the arrays: None (first local device), one
            `Sharding`, a callable `(path, abstract_leaf) -> Sharding`, or a pytree
            shaped like the state with a `Sharding` per array leaf. The checkpoint's
            own layout does not matter (resharding on restore).
        on_damaged: called with `(step_dir, reason)` for each damaged step skipped
            (instead of the warning).
        init: builds a whole concrete state; needed only for checkpoints that
            store just the trained leaves (`Checkpointer(base=...)`, a LoRA run):
            their frozen leaves are taken from `init()` (called once).
        base: the reference of the base `init` builds (a mapping with
            `"sha256"`); a checkpoint recording another hash is refused with
            `BaseChangedError` before `init` runs.

    Raises:
        IncompatibleCheckpointError: the checkpoint's leaves differ from `like`'s
            (the message names the first mismatched paths and shapes).
        CheckpointError: no checkpoint, none readable, or a chosen step damaged
            (one paragraph naming it).
    """
    directory, chosen = _storage.resolve(path)
    _storage.check_path(directory)
    chosen = step if step is not None else chosen
    template = _template(like)
    frozen = _Frozen(init, base)
    if chosen is not None:
        step_dir = directory / str(chosen)
        if not step_dir.is_dir():
            raise CheckpointError(
                f"no checkpoint {step_dir}; available steps: "
                f"{_storage.steps(directory) or 'none'}."
            )
        try:
            return _restore_step(step_dir, template, shardings, frozen)
        except DamagedCheckpointError as e:
            raise DamagedCheckpointError(
                f"cannot restore the checkpoint you named: {e}. Name another step "
                f"(available: {_storage.steps(directory) or 'none'}), or the run "
                "directory to use its newest readable checkpoint."
            ) from None
    failures: list[str] = []
    tried: set[int] = set()
    while True:
        # Re-listed after every failure: a run writing this directory may have
        # pruned the step we picked (it then simply is no longer listed).
        candidates = [s for s in _storage.steps(directory) if s not in tried]
        if not candidates:
            break
        candidate = candidates[-1]
        tried.add(candidate)
        step_dir = directory / str(candidate)
        try:
            restored = _restore_step(step_dir, template, shardings, frozen)
            error = None
        except IncompatibleCheckpointError:
            raise
        except DamagedCheckpointError as e:
            restored, error = None, e
        if not _agreed(error is None):
            if error is None:
                error = DamagedCheckpointError(
                    f"{step_dir}: unreadable on another process"
                )
            if not step_dir.exists():
                continue  # pruned meanwhile: not damaged
            reason = str(error)
            failures.append(f"  {reason}")
            if on_damaged is not None:
                on_damaged(step_dir, reason)
            else:
                warnings.warn(
                    f"damaged checkpoint: {reason}; trying the previous one.",
                    CheckpointWarning,
                    stacklevel=2,
                )
            continue
        return restored
    if not failures:
        raise CheckpointError(f"no complete checkpoint in {directory}.")
    raise CheckpointError(
        f"none of the checkpoints in {directory} could be read:\n"
        + "\n".join(failures)
        + "\nRefusing to start over from step 0: fix or move them, or start a new "
        "run directory."
    )


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
    """

    state: Any
    step: int | None
    run_id: str
    source: Path | None = None
    started_from: str | None = None
    moved_aside: tuple[Path, ...] = ()
    discarded: tuple[int, ...] = ()


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


def _discard(directory: Path, doomed: list[int], why: str) -> None:
    if not doomed:
        return
    if _writer():
        for s in doomed:
            _storage.remove_step(directory, s)
    warnings.warn(
        f"discarded checkpoint(s) {doomed} of {directory} ({why}).",
        CheckpointWarning,
        stacklevel=3,
    )


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
    """`restore_or_init` with everything a writer of `run_dir` needs to know:
    the run's identity (pass `run_id` to `Checkpointer`), where it came from,
    and which damaged steps were moved aside. Every refusal happens here, before
    anything is trained or compiled.

    - `"auto"`: the newest readable step of `run_dir`. Damaged newer steps
      (unreadable, incomplete, checksums that differ) are renamed to
      `<step>.damaged-<time>` with one `CheckpointWarning` naming them, so they
      never block the run again. Nothing readable at all: `CheckpointError`
      (never a silent restart from step 0).
    - `"never"`: `init()`; refuses if `run_dir` holds checkpoints, unless
      `overwrite=True` (they are deleted).
    - a step of `run_dir` itself (a rollback): refused before training if later
      steps exist, unless `overwrite=True` (they are discarded, with a warning).
    - another run's checkpoint: starts a new run from it; refused if `run_dir`
      already holds checkpoints of a different run, unless `overwrite=True`. When
      `run_dir`'s checkpoints are those of a run started from that very
      checkpoint, that run is continued (re-running the same command resumes).

    `base`: the reference of the frozen base `init` builds, for runs whose
    checkpoints store only trained leaves (`Checkpointer(base=...)`, LoRA): a
    checkpoint recording another base hash is refused (`BaseChangedError`).
    """
    directory = _storage.checkpoints_dir(run_dir)
    _storage.check_path(directory)
    template = init if like is None else like
    existing = _storage.steps(directory)
    resumed: Resumed
    if isinstance(resume, str) and resume in ("auto", "never"):
        mode = resume
    else:
        if str(resume) in ("", "none", "latest"):
            raise ConfigError(
                "`resume` must be 'auto', 'never' or a checkpoint path; got "
                f"{resume!r}."
            )
        mode = "path"
    if mode == "never":
        if existing and not overwrite:
            raise CheckpointError(
                f"{directory} already holds checkpoints (steps "
                f"{existing[-5:]}) and --resume never (resume='never'): refusing "
                "to mix two runs. Continue it with --resume auto (resume='auto'), "
                "delete them with --overwrite (overwrite=True), or use a new run "
                "directory."
            )
        if _writer():
            for step in existing:
                _storage.remove_step(directory, step)
            _storage.clean_leftovers(directory)
        return Resumed(init(), None, new_run_id())
    if mode == "path":
        src_dir, src_step = _storage.resolve(resume)
        same = os.path.realpath(src_dir) == os.path.realpath(directory)
        if same and src_step is None:
            mode = "auto"
        elif same:
            return _rollback(
                directory,
                src_step,
                existing,
                template,
                overwrite,
                shardings,
                data,
                init=init,
                base=base,
            )
        elif existing:
            newest = _newest_manifest(directory) or {}
            if _same_source(newest.get("started_from"), src_dir, src_step):
                mode = "auto"  # the run started from there: continue it
            elif not overwrite:
                raise CheckpointError(
                    f"{directory} already holds checkpoints (steps {existing[-5:]}) "
                    f"of another run; starting it over from {resume} would mix "
                    "two runs. Continue the run there with --resume auto "
                    "(resume='auto'), pass --overwrite (overwrite=True) to "
                    "discard its checkpoints, or use a new run directory."
                )
    if mode == "auto":
        if not existing:
            leftovers = _storage.damaged_steps(directory)
            if leftovers:
                raise CheckpointError(
                    f"{directory} holds no readable checkpoint, only damaged ones "
                    f"moved aside earlier ({', '.join(leftovers[:3])}). Refusing "
                    "to start over from step 0: move them away, or start anew "
                    "with --resume never --overwrite (resume='never')."
                )
            if _writer():
                _storage.clean_leftovers(directory)
            return Resumed(init(), None, new_run_id())
        seen: list[tuple[Path, str]] = []
        restored = restore(
            directory,
            template,
            shardings=shardings,
            on_damaged=lambda d, why: seen.append((d, why)),
            init=init,
            base=base,
        )
        moved = []
        for step_dir, why in seen:
            target = step_dir
            if _writer() and step_dir.exists():
                target = _storage.move_aside(directory, int(step_dir.name))
            moved.append((target, why))
        if moved:
            named = "; ".join(f"{why}, moved aside to {t.name}" for t, why in moved)
            warnings.warn(
                f"damaged checkpoint(s): {named}; resuming from step "
                f"{restored.step} (the steps after it are trained again).",
                CheckpointWarning,
                stacklevel=2,
            )
        manifest = restored.manifest
        resumed = Resumed(
            restored.state,
            restored.step,
            manifest.get("run_id") or new_run_id(),
            restored.path,
            manifest.get("started_from"),
            tuple(t for t, _ in moved),
        )
    else:  # another run's checkpoint: a new run starts from it
        restored = restore(resume, template, shardings=shardings, init=init, base=base)
        _discard(
            directory,
            existing,
            "overwrite: a new run starts from " + str(restored.path),
        )
        resumed = Resumed(
            restored.state,
            restored.step,
            new_run_id(),
            restored.path,
            str(restored.path),
        )
    _finish(resumed, restored, data)
    return resumed


def _rollback(
    directory: Path,
    step: int,
    existing: list[int],
    template: Any,
    overwrite: bool,
    shardings: ShardingsArg,
    data: Any,
    *,
    init: Callable[[], Any],
    base: Any,
) -> Resumed:
    later = [s for s in existing if s > step]
    if later and not overwrite:
        raise CheckpointError(
            f"resuming from {directory / str(step)} rolls the run back: it already "
            f"holds the later checkpoint(s) {later[-5:]}, which would be mixed with "
            "the retrained steps. Pass --overwrite (overwrite=True) to discard "
            "them, or --resume auto to continue from the newest."
        )
    restored = restore(
        directory, template, step=step, shardings=shardings, init=init, base=base
    )
    _discard(directory, later, f"overwrite: rolled back to step {step}")
    manifest = restored.manifest
    resumed = Resumed(
        restored.state,
        restored.step,
        manifest.get("run_id") or new_run_id(),
        restored.path,
        manifest.get("started_from"),
        discarded=tuple(later),
    )
    _finish(resumed, restored, data)
    return resumed


def _finish(resumed: Resumed, restored: Restored, data: Any) -> None:
    if data is not None and restored.data_position is not None:
        data.seek(restored.data_position)
    jax.block_until_ready(resumed.state)


def restore_or_init(
    run_dir: str | os.PathLike[str],
    init: Callable[[], Any],
    *,
    resume: str | os.PathLike[str] = "auto",
    overwrite: bool = False,
    shardings: ShardingsArg = None,
    data: Any = None,
    like: Any = None,
    base: Any = None,
) -> tuple[Any, int | None]:
    """The state to train from, by an explicit resume policy.

    Args:
        run_dir: the run directory (checkpoints under `run_dir/checkpoints`).
        init: builds a fresh state; only evaluated abstractly when restoring.
        resume: `"auto"`: continue from the latest readable checkpoint in
            `run_dir` (damaged newer steps are moved aside, with a warning), or
            `init()` if it has none. `"never"`: `init()`, and refuse if `run_dir`
            already holds checkpoints (unless `overwrite=True`, which deletes
            them). A path (a run, checkpoints or step directory): restore from
            there (the new checkpoints still go to `run_dir`); a step of
            `run_dir` itself with later steps present is a rollback, refused
            unless `overwrite=True` (the later steps are discarded).
        overwrite: delete existing checkpoints that would be mixed with the new
            ones (with `resume="never"`, a rollback, or another run's path).
        shardings: target shardings of restored arrays, as in `restore` (a fresh
            `init()` places its own arrays).
        data: a train `Loader`: it is moved to the checkpoint's position (`seek`).
        like: the structure to restore into (an abstract or concrete state, or a
            function building one); default: `init`, evaluated abstractly. Pass
            it when `init` is costly even abstractly (e.g. it reads weights).
        base: the reference of the frozen base `init` builds, for checkpoints
            that store only trained leaves (see `resume_run`).

    Returns:
        `(state, step)`, with `step` None when starting fresh. `resume_run` also
        returns the run's identity, for `Checkpointer(run_id=...)`.
    """
    resumed = resume_run(
        run_dir,
        init,
        resume=resume,
        overwrite=overwrite,
        shardings=shardings,
        data=data,
        like=like,
        base=base,
    )
    return resumed.state, resumed.step
