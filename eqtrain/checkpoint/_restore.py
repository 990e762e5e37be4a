"""Restoring: the latest (or a chosen) step into a template from
`eqx.filter_eval_shape`, with target shardings; falling back past damaged steps;
and `restore_or_init`, the explicit resume policy shared by scripts and the CLI."""

import dataclasses
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import orbax.checkpoint as ocp

from .._errors import ConfigError
from . import _storage
from ._errors import CheckpointError, CheckpointWarning, IncompatibleCheckpointError
from ._tree import ShardingsArg, abstract_on_disk, check_compatible, from_disk


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


def _restore_step(step_dir: Path, template: Any, shardings: ShardingsArg) -> Restored:
    manifest = _storage.read_json(step_dir, _storage.MANIFEST, _storage.MANIFEST_FILE)
    check_compatible(manifest.get("leaves", {}), template, str(step_dir))
    data = _storage.read_json(step_dir, _storage.DATA, _storage.DATA_FILE)
    target, _, _, targets = abstract_on_disk(template, shardings)
    with ocp.StandardCheckpointer() as checkpointer:
        arrays = checkpointer.restore(step_dir / _storage.STATE, target)
    return Restored(
        state=from_disk(template, arrays, targets),
        step=int(step_dir.name),
        data_position=data.get("position"),
        manifest=manifest,
        path=step_dir,
    )


def restore(
    path: str | os.PathLike[str],
    like: Any,
    *,
    step: int | None = None,
    shardings: ShardingsArg = None,
) -> Restored:
    """Restore a checkpoint into the structure of `like`.

    Args:
        path: a run directory, its `checkpoints/` directory, or one step's
            directory.
        like: a function building the state (evaluated abstractly with
            `eqx.filter_eval_shape`: nothing is allocated) or a state (concrete or
            abstract) of the same structure.
        step: the step to restore; default: the latest readable one. A damaged
            latest step is reported (a `CheckpointWarning` naming it) and the
            previous one used; a chosen `step` never falls back.
        shardings: where to put the arrays: None (first local device), one
            `Sharding`, a callable `(path, abstract_leaf) -> Sharding`, or a pytree
            shaped like the state with a `Sharding` per array leaf. The checkpoint's
            own layout does not matter (resharding on restore).

    Raises:
        IncompatibleCheckpointError: the checkpoint's leaves differ from `like`'s
            (the message names the first mismatched paths and shapes).
        CheckpointError: no checkpoint, or none readable.
    """
    directory, chosen = _storage.resolve(path)
    chosen = step if step is not None else chosen
    template = _template(like)
    if chosen is not None:
        step_dir = directory / str(chosen)
        if not step_dir.is_dir():
            raise CheckpointError(
                f"no checkpoint {step_dir}; available steps: "
                f"{_storage.steps(directory) or 'none'}."
            )
        return _restore_step(step_dir, template, shardings)
    available = _storage.steps(directory)
    if not available:
        raise CheckpointError(f"no complete checkpoint in {directory}.")
    failures = []
    for candidate in reversed(available):
        step_dir = directory / str(candidate)
        try:
            restored = _restore_step(step_dir, template, shardings)
        except IncompatibleCheckpointError:
            raise
        except Exception as e:  # damaged files surface as many error types
            failures.append(f"  {step_dir}: {type(e).__name__}: {_first_line(e)}")
            warnings.warn(
                f"checkpoint {step_dir} is unreadable ({type(e).__name__}: "
                f"{_first_line(e)}); trying the previous one.",
                CheckpointWarning,
                stacklevel=2,
            )
            continue
        return restored
    raise CheckpointError(
        f"none of the checkpoints in {directory} could be read:\n"
        + "\n".join(failures)
        + "\nRefusing to start over from step 0: fix or move them, or start a new "
        "run directory."
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def restore_or_init(
    run_dir: str | os.PathLike[str],
    init: Callable[[], Any],
    *,
    resume: str | os.PathLike[str] = "auto",
    overwrite: bool = False,
    shardings: ShardingsArg = None,
    data: Any = None,
    like: Any = None,
) -> tuple[Any, int | None]:
    """The state to train from, by an explicit resume policy.

    Args:
        run_dir: the run directory (checkpoints under `run_dir/checkpoints`).
        init: builds a fresh state; only evaluated abstractly when restoring.
        resume: `"auto"`: continue from the latest readable checkpoint in
            `run_dir`, or `init()` if it has none. `"never"`: `init()`, and refuse
            if `run_dir` already holds checkpoints (unless `overwrite=True`, which
            deletes them). A path (a run, checkpoints or step directory): restore
            from there (the new checkpoints still go to `run_dir`).
        overwrite: with `resume="never"`, delete existing checkpoints first.
        shardings: target shardings of restored arrays, as in `restore` (a fresh
            `init()` places its own arrays).
        data: a train `Loader`: it is moved to the checkpoint's position (`seek`).
        like: the structure to restore into (an abstract or concrete state, or a
            function building one); default: `init`, evaluated abstractly. Pass
            it when `init` is costly even abstractly (e.g. it reads weights).

    Returns:
        `(state, step)`, with `step` None when starting fresh.
    """
    directory = _storage.checkpoints_dir(run_dir)
    if isinstance(resume, str) and resume in ("auto", "never"):
        existing = _storage.steps(directory)
        if resume == "never":
            if existing and not overwrite:
                raise CheckpointError(
                    f"{directory} already holds checkpoints (steps "
                    f"{existing[-5:]}) and resume='never': refusing to mix two "
                    "runs. Use resume='auto' to continue it, overwrite=True to "
                    "delete them, or a new run directory."
                )
            for step in existing:
                _storage.remove_step(directory, step)
            _storage.clean_leftovers(directory)
            return init(), None
        if not existing:
            if _storage.has_leftovers(directory):
                _storage.clean_leftovers(directory)
            return init(), None
        restored = restore(
            directory, init if like is None else like, shardings=shardings
        )
    else:
        if str(resume) in ("", "none", "latest"):
            raise ConfigError(
                "`resume` must be 'auto', 'never' or a checkpoint path; got "
                f"{resume!r}."
            )
        restored = restore(resume, init if like is None else like, shardings=shardings)
    if data is not None and restored.data_position is not None:
        data.seek(restored.data_position)
    jax.block_until_ready(restored.state)
    return restored.state, restored.step
