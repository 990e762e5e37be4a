import json
import warnings
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqtrain
from eqtrain.checkpoint import (
    Checkpointer,
    CheckpointError,
    CheckpointWarning,
    DamagedCheckpointError,
    IncompatibleCheckpointError,
    RunInUseError,
    RunLock,
    list_steps,
    read_manifest,
    restore,
    resume_run,
)
from eqtrain.data import Loader

from .conftest import Regressor, make_batches, mse_loss


OPT = optax.adam(1e-2)


def init(width=16):
    return eqtrain.TrainState.create(Regressor(jr.key(0), width), OPT, key=0, ema=True)


def arrays(state):
    out = []
    for x in jax.tree.leaves(eqx.filter(state, eqx.is_array)):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(x))
    return out


def assert_same(a, b):
    xs, ys = arrays(a), arrays(b)
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y)


def rows(n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return {"x": x, "y": (x @ np.arange(1, 5, dtype=np.float32)).astype(np.float32)}


def info(state, step, metrics=None, stop_reason=None):
    return eqtrain.StepInfo(
        step=step,
        metrics=metrics or {},
        num_steps=100,
        stop_reason=stop_reason,
        _state=state,
    )


def train(state, loader_or_batches, num_steps, ckpt=None, **kw):
    return eqtrain.fit(
        state,
        eqtrain.train_step(mse_loss, OPT, ema=0.9),
        loader_or_batches,
        num_steps=num_steps,
        checkpointer=ckpt,
        **kw,
    )


def test_roundtrip_with_position_and_manifest(tmp_path):
    loader = Loader(rows(), 8, seed=1)
    ckpt = Checkpointer(tmp_path, every_steps=3, data=loader, config={"lr": 0.01})
    result = train(init(), loader, 5, ckpt)
    assert list_steps(tmp_path) == [3, 5]
    restored = restore(tmp_path, init)
    assert restored.step == 5
    assert_same(restored.state, result.state)
    assert restored.data_position == {"epoch": 0, "index": 5}
    m = restored.manifest
    assert m["config"] == {"lr": 0.01} and m["step"] == 5 and m["final"]
    assert m["stop_reason"]["kind"] == "max_steps"
    assert set(m["versions"]) >= {
        "eqtrain",
        "jax",
        "equinox",
        "optax",
        "orbax-checkpoint",
    }
    assert "git_revision" in m and m["metrics"]["loss"] == result.history[-1]["loss"]
    at3 = restore(tmp_path, init, step=3)
    assert at3.data_position == {"epoch": 0, "index": 3} and int(at3.state.step) == 3
    # Plain files: JSON items, no pickle anywhere.
    step_dir = tmp_path / "checkpoints" / "5"
    assert json.loads((step_dir / "data_position" / "data_position.json").read_text())
    files = [p.name for p in step_dir.rglob("*")]
    assert not any(f.endswith((".pkl", ".pickle")) for f in files)


def test_plain_orbax_reads_it(tmp_path):
    import orbax.checkpoint as ocp

    ckpt = Checkpointer(tmp_path, every_steps=2)
    result = train(init(), make_batches(2), 2, ckpt)
    with ocp.StandardCheckpointer() as c:
        tree = c.restore(tmp_path / "checkpoints" / "2" / "state")
    np.testing.assert_array_equal(tree["step"], 2)
    np.testing.assert_array_equal(tree["model"]["scale"], result.state.model.scale)
    assert tree["key"].dtype == np.uint32


def test_final_save_always_and_dedupe(tmp_path):
    @eqtrain.uses_state  # stop at exactly step 3
    def stop_at_3(i):
        if i.step == 3:
            raise eqtrain.StopTraining("enough")

    ckpt = Checkpointer(tmp_path, every_steps=10)
    train(init(), make_batches(10), 10, ckpt, hooks=[stop_at_3])
    assert list_steps(tmp_path) == [3]
    m = restore(tmp_path, init).manifest
    assert m["stop_reason"] == {"kind": "hook", "step": 3, "message": "enough"}
    ckpt = Checkpointer(tmp_path / "b", every_steps=2)
    train(init(), make_batches(4), 4, ckpt)
    assert len(ckpt.blocking_times) == 2  # the final save at step 4 was a no-op


def test_due_every_minutes(tmp_path):
    ckpt = Checkpointer(tmp_path, every_minutes=0.001)
    assert not Checkpointer(tmp_path, every_steps=5).due(3)
    import time

    time.sleep(0.1)
    assert ckpt.due(1)


def _save_steps(ckpt, steps, metric=None):
    state = init()
    for s in steps:
        metrics = {} if metric is None else {"eval/loss": metric(s)}
        ckpt.save(info(state, s, metrics), final=False)
    ckpt.close()


def test_keep_last(tmp_path):
    _save_steps(Checkpointer(tmp_path, keep_last=2), range(1, 7))
    assert list_steps(tmp_path) == [5, 6]


def test_keep_every(tmp_path):
    _save_steps(Checkpointer(tmp_path, keep_last=1, keep_every=3), range(1, 8))
    assert list_steps(tmp_path) == [3, 6, 7]


def test_keep_best(tmp_path):
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 0.5, 5: 3.0, 6: 2.0, 7: float("nan")}
    _save_steps(
        Checkpointer(tmp_path, keep_last=1, best="eval/loss", keep_best=2),
        range(1, 8),
        losses.get,
    )
    assert list_steps(tmp_path) == [2, 4, 7]
    _save_steps(
        Checkpointer(tmp_path / "max", keep_last=1, best="eval/loss", best_mode="max"),
        range(1, 7),
        losses.get,
    )
    assert list_steps(tmp_path / "max") == [1, 6]


