"""`prepare(config)`: a run assembled phase by phase, without training. Each
phase is a function from one value to the next: the config checked against
its checkpoints -> planned (`_plan`: job, rows, mesh) -> its directory claimed
-> started (loader, state restored or new, reference pass) -> assembled
(compiled steps, checkpointer, hooks) into a `Prepared`."""

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from .. import checkpoint, hooks as hooks_lib
from .._stops import StopConditions
from ..config import Config, to_dict
from ..data import Loader
from . import _build, _plan, _preflight, _reference, _run_hooks, _rundir, _steps


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A run assembled and ready for `eqtrain.fit(state, step, loader, **fit_kwargs)`.

    Attributes:
        job: the built pieces (config, tokenizer, model config, optimizer).
        placement: mesh and shardings.
        state: the initial or restored `TrainState`, placed on the mesh.
        step: the compiled train step.
        loader: the training `Loader` (at the restored position).
        fit_kwargs: everything else `fit` takes (hooks, evaluation, checkpointer,
            stop conditions, FLOP figures).
        resumed_from: the restored checkpoint's step, or None.
        source: the restored step directory (of this run or another), or None.
        lock: the run directory's lock (process 0), released by `close()`.
        rows: the training rows (their columns' shapes size the compiled step).
    """

    job: _build.Job
    placement: Any
    state: Any
    step: Any
    loader: Loader
    fit_kwargs: dict[str, Any]
    resumed_from: int | None
    source: Path | None = None
    lock: Any = None
    rows: Any = None

    def close(self) -> None:
        """Stop the loader's prefetch and release the run directory."""
        try:
            self.loader.close()
        finally:
            if self.lock is not None:
                self.lock.release()


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
    """

    state: Any
    resumed: int | None
    restored: Any
    base: dict[str, Any] | None
    eval_rows: Any
    loader: Loader
    architecture: dict[str, Any] | None = None


def stderr(text: str) -> None:
    """Print a progress note to standard error."""
    print(text, file=sys.stderr, flush=True)


def prepare(
    config: Config,
    *,
    resume: str | None = None,
    overwrite: bool = False,
    echo: Callable[[str], None] | None = None,
    export: bool = True,
) -> Prepared:
    """Assemble the run `config` describes, without training: check everything,
    create the run directory, restore or initialise the state (and for
    `task.reference = "precomputed"`, compute or read the reference log-probs),
    compile nothing yet. `run` is `prepare` followed by `eqtrain.fit`.
    Progress notes go to `echo` (default: standard error); `export=False` leaves
    out the Hugging Face export (see `run`)."""
    request = Request(
        resume or config.checkpoint.resume, overwrite, echo or stderr, export
    )
    # Before any data is read: a config its checkpoints cannot continue.
    _rundir.check_same_state_layout(config, Path(config.run_dir), request.resume)
    planned = _plan.plan(config, recorded=_rundir.fallback_record(config))
    _plan.refuse_multi_process(planned.job, export=export)
    lock = claim(planned.job.config)
    try:
        return _started(planned, lock, request)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def claim(config: Config) -> Any:
    """Check the run directory and every output target (before compiling), and
    take the directory's lock: one run per directory, process 0 holds it until
    the run ends (other processes get None)."""
    run_dir = Path(config.run_dir)
    writer = jax.process_index() == 0
    _rundir.check_checkpoint_path(run_dir)
    # Every output target (run dir, TensorBoard, export, plot), before compiling.
    _preflight.check_outputs(config, writer=writer)
    _rundir.check_writable(run_dir)
    return checkpoint.RunLock(run_dir).acquire() if writer else None


def _started(planned: _plan.Plan, lock: Any, request: Request) -> Prepared:
    """The claimed run started from its checkpoint (or new) and assembled; the
    loader is closed again if that fails."""
    config = planned.job.config
    _rundir.check_kill_switch(config)
    for note in planned.job.notes:  # rows the data pipelines skipped
        request.say(note)
    loader = train_loader(planned)
    try:
        start = _start(planned, loader, request)
        start = dataclasses.replace(start, architecture=_write_run_files(config))
        return _assemble(planned, start, lock, request.export)
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


def _start(planned: _plan.Plan, loader: Loader, request: Request) -> Start:
    """Restore the run's latest checkpoint (and the loader's position), or
    initialise a new state; then the precomputed reference's pass, if any."""
    job, placement = planned.job, planned.placement
    base = job.base_reference()  # a LoRA run's frozen base (None otherwise)
    restored = checkpoint.resume_run(
        Path(job.config.run_dir),
        lambda: placement.place(job.new_state(placement.mesh)),
        like=job.abstract_state(),
        resume=request.resume,
        overwrite=request.overwrite,
        shardings=placement.state_shardings,
        data=loader,
        base=base,
    )
    eval_rows = planned.eval_rows
    start = Start(restored.state, restored.step, restored, base, eval_rows, loader)
    if job.reference == "precomputed":
        return _with_reference(planned, start, request.say)
    return start


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
    )
    start.loader.add_columns(values["train"])
    if eval_rows is not None:
        eval_rows = {**eval_rows, **values["eval"]}
    return dataclasses.replace(start, eval_rows=eval_rows)


