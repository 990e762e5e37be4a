"""Before a run is planned: can this config continue the checkpoints in its
directory (the same LoRA and reference layout of the state), and where is the
run's record of `model.init_from` when that directory is gone."""

from pathlib import Path

from .. import checkpoint
from .._errors import ConfigError
from ..config import Config, from_dict, lora_on, read_toml, reference_mode
from ._rundir import RECORD


def check(config: Config, resume: str) -> Path | None:
    """Refuse a config its run's checkpoints cannot continue
    (`check_same_state_layout`), before any data is read; return the run's
    record of `model.init_from` to build from, if that directory is gone
    (`fallback_record`)."""
    check_same_state_layout(config, Path(config.run_dir), resume)
    return fallback_record(config)


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