def test_best_metric_the_run_never_reports_fails_at_the_first_eval(tmp_path):
    ckpt = Checkpointer(tmp_path, every_steps=2, best="eval/los")  # a typo
    batches = make_batches(6)
    evaluation = eqtrain.Evaluation(eqtrain.eval_step(mse_loss), batches[:2], every=2)
    with pytest.raises(eqtrain.ConfigError, match=r"'eval/los'.*eval/loss"):
        train(init(), batches, 6, ckpt, evaluation=evaluation)
    assert list_steps(tmp_path) == [2]  # the step that showed it is saved
    ok = Checkpointer(tmp_path / "ok", every_steps=2, best="eval/loss")
    train(init(), batches, 6, ok, evaluation=evaluation)
    assert list_steps(tmp_path / "ok") == [2, 4, 6]


def test_pruning_renames_before_deleting(tmp_path, monkeypatch):
    import shutil

    seen = []
    monkeypatch.setattr(shutil, "rmtree", lambda p, **kw: seen.append(Path(p).name))
    _save_steps(Checkpointer(tmp_path, keep_last=1), [1, 2])
    assert seen and all(not n.isdigit() and ".eqtrain-deleting" in n for n in seen)
    assert list_steps(tmp_path) == [2]  # the half-deleted step is not a step


def test_resume_policies(tmp_path):
    loader = Loader(rows(), 8, seed=1)
    train(init(), loader, 4, Checkpointer(tmp_path, every_steps=2, data=loader))
    # never: refuses; overwrite: deletes.
    with pytest.raises(CheckpointError, match="resume='never'"):
        resume_run(tmp_path, init, resume="never")
    # a fresh Checkpointer over the old run refuses to mix.
    with pytest.raises(CheckpointError, match="mix two runs"):
        train(init(), make_batches(4), 4, Checkpointer(tmp_path, every_steps=2))
    # auto: continues, with the data position.
    fresh = Loader(rows(), 8, seed=1)
    resumed = resume_run(tmp_path, init, data=fresh)
    assert resumed.step == 4 and int(resumed.state.step) == 4
    assert fresh.position["index"] == 4
    # a path: restores from another run's step.
    other = resume_run(tmp_path / "other", init, resume=tmp_path / "checkpoints" / "2")
    assert other.step == 2
    never = resume_run(tmp_path, init, resume="never", overwrite=True)
    assert never.step is None and list_steps(tmp_path) == []
    new = resume_run(tmp_path / "new", init)
    assert new.step is None and int(new.state.step) == 0


def test_torn_save_ignored_and_cleaned(tmp_path):
    train(init(), make_batches(2), 2, Checkpointer(tmp_path, every_steps=2))
    torn = tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp-1234"
    (torn / "state").mkdir(parents=True)
    (torn / "state" / "garbage").write_bytes(b"\0" * 10)
    assert restore(tmp_path, init).step == 2
    Checkpointer(tmp_path)
    assert not torn.exists()