def _write_run_files(config: Config) -> dict[str, Any] | None:
    """The run's config.toml and record of `model.init_from` (process 0), only
    once the restore succeeded: a refused resume leaves the config that the
    checkpoints were written with. Returns the architecture for the manifests."""
    run_dir, writer = Path(config.run_dir), jax.process_index() == 0
    if writer:
        _rundir.write_config(config, run_dir)
    return _rundir.architecture_record(config, run_dir, writer)


def _assemble(planned: _plan.Plan, start: Start, lock: Any, export: bool) -> Prepared:
    """The started run's compiled steps, checkpointer and hooks, as `Prepared`."""
    job, placement = planned.job, planned.placement
    step = _steps.train_step(job, placement)
    return Prepared(
        job,
        placement,
        start.state,
        step,
        start.loader,
        fit_kwargs(planned, start, export),
        start.resumed,
        start.restored.source,
        lock,
        planned.rows,
    )


def fit_kwargs(planned: _plan.Plan, start: Start, export: bool) -> dict[str, Any]:
    """Everything `eqtrain.fit` takes besides state, step and data."""
    job, placement = planned.job, planned.placement
    config, done = job.config, start.resumed or 0
    evaluation = _steps.fit_evaluation(job, placement, start.eval_rows)
    # the checkpointer before the hooks: it refuses a directory holding another
    # run's steps before any log there is touched
    checkpointer = _checkpointer(config, start)
    return dict(
        num_steps=config.loop.steps,
        hooks=_hooks(planned, start, export),
        evaluation=evaluation,
        checkpointer=checkpointer,
        stop=_stop_conditions(config),
        flops_per_token=job.flops_per_token(),
        peak_flops=_peak_flops(config, placement.mesh),
        tokens_seen=done * config.data.batch_size * job.tokens_per_row,
    )


def _hooks(planned: _plan.Plan, start: Start, export: bool) -> list[Any]:
    """The run's hooks: progress, logs, samples, per-step exports."""
    done = start.resumed or 0
    return _run_hooks.run_hooks(
        planned.job, planned.samples, planned.placement.mesh,
        exports=export, start=done, rows=start.loader.source,
    )  # fmt: skip


def _checkpointer(config: Config, start: Start) -> checkpoint.Checkpointer:
    """The run's `Checkpointer` as `[checkpoint]` says; it refuses another run's
    steps in the directory here, before compiling."""
    ckpt = config.checkpoint
    return checkpoint.Checkpointer(
        Path(config.run_dir),
        every_steps=ckpt.every or None,
        every_minutes=ckpt.every_minutes or None,
        keep_last=ckpt.keep_last,
        keep_every=ckpt.keep_every,
        best=ckpt.best,
        best_mode=ckpt.best_mode,
        data=start.loader,
        config=to_dict(config),
        async_save=ckpt.async_save,
        run_id=start.restored.run_id,
        started_from=start.restored.started_from,
        base=start.base,  # LoRA: store the trained leaves and a reference to the base
        extra=_manifest_extra(start.architecture),
    )


def _manifest_extra(architecture: dict[str, Any] | None) -> dict[str, Any] | None:
    """What every checkpoint's manifest adds: the architecture of
    `model.init_from`, when the run has one."""
    return {_rundir.RECORD: architecture} if architecture else None


def _stop_conditions(config: Config) -> StopConditions:
    """`loop.time_limit` and the kill-switch file (in the run directory)."""
    loop = config.loop
    kill_switch = None
    if loop.kill_switch is not None:
        kill_switch = Path(config.run_dir) / loop.kill_switch
    return StopConditions(time_limit=loop.time_limit or None, kill_switch=kill_switch)


def _peak_flops(config: Config, mesh: Any) -> float | None:
    """The devices' peak FLOP/s for MFU: `log.peak_flops` per device, else the
    known figure of the devices at the run's compute dtype."""
    devices = mesh.devices.flatten().tolist() if mesh is not None else jax.devices()
    if config.log.peak_flops is not None:
        return config.log.peak_flops * len(devices)
    dtype = "bfloat16" if config.loop.precision == "bf16" else config.model.param_dtype
    return hooks_lib.total_peak_flops(devices, dtype)
