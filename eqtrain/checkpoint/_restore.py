"""Restoring: the latest (or a chosen) step into a template from
`eqx.filter_eval_shape`, with target shardings, falling back past damaged steps.
`resume_run` (in `_resume.py`) decides what to restore and calls `restore`."""

import dataclasses
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import orbax.checkpoint as ocp

from . import _integrity, _storage
from ._errors import BaseChangedError, CheckpointError, CheckpointWarning
from ._quiet import quiet_closed_loop, read_error
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

    @property
    def hook_states(self) -> dict[str, dict[str, Any]]:
        """The saved states of the hooks that keep one, by `state_key` (empty
        for a checkpoint written before hooks kept state)."""
        return dict(self.manifest.get("hooks") or {})


class DamagedCheckpointError(CheckpointError):
    """A step's files are unreadable, incomplete, or do not match the checksums
    recorded when it was written."""


def _template(like: Any) -> Any:
    """An abstract state from an init function or a (concrete or abstract) state."""
    if callable(like) and not isinstance(like, eqx.Module):
        return eqx.filter_eval_shape(like)
    return eqx.filter_eval_shape(lambda: like)


# -- a frozen base ------------------------------------------------------------------
def _describe_base(base: Any) -> str:
    where = base.get("path") or "a random initialisation"
    extra = f" with seed {base['seed']}" if base.get("seed") is not None else ""
    return f"{where}{extra}, sha256 {str(base.get('sha256'))[:12]}..."


def _base_changed(recorded: Any, expected: Any, step_dir: Path) -> BaseChangedError:
    fix = (
        "Restore the original base files"
        if recorded.get("path")
        else ("Use the seed it was trained with")
    )
    return BaseChangedError(
        f"{step_dir} was trained on the base {_describe_base(recorded)}, but "
        f"the base now is {_describe_base(expected)}: its content changed, "
        f"so the adapters would be applied to other weights. {fix}, or start a "
        "new run directory."
    )


@dataclasses.dataclass
class _Frozen:
    """How a step that stores only trained leaves gets its frozen ones back:
    `init()` rebuilds the whole state (the base included), called at most once;
    `expected` is the reference of the base `init` builds (checked first)."""

    init: Callable[[], Any] | None
    expected: Any = None
    _state: Any = None

    def check(self, recorded: Any, step_dir: Path) -> None:
        """Refuse a step whose base cannot be rebuilt, or whose base changed."""
        if self.init is None:
            raise CheckpointError(
                f"{step_dir} stores only the trained leaves of a run over a frozen "
                f"base ({_describe_base(recorded)}); restore it with a function "
                "that rebuilds that base: resume_run with `init`, or "
                "restore(..., init=...)."
            )
        expected = self.expected
        if expected is not None and expected.get("sha256") != recorded.get("sha256"):
            raise _base_changed(recorded, expected, step_dir)

    def state(self) -> Any:
        if self._state is None:
            assert self.init is not None
            self._state = self.init()
        return self._state


# -- one step -----------------------------------------------------------------------
def _manifest_of(step_dir: Path) -> dict[str, Any]:
    if not step_dir.is_dir():
        raise DamagedCheckpointError(f"{step_dir} does not exist.")
    try:
        return _storage.read_json(step_dir, _storage.MANIFEST, _storage.MANIFEST_FILE)
    except CheckpointError as e:
        raise DamagedCheckpointError(str(e)) from None


def _check_files(step_dir: Path) -> None:
    # Missing or cut-short array files are found from the index, without
    # starting Orbax's reads (which name no file, and leave reads behind).
    problem = _storage.step_problems(step_dir)
    if problem is not None:
        raise DamagedCheckpointError(f"{step_dir} is unreadable: {problem}")


def _read(
    step_dir: Path, template: Any, shardings: ShardingsArg
) -> tuple[dict[str, Any], dict[str, Any], list[tuple[str, ...]], list[Any]]:
    """The step's data item, its arrays as Orbax reads them, their paths and
    their target shardings."""
    # the template and the caller's shardings: their errors are the caller's
    target, paths, _, targets = abstract_on_disk(template, shardings)
    try:
        data = _storage.read_json(step_dir, _storage.DATA, _storage.DATA_FILE)
        with ocp.StandardCheckpointer() as checkpointer:
            arrays = checkpointer.restore(step_dir / _storage.STATE, target)
    except Exception as e:  # damaged files surface as many error types
        raise DamagedCheckpointError(
            f"{step_dir} is unreadable ({read_error(e)})"
        ) from None
    return data, arrays, paths, targets


