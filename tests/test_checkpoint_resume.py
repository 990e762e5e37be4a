"""Exact resume and kills, in real subprocesses (1 CPU device each)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqtrain
from eqtrain.checkpoint import Checkpointer, list_steps, resume_run

from .conftest import mse_loss


TOTAL = 16  # 2N steps; the loader has 12 batches per epoch, so resume crosses one

CHILD = textwrap.dedent(
    """
    import sys, time
    import equinox as eqx, jax, jax.numpy as jnp, jax.random as jr, numpy as np, optax
    import eqtrain
    from eqtrain.checkpoint import Checkpointer, resume_run
    from eqtrain.data import Loader
    from tests.conftest import Regressor, mse_loss

    mode, run_dir, out = sys.argv[1], sys.argv[2], sys.argv[3]
    TOTAL = int(sys.argv[4])
    opt = optax.adam(1e-2)

    class Big(eqx.Module):
        core: Regressor
        frozen: jax.Array

        def __call__(self, x):
            return self.core(x) + 0 * self.frozen[0]

    def init():
        model = Regressor(jr.key(0))
        if mode == "big":
            model = Big(model, jnp.zeros((int(sys.argv[5]),), jnp.float32))
            return eqtrain.TrainState.create(
                model, opt, key=0, trainable=Big(True, False)
            )
        return eqtrain.TrainState.create(model, opt, key=0, ema=True)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4)).astype(np.float32)
    rows = {"x": x, "y": (x @ np.arange(1, 5, dtype=np.float32)).astype(np.float32)}
    loader = Loader(rows, 8, seed=3)

    def announce(info):
        print(f"STEP {info.step} {float(info.metrics['loss']).hex()}", flush=True)
        time.sleep(0.03 if mode != "big" else 0.1)

    class Announced(Checkpointer):
        def save(self, info, *, final):
            super().save(info, final=final)
            if mode == "big" and info.step == 2:
                self.wait()
            print(f"SAVED {info.step}", flush=True)

    ckpt = None
    if mode == "straight":
        state = init()
    else:
        resumed = resume_run(run_dir, init, resume="auto", data=loader)
        state, start = resumed.state, resumed.step
        print(f"START {start or 0}", flush=True)
        ckpt = Announced(run_dir, every_steps=2 if mode == "big" else 3,
                         keep_last=None, data=loader)
    step = eqtrain.train_step(mse_loss, opt, ema=None if mode == "big" else 0.9)
    result = eqtrain.fit(state, step, loader, num_steps=TOTAL, hooks=[announce],
                         checkpointer=ckpt)
    leaves = [np.asarray(jax.random.key_data(v) if jnp.issubdtype(
        v.dtype, jax.dtypes.prng_key) else v)
        for v in jax.tree.leaves(eqx.filter(result.state, eqx.is_array))]
    np.savez(out, *leaves)
    print(f"DONE {result.stop_reason.kind}", flush=True)
    """
)


def _spawn(tmp_path, mode, run_dir, out, *extra):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    env["XLA_FLAGS"] = ""
    return subprocess.Popen(
        [sys.executable, str(script), mode, str(run_dir), str(out), str(TOTAL), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _read_until(proc, prefix, deadline, lines):
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(
        f"child never printed {prefix!r}; stderr:\n{proc.stderr.read()[-3000:]}"
    )


def _finish(proc, deadline, lines):
    _read_until(proc, "DONE", deadline, lines)
    assert proc.wait(timeout=max(1, deadline - time.monotonic())) == 0


def _losses(lines, upto=None):
    out = {}
    for line in lines:
        if line.startswith("STEP "):
            _, k, loss = line.split()
            if upto is None or int(k) <= upto:
                out[int(k)] = loss
    return out


def _start(lines):
    return int(next(x for x in lines if x.startswith("START")).split()[1])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight")
    proc = _spawn(tmp, "straight", tmp / "run", tmp / "out.npz")
    lines = []
    try:
        _finish(proc, time.monotonic() + 120, lines)
    finally:
        proc.kill()
    return _losses(lines), np.load(tmp / "out.npz")


def _assert_bitwise(out, straight):
    want = straight[1]
    got = np.load(out)
    assert len(got.files) == len(want.files)
    for name in want.files:
        assert got[name].dtype == want[name].dtype
        assert np.array_equal(got[name], want[name]), name


@pytest.mark.tuned  # re-run under each CPU setting (test_tuned_settings.py)
def test_sigterm_then_resume_is_bit_identical(tmp_path, straight):
    run = tmp_path / "run"
    deadline = time.monotonic() + 150
    first, second = [], []
    proc = _spawn(tmp_path, "run", run, tmp_path / "a.npz")
    try:
        _read_until(proc, "STEP 5", deadline, first)
        proc.send_signal(signal.SIGTERM)
        _finish(proc, deadline, first)
    finally:
        proc.kill()
    stopped = max(_losses(first))
    assert stopped < TOTAL and list_steps(run)[-1] == stopped  # the final save
    proc = _spawn(tmp_path, "run", run, tmp_path / "b.npz")
    try:
        _finish(proc, deadline, second)
    finally:
        proc.kill()
    assert _start(second) == stopped
    assert {**_losses(first), **_losses(second)} == straight[0]
    _assert_bitwise(tmp_path / "b.npz", straight)


def test_sigkill_after_a_save_then_resume_is_bit_identical(tmp_path, straight):
    run = tmp_path / "run"
    deadline = time.monotonic() + 150
    first, second = [], []
    proc = _spawn(tmp_path, "run", run, tmp_path / "a.npz")
    try:
        while not (run / "checkpoints" / "6").is_dir():  # committed (renamed)
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        proc.kill()
        proc.wait(timeout=30)
        first = proc.stdout.read().splitlines()
    finally:
        proc.kill()
    proc = _spawn(tmp_path, "run", run, tmp_path / "b.npz")
    try:
        _finish(proc, deadline, second)
    finally:
        proc.kill()
    start = _start(second)
    assert start >= 6 and start % 3 == 0
    assert {**_losses(first, upto=start), **_losses(second)} == straight[0]
    _assert_bitwise(tmp_path / "b.npz", straight)


def _kill_during_async_save(tmp_path, size):
    run = tmp_path / "run"
    deadline = time.monotonic() + 120
    lines = []
    proc = _spawn(tmp_path, "big", run, tmp_path / "a.npz", str(size))
    try:
        _read_until(proc, "SAVED 4", deadline, lines)  # save() returned: writing
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    ckpts = run / "checkpoints"
    torn = [p.name for p in ckpts.iterdir() if not p.name.isdigit()]
    caught_mid_write = not (ckpts / "4").exists()
    assert list_steps(run)[0] == 2

    class Big(eqx.Module):
        core: eqx.Module
        frozen: jax.Array

        def __call__(self, x):
            return self.core(x) + 0 * self.frozen[0]

    from .conftest import Regressor

    opt = optax.adam(1e-2)

    def init():
        model = Big(Regressor(jr.key(0)), jnp.zeros((size,), jnp.float32))
        return eqtrain.TrainState.create(model, opt, key=0, trainable=Big(True, False))

    if caught_mid_write:
        resumed = resume_run(run, init)
        state = resumed.state
        assert resumed.step == 2 and int(state.step) == 2
    # Training continues: new checkpoints go next to the old, the torn one is gone.
    from .conftest import make_batches

    result = eqtrain.fit(
        state if caught_mid_write else resume_run(run, init).state,
        eqtrain.train_step(mse_loss, opt),
        make_batches(4),
        num_steps=int(list_steps(run)[-1]) + 2,
        checkpointer=Checkpointer(run, every_steps=1, keep_last=None),
    )
    assert result.stop_reason.kind == "max_steps"
    assert not [p for p in ckpts.iterdir() if not p.name.isdigit()]
    return caught_mid_write, torn


def test_kill9_during_async_save_small(tmp_path):
    # ~64 MB of state: the write takes a moment; the kill usually lands mid-write.
    caught, torn = _kill_during_async_save(tmp_path, 16_000_000)
    if not caught:
        pytest.skip("the save finished before the kill; the slow variant is stricter")


@pytest.mark.slow
def test_kill9_during_async_save_large(tmp_path):
    caught, torn = _kill_during_async_save(tmp_path, 64_000_000)  # 256 MB
    assert caught and torn


def test_benchmark_quick():
    import json

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "checkpoint.py"
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(script), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["saves"] >= 2 and record["blocking_s"] > 0
