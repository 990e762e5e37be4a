"""A started run assembled for `eqtrain.fit`: its compiled train and eval steps
(`_steps`), its checkpointer, its hooks (`_run_hooks`) and the rest of `fit`'s
keywords, as a `Prepared`."""

import dataclasses
from pathlib import Path
from typing import Any

import jax

from .. import checkpoint, hooks as hooks_lib
from .._fit import StopConditions
from ..config import Config, best_mode, to_dict
from ..data import Loader
from . import _build, _claim, _identity, _plan, _run_hooks, _rundir, _start, _steps


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


def assemble(
    planned: _plan.Plan, start: _start.Start, claimed: _claim.Claimed, export: bool
) -> Prepared:
    """The started run's compiled steps, checkpointer and hooks, as `Prepared`
    (`export=False`: no Hugging Face export hooks)."""
    job, placement = planned.job, planned.placement
    step, evaluation = _steps.steps(job, placement, start.eval_rows)
    # the checkpointer before the hooks: it refuses a directory holding another
    # run's steps before any log there is touched
    checkpointer = _checkpointer(job.config, start)
    done = start.resumed or 0
    hooks = _run_hooks.run_hooks(
        job, planned.samples, placement.mesh,
        targets=claimed.targets if export else {}, start=done,
        rows=start.loader.source,
    )  # fmt: skip
    fit_kwargs = dict(
        num_steps=job.config.loop.steps,
        hooks=hooks,
        evaluation=evaluation,
        checkpointer=checkpointer,
        stop=_stop_conditions(job.config),
        **_flops(job, placement.mesh, done),
    )
    return Prepared(
        job, placement, start.state, step, start.loader, fit_kwargs,
        start.resumed, start.restored.source, claimed.lock, planned.rows,
    )  # fmt: skip


def _flops(job: _build.Job, mesh: Any, done: int) -> dict[str, Any]:
    """`fit`'s MFU figures: FLOPs per token, the devices' peak, tokens seen."""
    config = job.config
    return dict(
        flops_per_token=job.flops_per_token,
        peak_flops=_peak_flops(config, mesh),
        tokens_seen=done * config.data.batch_size * job.tokens_per_row,
    )


def _checkpointer(config: Config, start: _start.Start) -> checkpoint.Checkpointer:
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
        best_mode=best_mode(config),
        data=start.loader,
        config=to_dict(config),
        async_save=ckpt.async_save,
        run_id=start.restored.run_id,
        started_from=start.restored.started_from,
        base=start.base,  # LoRA: store the trained leaves and a reference to the base
        extra=_manifest_extra(start),
    )


def _manifest_extra(start: _start.Start) -> dict[str, Any]:
    """What every checkpoint's manifest adds: what identifies the run (which
    every resume compares), and the architecture of `model.init_from`, when the
    run has one."""
    extra: dict[str, Any] = {}
    if start.identity is not None:
        extra[_identity.MANIFEST_ENTRY] = start.identity
    if start.architecture:
        extra[_rundir.RECORD] = start.architecture
    return extra


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