def _verify(
    step_dir: Path,
    recorded: dict[str, str] | None,
    arrays: dict[str, Any],
    paths: list[tuple[str, ...]],
) -> None:
    """Refuse arrays whose checksums differ from those recorded when written."""
    if not recorded:
        return
    names = [path_name(p) for p in paths]
    actual = _integrity.checksums(names, unnest(arrays, paths))
    bad = _integrity.mismatches(recorded, actual)
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if bad[5:] else "")
        raise DamagedCheckpointError(
            f"{step_dir} does not hold what was written: the checksums of "
            f"{len(bad)} array(s) differ ({shown})"
        )


def _trained_only(template: Any, shardings: ShardingsArg) -> tuple[Any, ShardingsArg]:
    """The template and shardings of the trained leaves alone (what a step over
    a frozen base stores)."""
    if isinstance(shardings, eqx.Module):  # a state-shaped pytree
        shardings = trained_part(shardings)
    return trained_part(template), shardings


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
    manifest = _manifest_of(step_dir)
    frozen = frozen or _Frozen(None)
    if (base := manifest.get("base")) is not None:
        frozen.check(base, step_dir)
        template, shardings = _trained_only(template, shardings)
    check_compatible(manifest.get("leaves", {}), template, str(step_dir))
    _check_files(step_dir)
    data, arrays, paths, targets = _read(step_dir, template, shardings)
    _verify(step_dir, manifest.get("checksums"), arrays, paths)
    state = from_disk(template, arrays, targets)
    if base is not None:
        state = with_frozen(state, frozen.state())
    position = data.get("position")
    return Restored(state, int(step_dir.name), position, manifest, step_dir)


# -- which step ---------------------------------------------------------------------
def _agreed(ok: bool) -> bool:
    """In a multi-process run, a step counts as read only if every process read it
    (each reads its own shards)."""
    if jax.process_count() == 1:
        return ok
    from ..distributed import agree

    return not bool(agree([0 if ok else 1])[0])


def _available(directory: Path) -> Any:
    return _storage.steps(directory) or "none"


def _restore_chosen(
    directory: Path, step: int, read: Callable[[Path], Restored]
) -> Restored:
    """The step the caller named: never a fallback."""
    step_dir = directory / str(step)
    if not step_dir.is_dir():
        raise CheckpointError(
            f"no checkpoint {step_dir}; available steps: {_available(directory)}."
        )
    try:
        return read(step_dir)
    except DamagedCheckpointError as e:
        raise DamagedCheckpointError(
            f"cannot restore the checkpoint you named: {e}. Name another step "
            f"(available: {_available(directory)}), or the run "
            "directory to use its newest readable checkpoint."
        ) from None


def _attempt(
    step_dir: Path, read: Callable[[Path], Restored]
) -> tuple[Restored | None, DamagedCheckpointError | None]:
    """One step read, or why it was not (by this or another process)."""
    try:
        restored, error = read(step_dir), None
    except DamagedCheckpointError as e:
        restored, error = None, e
    if _agreed(error is None):
        return restored, None
    other = DamagedCheckpointError(f"{step_dir}: unreadable on another process")
    return None, error or other


def _warn_damaged(step_dir: Path, reason: str) -> None:
    warnings.warn(
        f"damaged checkpoint: {reason}; trying the previous one.",
        CheckpointWarning,
        stacklevel=4,  # the caller of `restore`
    )


def _none_readable(directory: Path, failures: list[str]) -> CheckpointError:
    if not failures:
        return CheckpointError(f"no complete checkpoint in {directory}.")
    return CheckpointError(
        f"none of the checkpoints in {directory} could be read:\n"
        + "\n".join(failures)
        + "\nRefusing to start over from step 0: fix or move them, or start a new "
        "run directory."
    )


def _restore_newest(
    directory: Path,
    read: Callable[[Path], Restored],
    on_damaged: Callable[[Path, str], None],
) -> Restored:
    """The newest step every process can read; damaged newer ones are reported."""
    failures: list[str] = []
    tried: set[int] = set()
    # Re-listed after every failure: a run writing this directory may have
    # pruned the step we picked (it then simply is no longer listed).
    while candidates := [s for s in _storage.steps(directory) if s not in tried]:
        tried.add(candidates[-1])
        step_dir = directory / str(candidates[-1])
        restored, error = _attempt(step_dir, read)
        if restored is not None:
            return restored
        if step_dir.exists():  # else pruned meanwhile: not damaged
            failures.append(f"  {error}")
            on_damaged(step_dir, str(error))
    raise _none_readable(directory, failures)


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
    template, frozen = _template(like), _Frozen(init, base)

    def read(step_dir: Path) -> Restored:
        return _restore_step(step_dir, template, shardings, frozen)

    if chosen is not None:
        return _restore_chosen(directory, chosen, read)
    return _restore_newest(directory, read, on_damaged or _warn_damaged)
