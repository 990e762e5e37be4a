"""Tests for `fit`: stop reasons, hook schedules, evaluation, checkpointer calls, and
the asynchronous (one-step-ahead) dispatch."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import equinox as eqx
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqtrain
from eqtrain import StopKind, StopTraining, TrainState, at, at_end, every, every_seconds

from .conftest import Regressor, make_batches, mse_loss


OPT = optax.adam(1e-2)


def fresh_state(seed=0):
    return TrainState.create(Regressor(jr.key(seed)), OPT, key=seed)


@pytest.fixture(scope="module")
def step():
    # One compiled step shared by the tests of this module: compiled once.
    return eqtrain.jit(eqtrain.train_step(mse_loss, OPT, nonfinite="stop"))


@pytest.fixture(scope="module")
def skip_step():
    return eqtrain.jit(eqtrain.train_step(mse_loss, OPT, nonfinite="skip"))


@pytest.fixture(scope="module")
def evaluate():
    return eqtrain.jit(eqtrain.eval_step(mse_loss), donate=False)


class FakeCheckpointer:
    """Records the protocol calls `fit` makes (the real one is Orbax-based)."""

    def __init__(self, every_n):
        self.every_n = every_n
        self.saves = []
        self.finals = []
        self.closed = 0

    def due(self, step):
        return step % self.every_n == 0

    def save(self, info, *, final):
        entry = (info.step, int(info.state.step), info.stop_reason)
        (self.finals if final else self.saves).append(entry)

    def close(self):
        self.closed += 1


def test_max_steps_history_and_single_trace(step, batches):
    result = eqtrain.fit(fresh_state(), step, batches, num_steps=10)
    assert result.stop_reason.kind == StopKind.MAX_STEPS == "max_steps"
    assert result.stop_reason.step == 10 and int(result.state.step) == 10
    assert [h["step"] for h in result.history] == list(range(1, 11))
    assert result.metrics["step"] == 10 and "loss" in result.metrics
    assert step.num_traces == 1


def test_equals_a_manual_loop(step, batches):
    manual = fresh_state()
    plain = eqtrain.train_step(mse_loss, OPT, nonfinite="stop")
    losses = []
    for b in batches[:6]:
        manual, m = plain(manual, b)
        losses.append(float(m["loss"]))
    result = eqtrain.fit(fresh_state(), step, batches, num_steps=6)
    np.testing.assert_allclose([h["loss"] for h in result.history], losses, rtol=1e-6)
    assert eqx.tree_equal(result.state, manual, rtol=1e-6, atol=1e-7)


@pytest.mark.tuned  # re-run under each CPU setting (test_tuned_settings.py)
def test_num_steps_is_absolute_and_resume_is_exact(step, batches):
    straight = eqtrain.fit(fresh_state(), step, batches, num_steps=8)
    first = eqtrain.fit(fresh_state(), step, batches, num_steps=5)
    second = eqtrain.fit(first.state, step, batches[5:], num_steps=8)
    assert [h["step"] for h in second.history] == [6, 7, 8]
    assert eqx.tree_equal(second.state, straight.state)
    losses = [h["loss"] for h in first.history + second.history]
    assert losses == [h["loss"] for h in straight.history]
    # already there: no step runs, final hooks still see the state
    seen = []
    again = eqtrain.fit(
        second.state, step, batches, num_steps=8, hooks=[at_end(seen.append)]
    )
    assert again.history == [] and again.stop_reason.kind == "max_steps"
    assert seen[0].step == 8 and int(seen[0].state.step) == 8


def test_reusing_a_consumed_state_is_a_clear_error(step, batches):
    state = fresh_state()
    eqtrain.fit(state, step, batches, num_steps=2)
    with pytest.raises(eqtrain.DonatedStateError, match="fit"):
        eqtrain.fit(state, step, batches, num_steps=2)


def test_data_exhausted(step, batches):
    result = eqtrain.fit(fresh_state(), step, batches[:4], num_steps=100)
    assert result.stop_reason.kind == "data_exhausted" and result.stop_reason.step == 4


def test_time_limit(step, batches):
    def slow():
        for b in batches:
            time.sleep(0.05)
            yield b

    stop = eqtrain.StopConditions(time_limit=0.4)
    result = eqtrain.fit(fresh_state(), step, slow(), num_steps=1000, stop=stop)
    assert result.stop_reason.kind == "time_limit"
    assert 1 <= result.stop_reason.step < len(batches)
    assert int(result.state.step) == result.stop_reason.step


def test_kill_switch(step, batches, tmp_path):
    switch = tmp_path / "STOP"
    result = eqtrain.fit(
        fresh_state(),
        step,
        batches,
        num_steps=50,
        stop=eqtrain.StopConditions(kill_switch=switch),
        hooks=[at([3], lambda info: switch.touch(), uses_state=True)],  # exact step
    )
    assert (
        result.stop_reason.kind == "kill_switch"
        and str(switch) in result.stop_reason.message
    )
    assert result.stop_reason.step == 3 and int(result.state.step) == 3


def test_hook_requests_stop(step, batches):
    @eqtrain.uses_state  # stops at the exact step it saw
    def stopper(info):
        if info.step == 5:
            raise StopTraining("loss is good enough")

    result = eqtrain.fit(fresh_state(), step, batches, num_steps=50, hooks=[stopper])
    assert result.stop_reason.kind == "hook"
    assert result.stop_reason.message == "loss is good enough"
    assert result.stop_reason.step == 5 and int(result.state.step) == 5


def test_nonfinite_stop_returns_last_good_state(step, batches):
    data = list(batches[:10])
    data[4] = dict(data[4], y=np.full_like(data[4]["y"], np.inf))
    good = eqtrain.fit(fresh_state(), step, data[:4], num_steps=4)
    result = eqtrain.fit(fresh_state(), step, data, num_steps=10)
    assert result.stop_reason.kind == "nonfinite" and result.stop_reason.step == 5
    assert int(result.state.step) == 4
    assert eqx.tree_equal(result.state.model, good.state.model)


def test_nonfinite_skip_continues(skip_step, batches):
    data = list(batches[:10])
    data[4] = dict(data[4], y=np.full_like(data[4]["y"], np.nan))
    result = eqtrain.fit(fresh_state(), skip_step, data, num_steps=10)
    assert result.stop_reason.kind == "max_steps"
    assert [h["skipped"] for h in result.history] == [0] * 4 + [1] * 6


def test_other_exceptions_propagate_and_hooks_close(step, batches):
    class Boom(Exception):
        pass

    class Closing:
        uses_state = False
        closed = False

        def __call__(self, info):
            pass

        def close(self):
            Closing.closed = True

    def data():
        yield from batches[:3]
        raise Boom("disk on fire")

    with pytest.raises(Boom, match="disk on fire"):
        eqtrain.fit(fresh_state(), step, data(), num_steps=10, hooks=[Closing()])
    assert Closing.closed


def test_schedules(step, batches):
    calls = {"every": [], "at": [], "end": [], "plain": []}
    result = eqtrain.fit(
        fresh_state(),
        step,
        batches,
        num_steps=10,
        hooks=[
            every(3, lambda i: calls["every"].append(i.step)),
            at([2, 5, 99], lambda i: calls["at"].append(i.step)),
            at_end(lambda i: calls["end"].append((i.step, i.stop_reason.kind))),
            lambda i: calls["plain"].append(i.step),
        ],
    )
    assert calls["every"] == [3, 6, 9]
    assert calls["at"] == [2, 5]
    assert calls["end"] == [(10, "max_steps")]
    assert calls["plain"] == list(range(1, 11))
    assert result.stop_reason.kind == "max_steps"


def test_every_seconds(step, batches):
    seen = []

    def slow():
        for b in batches:
            time.sleep(0.03)
            yield b

    eqtrain.fit(
        fresh_state(),
        step,
        slow(),
        num_steps=20,
        hooks=[every_seconds(0.1, lambda i: seen.append(i.step))],
    )
    assert 1 <= len(seen) < 20 and seen == sorted(seen)


def test_schedule_argument_errors():
    with pytest.raises(eqtrain.ConfigError):
        every(0, print)
    with pytest.raises(eqtrain.ConfigError):
        at([0], print)
    with pytest.raises(eqtrain.ConfigError):
        every_seconds(0, print)


def test_state_hooks_see_exact_state_metrics_hooks_cannot(step, batches):
    seen = []

    @eqtrain.uses_state
    def needs_state(info):
        seen.append((info.step, int(info.state.step), info.has_state))

    eqtrain.fit(fresh_state(), step, batches, num_steps=4, hooks=[needs_state])
    assert seen == [(k, k, True) for k in range(1, 5)]

    def peeks(info):
        info.state  # noqa: B018

    with pytest.raises(eqtrain.StateUnavailableError, match="uses_state"):
        eqtrain.fit(
            fresh_state(),
            step,
            batches,
            num_steps=4,
            hooks=[every(1, peeks, uses_state=False)],
        )


def heavy_loss(model, batch, key):
    """The regression loss plus ~50 ms of matmuls, so a step is long enough to watch."""
    loss, aux = mse_loss(model, batch, key)
    x = batch["heavy"]
    for _ in range(6):
        x = jnp.tanh(x @ x)
    return loss + 1e-9 * jnp.mean(x), aux


def _spy_on(step, monkeypatch):
    """Record the loop's dispatches and metric reads, in order."""
    import eqtrain._fit._loop as loop_module

    events, dispatched, ready_at_next_dispatch = [], [], []
    original_call = step.call_flat

    def spy_call(arrays, batch):
        if dispatched:
            ready_at_next_dispatch.append(dispatched[-1]["loss"].is_ready())
        out = original_call(arrays, batch)
        dispatched.append(out[1])
        events.append(("dispatch", len(dispatched)))
        return out

    original_read = loop_module._to_host

    def spy_read(metrics_list):
        if any(m is d for m in metrics_list for d in dispatched):
            index = [
                next(i + 1 for i, d in enumerate(dispatched) if d is m)
                for m in metrics_list
            ]
            events.append(("read", index))
        return original_read(metrics_list)

    monkeypatch.setattr(step, "call_flat", spy_call)
    monkeypatch.setattr(loop_module, "_to_host", spy_read)
    return events, ready_at_next_dispatch


