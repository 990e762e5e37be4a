"""The reference log-probs of `task.reference = "precomputed"`: one pass of the
run's initial model over its preference pairs before training, stored in
`<run_dir>/reference/` and read back into the batches as `reference_chosen` /
`reference_rejected`.

The files are a cache keyed by the rows and the initial model: a resumed run reads
them instead of recomputing (the initial model may be long gone from memory), a
killed pass continues from its last written part, and a changed dataset or base is
recomputed from the run's initial model, rebuilt as at its start. Every file is
safetensors written atomically (temporary name, fsync, rename): a kill mid-pass
never leaves a part that reads back wrong.
"""

import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from .. import hf, sharding
from .._files import replace_durably, set_default_mode
from ..post_training import preference
from . import _build, _model


Rows = dict[str, np.ndarray]
# A split's pair rows: arrays by name, or the post-training store's `PostRows`
# (whose `[name]` reads a whole column).
PairRows = Any
PAIR_KEYS = tuple(
    f"{side}_{what}"
    for side in ("chosen", "rejected")
    for what in ("tokens", "targets", "mask")
)
OUT_KEYS = ("reference_chosen", "reference_rejected")
DIR = "reference"
PART_ROWS = 4096  # pairs per part file: what a killed pass loses at most


def identity(job: _build.Job, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the reference model is: the run's initial model, named by its
    source (init_from's content hash, or the random init's seed and config) and
    its adapters (`model.adapter_from`'s content, or new ones: zero updates).
    `base`: a LoRA run's `_model.base_reference`, which holds init_from's
    content hash already (its weights are read once)."""
    m, config = job.config.model, job.config
    out: dict[str, Any] = {"model_config": repr(job.model_config)}
    if m.init_from is not None:
        out["init_from"] = (base or hf.content_hash(m.init_from))["sha256"]
    else:
        out["seed"] = config.seed
    if job.lora is not None and m.adapter_from is not None:
        out["adapter_from"] = _hash_dir_files(m.adapter_from)
    out["param_dtype"] = m.param_dtype
    return out


def _hash_dir_files(path: str) -> str:
    digest = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            digest.update(name.encode())
            with open(file, "rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
    return digest.hexdigest()


def rows_key(rows: PairRows, model: dict[str, Any]) -> str:
    """The cache key of `rows` under the reference `model` (its `identity`)."""
    digest = hashlib.sha256(json.dumps(model, sort_keys=True).encode())
    for name in PAIR_KEYS:
        array = np.ascontiguousarray(rows[name])
        digest.update(f"{name}{array.dtype}{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def attach(
    job: _build.Job,
    placement: Any,
    splits: dict[str, PairRows | None],
    run_dir: Path,
    *,
    writer: bool,
    say: Callable[[str], None],
    initial: Any = None,
    base: dict[str, Any] | None = None,
) -> dict[str, Rows]:
    """The `reference_chosen` / `reference_rejected` columns of each split's
    rows: `<run_dir>/reference/<split>.safetensors` when it matches the rows and
    the initial model, else computed (with `initial`, the run's initial model on
    the mesh, when the caller has it; else rebuilt) and written. `base`: the
    run's `_model.base_reference`, when the caller has it (see `identity`)."""
    model_id = identity(job, base)
    models: list[Any] = [initial]  # built at most once, when a split needs it

    def model() -> Any:
        if models[0] is None:
            models[0] = _initial_model(job, placement)
        return models[0]

    out = {}
    for name, rows in splits.items():
        if rows is not None:
            path = run_dir / DIR / f"{name}.safetensors"
            key = rows_key(rows, model_id)
            out[name] = _read(path, key) or _compute(
                model(), rows, job, placement, path, key, writer, say
            )
    return out


def _initial_model(job: _build.Job, placement: Any) -> Any:
    """The run's initial model (the policy at step 0), on the mesh."""
    model = _model.new_model(job, placement.mesh)
    shardings = placement.state_shardings.model
    return sharding.shard(model, shardings)


def _read(path: Path, key: str, n: int | None = None) -> Rows | None:
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="np") as f:
            if (f.metadata() or {}).get("key") != key or set(f.keys()) != set(OUT_KEYS):
                return None
            tensors = {k: f.get_tensor(k) for k in OUT_KEYS}
    except (OSError, ValueError, SafetensorError):
        return None  # damaged: recompute (it is only a cache)
    if n is not None and any(len(v) != n for v in tensors.values()):
        return None
    return {k: np.asarray(v, np.float32) for k, v in tensors.items()}


def _write(path: Path, values: Rows, key: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(
        {k: np.ascontiguousarray(v) for k, v in values.items()}, str(tmp), {"key": key}
    )
    set_default_mode(tmp)  # save_file leaves 0600
    replace_durably(tmp, path, sync_dir=True)


def _compute(
    model: Any,
    rows: PairRows,
    job: _build.Job,
    placement: Any,
    path: Path,
    key: str,
    writer: bool,
    say: Callable[[str], None],
) -> Rows:
    n = len(rows["chosen_tokens"])
    batch = _pass_batch(job, placement)
    logps = _logprobs(job)
    say(f"computing the reference log-probs of {n:,} pairs ({path.name}) ...")

    def compute(start: int, stop: int) -> Rows:
        return _part(logps, model, rows, start, stop, batch, placement)

    parts = [
        _cached_part(path, key, start, min(start + PART_ROWS, n), compute, writer)
        for start in range(0, n, PART_ROWS)
    ]
    values = {k: np.concatenate([p[k] for _, p in parts]) for k in OUT_KEYS}
    if writer:
        _write_whole(path, values, key, [part_path for part_path, _ in parts])
    return values


def _cached_part(
    path: Path,
    key: str,
    start: int,
    stop: int,
    compute: Callable[[int, int], Rows],
    writer: bool,
) -> tuple[Path, Rows]:
    """Pairs `start:stop`'s values: their part file when a killed pass left it,
    else computed (and written, by the writer)."""
    part_path = path.with_name(f"{path.stem}.part-{start}.safetensors")
    part = _read(part_path, key, stop - start)
    if part is None:
        part = compute(start, stop)
        if writer:
            _write(part_path, part, key)
    return part_path, part


def _logprobs(job: _build.Job) -> Callable[..., Any]:
    """The compiled pair log-probs of `job`'s model (its real vocabulary and
    loss chunk)."""
    return eqx.filter_jit(
        functools.partial(
            preference.pair_logprobs,
            vocab_size=job.vocab_size,
            chunk=job.loss_chunk or None,
        )
    )


def _write_whole(path: Path, values: Rows, key: str, parts: list[Path]) -> None:
    """The whole split's file, and then its parts deleted."""
    _write(path, values, key)
    for part_path in parts:
        part_path.unlink(missing_ok=True)


def _pass_batch(job: _build.Job, placement: Any) -> int:
    """Pairs per forward pass: a training micro-batch (which fits the devices
    and splits over the data axes)."""
    config = job.config
    return config.data.batch_size // config.optim.accumulate


def _part(
    logps: Any,
    model: Any,
    rows: PairRows,
    start: int,
    stop: int,
    batch: int,
    placement: Any,
) -> Rows:
    out: dict[str, list[np.ndarray]] = {k: [] for k in OUT_KEYS}
    for i in range(start, stop, batch):
        j = min(i + batch, stop)
        # the last batch is padded with its own last pair (one compiled shape)
        index = np.minimum(np.arange(i, i + batch), j - 1)
        pairs = {k: rows[k][index] for k in PAIR_KEYS}
        pairs = jax.device_put(pairs, placement.batch_sharding)
        chosen, rejected = jax.device_get(logps(model, pairs))
        out["reference_chosen"].append(np.asarray(chosen)[: j - i])
        out["reference_rejected"].append(np.asarray(rejected)[: j - i])
    return {k: np.concatenate(v).astype(np.float32) for k, v in out.items()}
