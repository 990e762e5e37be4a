"""Working on an existing run: evaluate, export or describe a run directory or
one of its checkpoints, and import a Hugging Face model as a new run."""

import dataclasses
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import checkpoint, checkpoint as _storage, hf, lora
from .._errors import ConfigError
from .._hooks import StepInfo
from .._loop import evaluate
from ..config import (
    ARCH_KEYS,
    Config,
    apply_overrides,
    from_dict,
    read_toml,
    to_dict,
    validate,
)
from ..plot import read_metrics
from . import _build, _data, _place, _reference
from ._run import check_writable, evaluation, write_config


def _run_dir_of(path: Path) -> Path:
    """The run directory of a run, checkpoints or step directory."""
    directory, _ = _storage.resolve(path)
    return directory.parent


def open_run(path: str | os.PathLike[str], overrides: Iterable[str] = ()) -> Config:
    """The config a run (or one checkpoint of it) was trained with, with
    `overrides` applied and `run_dir` pointing at where the run is now.

    The run's `config.toml` is used; a step directory uses its own manifest's
    config (exactly what that checkpoint was trained with).
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(
            f"{p} does not exist; pass a run directory (holding config.toml and "
            "checkpoints/) or one checkpoint step directory."
        )
    directory, step = _storage.resolve(p)
    run_dir = directory.parent
    has_config = (run_dir / "config.toml").exists()
    recorded = None
    if step is not None or not has_config:
        try:
            recorded = checkpoint.read_manifest(p).get("config")
        except checkpoint.CheckpointError as e:
            if not has_config:
                raise ConfigError(
                    f"{p} is not an eqtrain run: it has no config.toml and {e}"
                ) from None
            # a step whose manifest is damaged: its restore says so, clearly
        if recorded is None and not has_config:
            raise ConfigError(f"the checkpoint at {p} records no config.")
    if recorded:
        model = recorded.get("model") or {}
        if model.get("init_from"):  # the architecture is the directory's (or the
            # run's record of it): the manifest's resolved copy is not a setting
            model = {k: v for k, v in model.items() if k not in ARCH_KEYS}
            recorded = {**recorded, "model": model}
        config = from_dict(recorded, source=f"the manifest of {p}")
    else:
        config = from_dict(read_toml(run_dir / "config.toml"), source=str(run_dir))
    config = dataclasses.replace(config, run_dir=str(run_dir))
    config = apply_overrides(config, overrides)
    validate(config)
    return config


def _restore(path: Path, job: _build.Job, placement: _place.Placement) -> Any:
    if not checkpoint.list_steps(path):
        raise ConfigError(
            f"{path} holds no checkpoint yet; train it first (`eqtrain fit`)."
        )
    return checkpoint.restore(
        path,
        job.abstract_state(),
        shardings=placement.state_shardings,
        init=lambda: placement.place(job.new_state(placement.mesh)),  # LoRA's base
        base=job.base_reference(),
    )


def evaluate_run(
    path: str | os.PathLike[str], overrides: Iterable[str] = ()
) -> dict[str, Any]:
    """Evaluate a run's latest checkpoint (or the given step directory) on its
    configured eval data. Returns `{"step": k, "eval/loss": ..., ...}`."""
    config = open_run(path, overrides)
    job = _open_job(path, config)
    rows = _build.eval_rows(job)
    if rows is None:
        raise ConfigError(
            f"the run at {path} has no evaluation data (data.eval = "
            f"{config.data.eval!r}); pass one with --set data.eval=PATH."
        )
    placement = _place.placement(job)
    if job.reference == "precomputed":  # the run's stored pass, or a new one
        values = _reference.attach(
            job, placement, {"eval": rows}, job.run_dir, writer=False, say=_quiet
        )
        rows = {**rows, **values["eval"]}
    restored = _restore(Path(path), job, placement)
    loader, evaluator = evaluation(job, placement, rows)
    metrics = evaluate(restored.state, evaluator, loader)
    return {"step": restored.step, **metrics}


def _quiet(text: str) -> None:
    pass


def export_run(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    ema: bool = False,
    merged: bool = False,
    overwrite: bool = False,
    overrides: Iterable[str] = (),
) -> Path:
    """Export a run's latest checkpoint (or a step directory) in Hugging Face
    format to `out_dir`. A LoRA run's export is its adapter in PEFT's format, or
    with `merged` the full model with the adapters folded in."""
    config = open_run(path, overrides)
    job = _open_job(path, config)
    if merged and job.lora is None:
        raise ConfigError(
            f"--merged merges LoRA adapters, but the run at {path} trains no "
            "adapters (lora.rank = 0); drop --merged."
        )
    state = _restore(Path(path), job, _place.placement(job)).state
    if ema and state.ema is None:
        raise ConfigError(
            f"the run at {path} keeps no EMA weights (loop.ema was unset); drop --ema."
        )
    model = job.exported(state.ema_model if ema else state.model)
    if job.lora is not None and not merged:
        return Path(
            hf.export_adapter(
                model,
                out_dir,
                model_type=job.model_type,
                spec=job.lora,
                trained=job.exported(state.trainable),
                overwrite=overwrite,
            )
        )
    if merged:
        model = lora.merge(model)
    return Path(
        hf.export(
            model,
            model.config,
            out_dir,
            dtype=dtype,
            max_shard_size=config.export.max_shard_size,
            tokenizer=job.tokenizer,
            model_type=job.model_type,
            chat_template=getattr(job.template, "source", None),
            overwrite=overwrite,
        )
    )


def restore_run(
    path: str | os.PathLike[str], overrides: Iterable[str] = ()
) -> tuple[_build.Job, Any]:
    """The job and restored `TrainState` of a run's latest checkpoint (or of a
    step directory), placed on the run's mesh: what `export_run` exports and
    `eqtrain generate` samples from (`job.exported(state.model)`)."""
    job = _open_job(path, open_run(path, overrides))
    return job, _restore(Path(path), job, _place.placement(job)).state


def import_hf(
    hf_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    config: Config | None = None,
    overwrite: bool = False,
) -> Path:
    """A new run directory at `out_dir` starting from the Hugging Face model in
    `hf_dir`: its weights as the step-0 checkpoint (with a fresh optimizer state
    from `config`'s `[optim]`), its tokenizer, and a `config.toml` describing
    the architecture, so `eqtrain fit <out_dir>/config.toml` fine-tunes it."""
    # Absolute: the new config.toml's run_dir must not depend on where `fit` runs.
    out = Path(os.path.abspath(out_dir))
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"{out} exists and is a file, not a directory; the run directory OUT "
            "must be a new (or empty) directory. Choose another path."
        )
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(
            f"{out} already exists and is not empty; choose a new directory or pass "
            "--overwrite."
        )
    hf_dir = os.path.abspath(hf_dir)
    base = config or Config()
    model = dataclasses.replace(base.model, init_from=hf_dir)
    config = dataclasses.replace(base, model=model, run_dir=str(out))
    job = _build.build(config)
    if job.lora is not None:
        raise ConfigError(
            "`eqtrain import` copies the model's weights into a new run, but LoRA "
            "runs keep their base outside the run (checkpoints hold the adapters and "
            f"name the base by content): set model.init_from = {hf_dir!r} in a "
            "config with [lora] and run `eqtrain fit` on it instead."
        )
    check_writable(out)
    if overwrite:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    tokenizer = job.config.data.tokenizer
    if tokenizer == "auto" and os.path.exists(os.path.join(hf_dir, "tokenizer.json")):
        shutil.copyfile(os.path.join(hf_dir, "tokenizer.json"), out / "tokenizer.json")
        tokenizer = str((out / "tokenizer.json").resolve())
    elif tokenizer == "auto":
        tokenizer = "byte"
    resolved = dataclasses.replace(
        job.config,
        model=dataclasses.replace(job.config.model, init_from=None),
        data=dataclasses.replace(job.config.data, tokenizer=tokenizer),
    )
    if _build.build(resolved).model_config != job.model_config:
        # The [model] section cannot say everything this model is (e.g. GPT-2's
        # exact GELU): the run keeps the directory's config.json as its
        # architecture (<out>/init_from, no weights: those are step 0's).
        _build.record_init_from(config, out)
        record = str(out / _build.RECORD)
        resolved = dataclasses.replace(
            resolved, model=dataclasses.replace(resolved.model, init_from=record)
        )
    placement = _place.placement(job)
    state = placement.place(job.new_state())
    ckpt = checkpoint.Checkpointer(
        out, every_steps=None, config=to_dict(resolved), async_save=False
    )
    ckpt.save(StepInfo(step=0, metrics={}, num_steps=0, _state=state), final=True)
    ckpt.close()
    write_config(resolved, out)
    return out


def run_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a run directory holds: config, checkpoints with their metrics and
    stop reasons, the last logged metrics, and exports."""
    p = Path(path)
    config = open_run(p)
    run_dir = _run_dir_of(p)
    steps = checkpoint.list_steps(run_dir)
    directory = run_dir / "checkpoints"
    checkpoints = []
    readable = []
    for step in steps:
        problem = checkpoint.step_problems(directory / str(step))
        if problem is not None:
            checkpoints.append({"step": step, "error": problem})
            continue
        manifest = checkpoint.read_manifest(run_dir, step=step)
        readable.append(step)
        checkpoints.append(
            {
                "step": step,
                "final": manifest.get("final"),
                "stop_reason": manifest.get("stop_reason"),
                "metrics": manifest.get("metrics", {}),
                "mesh": manifest.get("mesh"),
                "run_id": manifest.get("run_id"),
            }
        )
    last = _last_metrics(run_dir)
    config = _with_architecture(config, _record_of(p))
    export = None
    if config.export.hf is not None and (run_dir / config.export.hf).exists():
        export = str(run_dir / config.export.hf)
    trained = readable[-1] if readable else 0
    return {
        "run_dir": str(run_dir),
        # the newest step a resume would start from (damaged ones do not count)
        "steps_trained": trained,
        # a mixture's training tokens per source up to that step
        "sources": _data.source_tokens(config, trained),
        "damaged": checkpoint.damaged_steps(directory),
        "target_steps": config.loop.steps,
        "checkpoints": checkpoints,
        "last_metrics": last,
        "export": export,
        "config": to_dict(config),
    }


def _open_job(path: str | os.PathLike[str], config: Config) -> _build.Job:
    """The job of an existing run, built with the run's own record of
    `model.init_from`'s architecture and tokenizer (so that a moved or deleted
    base directory does not matter; a LoRA run still needs its base's weights)."""
    return _build.build(config, recorded=_record_of(Path(path)))


def _record_of(path: Path) -> Path | None:
    run_dir = _run_dir_of(path)
    manifest = None
    if not (run_dir / _build.RECORD / "config.json").is_file():
        try:
            manifest = checkpoint.read_manifest(path)
        except (checkpoint.CheckpointError, OSError):
            manifest = None
    return _build.recorded_init_from(run_dir, manifest)


def _with_architecture(config: Config, record: Path | None = None) -> Config:
    """`config` with the architecture fields of `model.init_from` filled in (the
    run's config.toml leaves them to the directory): from the run's record of
    it, else from the directory, when either is readable."""
    m = config.model
    if m.init_from is None:
        return config
    try:
        source = str(record) if record is not None else m.init_from
        model_config, hf_type = hf.load_config(source, dtype=m.param_dtype)
        model_type = hf.infer_model_type(model_config, hf_type)
    except Exception:  # a moved or damaged base: show what the config says
        return config
    section = _build.model_section(model_config, model_type, base=m)
    return dataclasses.replace(config, model=section)


def _last_metrics(run_dir: Path) -> dict[str, Any] | None:
    """The last logged step's metrics (None when nothing was logged yet)."""
    if not (run_dir / "metrics.jsonl").exists():
        return None
    try:
        return read_metrics(run_dir)[-1]
    except ConfigError:  # no step records yet
        return None