def test_loop_dispatches_next_step_before_reading_current(batches, monkeypatch):
    """The host stays one step ahead: step k+1 is dispatched while step k still runs,
    and step k's metrics are read only after that dispatch."""
    heavy = np.full((768, 768), 1.0 / 768, np.float32)
    data = [dict(b, heavy=heavy) for b in batches[:8]]
    step = eqtrain.jit(eqtrain.train_step(heavy_loss, OPT))
    events, ready_at_next_dispatch = _spy_on(step, monkeypatch)
    log = every(1, lambda info: None, uses_state=False)
    reading = eqtrain.Reading(every=1)
    eqtrain.fit(fresh_state(), step, data, num_steps=8, hooks=[log], reading=reading)

    expected = [("dispatch", 1)]
    for k in range(2, 9):
        expected += [("dispatch", k), ("read", [k - 1])]
    assert events == expected + [("read", [8])]
    # Step k had not finished when step k+1 was dispatched: the loop did not wait.
    # (Step 1 includes compilation and may finish first; steps 2.. are ~50 ms each.)
    later = ready_at_next_dispatch[1:]
    assert sum(not r for r in later) >= len(later) - 1


def test_metrics_are_read_in_batches(batches, monkeypatch):
    step = eqtrain.jit(eqtrain.train_step(mse_loss, OPT))
    events, _ = _spy_on(step, monkeypatch)
    seen = []
    log = every(1, lambda info: seen.append(info.step), uses_state=False)
    result = eqtrain.fit(
        fresh_state(),
        step,
        batches,
        num_steps=10,
        hooks=[log],
        reading=eqtrain.Reading(every=4, seconds=1e9),
    )
    reads = [e[1] for e in events if e[0] == "read"]
    assert reads == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert events.index(("read", [1, 2, 3, 4])) == events.index(("dispatch", 5)) + 1
    assert seen == list(range(1, 11)) and len(result.history) == 10


