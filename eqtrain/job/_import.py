"""`eqtrain import`: a Hugging Face model brought in as a new run directory, its
weights as the step-0 checkpoint and a `config.toml` that `eqtrain fit`
continues from. The directory is written beside its place and renamed into it
when complete: a failed import leaves nothing, and an earlier directory it was
told to replace (`overwrite`) stays until then."""

import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import checkpoint
from .._errors import ConfigError
from .._files import set_default_mode
from .._hooks import StepInfo
from ..config import Config, to_dict
from . import _build, _claim, _identity, _model, _place, _rundir


def import_hf(
    hf_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    config: Config | None = None,
    overwrite: bool = False,
) -> Path:
    """A new run directory at `out_dir` starting from the Hugging Face model in
    `hf_dir`: its weights as the step-0 checkpoint (with a fresh optimizer state
    from `config`'s `[optim]`), its tokenizer with its special tokens and chat
    template, and a `config.toml` describing the architecture, so `eqtrain fit
    <out_dir>/config.toml` fine-tunes it. With `overwrite`, an earlier run there
    is replaced whole, once the new one is complete."""
    # Absolute: the new config.toml's run_dir must not depend on where `fit` runs.
    out = Path(os.path.abspath(out_dir))
    _check_out(out, overwrite)
    hf_dir = os.path.abspath(hf_dir)
    job = _imported_job(config or Config(), hf_dir, out)
    with _staged(out) as tmp:
        staged = _run_config(job, hf_dir, tmp)
        resolved = _moved(staged, tmp, out)
        _save_step_zero(job, resolved, _identity.of_config(staged), tmp)
        _rundir.write_config(resolved, tmp)
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
    """The run directory must be new, or empty, or with `overwrite` a run
    directory (never a directory of other files, which it would delete)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"{out} exists and is a file, not a directory; the run directory OUT "
            "must be a new (or empty) directory. Choose another path."
        )
    if not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ConfigError(
            f"{out} already exists and is not empty; choose a new directory or pass "
            "--overwrite."
        )
    if not (out / "config.toml").is_file() and not (out / "checkpoints").is_dir():
        raise ConfigError(
            f"{out} is not a run directory (no config.toml, no checkpoints/), and "
            "--overwrite would delete everything in it; choose a new directory, or "
            "empty it first."
        )


@contextlib.contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A new directory beside `out` for the body to fill, put in `out`'s place
    when the body succeeds (see `_replace`), and deleted in any case."""
    _claim.check_writable(out.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.import-", dir=out.parent))
    try:
        set_default_mode(tmp)  # mkdtemp's 0700 is for secrets
        yield tmp
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replace(new: Path, out: Path) -> None:
    """Rename `new` to `out`: onto an empty `out` at once; an earlier run is
    moved aside first, put back if the rename fails, and deleted after."""
    if not out.exists() or not any(out.iterdir()):
        os.replace(new, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
    os.replace(out, old)
    try:
        os.replace(new, out)
    except BaseException:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _run_config(job: _build.Job, hf_dir: str, tmp: Path) -> Config:
    """The new run's config, its files in `tmp`: the architecture written out in
    `[model]` (no `init_from`), or where `[model]` cannot say it all, the run's
    record of the directory's config.json; the tokenizer copied into the run."""
    config = job.config
    resolved = dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, init_from=None),
        data=dataclasses.replace(config.data, tokenizer=_tokenizer(job, hf_dir, tmp)),
    )
    if _build.build(resolved).model_config == job.model_config:
        return resolved
    # The [model] section cannot say everything this model is (e.g. GPT-2's
    # exact GELU): the run keeps the directory's config.json as its
    # architecture (<out>/init_from, no weights: those are step 0's).
    _rundir.record_init_from(config, tmp)
    record = str(tmp / _rundir.RECORD)
    return dataclasses.replace(
        resolved, model=dataclasses.replace(resolved.model, init_from=record)
    )


def _tokenizer(job: _build.Job, hf_dir: str, tmp: Path) -> str:
    """`data.tokenizer` of the new run: `auto` becomes the directory's
    tokenizer.json, copied into the run with its special tokens and every chat
    template (`_rundir.copy_tokenizer_files`: the run's templates and EOS come
    from beside it), else the byte tokenizer."""
    tokenizer = job.config.data.tokenizer
    if tokenizer != "auto":
        return tokenizer
    source = Path(hf_dir)
    if not (source / "tokenizer.json").exists():
        return "byte"
    _rundir.copy_tokenizer_files(source, tmp)
    return str(tmp / "tokenizer.json")


def _moved(config: Config, tmp: Path, out: Path) -> Config:
    """`config` with its paths into `tmp` (run_dir, tokenizer, record) as they
    will be once `tmp` is renamed to `out`."""

    def moved(path: str | None) -> str | None:
        if path is None or not Path(path).is_relative_to(tmp):
            return path
        return str(out / Path(path).relative_to(tmp))

    return dataclasses.replace(
        config,
        run_dir=str(out),
        model=dataclasses.replace(
            config.model, init_from=moved(config.model.init_from)
        ),
        data=dataclasses.replace(config.data, tokenizer=moved(config.data.tokenizer)),
    )


def _save_step_zero(
    job: _build.Job, resolved: Config, identity: dict[str, Any], tmp: Path
) -> None:
    """The model's weights and a fresh optimizer state, as checkpoint 0 in
    `tmp`, its manifest recording `resolved` and the run's `identity`."""
    state = _place.placement(job).place(_model.new_state(job))
    ckpt = checkpoint.Checkpointer(
        tmp,
        every_steps=None,
        config=to_dict(resolved),
        async_save=False,
        extra={_identity.MANIFEST_ENTRY: identity},
    )
    ckpt.save(StepInfo(step=0, metrics={}, num_steps=0, _state=state), final=True)
    ckpt.close()
