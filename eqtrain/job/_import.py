"""`eqtrain import`: a Hugging Face model brought in as a new run directory, its
weights as the step-0 checkpoint and a `config.toml` that `eqtrain fit`
continues from."""

import dataclasses
import os
import shutil
from pathlib import Path

from .. import checkpoint
from .._errors import ConfigError
from .._hooks import StepInfo
from ..config import Config, to_dict
from . import _build, _claim, _place, _rundir


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
    _check_out(out, overwrite)
    hf_dir = os.path.abspath(hf_dir)
    job = _imported_job(config or Config(), hf_dir, out)
    _claim.check_writable(out)
    if overwrite:
        shutil.rmtree(out / "checkpoints", ignore_errors=True)
    resolved = _run_config(job, hf_dir, out)
    _save_step_zero(job, resolved, out)
    _rundir.write_config(resolved, out)
    return out


def _imported_job(base: Config, hf_dir: str, out: Path) -> _build.Job:
    """The job of `base` starting from `hf_dir` in `out` (LoRA refused: its
    base stays outside the run)."""
    model = dataclasses.replace(base.model, init_from=hf_dir)
    job = _build.build(dataclasses.replace(base, model=model, run_dir=str(out)))
    if job.lora is not None:
        raise ConfigError(
            "`eqtrain import` copies the model's weights into a new run, but LoRA "
            "runs keep their base outside the run (checkpoints hold the adapters and "
            f"name the base by content): set model.init_from = {hf_dir!r} in a "
            "config with [lora] and run `eqtrain fit` on it instead."
        )
    return job


def _check_out(out: Path, overwrite: bool) -> None:
    """The run directory must be new, or empty, or `overwrite` given."""
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


def _run_config(job: _build.Job, hf_dir: str, out: Path) -> Config:
    """The new run's config: the architecture written out in `[model]` (no
    `init_from`), or where `[model]` cannot say it all, the run's record of
    the directory's config.json; the tokenizer copied into the run."""
    config = job.config
    resolved = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, init_from=None),
        data=dataclasses.replace(config.data, tokenizer=_tokenizer(job, hf_dir, out)),
    )
    if _build.build(resolved).model_config == job.model_config:
        return resolved
    # The [model] section cannot say everything this model is (e.g. GPT-2's
    # exact GELU): the run keeps the directory's config.json as its
    # architecture (<out>/init_from, no weights: those are step 0's).
    _rundir.record_init_from(config, out)
    record = str(out / _rundir.RECORD)
    return dataclasses.replace(
        resolved, model=dataclasses.replace(resolved.model, init_from=record)
    )


def _tokenizer(job: _build.Job, hf_dir: str, out: Path) -> str:
    """`data.tokenizer` of the new run: `auto` becomes the directory's
    tokenizer.json (copied into the run), else the byte tokenizer."""
    tokenizer = job.config.data.tokenizer
    if tokenizer != "auto":
        return tokenizer
    if not os.path.exists(os.path.join(hf_dir, "tokenizer.json")):
        return "byte"
    shutil.copyfile(os.path.join(hf_dir, "tokenizer.json"), out / "tokenizer.json")
    return str((out / "tokenizer.json").resolve())


def _save_step_zero(job: _build.Job, resolved: Config, out: Path) -> None:
    """The model's weights and a fresh optimizer state, as checkpoint 0."""
    state = _place.placement(job).place(job.new_state())
    ckpt = checkpoint.Checkpointer(
        out, every_steps=None, config=to_dict(resolved), async_save=False
    )
    ckpt.save(StepInfo(step=0, metrics={}, num_steps=0, _state=state), final=True)
    ckpt.close()