def test_state_hook_makes_the_loop_wait_only_where_due(batches, monkeypatch):
    step = eqtrain.jit(eqtrain.train_step(mse_loss, OPT))
    events, _ = _spy_on(step, monkeypatch)
    eqtrain.fit(
        fresh_state(),
        step,
        batches,
        num_steps=6,
        hooks=[every(3, lambda info: info.state, uses_state=True)],
        # only the hook decides when to read (no timed reads)
        reading=eqtrain.Reading(seconds=1e9),
    )
    # steps 1-3 dispatched back to back; step 3 waited for (its hook uses the state)
    assert events == [
        ("dispatch", 1),
        ("dispatch", 2),
        ("dispatch", 3),
        ("read", [1, 2, 3]),
        ("dispatch", 4),
        ("dispatch", 5),
        ("dispatch", 6),
        ("read", [4, 5, 6]),
    ]


def test_evaluation_weighted_and_prefixed(step, evaluate, batches):
    eval_data = make_batches(3, batch_size=8, seed=7, mask=True)
    seen = {}

    def spy(info):
        if any(k.startswith("eval/") for k in info.metrics):
            seen[info.step] = info.metrics

    result = eqtrain.fit(
        fresh_state(),
        step,
        batches,
        num_steps=10,
        evaluation=eqtrain.Evaluation(evaluate, eval_data, every=4),
        hooks=[spy],
    )
    assert sorted(seen) == [4, 8]  # the end-of-run eval comes after the hooks
    assert "eval/loss" in result.history[-1]  # ... and is recorded at step 10
    # manual weighted average at step 10
    state = result.state
    ms = [eqtrain.eval_step(mse_loss)(state, b) for b in eval_data]
    w = np.array([float(m["weight"]) for m in ms])
    expect = sum(wi * float(m["loss"]) for wi, m in zip(w, ms, strict=True)) / w.sum()
    np.testing.assert_allclose(result.history[-1]["eval/loss"], expect, rtol=1e-5)
    assert result.history[-1]["eval/weight"] == w.sum()
    assert set(seen[4]) >= {"loss", "eval/loss", "eval/mae", "eval/weight"}


