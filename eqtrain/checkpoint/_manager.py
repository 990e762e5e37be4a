"""`Checkpointer`: `fit`'s checkpointer over Orbax's `CheckpointManager`. Each save
writes the state's arrays (OCDBT), the data loader's position and a run manifest,
asynchronously; retention is applied by renaming steps away before deleting them."""

import contextlib
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from .._errors import ConfigError
from .._hooks import StepInfo
from . import _integrity, _manifest, _storage
from ._errors import CheckpointError
from ._policy import Policy
from ._quiet import quiet_orbax, write_error
from ._tree import array_leaves, path_name, to_disk, trained_part


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


def _checked_base(base: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if base is not None and "sha256" not in base:
        raise ConfigError(
            "`base` must be a mapping with the base model's content hash under "
            f"'sha256'; got {base!r}."
        )
    return None if base is None else dict(base)


def _newest_run_id(manifests: dict[int, dict[str, Any] | None]) -> str | None:
    """The run identity of the newest step that records one."""
    for _, manifest in sorted(manifests.items(), reverse=True):
        if manifest and manifest.get("run_id"):
            return manifest["run_id"]
    return None


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
            save on evaluation steps). A name the run does not report (a save
            whose metrics hold `eval/...` values but not `best`) raises
            `ConfigError` at that save, once its state is saved.
        best_mode: `"min"` or `"max"`.
        keep_best: how many best checkpoints to keep.
        data: the train `Loader` (anything with a `position`); its position is
            saved so that a resumed run reads the same batches.
        config: the resolved run config (JSON-able mapping), saved in the manifest.
        async_save: write in the background (default) or block until written.
        run_id: the run's identity, written in every manifest (from
            `resume_run(...).run_id`). When given, a directory holding steps of
            another run is refused here, at construction (before anything is
            compiled). Default: the identity of the newest checkpoint in the
            directory, or a new one.
        started_from: the other run's checkpoint this run started from (recorded
            in the manifests; `resume_run(...).started_from`).
        base: a reference to the frozen base model (a JSON-able mapping with a
            `"sha256"` of its content, e.g. a LoRA run's `model.init_from`
            safetensors). Given, each checkpoint stores only the trained leaves
            (and optimizer state, step, key, data position) plus this reference;
            `restore`/`resume_run` rebuild the frozen leaves with `init` and
            refuse a base whose hash changed.
        extra: more JSON-able entries for every manifest (e.g. the architecture
            of a run started from a Hugging Face directory), under their names.

    Raises `CheckpointError` if the directory holds steps of another run (with
    `run_id`), and on the first save if it holds a later step, or the same step
    with other contents (two runs would be mixed); resume with `resume_run`, or
    start a new run directory. Saving a step that is
    already on disk with the same arrays (a finished run run again) is a no-op.

    A failed background write raises `CheckpointError` ("saving step N failed:
    <reason>; last good checkpoint: M") at the next save or at `close()`.
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
        run_id: str | None = None,
        started_from: str | None = None,
        base: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ):
        self.base = _checked_base(base)
        self.extra = dict(extra or {})
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
        _storage.check_path(self.directory)
        quiet_orbax()
        self.data, self.config, self.async_save = data, config, async_save
        self.started_from = started_from
        manifests = self._manifests()
        self.run_id = self._identity(run_id, manifests)
        self._scores = {
            s: self.policy.score((m or {}).get("metrics") or {})
            for s, m in manifests.items()
        }
        self._pending: int | None = None  # the step being written in the background
        self._manager: ocp.CheckpointManager | None = None
        self._open()  # starting Orbax's manager is slow: not inside the loop
        self._last_step: int | None = None
        self._last_time = time.monotonic()
        self.blocking_times: list[float] = []
        """Seconds each `save` kept the caller (the training loop) waiting."""
        self._deleting: list[Any] = []  # background deletions of pruned steps

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
        arrays, leaves, sums = self._on_disk(info.state)
        if self._last_step is None and self._check_not_mixing(step, sums):
            self._last_step = step  # this very state is on disk already
            return
        manager = self._open()
        self._wait(manager)  # the previous save is committed: prune now
        self._prune()
        manifest = self._manifest(info, leaves, sums, final=final)
        manager.save(step, args=self._items(arrays, manifest), force=True)
        self._pending = step
        self._scores[step] = self.policy.score(info.metrics)
        self._last_step = step
        self._last_time = time.monotonic()
        self.blocking_times.append(time.perf_counter() - start)
        if (problem := self.policy.missing_best(info.metrics)) is not None:
            raise ConfigError(problem)  # after this state was handed over: kept

    def wait(self) -> None:
        """Block until the last save is written and committed."""
        if self._manager is not None:
            self._wait(self._manager)

    def close(self) -> None:
        """Wait for the last save, apply retention, release Orbax's resources."""
        try:
            if self._manager is not None:
                self._wait(self._manager)
                self._prune()
        finally:
            if self._manager is not None:
                manager, self._manager = self._manager, None
                with contextlib.suppress(Exception):
                    manager.close()
            for thread in self._deleting:
                thread.join()
            self._deleting.clear()

    # -- internals -------------------------------------------------------------
    def _manifests(self) -> dict[int, dict[str, Any] | None]:
        """The manifest of every committed step (None: unreadable), after
        cleaning up what interrupted saves and deletions left behind."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if jax.process_index() == 0:
            _storage.clean_leftovers(self.directory)
        return {s: self._read_manifest(s) for s in _storage.steps(self.directory)}

    def _identity(
        self, run_id: str | None, manifests: dict[int, dict[str, Any] | None]
    ) -> str:
        """`run_id`, checked against the directory's steps; default: the newest
        step's run identity, or a new one."""
        if run_id is not None:
            self._check_identity(run_id, manifests)
            return run_id
        return _newest_run_id(manifests) or uuid.uuid4().hex

    def _on_disk(
        self, state: Any
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
        """The arrays to write (only the trained ones over a frozen base), the
        leaves' description and the arrays' checksums."""
        arrays, leaves = to_disk(state if self.base is None else trained_part(state))
        paths, stored = array_leaves(arrays)
        sums = _integrity.checksums([path_name(p) for p in paths], stored)
        return arrays, leaves, sums

    def _manifest(
        self,
        info: StepInfo,
        leaves: dict[str, Any],
        sums: dict[str, str],
        *,
        final: bool,
    ) -> dict[str, Any]:
        return _manifest.build(
            info,
            run_id=self.run_id,
            checksums=sums,
            leaves=leaves,
            config=self.config,
            final=final,
            started_from=self.started_from,
            base=self.base,
            extra=self.extra,
        )

    def _items(self, arrays: dict[str, Any], manifest: dict[str, Any]) -> Any:
        """Orbax's save arguments: the arrays, the data position, the manifest."""
        position = getattr(self.data, "position", None)
        return ocp.args.Composite(
            **{
                _storage.STATE: ocp.args.StandardSave(arrays),
                _storage.DATA: ocp.args.JsonSave({"position": position}),
                _storage.MANIFEST: ocp.args.JsonSave(manifest),
            }
        )

    def _open(self) -> ocp.CheckpointManager:
        if self._manager is None:
            self._manager = _manager(self.directory, async_save=self.async_save)
        return self._manager

    def _wait(self, manager: ocp.CheckpointManager) -> None:
        """Wait for the background write; a failure becomes one sentence."""
        pending, self._pending = self._pending, None
        try:
            manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 -- Orbax's errors wrap the cause
            self._last_step = None if self._last_step == pending else self._last_step
            good = [s for s in _storage.steps(self.directory) if s != pending]
            last = self.directory / str(good[-1]) if good else "none"
            raise CheckpointError(
                f"saving step {pending} failed: {write_error(e)}; last good "
                f"checkpoint: {last}."
            ) from None

    def _check_identity(self, run_id: str, manifests: dict[int, Any]) -> None:
        others = [
            s
            for s, m in manifests.items()
            if m and m.get("run_id") and m.get("run_id") != run_id
        ]
        if others:
            raise CheckpointError(
                f"{self.directory} holds checkpoint(s) {others[-5:]} written by "
                f"another run (run id {manifests[others[-1]]['run_id'][:12]}, this "
                f"run: {run_id[:12]}); saving here would mix two runs. Resume it "
                "(resume='auto'), delete them (resume='never', overwrite=True), or "
                "use a new run directory."
            )

    def _check_not_mixing(self, step: int, sums: dict[str, str]) -> bool:
        """Before the first save: refuse if a later step exists, or this step
        with other arrays. True when this very state is already saved."""
        existing = _storage.steps(self.directory)
        later = [s for s in existing if s > step]
        if later:
            raise CheckpointError(
                f"{self.directory} already holds checkpoint(s) {later[:5]} beyond "
                f"step {step}; saving here would mix two runs (or a rolled-back "
                "run with its old future). Resume with `resume_run(run_dir, init, "
                "resume='auto')`, discard them (`overwrite=True`), or use a new "
                "run directory."
            )
        if step not in existing:
            return False
        manifest = self._read_manifest(step) or {}
        if manifest.get("checksums") == sums and sums:
            return True
        raise CheckpointError(
            f"{self.directory} already holds a checkpoint of step {step} with other "
            "contents, written by another run; saving here would mix two runs. "
            "Resume with `resume_run(run_dir, init, resume='auto')`, delete it "
            "(`resume='never', overwrite=True`), or use a new run directory."
        )

    def _read_manifest(self, step: int) -> dict[str, Any] | None:
        try:
            return _storage.read_json(
                self.directory / str(step), _storage.MANIFEST, _storage.MANIFEST_FILE
            )
        except CheckpointError:
            return None

    def _prune(self) -> None:
        committed = _storage.steps(self.directory)
        keep = self.policy.keep(committed, self._scores)
        doomed = [s for s in committed if s not in keep]
        for step in doomed:
            # Rename now (safe against kills), delete in the background: removing
            # hundreds of MB would otherwise block the training loop. The directory
            # is shared by all processes: process 0 alone deletes (two renames of
            # one step race, and the loser's fails).
            if jax.process_index() == 0:
                thread = _storage.remove_step(self.directory, step, background=True)
                self._deleting.append(thread)
            self._scores.pop(step, None)
        if doomed and self._manager is not None:
            self._manager.reload()
