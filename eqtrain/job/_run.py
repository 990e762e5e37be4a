"""`run(config)`: the whole job `eqtrain fit` runs — data, model, optimizer,
placement on the mesh, resume, hooks, checkpoints, evaluation, export — assembled
from library pieces and handed to `eqtrain.fit`."""

import dataclasses
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from .. import checkpoint, hf, hooks as hooks_lib, models
from .._errors import ConfigError
from .._hooks import StopKind, StopReason, at_end, every
from .._jit import jit
from .._loop import FitResult, fit
from ..config import (
    Config,
    explicit,
    from_dict,
    lora_on,
    read_toml,
    reference_mode,
    to_dict,
    to_toml,
)
from ..data import Loader
from ..step import eval_step
from . import _build, _data, _grpo, _place, _preflight, _reference
from ._samples import samples_hooks


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


def check_writable(run_dir: Path) -> None:
    """Create `run_dir` and prove it writable, or say why not (before any work)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ConfigError(
            f"the run directory {run_dir} is not writable ({e.strerror or e}). "
            "Choose another with --run-dir or `run_dir` in the config."
        ) from None


def write_config(config: Config, run_dir: Path) -> Path:
    """Write the resolved config to `<run_dir>/config.toml`, atomically."""
    path = run_dir / "config.toml"
    tmp = path.with_name(".config.toml.tmp")
    tmp.write_text(to_toml(config), encoding="utf-8")
    os.replace(tmp, path)
    return path


def _progress_hooks(config: Config) -> list[Any]:
    """`bar`: a live bar; `lines`: a line every `log.every` steps; `auto`: the bar
    on a terminal, else a line about every 5% of the run (and at evaluations;
    every `log.every` steps when that key is set), so that a log file stays
    short."""
    mode = config.log.progress
    if mode == "none":
        return []
    if mode == "lines":
        return [every(config.log.every, hooks_lib.ConsoleLogger(stream=sys.stderr))]
    if mode == "auto" and not sys.stderr.isatty():
        period = config.log.every if "log.every" in explicit(config) else None
        return [hooks_lib.ProgressBar(plain_every=period, force_terminal=False)]
    return [hooks_lib.ProgressBar(force_terminal=True)]


def _hooks(
    job: _build.Job,
    run_dir: Path,
    exports: bool = True,
    start: int = 0,
    rows: Any = None,
) -> list[Any]:
    """Progress, logs and exports; the logs start at step `start` (the resumed
    one: the redone steps' earlier lines and events are replaced)."""
    config = job.config
    if jax.process_index() != 0:
        return []  # process 0 logs and exports for the run
    log = config.log
    out: list[Any] = _progress_hooks(config)
    metrics = hooks_lib.JsonlWriter(run_dir / "metrics.jsonl", start=start)
    writers: list[Any] = [metrics]
    if log.tensorboard:
        writers.append(hooks_lib.TensorBoardWriter(run_dir / "tb", start=start))
    if log.wandb_project is not None:
        writers.append(
            hooks_lib.WandbLogger(
                project=log.wandb_project,
                name=log.wandb_name,
                mode=log.wandb_mode,
                dir=str(run_dir),
                config=to_dict(config),
            )
        )
    if _data.mixture_of(rows) is not None:  # per-source tokens, before the writers
        out.append(every(log.every, _data.SourceTokens(rows, config.data.batch_size)))
    for writer in writers:
        out += [every(log.every, writer), at_end(writer)]
    export = config.export
    if export.hf is not None and exports:
        kwargs = dict(
            dtype=export.dtype,
            max_shard_size=export.max_shard_size,
            tokenizer=job.tokenizer,
            model_type=job.model_type,
            which="ema" if export.ema else "model",
            pick=job.exported,  # the policy, at its real vocabulary
        )
        template = getattr(job.template, "source", None)  # a Jinja chat template
        if template is not None:
            kwargs["chat_template"] = template
        if job.lora is not None:
            kwargs["spec"] = job.lora
        for form, target in _preflight.export_targets(config, run_dir).items():
            if export.every:  # beside the final export, which replaces it whole
                steps = _preflight.steps_export_dir(target)
                hook = hf.export_hook(steps, form=form, **kwargs)
                out.append(every(export.every, hook))
            hook = hf.export_hook(target, per_step=False, form=form, **kwargs)
            out.append(at_end(hook))
    return out


def evaluation(
    job: _build.Job, placement: _place.Placement, rows: _build.Rows | None
) -> tuple[Loader | None, Any]:
    """The eval loader over `rows` and the compiled eval step (None, None without
    rows)."""
    if rows is None:
        return None, None
    config = job.config
    loader = Loader(
        rows,
        _build.eval_batch_size(rows, config),
        mode="eval",
        sharding=placement.batch_sharding,
    )
    precision = "bf16" if config.loop.precision == "bf16" else None
    evaluator = jit(
        models.under_mesh(eval_step(job.loss_fn, precision=precision), placement.mesh),
        donate=False,
        shardings=placement.shardings,
    )
    return loader, evaluator


def _peak_flops(config: Config, mesh: Any) -> float | None:
    devices = mesh.devices.flatten().tolist() if mesh is not None else jax.devices()
    if config.log.peak_flops is not None:
        return config.log.peak_flops * len(devices)
    dtype = "bfloat16" if config.loop.precision == "bf16" else config.model.param_dtype
    return hooks_lib.total_peak_flops(devices, dtype)


@dataclasses.dataclass
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
    say = echo or _stderr
    # Before any data is read: a config its checkpoints cannot continue.
    check_same_state_layout(
        config, Path(config.run_dir), resume or config.checkpoint.resume
    )
    planned = _place.plan(config, recorded=_fallback_record(config))
    job, placement = planned.job, planned.placement
    rows, eval_rows = planned.rows, planned.eval_rows
    config = job.config
    if jax.process_count() > 1 and config.export.hf is not None and export:
        raise ConfigError(
            "`export.hf` is not supported in a multi-process run yet (the export "
            'would need every process\'s shards); set export.hf = "" and export '
            "the checkpoint afterwards with `eqtrain export RUN_DIR OUT`."
        )
    if jax.process_count() > 1 and job.reference == "precomputed":
        raise ConfigError(
            "task.reference = 'precomputed' is not supported in a multi-process run "
            "yet (its pass runs in one process); use task.reference = 'copy', or "
            "'adapters_off' with [lora]."
        )
    run_dir = Path(config.run_dir)
    writer = jax.process_index() == 0
    check_checkpoint_path(run_dir)
    # Every output target (run dir, TensorBoard, export, plot), before compiling.
    _preflight.check_outputs(config, writer=writer)
    check_writable(run_dir)
    # One run per directory: process 0 holds the lock until the run ends.
    lock = checkpoint.RunLock(run_dir).acquire() if writer else None
    loader = None
    try:
        check_kill_switch(config)
        for note in job.notes:  # rows the data pipelines skipped
            say(note)
        data = config.data
        loader = Loader(
            rows,
            data.batch_size,
            seed=config.seed,
            shuffle=data.shuffle,
            prefetch=data.prefetch,
            sharding=placement.batch_sharding,
        )
        base = job.base_reference()  # a LoRA run's frozen base (None otherwise)
        start = checkpoint.resume_run(
            run_dir,
            lambda: placement.place(job.new_state(placement.mesh)),
            like=job.abstract_state(),
            resume=resume or config.checkpoint.resume,
            overwrite=overwrite,
            shardings=placement.state_shardings,
            data=loader,
            base=base,
        )
        state, resumed = start.state, start.step
        if job.reference == "precomputed":  # the reference's log-probs, per pair
            splits = {"train": rows, "eval": eval_rows}
            initial = state.model if resumed is None else None  # fresh: step 0
            values = _reference.attach(
                job, placement, splits, run_dir, writer=writer, say=say, initial=initial
            )
            loader.add_columns(values["train"])
            if eval_rows is not None:
                eval_rows = {**eval_rows, **values["eval"]}
        # Only once the restore succeeded: a refused resume leaves the config
        # that the checkpoints were written with.
        if writer:
            write_config(config, run_dir)
        architecture = _record(config, run_dir, writer)
        prepared = _assemble(
            config,
            job,
            placement,
            eval_rows,
            run_dir,
            loader,
            state,
            resumed,
            start,
            base,
            architecture,
            export,
        )
    except BaseException:
        if loader is not None:
            loader.close()
        if lock is not None:
            lock.release()
        raise
    prepared.lock, prepared.rows = lock, rows
    return prepared


def _fallback_record(config: Config) -> Path | None:
    """The run directory's record of `model.init_from` when that directory's
    config.json is gone (a resumed full fine-tuning run needs only the
    architecture: its weights are in the checkpoints)."""
    init_from = config.model.init_from
    if init_from is None or (Path(init_from) / "config.json").is_file():
        return None
    record = Path(config.run_dir) / _build.RECORD
    return record if (record / "config.json").is_file() else None


def _record(config: Config, run_dir: Path, writer: bool) -> dict[str, Any] | None:
    """Record `model.init_from`'s config and tokenizer files in the run (process
    0), and return the architecture for the manifests; a base directory that is
    gone keeps the run's earlier record."""
    init_from = config.model.init_from
    if init_from is None:
        return None
    if (Path(init_from) / "config.json").is_file():
        if writer:
            return _build.record_init_from(config, run_dir)
        source = Path(init_from)
    else:
        source = run_dir / _build.RECORD
    import json

    with open(source / "config.json", encoding="utf-8") as f:
        return {"path": str(Path(init_from).resolve()), "config": json.load(f)}


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def check_same_state_layout(config: Config, run_dir: Path, resume: str) -> None:
    """Refuse to resume a run whose checkpoints hold a reference copy (DPO/IPO
    with `task.reference = "copy"`) with a config that has none, or LoRA
    adapters with a config without LoRA, or the reverse of either: the state
    would not match its checkpoints."""
    recorded = run_dir / "config.toml"
    if resume != "auto" or not recorded.is_file():
        return
    if not checkpoint.list_steps(run_dir):
        return
    try:
        before = from_dict(read_toml(recorded), source=str(recorded))
    except ConfigError:
        return  # an unreadable config.toml: the restore itself reports the state
    _check_same_lora(before, config, run_dir)
    was, now = reference_mode(before), reference_mode(config)
    if (was == "copy") == (now == "copy"):
        return
    raise ConfigError(
        f"the run in {run_dir} was trained with task.kind = {before.task.kind!r}, "
        f"task.reference = {was or 'none'!r}, and this config asks for "
        f"task.kind = {config.task.kind!r}, task.reference = {now or 'none'!r}: "
        "only a 'copy' reference is part of the saved state, so its checkpoints "
        f"cannot continue this way. Keep task.reference = {was or 'none'!r} (or "
        "the task) to resume, or start a new run directory."
    )


def _check_same_lora(before: Config, config: Config, run_dir: Path) -> None:
    if lora_on(before) == lora_on(config):
        return
    if lora_on(config):  # e.g. a run made by `eqtrain import`
        raise ConfigError(
            f"LoRA cannot continue the run in {run_dir}: its checkpoints hold "
            "every weight (full fine-tuning, or a model brought in by `eqtrain "
            "import`), while a LoRA run trains adapters on a frozen base that "
            "`model.init_from` names, so set model.init_from to the model's "
            "Hugging Face directory (`eqtrain export` writes one from this run) "
            "and start a new run directory."
        )
    raise ConfigError(
        f"the run in {run_dir} trained LoRA adapters (its checkpoints hold only "
        "those), so it cannot continue with LoRA off: keep its [lora] settings to "
        "resume it, or start a new run directory from its merged model (`eqtrain "
        "export RUN --merged`)."
    )


def check_kill_switch(config: Config) -> None:
    """Refuse to start while the run's kill-switch file exists: the run would
    stop after its first step."""
    if config.loop.kill_switch is None:
        return
    path = Path(config.run_dir) / config.loop.kill_switch
    if path.exists():
        raise ConfigError(
            f"the kill-switch file {path} exists, so the run would stop at once; "
            f"remove {path} to continue."
        )


def check_checkpoint_path(run_dir: Path) -> None:
    """Refuse a run directory whose checkpoints could never be read back."""
    try:
        checkpoint.check_path(run_dir)
    except checkpoint.CheckpointError as e:
        raise ConfigError(str(e)) from None


def _assemble(
    config: Config,
    job: _build.Job,
    placement: Any,
    eval_rows: Any,
    run_dir: Path,
    loader: Loader,
    state: Any,
    resumed: int | None,
    start: Any,
    base: Any,
    architecture: Any = None,
    export: bool = True,
) -> "Prepared":
    data = config.data
    loop = config.loop
    step = _place.train_step(job, placement)
    eval_loader, evaluator = evaluation(job, placement, eval_rows)
    ckpt = config.checkpoint
    checkpointer = checkpoint.Checkpointer(
        run_dir,
        every_steps=ckpt.every or None,
        every_minutes=ckpt.every_minutes or None,
        keep_last=ckpt.keep_last,
        keep_every=ckpt.keep_every,
        best=ckpt.best,
        best_mode=ckpt.best_mode,
        data=loader,
        config=to_dict(config),
        async_save=ckpt.async_save,
        run_id=start.run_id,  # refuses another run's steps here, before compiling
        started_from=start.started_from,
        base=base,  # LoRA: store the trained leaves and a reference to the base
        extra={_build.RECORD: architecture} if architecture else None,
    )
    fit_kwargs = dict(
        num_steps=loop.steps,
        hooks=[
            *_hooks(job, run_dir, export, start=resumed or 0, rows=loader.source),
            *samples_hooks(job, placement.mesh, start=resumed or 0),
        ],
        eval_step=evaluator,
        eval_data=eval_loader,
        # No eval data (data.eval = none, or `auto` off the stdlib corpus): the
        # default loop.eval_every has nothing to evaluate (an explicit one with
        # data.eval = none is refused by the config's checks, before any data).
        eval_every=(loop.eval_every or None) if eval_loader is not None else None,
        eval_at_end=loop.eval_at_end and eval_loader is not None,
        checkpointer=checkpointer,
        time_limit=loop.time_limit or None,
        kill_switch=None if loop.kill_switch is None else run_dir / loop.kill_switch,
        flops_per_token=job.flops_per_token(),
        peak_flops=_peak_flops(config, placement.mesh),
        tokens_seen=(resumed or 0) * data.batch_size * job.tokens_per_row,
    )
    return Prepared(
        job, placement, state, step, loader, fit_kwargs, resumed, start.source
    )


def _nothing_to_do(
    prepared: Prepared, run_dir: Path, say: Callable[[str], None]
) -> RunResult:
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
    export_dir = None
    if config.export.hf is not None and (run_dir / config.export.hf).exists():
        export_dir = run_dir / config.export.hf
    result = FitResult(state=prepared.state, stop_reason=reason, history=[])
    return RunResult(result, run_dir, done, export_dir, config)


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
    say = echo or _stderr
    prepared = prepare(
        config, resume=resume, overwrite=overwrite, echo=say, export=export
    )
    config = prepared.job.config
    run_dir = Path(config.run_dir)
    done = prepared.resumed_from
    if done is not None:
        say(f"resumed from {prepared.source}")
    if done is not None and done >= config.loop.steps:
        return _nothing_to_do(prepared, run_dir, say)
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
    export_dir = None
    exported = export and config.export.hf is not None
    if exported and (run_dir / config.export.hf).exists():
        export_dir = run_dir / config.export.hf
    return RunResult(result, run_dir, prepared.resumed_from, export_dir, config)