def test_nonfinite_stop_survives_wrapping_the_step(batches):
    inner = eqtrain.train_step(mse_loss, OPT, nonfinite="stop")

    def wrapped(state, batch):  # user code around the builder's step
        return inner(state, batch)

    data = list(batches[:10])
    data[2] = dict(data[2], y=np.full_like(data[2]["y"], np.nan))
    result = eqtrain.fit(fresh_state(), wrapped, data, num_steps=10)
    assert result.stop_reason.kind == "nonfinite" and result.stop_reason.step == 3
    assert int(result.state.step) == 2


def test_evaluate_standalone_matches_fit(step, evaluate, batches):
    eval_data = make_batches(3, batch_size=8, seed=7, mask=True)
    result = eqtrain.fit(
        fresh_state(),
        step,
        batches,
        num_steps=4,
        evaluation=eqtrain.Evaluation(evaluate, eval_data, every=4),
    )
    alone = eqtrain.evaluate(result.state, eqtrain.eval_step(mse_loss), eval_data)
    assert alone == pytest.approx(
        {k: v for k, v in result.history[-1].items() if k.startswith("eval/")}
    )
    with pytest.raises(eqtrain.ConfigError, match="donate=False"):
        eqtrain.evaluate(
            result.state, eqtrain.jit(eqtrain.eval_step(mse_loss)), eval_data
        )


