"""A claimed run started: its training loader, its state restored from the
latest checkpoint (with the loader's position) or new, the precomputed
reference's pass, and then its files written (`_rundir`), as a `Start`."""

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from .. import checkpoint
from ..data import Loader
from . import _identity, _model, _plan, _reference, _rundir


@dataclasses.dataclass(frozen=True)
class Request:
    """How `prepare` was asked to start the run (see `prepare`)."""

    resume: str
    overwrite: bool
    say: Callable[[str], None]
    export: bool


@dataclasses.dataclass(frozen=True)
class Start:
    """A run's starting point: its state (restored or new) and what the
    restore found.

    Attributes:
        state: the `TrainState`, placed on the mesh.
        resumed: the restored checkpoint's step, or None (a new run).
        restored: `checkpoint.resume_run`'s result (run id, source, ...).
        base: a LoRA run's reference to its frozen base, else None.
        eval_rows: the eval rows (with the precomputed reference's columns).
        loader: the training `Loader`, at the restored position.
        architecture: the manifests' entry of `model.init_from`'s architecture
            (once the run's files are written), or None.
        identity: the manifests' entry of what identifies the run
            (`_identity.of_config`), which every resume compares.
    """

    state: Any
    resumed: int | None
    restored: Any
    base: dict[str, Any] | None
    eval_rows: Any
    loader: Loader
    architecture: dict[str, Any] | None = None
    identity: dict[str, Any] | None = None


def start(planned: _plan.Plan, request: Request) -> Start:
    """The planned (and claimed) run started from its checkpoint, or new; its
    loader is closed again if that fails."""
    for note in planned.job.notes:  # rows the data pipelines skipped
        request.say(note)
    loader = train_loader(planned)
    try:
        begun = _restored(planned, loader, request)
        if planned.job.reference == "precomputed":
            begun = _with_reference(planned, begun, request.say)
        architecture = _rundir.write_run_files(planned.job.config)
        identity = _identity.of_job(planned.job)
        return dataclasses.replace(begun, architecture=architecture, identity=identity)
    except BaseException:
        loader.close()
        raise


def train_loader(planned: _plan.Plan) -> Loader:
    """The training `Loader` over the planned rows, split over the mesh."""
    config = planned.job.config
    data = config.data
    return Loader(
        planned.rows,
        data.batch_size,
        seed=config.seed,
        shuffle=data.shuffle,
        prefetch=data.prefetch,
        sharding=planned.placement.batch_sharding,
    )


def _restored(planned: _plan.Plan, loader: Loader, request: Request) -> Start:
    """Restore the run's latest checkpoint (and the loader's position), or
    initialise a new state."""
    job, placement = planned.job, planned.placement
    base = _model.base_reference(job)  # a LoRA run's frozen base (None otherwise)
    restored = checkpoint.resume_run(
        Path(job.config.run_dir),
        lambda: placement.place(_model.new_state(job, placement.mesh)),
        like=job.abstract,
        resume=request.resume,
        overwrite=request.overwrite,
        shardings=placement.state_shardings,
        data=loader,
        base=base,
    )
    eval_rows = planned.eval_rows
    return Start(restored.state, restored.step, restored, base, eval_rows, loader)


def _with_reference(
    planned: _plan.Plan, start: Start, say: Callable[[str], None]
) -> Start:
    """The reference's log-probs of each pair (the stored pass, or a new one
    from the initial model), added to the training loader and the eval rows."""
    eval_rows = start.eval_rows
    splits = {"train": planned.rows, "eval": eval_rows}
    initial = start.state.model if start.resumed is None else None  # fresh: step 0
    values = _reference.attach(
        planned.job,
        planned.placement,
        splits,
        Path(planned.job.config.run_dir),
        writer=jax.process_index() == 0,
        say=say,
        initial=initial,
        base=start.base,
    )
    start.loader.add_columns(values["train"])
    if eval_rows is not None:
        eval_rows = {**eval_rows, **values["eval"]}
    return dataclasses.replace(start, eval_rows=eval_rows)
