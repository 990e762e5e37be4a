"""Checks of every place a run will write, before anything is compiled, and the
one-paragraph messages for write errors (`OSError`) that happen anyway.

A run writes its run directory (config.toml, metrics.jsonl, checkpoints/), the
TensorBoard directory `<run_dir>/tb`, the Hugging Face export `<run_dir>/<export.hf>`
and, with `eqtrain plot`, `<run_dir>/plot.png`. Each is checked here, so a target
that cannot be written fails the run at once, not after hours of training.
"""

import errno
import os
import re
from pathlib import Path
from types import TracebackType
from typing import Any

from .._errors import ConfigError
from .._files import describe_names, foreign_files
from .._fit import failed_at
from ..config import Config, export_targets, steps_export_dir


PROBE_BYTES = 64 * 1024
"""What the writability probe writes (and fsyncs): enough that a full disk fails
it (an empty probe file needs no data block, so it succeeds on a full disk)."""

WRITE_ERRNOS = frozenset(
    {
        errno.ENOSPC,  # no space left on device
        errno.EDQUOT,  # disk quota exceeded
        errno.EROFS,  # read-only file system
        errno.ENOTDIR,  # a path component is a file
        errno.EISDIR,  # a file's path is a directory
        errno.EEXIST,  # a directory's path is a file
        errno.EACCES,
        errno.EPERM,
        errno.EFBIG,
    }
)
"""The `OSError`s of writing that say where, not what went wrong in eqtrain."""

_fsync = os.fsync  # module-level, so a test can simulate a full disk here


def check_outputs(config: Config, *, writer: bool = True) -> dict[str, Path]:
    """Check every output target of the run `config` describes, or raise
    `ConfigError` naming the target and what to change; returns the export
    targets (`eqtrain.config.export_targets`, none for `writer=False`).

    Creates the run directory and proves it writable by writing (and fsyncing)
    `PROBE_BYTES` there. `writer=False` (processes other than 0, which neither
    log nor export) checks the run directory only.
    """
    run_dir = Path(config.run_dir)
    _check_run_dir(run_dir)
    if not writer:
        return {}
    if config.log.tensorboard:
        _check_tensorboard(run_dir / "tb")
    targets = export_targets(config, run_dir)
    for target in targets.values():
        _check_export(target, bool(config.export.every))
    return targets


_RUN_FILES = (
    ("config.toml", "the run's config file"),
    ("metrics.jsonl", "the metrics log"),
    ("plot.png", "the plot `eqtrain plot` writes"),
)


def _check_run_dir(run_dir: Path) -> None:
    """The run directory (created and probed), its files and checkpoints/."""
    where = "choose another place with --run-dir or `run_dir`"
    _check_dir(run_dir, "the run directory", where, create=True)
    _probe(run_dir, "the run directory", where)
    for name, what in _RUN_FILES:
        _check_file(run_dir / name, what)
    _check_dir(run_dir / "checkpoints", "the checkpoint directory", where)


def _check_tensorboard(tb: Path) -> None:
    # Its place is fixed (`<run_dir>/tb`); log.tensorboard only turns it on.
    where = "choose another run directory (--run-dir), or set log.tensorboard = false"
    _check_dir(tb, "the TensorBoard directory", where, create=True)
    _probe(tb, "the TensorBoard directory", where)


def _fail(path: Path, what: str, why: str, fix: str) -> ConfigError:
    return ConfigError(f"{what} {path} {why}; the run would fail there. {fix}")


def _check_dir(path: Path, what: str, where: str, *, create: bool = False) -> None:
    """`where`: how to choose another place, e.g. "choose another place with
    export.hf"."""
    if path.exists() and not path.is_dir():
        raise _fail(
            path,
            what,
            "is a file, not a directory",
            f"Move the file away, or {where}.",
        )
    if not create:
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _fail(
            path,
            what,
            f"cannot be created ({describe(e)})",
            where[0].upper() + where[1:] + ".",
        ) from None


def _check_file(path: Path, what: str) -> None:
    if path.is_dir():
        raise _fail(
            path,
            what,
            "is a directory, where eqtrain writes a file",
            "Move the directory away, or choose another run directory.",
        )