def test_eval_arguments_checked(step, batches):
    with pytest.raises(eqtrain.ConfigError, match="eval_data"):
        with pytest.warns(DeprecationWarning):
            eqtrain.fit(fresh_state(), step, batches, num_steps=2, eval_every=1)
    with pytest.raises(eqtrain.ConfigError, match="re-iterable"):
        eqtrain.Evaluation(eqtrain.eval_step(mse_loss), iter(batches), every=1)
    with pytest.raises(eqtrain.ConfigError, match="only `eval_step`"):
        with pytest.warns(DeprecationWarning):
            eqtrain.fit(
                fresh_state(),
                step,
                batches,
                num_steps=2,
                eval_step=eqtrain.eval_step(mse_loss),
            )
    with pytest.raises(eqtrain.ConfigError, match="num_steps"):
        eqtrain.fit(fresh_state(), step, batches, num_steps=-1)


def _run_with_reason(kind, step, batches, tmp_path):
    data = list(batches[:12])
    kwargs, hooks = {}, []
    if kind == "max_steps":
        kwargs["num_steps"] = 6
    elif kind == "data_exhausted":
        data = data[:5]
    elif kind == "kill_switch":
        kwargs["stop"] = eqtrain.StopConditions(kill_switch=tmp_path / "STOP")
        hooks.append(at([5], lambda i: (tmp_path / "STOP").touch(), uses_state=True))
    elif kind == "hook":
        hooks.append(
            at([5], lambda i: (_ for _ in ()).throw(StopTraining("enough")),
               uses_state=True)
        )  # fmt: skip
    elif kind == "nonfinite":
        data[5] = dict(data[5], y=np.full_like(data[5]["y"], np.nan))
    elif kind == "time_limit":
        kwargs["stop"] = eqtrain.StopConditions(time_limit=0.3)

        def slow(src=data):
            for b in src:
                time.sleep(0.05)
                yield b

        data = slow()
    kwargs.setdefault("num_steps", 12)
    return data, hooks, kwargs


@pytest.mark.parametrize(
    "kind",
    ["max_steps", "data_exhausted", "kill_switch", "hook", "nonfinite", "time_limit"],
)
def test_checkpointer_saves_when_due_and_once_at_every_stop(
    kind, step, batches, tmp_path
):
    data, hooks, kwargs = _run_with_reason(kind, step, batches, tmp_path)
    ckpt = FakeCheckpointer(every_n=2)
    result = eqtrain.fit(
        fresh_state(), step, data, hooks=hooks, checkpointer=ckpt, **kwargs
    )
    assert result.stop_reason.kind == kind
    assert all(s == k and s % 2 == 0 for s, k, _ in ckpt.saves)
    assert len(ckpt.finals) == 1 and ckpt.closed == 1
    final_step, state_step, reason = ckpt.finals[0]
    assert state_step == int(result.state.step) == final_step
    assert reason == result.stop_reason


def test_previous_signal_handlers_restored(step, batches):
    def mine(signum, frame):
        pass

    old_int, old_term = (
        signal.getsignal(signal.SIGINT),
        signal.getsignal(signal.SIGTERM),
    )
    signal.signal(signal.SIGTERM, mine)
    try:
        eqtrain.fit(fresh_state(), step, batches, num_steps=2)
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is old_int
    finally:
        signal.signal(signal.SIGTERM, old_term)


