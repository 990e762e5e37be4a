"""An existing run opened: the config it was trained with (or one checkpoint
of it), its job built with its own record of `model.init_from`, and its state
restored on its mesh."""

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .. import checkpoint
from .._errors import ConfigError
from ..config import ARCH_KEYS, Config, apply_overrides, from_dict, read_toml, validate
from . import _build, _model, _place, _resumable, _rundir


def run_dir_of(path: Path) -> Path:
    """The run directory of a run, checkpoints or step directory."""
    directory, _ = checkpoint.resolve(path)
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
    run_dir = run_dir_of(p)
    recorded = _manifest_config(p)
    if recorded:
        config = from_dict(_settings_of(recorded), source=f"the manifest of {p}")
    else:
        config = from_dict(read_toml(run_dir / "config.toml"), source=str(run_dir))
    config = dataclasses.replace(config, run_dir=str(run_dir))
    overrides = list(overrides)
    config = apply_overrides(config, overrides)
    validate(config)
    if overrides:  # not one that reads the weights as another model
        _resumable.check_same_identity(
            config, p, record_of(p), advice=_resumable.OPEN_ADVICE
        )
    return config


def _manifest_config(p: Path) -> dict[str, Any] | None:
    """The config a step directory's manifest records (also a run's without
    config.toml: its latest step's); None where config.toml is used."""
    directory, step = checkpoint.resolve(p)
    has_config = (directory.parent / "config.toml").exists()
    if step is None and has_config:
        return None
    try:
        recorded = checkpoint.read_manifest(p).get("config")
    except checkpoint.CheckpointError as e:
        if not has_config:
            raise ConfigError(
                f"{p} is not an eqtrain run: it has no config.toml and {e}"
            ) from None
        return None  # a step whose manifest is damaged: its restore says so, clearly
    if recorded is None and not has_config:
        raise ConfigError(f"the checkpoint at {p} records no config.")
    return recorded


def _settings_of(recorded: dict[str, Any]) -> dict[str, Any]:
    """A manifest's config as settings: with `model.init_from`, the architecture
    is the directory's (or the run's record of it), so the manifest's resolved
    copy of it is left out."""
    model = recorded.get("model") or {}
    if not model.get("init_from"):
        return recorded
    model = {k: v for k, v in model.items() if k not in ARCH_KEYS}
    return {**recorded, "model": model}


def restore(
    path: Path,
    job: _build.Job,
    placement: _place.Placement,
    base: dict[str, Any] | None = None,
) -> Any:
    """The latest checkpoint of `path` (or that step directory), restored onto
    `placement` (`checkpoint.restore`'s result: state and step). `base`: a LoRA
    run's `_model.base_reference`, when the caller has read it already (else it
    is read here, once the checkpoints are found)."""
    if not checkpoint.list_steps(path):
        raise ConfigError(
            f"{path} holds no checkpoint yet; train it first (`eqtrain fit`)."
        )
    return checkpoint.restore(
        path,
        job.abstract,
        shardings=placement.state_shardings,
        # a LoRA checkpoint holds the adapters: the base is rebuilt
        init=lambda: placement.place(_model.new_state(job, placement.mesh)),
        base=base or _model.base_reference(job),
    )


def restore_run(
    path: str | os.PathLike[str], overrides: Iterable[str] = ()
) -> tuple[_build.Job, Any]:
    """The job and restored `TrainState` of a run's latest checkpoint (or of a
    step directory), placed on the run's mesh: what `export_run` exports and
    `eqtrain generate` samples from (`job.exported(state.model)`)."""
    job = open_job(path, open_run(path, overrides))
    return job, restore(Path(path), job, _place.placement(job)).state


def open_job(path: str | os.PathLike[str], config: Config) -> _build.Job:
    """The job of an existing run, built with the run's own record of
    `model.init_from`'s architecture and tokenizer (so that a moved or deleted
    base directory does not matter; a LoRA run still needs its base's weights)."""
    return _build.build(config, recorded=record_of(Path(path)))


def record_of(path: Path) -> Path | None:
    """The run's record of `model.init_from` (or one made from the manifest)."""
    run_dir = run_dir_of(path)
    manifest = None
    if not (run_dir / _rundir.RECORD / "config.json").is_file():
        try:
            manifest = checkpoint.read_manifest(path)
        except (checkpoint.CheckpointError, OSError):
            manifest = None
    return _rundir.recorded_init_from(run_dir, manifest)
