"""`Checkpointer`: `fit`'s checkpointer over Orbax's `CheckpointManager`. Each save
writes the state's arrays (OCDBT), the data loader's position and a run manifest,
asynchronously; retention is applied by renaming steps away before deleting them."""

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from .._hooks import StepInfo
from . import _manifest, _storage
from ._errors import CheckpointError
from ._policy import Policy
from ._tree import to_disk


def _manager(directory: Path, *, async_save: bool) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=None,  # retention is ours: Orbax deletes in place (not kill-safe)
        create=True,
        cleanup_tmp_directories=True,
        enable_async_checkpointing=async_save,
    )
    handlers = {
        _storage.STATE: ocp.StandardCheckpointHandler(),
        _storage.DATA: ocp.JsonCheckpointHandler(filename=_storage.DATA_FILE),
        _storage.MANIFEST: ocp.JsonCheckpointHandler(filename=_storage.MANIFEST_FILE),
    }
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


class Checkpointer:
    """Save a run's `TrainState`, data position and manifest under
    `<run_dir>/checkpoints/<step>/`, for `fit(..., checkpointer=...)`.

    Saves are asynchronous: `save` copies the arrays to host memory and returns
    while Orbax writes them; `close()` (called by `fit`) waits for the last write.
    `fit` also saves once when it stops, whatever the reason.

    Args:
        run_dir: the run directory; checkpoints go to `run_dir/checkpoints`.
        every_steps: save after every `every_steps` steps...
        every_minutes: ...and/or when this many minutes passed since the last save.
        keep_last: keep the newest `keep_last` checkpoints (None: keep all).
        keep_every: also keep every step divisible by `keep_every`, permanently.
        best: also keep the `keep_best` checkpoints with the best value of this
            metric (e.g. `"eval/loss"`; read from `info.metrics` at save time, so
            save on evaluation steps).
        best_mode: `"min"` or `"max"`.
        keep_best: how many best checkpoints to keep.
        data: the train `Loader` (anything with a `position`); its position is
            saved so that a resumed run reads the same batches.
        config: the resolved run config (JSON-able mapping), saved in the manifest.
        async_save: write in the background (default) or block until written.

    Raises `CheckpointError` on the first save if the directory holds a step at or
    beyond it that this run did not write (two runs would be mixed); resume with
    `restore_or_init`, or start a new run directory.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        every_steps: int | None = None,
        every_minutes: float | int | None = None,
        keep_last: int | None = 3,
        keep_every: int | None = None,
        best: str | None = None,
        best_mode: str = "min",
        keep_best: int = 1,
        data: Any = None,
        config: Mapping[str, Any] | None = None,
        async_save: bool = True,
    ):
        self.policy = Policy(
            every_steps=every_steps,
            every_minutes=every_minutes,
            keep_last=keep_last,
            keep_every=keep_every,
            best=best,
            best_mode=best_mode,
            keep_best=keep_best,
        )
        self.directory = _storage.checkpoints_dir(run_dir).absolute()  # Orbax wants it
        self.data = data
        self.config = config
        self.async_save = async_save
        self.directory.mkdir(parents=True, exist_ok=True)
        _storage.clean_leftovers(self.directory)
        self._existing = _storage.steps(self.directory)
        self._scores = {s: self._read_score(s) for s in self._existing}
        self._manager: ocp.CheckpointManager | None = None
        self._open()  # starting Orbax's manager takes ~0.4 s: not inside the loop
        self._last_step: int | None = None
        self._last_time = time.monotonic()
        self.blocking_times: list[float] = []
        self._deleting: list[Any] = []  # background deletions of pruned steps
        """Seconds each `save` kept the caller (the training loop) waiting."""

    @property
    def saved_steps(self) -> list[int]:
        """Committed steps on disk, ascending."""
        return _storage.steps(self.directory)

    def due(self, step: int) -> bool:
        return self.policy.due(step, self._last_time)

    def save(self, info: StepInfo, *, final: bool = False) -> None:
        """Save `info.state` as step `info.step` (a no-op for a step already saved)."""
        step = int(info.step)
        if step == self._last_step:
            return
        start = time.perf_counter()
        self._check_not_mixing(step)
        manager = self._open()
        manager.wait_until_finished()  # the previous save is committed: prune now
        self._prune()
        state = info.state
        arrays, leaves = to_disk(state)
        position = (
            getattr(self.data, "position", None) if self.data is not None else None
        )
        manifest = _manifest.build(
            step=step,
            state=state,
            leaves=leaves,
            metrics=info.metrics,
            config=self.config,
            stop_reason=info.stop_reason,
            final=final,
        )
        manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    _storage.STATE: ocp.args.StandardSave(arrays),
                    _storage.DATA: ocp.args.JsonSave({"position": position}),
                    _storage.MANIFEST: ocp.args.JsonSave(manifest),
                }
            ),
            force=True,
        )
        self._scores[step] = self.policy.score(info.metrics)
        self._last_step = step
        self._last_time = time.monotonic()
        self.blocking_times.append(time.perf_counter() - start)

    def wait(self) -> None:
        """Block until the last save is written and committed."""
        if self._manager is not None:
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the last save, apply retention, release Orbax's resources."""
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._prune()
            self._manager.close()
            self._manager = None
        for thread in self._deleting:
            thread.join()
        self._deleting.clear()

    # -- internals -------------------------------------------------------------
    def _open(self) -> ocp.CheckpointManager:
        if self._manager is None:
            self._manager = _manager(self.directory, async_save=self.async_save)
        return self._manager

    def _check_not_mixing(self, step: int) -> None:
        if self._last_step is not None:
            return
        later = [s for s in self._existing if s >= step]
        if later:
            raise CheckpointError(
                f"{self.directory} already holds checkpoint(s) {later[:5]} at or "
                f"beyond step {step}, written by another run; saving here would "
                "mix two runs. Resume with `eqtrain.checkpoint.restore_or_init("
                "run_dir, init, resume='auto')`, delete them (`resume='never', "
                "overwrite=True`), or use a new run directory."
            )

    def _read_score(self, step: int) -> float | None:
        if self.policy.best is None:
            return None
        try:
            manifest = _storage.read_json(
                self.directory / str(step), _storage.MANIFEST, _storage.MANIFEST_FILE
            )
        except CheckpointError:
            return None
        return self.policy.score(manifest.get("metrics") or {})

    def _prune(self) -> None:
        committed = _storage.steps(self.directory)
        keep = self.policy.keep(committed, self._scores)
        doomed = [s for s in committed if s not in keep]
        for step in doomed:
            # Rename now (safe against kills), delete in the background: removing
            # hundreds of MB would otherwise block the training loop.
            thread = _storage.remove_step(self.directory, step, background=True)
            self._deleting.append(thread)
            self._scores.pop(step, None)
        if doomed and self._manager is not None:
            self._manager.reload()