def _probe(directory: Path, what: str, where: str) -> None:
    probe = directory / f".eqtrain-write-test-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            _fsync(f.fileno())
    except OSError as e:
        raise _fail(
            directory,
            what,
            f"is not writable ({describe(e)}: writing {PROBE_BYTES // 1024} KiB "
            "failed)",
            f"Free space there, or {where}.",
        ) from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


_STEP_DIR = re.compile(r"step_\d+(_ema)?")


def _is_export(path: Path) -> bool:
    """An empty directory or an earlier export (config.json): what
    `hf.export(..., overwrite=True)` replaces."""
    names = os.listdir(path)
    return not names or "config.json" in names or "adapter_config.json" in names


def _holds_step_exports(path: Path) -> bool:
    """Empty, or only per-step exports (`step_<k>/`) and their temporaries."""
    return all(_STEP_DIR.fullmatch(n) or n.startswith(".") for n in os.listdir(path))


def _check_export(target: Path, per_step: bool) -> None:
    fix = "Set export.hf to a new directory (or to '' for no export)."
    what = "the export directory (export.hf)"
    if target.exists() and not target.is_dir():
        raise _fail(target, what, "is a file", fix)
    if target.is_dir() and not _is_export(target):
        raise _fail(
            target,
            what,
            "is not empty and holds no config.json (or adapter_config.json), so it "
            "is not an earlier export and will not be overwritten",
            fix,
        )
    if target.is_dir():
        _check_no_user_files(target, what, fix)
    # The export is written to a temporary sibling and renamed: the parent must
    # take files (and so must the per-step exports' directory).
    parent = target.parent
    where = "choose another place with export.hf"
    _check_dir(parent, "the export's parent directory", where, create=True)
    _probe(parent, "the export's parent directory", where)
    if per_step:
        _check_step_exports(steps_export_dir(target), fix, where)


def _check_step_exports(steps: Path, fix: str, where: str) -> None:
    """`export.every`'s directory holds only its `step_<k>` exports, none of
    which holds a user's files."""
    what = "the per-step export directory (export.every)"
    if steps.is_dir() and not _holds_step_exports(steps):
        raise _fail(steps, what, "holds files other than step_<k> exports", fix)
    _check_dir(steps, what, where, create=True)
    for step in steps.glob("step_*") if steps.is_dir() else ():
        if _STEP_DIR.fullmatch(step.name) and step.is_dir():
            _check_no_user_files(step, what, fix)


def _check_no_user_files(export: Path, what: str, fix: str) -> None:
    """An earlier export that also holds a user's files is never replaced (that
    would delete them)."""
    foreign = foreign_files(export)
    if foreign:
        raise _fail(
            export,
            what,
            f"holds files that are not part of an export ({describe_names(foreign)})"
            ", which replacing it would delete",
            "Move them out of it, or s" + fix[1:],
        )


# -- write errors that happen anyway ----------------------------------------------
_WRITERS = (
    ("tensorboard", "the TensorBoard log ({run}/tb)"),
    ("jsonl", "the metrics log ({run}/metrics.jsonl)"),
    ("hf", "the Hugging Face export"),
    ("export", "the Hugging Face export"),
    ("checkpoint", "a checkpoint ({run}/checkpoints)"),
    ("plot", "the plot"),
)


def is_write_error(error: BaseException) -> bool:
    """Whether `error` is an `OSError` of writing a file (no space, read-only,
    not a directory, is a directory, permission)."""
    return isinstance(error, OSError) and error.errno in WRITE_ERRNOS


def describe(error: OSError) -> str:
    """`No space left on device`, not `[Errno 28] No space left on device: 'x'`."""
    return error.strerror or str(error)


def write_error_message(
    error: OSError, run_dir: str | os.PathLike[str] | None = None
) -> str:
    """One paragraph for a write error of a run: what failed, where, and (with
    `run_dir`) which checkpoint is the last complete one to resume from."""
    where = error.filename and os.fspath(error.filename)
    if where is None:
        where = _writer_of(error.__traceback__, run_dir)
    text = f"writing {where} failed: {describe(error)}."
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        text += " Free some space"
    else:
        text += " Make it writable or choose another place"
    text += " and run the command again."
    if run_dir is not None:
        text += " " + last_checkpoint_note(run_dir)
    return text


