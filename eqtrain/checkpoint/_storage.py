"""The checkpoint directory on disk: finding step directories, reading the JSON
items, and deleting steps safely (rename out of the way first, then delete)."""

import json
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from . import _ocdbt
from ._errors import CheckpointError


CHECKPOINTS = "checkpoints"
STATE = "state"
DATA = "data_position"
MANIFEST = "manifest"
DATA_FILE = "data_position.json"
MANIFEST_FILE = "manifest.json"
DELETING = ".eqtrain-deleting"
DAMAGED = ".damaged-"
# Characters that Orbax/TensorStore treat as glob or escape syntax in paths: a
# checkpoint written under them could never be read back.
SPECIAL = "[]*?\\"


def checkpoints_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir).absolute() / CHECKPOINTS  # Orbax needs absolute paths


def check_path(path: str | os.PathLike[str]) -> None:
    """Refuse a checkpoint path that Orbax/TensorStore cannot read back."""
    text = os.fspath(Path(path).absolute())
    bad = sorted({c for c in text if c in SPECIAL})
    if bad:
        raise CheckpointError(
            f"the path {text} contains {' '.join(repr(c) for c in bad)}, which "
            "Orbax/TensorStore treat as pattern syntax: checkpoints written there "
            "could never be read back; choose a run directory without "
            "[ ] * ? or backslash."
        )


def _is_step(p: Path) -> bool:
    # An empty directory with a step's name holds nothing to restore: not a step.
    return p.name.isdigit() and p.is_dir() and any(p.iterdir())


def steps(directory: Path) -> list[int]:
    """Committed steps in a checkpoints directory, ascending. Orbax renames
    `<step>.orbax-checkpoint-tmp-*` to `<step>` only once the save is complete,
    so torn saves (and steps being deleted) are not listed; nor are empty
    directories with a step's name."""
    if not directory.is_dir():
        return []
    out = []
    for p in directory.iterdir():
        try:
            if _is_step(p):
                out.append(int(p.name))
        except OSError:  # pruned while listing
            continue
    return sorted(out)


def damaged_steps(directory: Path) -> list[str]:
    """Names of the steps moved aside as damaged (`<step>.damaged-<time>`)."""
    if not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if DAMAGED in p.name)


def move_aside(directory: Path, step: int) -> Path:
    """Rename a damaged step to `<step>.damaged-<time>` (kept, never read again)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = directory / f"{step}{DAMAGED}{stamp}"
    n = 1
    while target.exists():
        n += 1
        target = directory / f"{step}{DAMAGED}{stamp}-{n}"
    os.rename(directory / str(step), target)
    return target


def has_leftovers(directory: Path) -> bool:
    """Torn saves or interrupted deletions (anything that is not a step)."""
    return directory.is_dir() and any(
        not p.name.isdigit() for p in directory.iterdir() if p.is_dir()
    )


def remove_step(directory: Path, step: int, *, background: bool = False) -> Any:
    """Delete a step so that a kill at any moment leaves it either complete under
    its name or gone: rename it to a non-step name first, then delete that.

    The rename is what makes it safe, and it is instant; with `background=True`
    the deletion of the renamed directory (hundreds of MB) runs in a thread, which
    is returned so that the caller can join it. A deletion cut short by a kill is
    finished by `clean_leftovers`.
    """
    doomed = directory / f"{step}{DELETING}-{uuid.uuid4().hex[:8]}"
    os.rename(directory / str(step), doomed)
    if not background:
        shutil.rmtree(doomed, ignore_errors=True)
        return None
    thread = threading.Thread(
        target=shutil.rmtree,
        args=(doomed,),
        kwargs={"ignore_errors": True},
        name="eqtrain-prune",
        daemon=True,
    )
    thread.start()
    return thread


def clean_leftovers(directory: Path) -> list[str]:
    """Delete interrupted deletions and torn saves; returns their names."""
    removed = []
    if not directory.is_dir():
        return removed
    for p in directory.iterdir():
        if p.is_dir() and (DELETING in p.name or ".orbax-checkpoint-tmp" in p.name):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
        elif p.name.isdigit() and p.is_dir() and not any(p.iterdir()):
            p.rmdir()  # an empty directory with a step's name: nothing to lose
            removed.append(p.name)
    return removed


def step_problems(step_dir: Path) -> str | None:
    """What a restore of this step would find unreadable, checked cheaply (no
    array data is read): None if its JSON items, Orbax's array metadata and its
    OCDBT index are readable and every array file the index refers to is there
    and long enough, else one short sentence naming the file (and the arrays in
    it). Flipped bits inside an array file are found only by restoring (the
    checksums recorded in the manifest)."""
    try:
        read_json(step_dir, MANIFEST, MANIFEST_FILE)
        read_json(step_dir, DATA, DATA_FILE)
    except CheckpointError as e:
        return str(e)
    state = step_dir / STATE
    if not (state / "manifest.ocdbt").is_file():
        return f"{state / 'manifest.ocdbt'} is missing"
    return _metadata_problem(state) or _ocdbt.problems(state)


def _metadata_problem(state: Path) -> str | None:
    """An unreadable metadata file of Orbax's, if any. Orbax reads these JSON
    files when they are there (a restore into a template does without them)."""
    for path in [state / "_METADATA", *sorted(state.glob("array_metadatas/*"))]:
        try:
            with open(path) as f:
                json.load(f)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            return f"cannot read {path}: {e}"
    return None


def read_json(step_dir: Path, item: str, filename: str) -> Any:
    path = step_dir / item / filename
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e


def resolve(path: str | os.PathLike[str]) -> tuple[Path, int | None]:
    """(checkpoints directory, step or None) for a run directory, a checkpoints
    directory or one step's directory."""
    p = Path(path).absolute()
    if (p / CHECKPOINTS).is_dir() or (p / "config.toml").is_file():
        return p / CHECKPOINTS, None
    if p.name.isdigit() and (
        (p / STATE).exists() or (p / MANIFEST).exists() or p.parent.name == CHECKPOINTS
    ):
        return p.parent, int(p.name)
    if p.is_dir():
        return p, None
    raise CheckpointError(
        f"{p} does not exist: expected a run directory (holding `{CHECKPOINTS}/`), "
        "a checkpoints directory, or one step's directory."
    )


def list_steps(path: str | os.PathLike[str]) -> list[int]:
    """Committed checkpoint steps of a run directory (or checkpoints directory)."""
    directory, _ = resolve(path)
    return steps(directory)


def read_manifest(path: str | os.PathLike[str], *, step: int | None = None) -> Any:
    """The manifest (config, metrics, stop reason, versions, mesh, ...) of a
    checkpoint: `path` a step directory, or a run/checkpoints directory with
    `step` (default: the latest committed step).

    Raises:
        CheckpointError: no such directory, no checkpoint, or an unreadable
            manifest.
    """
    directory, found = resolve(path)
    step = step if step is not None else found
    if step is None:
        existing = steps(directory)
        if not existing:
            raise CheckpointError(f"{directory} holds no committed checkpoint.")
        step = existing[-1]
    return read_json(directory / str(step), MANIFEST, MANIFEST_FILE)
