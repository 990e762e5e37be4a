"""What a run writes in its directory once its state is restored: its
`config.toml` and its record of `model.init_from` (`<run_dir>/init_from/`).
The checks before (`_resumable`, `_claim`) live beside it."""

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax

from .. import data as data_lib
from .._files import set_default_mode
from ..config import Config, to_toml


RECORD = "init_from"
"""`<run_dir>/init_from/`: the config and tokenizer files of `model.init_from`
(no weights), so that the run's architecture and tokenizer never depend on that
directory staying where it was."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""A model's tokenizer and what goes with it: its special tokens (which set the
tokenizer's EOS id); its chat templates come along too (`copy_tokenizer_files`)."""
RECORD_FILES = ("config.json", "generation_config.json", *TOKENIZER_FILES)


def write_run_files(config: Config) -> dict[str, Any] | None:
    """The run's config.toml and record of `model.init_from` (process 0), only
    once the restore succeeded: a refused resume leaves the config that the
    checkpoints were written with. Returns the architecture for the manifests."""
    run_dir, writer = Path(config.run_dir), jax.process_index() == 0
    if writer:
        write_config(config, run_dir)
    return architecture_record(config, run_dir, writer)


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
        copy_tokenizer_files(source, tmp, RECORD_FILES)
        _replace_dir(tmp, run_dir / RECORD)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _architecture_entry(init_from, run_dir / RECORD)


def copy_tokenizer_files(
    source: Path, target: Path, names: tuple[str, ...] = TOKENIZER_FILES
) -> None:
    """Copy the files `names` that `source` has into `target`, a directory being
    made, with every chat template of `source` (`eqtrain.data.chat_template`
    reads them beside the tokenizer) in transformers 5's layout, whichever layout
    `source` has: `chat_template.jinja` and `additional_chat_templates/`. The
    copies get a new file's mode under the umask, not the source's."""
    for name in names:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    data_lib.copy_chat_templates(source, target)


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