CHILD = textwrap.dedent(
    """
    import json, sys, time
    import jax.random as jr, numpy as np, optax
    import eqtrain
    from tests.conftest import Regressor, make_batches, mse_loss

    mode = sys.argv[1]
    opt = optax.adam(1e-2)
    state = eqtrain.TrainState.create(Regressor(jr.key(0)), opt, key=0)
    batches = make_batches(8)

    def data():
        while True:
            for b in batches:
                time.sleep(0.02)
                yield b

    def announce(info):
        print(f"STEP {info.step}", flush=True)

    def final(info):
        print("FINAL " + json.dumps({"step": info.step, "kind": info.stop_reason.kind,
                                     "message": info.stop_reason.message}), flush=True)
        if mode == "slow-final":
            time.sleep(60)

    class Ckpt:
        finals = 0
        def due(self, step): return False
        def save(self, info, *, final):
            Ckpt.finals += final
        def close(self): pass

    result = eqtrain.fit(state, eqtrain.train_step(mse_loss, opt), data(),
                         num_steps=100000, hooks=[announce, eqtrain.at_end(final)],
                         checkpointer=Ckpt())
    print("RESULT " + json.dumps({"kind": result.stop_reason.kind,
                                  "state_step": int(result.state.step),
                                  "finals": Ckpt.finals}), flush=True)
    """
)


def _spawn(tmp_path, mode):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    env["XLA_FLAGS"] = ""
    return subprocess.Popen(
        [sys.executable, str(script), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for(proc, prefix, deadline):
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line
    raise AssertionError(
        f"child never printed {prefix!r}; stderr:\n{proc.stderr.read()[-3000:]}"
    )


# SIGTERM under `nox -s slow` (default-suite time): the same handler takes both,
# and tests/test_signals.py sends SIGTERM to a real `eqtrain fit`
@pytest.mark.parametrize(
    "sig", [pytest.param(signal.SIGTERM, marks=pytest.mark.slow), signal.SIGINT]
)
def test_signal_stops_cleanly_in_a_real_process(sig, tmp_path):
    proc = _spawn(tmp_path, "normal")
    deadline = time.monotonic() + 120
    try:
        _wait_for(proc, "STEP 5", deadline)
        proc.send_signal(sig)
        final = json.loads(_wait_for(proc, "FINAL", deadline)[len("FINAL ") :])
        result = json.loads(_wait_for(proc, "RESULT", deadline)[len("RESULT ") :])
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert final["kind"] == result["kind"] == "signal"
    assert final["message"] == signal.Signals(sig).name
    assert result["finals"] == 1
    assert result["state_step"] == final["step"] >= 5


def test_second_sigint_aborts(tmp_path):
    proc = _spawn(tmp_path, "slow-final")
    deadline = time.monotonic() + 120
    try:
        _wait_for(proc, "STEP 3", deadline)
        proc.send_signal(signal.SIGINT)
        _wait_for(proc, "FINAL", deadline)  # now sleeping inside the final hook
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        proc.kill()
    # the watchdog ends the process (no exception raised into the hook)
    assert code == 128 + signal.SIGINT, err
    # the first signal's notice, printed by the loop (not by the handler)
    assert "SIGINT received: stopping after the current step" in err
    assert "aborted by a second signal (SIGINT)" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err


def test_tokens_seen_and_mfu(step, batches):
    token_batches = [{**b, "tokens": np.zeros((8, 5), np.int32)} for b in batches]
    seen = []
    state = fresh_state()
    eqtrain.fit(
        state,
        step,
        token_batches[:3],
        num_steps=3,
        hooks=[lambda info: seen.append((info.tokens_seen, info))],
        flops_per_token=6.0,
        peak_flops=1e3,
        tokens_seen=100,
    )
    assert [t for t, _ in seen] == [140, 180, 220]
    for _, info in seen:
        assert info.mfu == pytest.approx(info.tokens_per_second * 6.0 / 1e3)
    # Without the FLOP figures there is no MFU, and batches without tokens count none.
    state = fresh_state()
    infos = []
    eqtrain.fit(state, step, batches[:2], num_steps=2, hooks=[infos.append])
    assert all(i.mfu is None and i.tokens_seen is None for i in infos)
