"""A run's directory: the checks before a run claims it (writable, readable
checkpoints, no kill switch, a state its checkpoints can continue), its
`config.toml`, and its record of `model.init_from` (`<run_dir>/init_from/`)."""

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .. import checkpoint
from .._errors import ConfigError
from .._files import set_default_mode
from ..config import Config, from_dict, lora_on, read_toml, reference_mode, to_toml


RECORD = "init_from"
"""`<run_dir>/init_from/`: the config and tokenizer files of `model.init_from`
(no weights), so that the run's architecture and tokenizer never depend on that
directory staying where it was."""
RECORD_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


# -- checks before a run claims its directory ----------------------------------------
def check_writable(run_dir: Path) -> None:
    """Create `run_dir` and prove it writable, or say why not (before any work)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-test-"):
            pass
    except OSError as e:
        raise _not_writable(run_dir, e) from None


def _not_writable(run_dir: Path, e: OSError) -> ConfigError:
    return ConfigError(
        f"the run directory {run_dir} is not writable ({e.strerror or e}). "
        "Choose another with --run-dir or `run_dir` in the config."
    )


def check_checkpoint_path(run_dir: Path) -> None:
    """Refuse a run directory whose checkpoints could never be read back."""
    try:
        checkpoint.check_path(run_dir)
    except checkpoint.CheckpointError as e:
        raise ConfigError(str(e)) from None


def check_kill_switch(config: Config) -> None:
    """Refuse to start while the run's kill-switch file exists: the run would
    stop after its first step."""
    if config.loop.kill_switch is None:
        return
    path = Path(config.run_dir) / config.loop.kill_switch
    if path.exists():
        raise ConfigError(
            f"the kill-switch file {path} exists, so the run would "
            f"stop at once; remove {path} to continue."
        )


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


# -- what a run writes there ------------------------------------------------------
def write_config(config: Config, run_dir: Path) -> Path:
    """Write the resolved config to `<run_dir>/config.toml`, atomically."""
    path = run_dir / "config.toml"
    tmp = path.with_name(".config.toml.tmp")
    tmp.write_text(to_toml(config), encoding="utf-8")
    os.replace(tmp, path)
    return path


def record_init_from(config: Config, run_dir: Path) -> dict[str, Any] | None:
    """Copy `model.init_from`'s config and tokenizer files into
    `<run_dir>/init_from/` (replacing an older copy whole, atomically) and
    return the manifest entry of the architecture (its config.json); None
    without `init_from`."""
    init_from = config.model.init_from
    if init_from is None:
        return None
    source = Path(init_from)
    tmp = Path(tempfile.mkdtemp(prefix=".init_from-", dir=run_dir))
    try:
        set_default_mode(tmp)  # mkdtemp's 0700 is for secrets
        for name in RECORD_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)
        _replace_dir(tmp, run_dir / RECORD)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _architecture_entry(init_from, run_dir / RECORD)


def _replace_dir(new: Path, target: Path) -> None:
    """Put the directory `new` in `target`'s place (an older one moved aside
    first, then deleted)."""
    old = target.with_name(".init_from.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


def _architecture_entry(init_from: str, source: Path) -> dict[str, Any]:
    """The manifests' entry of the architecture: `init_from`'s path and the
    config.json in `source`."""
    with open(source / "config.json", encoding="utf-8") as f:
        return {"path": str(Path(init_from).resolve()), "config": json.load(f)}


def architecture_record(
    config: Config, run_dir: Path, writer: bool
) -> dict[str, Any] | None:
    """Record `model.init_from`'s config and tokenizer files in the run (process
    0), and return the architecture for the manifests; a base directory that is
    gone keeps the run's earlier record."""
    init_from = config.model.init_from
    if init_from is None:
        return None
    if not (Path(init_from) / "config.json").is_file():
        return _architecture_entry(init_from, run_dir / RECORD)
    if writer:
        return record_init_from(config, run_dir)
    return _architecture_entry(init_from, Path(init_from))


def fallback_record(config: Config) -> Path | None:
    """The run directory's record of `model.init_from` when that directory's
    config.json is gone (a resumed full fine-tuning run needs only the
    architecture: its weights are in the checkpoints)."""
    init_from = config.model.init_from
    if init_from is None or (Path(init_from) / "config.json").is_file():
        return None
    record = Path(config.run_dir) / RECORD
    return record if (record / "config.json").is_file() else None


def recorded_init_from(run_dir: Path, manifest: dict[str, Any] | None) -> Path | None:
    """A run's record of `model.init_from` (`<run_dir>/init_from`), or, for a
    checkpoint without its run directory, one made from its manifest's
    architecture entry (config.json only) in a temporary directory; None."""
    if (run_dir / RECORD / "config.json").is_file():
        return run_dir / RECORD
    entry = (manifest or {}).get(RECORD)
    if not entry or "config" not in entry:
        return None
    tmp = Path(tempfile.mkdtemp(prefix="eqtrain-init_from-"))
    (tmp / "config.json").write_text(json.dumps(entry["config"]), encoding="utf-8")
    return tmp
