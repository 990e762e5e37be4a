"""Working on an existing run: evaluate, export or describe a run directory or
one of its checkpoints, and import a Hugging Face model as a new run."""

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import checkpoint, hf, lora, quantize
from .._errors import ConfigError
from .._fit import evaluate
from ..config import (
    Config,
    to_dict,
)
from ..plot import read_metrics
from ..post_training import rewards
from . import (
    _build,
    _data,
    _model,
    _open,
    _place,
    _reference,
    _resolve,
    _rows,
    _run_hooks,
    _steps,
)


def evaluate_run(
    path: str | os.PathLike[str], overrides: Iterable[str] = ()
) -> dict[str, Any]:
    """Evaluate a run's latest checkpoint (or the given step directory) on its
    configured eval data. Returns `{"step": k, "eval/loss": ..., ...}`."""
    job = _open.open_job(path, _open.open_run(path, overrides))
    placement = _place.placement(job)
    # a LoRA run's base is read once, for the precomputed reference's key and restore
    precomputed = job.reference == "precomputed"
    base = _model.base_reference(job) if precomputed else None
    rows = _eval_rows(job, placement, path, base)
    restored = _open.restore(Path(path), job, placement, base)
    loader, evaluator = _steps.evaluation(job, placement, rows)
    metrics = evaluate(restored.state, evaluator, loader)
    return {"step": restored.step, **metrics}


def _eval_rows(
    job: _build.Job, placement: Any, path: Any, base: dict[str, Any] | None
) -> _rows.Rows:
    """The run's eval rows (with the precomputed reference's columns: the run's
    stored pass, or a new one; `base`: a LoRA run's `_model.base_reference`)."""
    rows = _rows.eval_rows(job)
    if rows is None:
        raise ConfigError(
            f"the run at {path} has no evaluation data (data.eval = "
            f"{job.config.data.eval!r}); pass one with --set data.eval=PATH."
        )
    if job.reference != "precomputed":
        return rows
    values = _reference.attach(
        job,
        placement,
        {"eval": rows},
        job.run_dir,
        writer=False,
        say=_quiet,
        base=base,
    )
    return {**rows, **values["eval"]}


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
    with `merged` the full model with the adapters folded in. A GRPO run's
    reward functions are not imported (an export scores nothing)."""
    with rewards.imports_deferred():
        job = _open.open_job(path, _open.open_run(path, overrides))
    _check_merged(job, merged, path)
    state = _open.restore(Path(path), job, _place.placement(job)).state
    model = job.exported(_weights(state, ema, path))
    if job.lora is not None and not merged:
        return _export_adapter(job, state, model, out_dir, overwrite)
    if merged:
        model = quantize.dequantize(lora.merge(model))
    return _export_model(job, model, out_dir, dtype=dtype, overwrite=overwrite)


def _check_merged(job: _build.Job, merged: bool, path: Any) -> None:
    """`--merged` needs a run that trains adapters."""
    if merged and job.lora is None:
        raise ConfigError(
            f"--merged merges LoRA adapters, but the run at {path} trains no "
            "adapters (lora.rank = 0); drop --merged."
        )


def _weights(state: Any, ema: bool, path: Any) -> Any:
    """The state's model, or with `ema` its EMA weights (which the run must keep)."""
    if not ema:
        return state.model
    if state.ema is None:
        raise ConfigError(
            f"the run at {path} keeps no EMA weights (loop.ema was unset); drop --ema."
        )
    return state.ema_model


def _export_adapter(
    job: _build.Job, state: Any, model: Any, out_dir: Any, overwrite: bool
) -> Path:
    """A LoRA run's adapters, in PEFT's format, with the run's tokenizer."""
    trained = job.exported(state.trainable)
    return Path(
        hf.export_adapter(
            model,
            out_dir,
            model_type=job.model_type,
            spec=job.lora,
            base_model_name_or_path=_run_hooks.adapter_base(job),
            trained=trained,
            tokenizer=job.tokenizer,
            chat_template=_run_hooks.exported_templates(job),
            overwrite=overwrite,
        )
    )


def _export_model(
    job: _build.Job, model: Any, out_dir: Any, *, dtype: str | None, overwrite: bool
) -> Path:
    """The whole model in Hugging Face format, with the run's tokenizer."""
    return Path(
        hf.export(
            model,
            model.config,
            out_dir,
            dtype=dtype,
            max_shard_size=job.config.export.max_shard_size,
            tokenizer=job.tokenizer,
            model_type=job.model_type,
            chat_template=_run_hooks.exported_templates(job),
            overwrite=overwrite,
        )
    )


def run_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a run directory holds: config, checkpoints with their metrics and
    stop reasons, the last logged metrics, and exports. A GRPO run's reward
    functions are not imported."""
    p = Path(path)
    run_dir = _open.run_dir_of(p)
    with rewards.imports_deferred():
        config = _open.open_run(p)
    config = _with_architecture(config, _open.record_of(p))
    directory = run_dir / "checkpoints"
    checkpoints, trained = _checkpoints(run_dir)
    return {
        "run_dir": str(run_dir),
        # the newest step a resume would start from (damaged ones do not count)
        "steps_trained": trained,
        # a mixture's training tokens per source up to that step
        "sources": _data.source_tokens(config, trained),
        "damaged": checkpoint.damaged_steps(directory),
        "target_steps": config.loop.steps,
        "checkpoints": checkpoints,
        "last_metrics": _last_metrics(run_dir),
        "export": _export_of(config, run_dir),
        "config": to_dict(config),
    }


def _checkpoints(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """Every checkpoint's info, and the newest readable step (0 without one)."""
    found = [_checkpoint_info(run_dir, s) for s in checkpoint.list_steps(run_dir)]
    readable = [c["step"] for c in found if "error" not in c]
    return found, readable[-1] if readable else 0


def _checkpoint_info(run_dir: Path, step: int) -> dict[str, Any]:
    """A checkpoint's manifest entries, or what is wrong with it."""
    problem = checkpoint.step_problems(run_dir / "checkpoints" / str(step))
    if problem is not None:
        return {"step": step, "error": problem}
    manifest = checkpoint.read_manifest(run_dir, step=step)
    return {
        "step": step,
        "final": manifest.get("final"),
        "stop_reason": manifest.get("stop_reason"),
        "metrics": manifest.get("metrics", {}),
        "mesh": manifest.get("mesh"),
        "run_id": manifest.get("run_id"),
    }


def _export_of(config: Config, run_dir: Path) -> str | None:
    """The run's final export, if it has written one."""
    if config.export.hf is None or not (run_dir / config.export.hf).exists():
        return None
    return str(run_dir / config.export.hf)


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
    section = _resolve.model_section(model_config, model_type, base=m)
    return dataclasses.replace(config, model=section)


def _last_metrics(run_dir: Path) -> dict[str, Any] | None:
    """The last logged step's metrics (None when nothing was logged yet)."""
    if not (run_dir / "metrics.jsonl").exists():
        return None
    try:
        return read_metrics(run_dir)[-1]
    except ConfigError:  # no step records yet
        return None
