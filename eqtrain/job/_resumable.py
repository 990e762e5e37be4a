"""Before a run is planned: can this config continue the checkpoints in its
directory (the same LoRA and reference layout of the state, the same identity:
`_identity`), and where is the run's record of `model.init_from` when that
directory is gone."""

import os
from pathlib import Path
from typing import Any

from .. import checkpoint
from .._errors import ConfigError
from ..config import Config, from_dict, lora_on, read_toml, reference_mode
from . import _identity
from ._rundir import RECORD


RESUME_ADVICE = (
    "Drop the override, or put back what changed (the run's config.toml holds "
    "what it was trained with; with model.init_from, that directory's "
    "config.json says the rest), or train this config in a new run directory "
    "(--run-dir)."
)
OPEN_ADVICE = "Drop the --set override: a checkpoint is read as what it was trained as."


def check(config: Config, resume: str) -> Path | None:
    """Refuse a config its run's checkpoints cannot continue
    (`check_same_state_layout`, `check_same_identity`), before any data is read
    or anything written; return the run's record of `model.init_from` to build
    from, if that directory is gone (`fallback_record`)."""
    run_dir = Path(config.run_dir)
    check_same_state_layout(config, run_dir, resume)
    recorded = fallback_record(config)
    check_same_identity(config, resumed_from(run_dir, resume), recorded)
    return recorded


def check_same_state_layout(config: Config, run_dir: Path, resume: str) -> None:
    """Refuse to resume a run whose checkpoints hold a reference copy (DPO/IPO
    with `task.reference = "copy"`) with a config that has none, or LoRA
    adapters with a config without LoRA, or the reverse of either: the state
    would not match its checkpoints."""
    before = _resumed_config(run_dir, resume)
    if before is None:
        return
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


def _resumed_config(run_dir: Path, resume: str) -> Config | None:
    """The config of the checkpoints an automatic resume continues, or None
    (no resume, no checkpoint, or an unreadable config.toml: the restore
    itself reports the state)."""
    recorded = run_dir / "config.toml"
    if resume != "auto" or not recorded.is_file() or not checkpoint.list_steps(run_dir):
        return None
    try:
        return from_dict(read_toml(recorded), source=str(recorded))
    except ConfigError:
        return None


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


def fallback_record(config: Config) -> Path | None:
    """The run directory's record of `model.init_from` when that directory's
    config.json is gone (a resumed full fine-tuning run needs only the
    architecture: its weights are in the checkpoints)."""
    init_from = config.model.init_from
    if init_from is None or (Path(init_from) / "config.json").is_file():
        return None
    record = Path(config.run_dir) / RECORD
    return record if (record / "config.json").is_file() else None


# -- identity ---------------------------------------------------------------------
def resumed_from(run_dir: Path, resume: str | os.PathLike[str]) -> Path | None:
    """The checkpoints a resume continues: the run directory's (`auto`, when it
    holds any), the checkpoint `resume` names, or None (`never`, or none)."""
    if resume == "never":
        return None
    if resume != "auto":
        return Path(resume)
    try:
        return run_dir if checkpoint.list_steps(run_dir) else None
    except checkpoint.CheckpointError:  # no such directory
        return None


def check_same_identity(
    config: Config,
    source: Path | None,
    recorded: Path | None,
    advice: str = RESUME_ADVICE,
) -> None:
    """Refuse `config` for the checkpoint at `source` (a step, or a run's newest)
    when a key that identifies the run (`_identity`) differs from what the
    checkpoint was trained with: naming each such key, both values and
    `advice`. Nothing to compare (no checkpoint, no manifest that says) passes;
    a damaged checkpoint is the restore's to report."""
    found = None if source is None else recorded_identity(source)
    if found is None:
        return
    identity, step_dir = found
    now = _identity.of_config(config, recorded)
    changed = _identity.differences(identity, now)
    if changed:
        raise checkpoint.IncompatibleCheckpointError(
            _refusal(step_dir, changed, advice)
        )


def recorded_identity(path: Path) -> tuple[dict[str, Any], Path] | None:
    """The identity the checkpoint at `path` (a step, or a run's newest readable
    one) was trained with, and its step directory: its manifest's entry, else
    (a manifest written before there was one) what its config says, else the
    run's config.toml; None where nothing says."""
    for step_dir in _newest_first(path):
        try:
            manifest = checkpoint.read_manifest(step_dir)
        except checkpoint.CheckpointError:
            continue  # a damaged step: the restore moves it aside, or says so
        identity = manifest.get(_identity.MANIFEST_ENTRY)
        if isinstance(identity, dict):
            return identity, step_dir
        settings = manifest.get("config") or _config_toml(step_dir.parent.parent)
        return (_identity.of_settings(settings), step_dir) if settings else None
    return None


def _newest_first(path: Path) -> list[Path]:
    """The step directory `path` names, or its run's steps, newest first."""
    try:
        directory, step = checkpoint.resolve(path)
        steps = [step] if step is not None else checkpoint.list_steps(directory)
    except checkpoint.CheckpointError:
        return []  # not a checkpoint: the restore says what it is
    return [directory / str(s) for s in reversed(steps)]


def _config_toml(run_dir: Path) -> dict[str, Any] | None:
    try:
        return read_toml(run_dir / "config.toml")
    except ConfigError:
        return None


def _refusal(step_dir: Path, changed: list[tuple[str, Any, Any]], advice: str) -> str:
    said = "; ".join(
        f"{key} = {_shown(now)} here, {_shown(was)} there" for key, was, now in changed
    )
    return (
        f"this config describes another model than the checkpoint {step_dir} "
        f"was trained as ({said}): its arrays would be read as a model they are "
        f"not, whatever their shapes. {advice}"
    )


def _shown(value: Any) -> str:
    """A value as the config writes it; a tokenizer's digest shortened."""
    if value is None:
        return "unset"
    if isinstance(value, str) and value.startswith("sha256:"):
        return f"the tokenizer file with sha256 {value[7:19]}..."
    return repr(value)