def _corrupt(step_dir, how):
    if how == "truncate":
        for f in (step_dir / "state").rglob("d/*"):
            if f.is_file():
                f.write_bytes(f.read_bytes()[:7])
    else:
        (step_dir / "manifest" / "manifest.json").unlink()


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_corrupted_latest_falls_back(tmp_path, how):
    result = train(init(), make_batches(4), 4, Checkpointer(tmp_path, every_steps=2))
    good = restore(tmp_path, init, step=2).state
    _corrupt(tmp_path / "checkpoints" / "4", how)
    with pytest.warns(CheckpointWarning, match=r"checkpoints/4"):
        restored = restore(tmp_path, init)
    assert restored.step == 2
    assert_same(restored.state, good)
    del result


def test_nothing_readable_is_an_error(tmp_path):
    train(init(), make_batches(2), 2, Checkpointer(tmp_path, every_steps=1))
    for s in (1, 2):
        _corrupt(tmp_path / "checkpoints" / str(s), "truncate")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        with pytest.raises(CheckpointError, match="Refusing to start over"):
            resume_run(tmp_path, init)


def test_incompatible_names_leaves(tmp_path):
    train(init(), make_batches(2), 2, Checkpointer(tmp_path, every_steps=2))
    with pytest.raises(IncompatibleCheckpointError) as e:
        restore(tmp_path, lambda: init(width=8))
    msg = str(e.value)
    assert "model.mlp.layers.0.weight" in msg and "(16, 4)" in msg and "(8, 4)" in msg
    no_ema = lambda: eqtrain.TrainState.create(Regressor(jr.key(0)), OPT, key=0)
    with pytest.raises(IncompatibleCheckpointError, match="ema.*not in the model"):
        restore(tmp_path, no_ema)


def test_a_failing_shardings_callable_is_the_callers_error(tmp_path):
    """A bug in the caller's `shardings` callable is said as such: not as every
    checkpoint of the run being unreadable, and nothing is moved aside."""
    train(init(), make_batches(2), 2, Checkpointer(tmp_path, every_steps=1))
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())

    def shardings(path, leaf):
        return undefined_name  # noqa: F821

    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)  # no step called damaged
        with pytest.raises(IncompatibleCheckpointError) as e:
            restore(tmp_path, init, shardings=shardings)
    msg = str(e.value)
    assert "`shardings` callable raised NameError" in msg and "unreadable" not in msg
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
    with pytest.raises(IncompatibleCheckpointError, match="must return a jax"):
        restore(tmp_path, init, shardings=lambda path, leaf: "device 0")


class Wide(eqx.Module):
    w: jax.Array
    b: jax.Array


def wide_state():
    model = Wide(jnp.arange(64.0 * 8).reshape(64, 8), jnp.ones(3))
    return eqtrain.TrainState.create(model, optax.adam(1e-3), key=1)


def _spread(mesh):
    def sharding(path, leaf):
        if leaf.ndim and leaf.shape[0] % 8 == 0:
            return NamedSharding(mesh, P("data"))
        return NamedSharding(mesh, P())

    return sharding


def test_reshard_8_to_1_and_1_to_8(tmp_path):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    state = wide_state()
    sharded = placed(state, _spread(mesh))
    assert len(sharded.model.w.sharding.device_set) == 8
    ck = Checkpointer(tmp_path / "eight")
    ck.save(info(sharded, 1), final=True)
    ck.close()
    assert restore(tmp_path / "eight", wide_state).manifest["mesh"] == {"data": 8}
    one = restore(tmp_path / "eight", wide_state).state  # default: one device
    assert len(one.model.w.sharding.device_set) == 1
    assert_same(one, state)
    ck = Checkpointer(tmp_path / "one")
    ck.save(info(state, 1), final=True)
    ck.close()
    eight = restore(tmp_path / "one", wide_state, shardings=_spread(mesh)).state
    assert eight.model.w.sharding.spec == P("data")
    assert len(eight.opt_state[0].mu.w.sharding.device_set) == 8
    assert_same(eight, state)


