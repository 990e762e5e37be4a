"""A planned run claims its directory: what a multi-process run cannot do yet is
refused, the directory is proved writable, every output target is checked
(`_preflight`), a kill-switch file left behind is refused, and process 0 takes
the directory's lock. Nothing is compiled yet."""

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import jax

from .. import checkpoint
from .._errors import ConfigError
from ..config import Config
from . import _build, _preflight


@dataclasses.dataclass(frozen=True)
class Claimed:
    """A claimed run directory.

    Attributes:
        lock: the directory's `RunLock` (process 0), else None.
        targets: where the run exports, by form (`eqtrain.config.export_targets`).
    """

    lock: Any
    targets: dict[str, Path]


def claim(job: _build.Job, *, export: bool) -> Claimed:
    """Check the run directory and every output target (before compiling), and
    take the directory's lock: one run per directory, process 0 holds it until
    the run ends (other processes get None)."""
    config = job.config
    run_dir, writer = Path(config.run_dir), jax.process_index() == 0
    refuse_multi_process(job, export=export)
    check_checkpoint_path(run_dir)
    # Every output target (run dir, TensorBoard, export, plot), before compiling.
    targets = _preflight.check_outputs(config, writer=writer)
    check_writable(run_dir)
    check_kill_switch(config)
    lock = checkpoint.RunLock(run_dir).acquire() if writer else None
    return Claimed(lock, targets)


def refuse_multi_process(job: _build.Job, *, export: bool) -> None:
    """What a multi-process run cannot do yet: an HF export written during the
    run, and the precomputed reference's pass."""
    if jax.process_count() == 1:
        return
    if job.config.export.hf is not None and export:
        raise ConfigError(
            "`export.hf` is not supported in a multi-process run yet (the export "
            'would need every process\'s shards); set export.hf = "" and export '
            "the checkpoint afterwards with `eqtrain export RUN_DIR OUT`."
        )
    if job.reference == "precomputed":
        raise ConfigError(
            "task.reference = 'precomputed' is not supported in a multi-process run "
            "yet (its pass runs in one process); use task.reference = 'copy', or "
            "'adapters_off' with [lora]."
        )


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