def last_checkpoint_note(run_dir: str | os.PathLike[str]) -> str:
    """Which checkpoint of `run_dir` a resume would continue from."""
    from .. import checkpoint

    try:
        steps = checkpoint.list_steps(run_dir)
    except Exception:  # noqa: BLE001 -- a note; never hide the error it explains
        steps = []
    if not steps:
        return f"No checkpoint of {run_dir} was saved."
    last = Path(run_dir) / "checkpoints" / str(steps[-1])
    return (
        f"The last complete checkpoint is {last}; `eqtrain fit` with the same "
        "config resumes from it."
    )


def _writer_of(tb: TracebackType | None, run_dir: Any) -> str:
    """A guess at what was being written from the innermost eqtrain frame (a
    failed `write()` on an open file names no path)."""
    run = os.fspath(run_dir) if run_dir is not None else "the run directory"
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    for code in reversed(frames):
        if f"{os.sep}eqtrain{os.sep}" not in code.co_filename:
            continue
        lowered = code.co_filename.lower()
        names = (os.path.basename(lowered), code.co_qualname.lower())
        for token, what in _WRITERS:
            if any(token in n for n in names) or f"{os.sep}{token}{os.sep}" in lowered:
                return what.format(run=run)
    return f"into {run}" if run_dir is not None else "a file"


# -- out of device memory -----------------------------------------------------------
_OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is XLA's out-of-device-memory error (`RESOURCE_EXHAUSTED`)."""
    if isinstance(error, MemoryError):
        return True
    if type(error).__name__ not in ("XlaRuntimeError", "JaxRuntimeError"):
        return False
    return any(m in str(error) for m in _OOM_MARKERS)


def out_of_memory_error(error: BaseException, prepared: Any) -> ConfigError:
    """A `ConfigError` for a run that ran out of device memory: the step that
    failed (as `fit` found it), the dry run's figure for the compiled step's
    peak per device, and the settings that lower it with their values."""
    c = prepared.job.config
    first = next((ln for ln in str(error).splitlines() if ln.strip()), "")[:200]
    where = failed_at(error)
    when = "" if where is None else f" {where}"
    micro = c.data.batch_size // c.optim.accumulate
    return ConfigError(
        f"training ran out of device memory{when} ({first}). The dry run "
        f"(`eqtrain fit CONFIG --dry-run`) {_peak_estimate(prepared)}. Lower it with: "
        f"a smaller data.batch_size ({c.data.batch_size}) or a larger optim.accumulate "
        f"({c.optim.accumulate}; micro-batches of {micro} rows), a shorter "
        f"data.seq_len ({c.data.seq_len}), model.remat = 'full' (now "
        f"{c.model.remat!r}), model.attention_chunk = 512 (now "
        f"{c.model.attention_chunk}), model.mlp_chunks = 'auto' (now "
        f"{c.model.mlp_chunks!r}), model.loss_chunk = 256 (now "
        f"{c.model.loss_chunk!r}), loop.precision = 'bf16' (now "
        f"{c.loop.precision!r}), or more devices for mesh.fsdp to shard parameters "
        "and optimizer state; `--memory-budget SIZE` finds the longest "
        "data.seq_len that fits."
    )


def _peak_estimate(prepared: Any) -> str:
    """What the dry run says of the compiled step's peak (the figure, when it
    can be had)."""
    try:
        peak = compiled_peak(prepared)
    except Exception:  # noqa: BLE001 -- the advice matters more than the figure
        return "gives the compiled training step's peak memory per device"
    return f"puts the compiled training step's peak at {peak} per device"


def compiled_peak(prepared: Any) -> str:
    """The dry run's "peak" figure: the per-device peak of the compiled training
    step (XLA's memory analysis), compiled again from shapes (nothing runs)."""
    from .. import sharding
    from . import _memory

    job, placement = prepared.job, prepared.placement
    batch = _memory.abstract_batch(job, prepared.rows)
    return sharding.format_bytes(_memory.step_memory(job, placement, batch).peak)