def placed(state, sharding_fn):
    from eqtrain.checkpoint._tree import array_leaves, path_name

    paths, leaves = array_leaves(state)
    placed = iter(
        jax.device_put(x, sharding_fn(path_name(p), x))
        for p, x in zip(paths, leaves, strict=True)
    )
    return jax.tree.map(lambda x: next(placed) if eqx.is_array(x) else x, state)


# -- integrity, identity, concurrency (issue 19) ----------------------------------
def _flip_bit(step_dir):
    """One bit flipped in the largest array file, where it still decodes."""
    from .test_resume_workflows import _flip_one_bit_in_an_array

    _flip_one_bit_in_an_array(step_dir)


def test_bit_flip_fails_the_checksums(tmp_path):
    train(init(width=64), make_batches(4), 4, Checkpointer(tmp_path, every_steps=2))
    manifest = json.loads(
        (tmp_path / "checkpoints" / "4" / "manifest" / "manifest.json").read_text()
    )
    assert manifest["checksum"] == "sum32x2" and manifest["run_id"]
    assert set(manifest["checksums"]) == set(manifest["leaves"])
    _flip_bit(tmp_path / "checkpoints" / "4")
    with pytest.raises(DamagedCheckpointError, match="checksums of 1 array"):
        restore(tmp_path, lambda: init(width=64), step=4)
    with pytest.warns(CheckpointWarning, match=r"checkpoints/4 does not hold"):
        assert restore(tmp_path, lambda: init(width=64)).step == 2
    # a writer (resume) moves it aside, once
    with pytest.warns(CheckpointWarning, match="moved aside to 4.damaged-"):
        resumed = resume_run(tmp_path, lambda: init(width=64))
    assert resumed.step == 2 and list_steps(tmp_path) == [2]
    names = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert sorted(n.split(".")[0] for n in names if ".damaged-" in n) == ["4"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resume_run(tmp_path, lambda: init(width=64)).step == 2


def test_a_checkpoint_written_before_checksums_still_restores(tmp_path):
    """A manifest of format 1 (no run_id, no checksums) restores and resumes."""
    train(init(width=64), make_batches(4), 4, Checkpointer(tmp_path, every_steps=2))
    want = restore(tmp_path, lambda: init(width=64), step=4).state
    for step in (2, 4):
        path = tmp_path / "checkpoints" / str(step) / "manifest" / "manifest.json"
        manifest = json.loads(path.read_text())
        for key in ("run_id", "checksum", "checksums"):
            del manifest[key]
        path.write_text(json.dumps({**manifest, "format": 1}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not taken for damaged, silently
        old = restore(tmp_path, lambda: init(width=64))
        assert old.step == 4
        assert_same(old.state, want)
        assert resume_run(tmp_path, lambda: init(width=64)).step == 4


def test_checksums_cover_every_dtype():
    from eqtrain.checkpoint._integrity import _all_sums, checksums, host_sums

    leaves = [
        jnp.arange(6.0).reshape(2, 3),
        jnp.ones((3,), jnp.bfloat16),
        jnp.array([True, False]),
        jnp.arange(4, dtype=jnp.int8),
        jax.random.key_data(jax.random.key(3)),
    ]
    names = [str(i) for i in range(len(leaves))]
    sums = checksums(names, leaves)
    assert set(sums) == set(names)
    changed = [leaves[0].at[1, 2].set(5.0000005), *leaves[1:]]
    assert checksums(names, changed)["0"] != sums["0"]
    swapped = [leaves[0][::-1], *leaves[1:]]  # same values, other places
    assert checksums(names, swapped)["0"] != sums["0"]
    # the host (numpy) and device (jitted) forms agree, on every dtype
    on_device = np.asarray(_all_sums(leaves))
    assert [tuple(map(int, r)) for r in on_device] == [
        host_sums(np.asarray(x)) for x in leaves
    ]


def test_restore_relists_when_the_picked_step_is_pruned(tmp_path, monkeypatch):
    """`eval`/`export` on a directory being written: the step picked is pruned
    meanwhile (renamed away); the newest complete one is taken, silently."""
    from eqtrain.checkpoint import _restore, _storage

    train(init(), make_batches(4), 4, Checkpointer(tmp_path, every_steps=2))
    real = _restore._restore_step
    pruned = []

    def racing(step_dir, *args):
        if not pruned:
            pruned.append(step_dir.name)
            _storage.remove_step(step_dir.parent, int(step_dir.name))
        return real(step_dir, *args)

    monkeypatch.setattr(_restore, "_restore_step", racing)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert restore(tmp_path, init).step == 2
    assert pruned == ["4"]


def test_run_identity_not_step_numbers(tmp_path):
    loader = Loader(rows(), 8, seed=1)
    train(init(), loader, 4, Checkpointer(tmp_path, every_steps=2, data=loader))
    run_id = json.loads(
        (tmp_path / "checkpoints" / "2" / "manifest" / "manifest.json").read_text()
    )["run_id"]
    # another run's identity: refused at construction, before any training
    with pytest.raises(CheckpointError, match="written by another run"):
        Checkpointer(tmp_path, run_id="someone-else")
    # the same run, finished, run again: nothing trained, nothing written
    fresh = Loader(rows(), 8, seed=1)
    resumed = resume_run(tmp_path, init, data=fresh)
    assert resumed.run_id == run_id and resumed.step == 4
    mtime = (tmp_path / "checkpoints" / "4").stat().st_mtime_ns
    ck = Checkpointer(tmp_path, every_steps=2, data=fresh, run_id=resumed.run_id)
    result = train(resumed.state, fresh, 4, ck)
    assert result.stop_reason.kind == "max_steps"
    assert (tmp_path / "checkpoints" / "4").stat().st_mtime_ns == mtime
    # ... and continued further: same identity in the new manifests
    train(resumed.state, fresh, 6, Checkpointer(tmp_path, every_steps=2))
    assert read_manifest(tmp_path, step=6)["run_id"] == run_id


def test_rollback_refused_before_training_unless_overwrite(tmp_path):
    train(init(), make_batches(4), 4, Checkpointer(tmp_path, every_steps=2))
    step2 = tmp_path / "checkpoints" / "2"
    with pytest.raises(CheckpointError, match=r"rolls the run back.*\[4\]"):
        resume_run(tmp_path, init, resume=step2)
    with pytest.warns(CheckpointWarning, match=r"discarded checkpoint\(s\) \[4\]"):
        resumed = resume_run(tmp_path, init, resume=step2, overwrite=True)
    assert resumed.step == 2 and list_steps(tmp_path) == [2]


def test_failed_background_save_is_one_sentence(tmp_path, monkeypatch, capfd):
    import errno

    import orbax.checkpoint as ocp

    ck = Checkpointer(tmp_path, every_steps=1)
    state = init()
    ck.save(info(state, 1))
    ck.wait()
    real = ocp.StandardCheckpointHandler.async_save

    class Failing:
        def result(self, timeout=None):
            raise OSError(errno.ENOSPC, "No space left on device", "/x/d/abc")

    async def failing(self, *args, **kwargs):
        return [*(await real(self, *args, **kwargs) or []), Failing()]

    monkeypatch.setattr(ocp.StandardCheckpointHandler, "async_save", failing)
    ck.save(info(state, 2))
    with pytest.raises(CheckpointError) as e:
        ck.close()
    assert str(e.value) == (
        "saving step 2 failed: No space left on device writing /x/d/abc; last good "
        f"checkpoint: {tmp_path.absolute() / 'checkpoints' / '1'}."
    )
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Event loop is closed" not in err
    assert list_steps(tmp_path) == [1]


def test_run_lock(tmp_path, capsys):
    import os
    import subprocess

    lock = RunLock(tmp_path).acquire()
    info_ = json.loads((tmp_path / ".lock").read_text())
    assert info_["pid"] == os.getpid()
    with pytest.raises(RunInUseError, match=f"in use by PID {os.getpid()} since"):
        RunLock(tmp_path).acquire()
    lock.release()
    assert not (tmp_path / ".lock").exists()
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / ".lock").write_text(
        json.dumps({"pid": dead.pid, "host": os.uname().nodename, "started": 1.0})
    )
    with RunLock(tmp_path):
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    assert f"PID {dead.pid}" in capsys.readouterr().err
    assert not (tmp_path / ".lock").exists()


@pytest.mark.parametrize("name", ["a[1]", "b*", "c?", "d\\e"])
def test_pattern_characters_refused(tmp_path, name):
    with pytest.raises(CheckpointError, match="could never be read back"):
        Checkpointer(tmp_path / name)
    assert not (tmp_path / name).exists()
