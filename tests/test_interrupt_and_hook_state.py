"""Issue 58, points 1 and 2: a `KeyboardInterrupt` inside `fit` saves the latest
state as any other exception does (and says so), also when it comes during a save;
and hooks keep state across a resume (`state_dict`/`load_state_dict`, stored in the
checkpoint's manifest): an early-stopping hook resumed stops where the uninterrupted
run stopped, and a run it already stopped does not train on."""

import json
import signal

import jax.numpy as jnp
import jax.random as jr
import optax
import pytest

import eqtrain
from eqtrain import ConfigError, Evaluation, StopConditions, StopKind, at, every
from eqtrain.checkpoint import Checkpointer, list_steps, read_manifest, resume_run
from eqtrain.hooks import EarlyStopping

from .conftest import Regressor, make_batches, mse_loss
from .test_loop import FakeCheckpointer


# Updates change the model for the first 6 steps only (the learning rate is 0
# after): evaluated every 2 steps, `eval/loss` improves at steps 2, 4, 6 and then
# never again, so an early stop with patience 3 comes at step 12.
OPT = optax.sgd(lambda count: jnp.where(count < 6, 0.02, 0.0))
STOPS_AT = 12


def init():
    return eqtrain.TrainState.create(Regressor(jr.key(0)), OPT, key=0)


@pytest.fixture(scope="module")
def step():
    return eqtrain.jit(eqtrain.train_step(mse_loss, OPT))


@pytest.fixture(scope="module")
def evaluation():
    evaluate = eqtrain.jit(eqtrain.eval_step(mse_loss), donate=False)
    return Evaluation(evaluate, make_batches(2, seed=1), every=2, at_end=False)


@pytest.fixture(scope="module")
def batches():
    return make_batches(40)


def interrupt_at(n):
    """A hook that raises `KeyboardInterrupt` at step `n`, on its exact state."""

    def hook(info):
        if info.step == n:
            raise KeyboardInterrupt

    return at([n], hook, uses_state=True)


# -- point 1: Ctrl-C inside `fit` -----------------------------------------------
def test_a_keyboard_interrupt_saves_the_latest_state_and_says_so(
    step, batches, tmp_path, capsys
):
    """The issue's done-when at a small scale: saving every 5, a hook raising
    `KeyboardInterrupt` at step 12 leaves step 12 saved (a real Orbax
    checkpointer), and a note; the interrupt still propagates."""
    ckpt = Checkpointer(tmp_path, every_steps=5)
    with pytest.raises(KeyboardInterrupt):
        eqtrain.fit(
            init(), step, batches, num_steps=30, hooks=[interrupt_at(12)],
            checkpointer=ckpt,
        )  # fmt: skip
    assert list_steps(tmp_path)[-1] == 12
    manifest = read_manifest(tmp_path)
    assert manifest["final"] and manifest["stop_reason"]["kind"] == "error"
    assert manifest["stop_reason"]["message"].startswith("KeyboardInterrupt")
    err = capsys.readouterr().err
    assert "KeyboardInterrupt ended the run after step 12" in err
    assert "the state of step 12 was saved first" in err
    assert resume_run(tmp_path, init).step == 12


def test_a_keyboard_interrupt_from_the_data_saves_the_steps_done(step, batches):
    ckpt = FakeCheckpointer(100)

    def data():
        yield from batches[:7]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        eqtrain.fit(init(), step, data(), num_steps=30, checkpointer=ckpt)
    [(saved, state_step, reason)] = ckpt.finals
    assert saved == state_step == 7 and reason.kind == StopKind.ERROR
    assert ckpt.closed == 1


def test_sigint_without_fit_s_handler_saves_too(step, batches, capsys):
    """Where `fit`'s handler is not installed (here `handle_signals=False`; in a
    notebook, the kernel's), Python raises `KeyboardInterrupt` on SIGINT."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler in this process")
    ckpt = FakeCheckpointer(100)

    @eqtrain.uses_state
    def ctrl_c(info):
        if info.step == 4:
            signal.raise_signal(signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        eqtrain.fit(
            init(), step, batches, num_steps=30, hooks=[ctrl_c], checkpointer=ckpt,
            stop=StopConditions(handle_signals=False),
        )  # fmt: skip
    assert [s for s, _, _ in ckpt.finals] == [4]
    assert "the state of step 4 was saved first" in capsys.readouterr().err


class _InterruptedSave(FakeCheckpointer):
    """Ctrl-C arrives inside `save` at the saves numbered in `at`."""

    def __init__(self, every_n, at):
        super().__init__(every_n)
        self.at, self.calls = at, []

    def save(self, info, *, final):
        self.calls.append((info.step, final))
        if len(self.calls) in self.at:
            raise KeyboardInterrupt
        super().save(info, final=final)


def test_an_interrupt_during_a_save_is_not_retried(step, batches, capsys):
    ckpt = _InterruptedSave(5, at={2})  # the save of step 10
    with pytest.raises(KeyboardInterrupt):
        eqtrain.fit(init(), step, batches, num_steps=30, checkpointer=ckpt)
    assert ckpt.calls == [(5, False), (10, False)]  # step 10's save not retried
    assert ckpt.closed == 1
    err = capsys.readouterr().err
    assert "KeyboardInterrupt ended the run after step 10" in err
    assert "while step 10 was being saved" in err and "not retried" in err


def test_a_second_interrupt_during_the_save_abandons_it(step, batches, capsys):
    """The first Ctrl-C (from a hook) starts the save of step 6; a second one
    during that save stops it: no third try, and the first interrupt propagates."""
    ckpt = _InterruptedSave(100, at={1})
    with pytest.raises(KeyboardInterrupt):
        eqtrain.fit(
            init(), step, batches, num_steps=30, hooks=[interrupt_at(6)],
            checkpointer=ckpt,
        )  # fmt: skip
    assert ckpt.calls == [(6, True)] and ckpt.finals == [] and ckpt.closed == 1
    err = capsys.readouterr().err
    assert "a second interrupt stopped the save of step 6" in err


def test_an_interrupt_inside_orbax_s_save_keeps_the_earlier_steps(
    step, batches, tmp_path, monkeypatch
):
    ckpt = Checkpointer(tmp_path, every_steps=4)
    items = ckpt._items

    def interrupted(arrays, manifest):
        if manifest["step"] == 8:
            raise KeyboardInterrupt
        return items(arrays, manifest)

    monkeypatch.setattr(ckpt, "_items", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eqtrain.fit(init(), step, batches, num_steps=30, checkpointer=ckpt)
    assert list_steps(tmp_path) == [4]
    assert resume_run(tmp_path, init).step == 4


# -- point 2: hook state across a resume ------------------------------------------
def _stopper():
    return EarlyStopping("eval/loss", patience=3)


def test_early_stopping_stops_after_patience_evaluations(step, evaluation, batches):
    stopper = _stopper()
    result = eqtrain.fit(
        init(), step, batches, num_steps=30, hooks=[stopper], evaluation=evaluation
    )
    assert result.stop_reason.kind == StopKind.HOOK
    assert result.stop_reason.step == int(result.state.step) == STOPS_AT
    assert "eval/loss" in result.stop_reason.message
    state = stopper.state_dict()
    assert state["best_step"] == 6 and state["stopped_at"] == STOPS_AT
    assert json.loads(json.dumps(state)) == state


def test_early_stopping_resumed_stops_where_the_uninterrupted_run_did(
    step, evaluation, batches, tmp_path, capsys
):
    """Interrupted at step 9 (one evaluation without improvement behind it),
    resumed: the hook's count and best value come back from the checkpoint, so
    it stops at step 12 as the uninterrupted run did (from scratch, it would have
    waited for 3 more evaluations: step 16). Then the early-stopped run, resumed
    again, says so and trains nothing."""
    ckpt = Checkpointer(tmp_path, every_steps=4)
    with pytest.raises(KeyboardInterrupt):
        eqtrain.fit(
            init(), step, batches, num_steps=30, checkpointer=ckpt,
            hooks=[_stopper(), interrupt_at(9)], evaluation=evaluation,
        )  # fmt: skip
    key = _stopper().state_key
    assert read_manifest(tmp_path)["hooks"][key]["since_best"] == 1

    resumed = resume_run(tmp_path, init)
    assert resumed.step == 9 and resumed.hook_states[key]["best_step"] == 6
    ckpt = Checkpointer(tmp_path, every_steps=4, run_id=resumed.run_id)
    stopper = _stopper()
    result = eqtrain.fit(
        resumed.state, step, batches[9:], num_steps=30, checkpointer=ckpt,
        hooks=[stopper], evaluation=evaluation, hook_states=resumed.hook_states,
    )  # fmt: skip
    assert result.stop_reason.kind == StopKind.HOOK
    assert int(result.state.step) == STOPS_AT
    assert read_manifest(tmp_path)["hooks"][key]["stopped_at"] == STOPS_AT
    capsys.readouterr()

    again = resume_run(tmp_path, init)
    taken = []

    def data():
        for batch in batches[STOPS_AT:]:
            taken.append(batch)
            yield batch

    ckpt = Checkpointer(tmp_path, every_steps=4, run_id=again.run_id)
    result = eqtrain.fit(
        again.state, step, data(), num_steps=30, checkpointer=ckpt,
        hooks=[_stopper()], evaluation=evaluation, hook_states=again.hook_states,
    )  # fmt: skip
    assert result.stop_reason.kind == StopKind.HOOK
    assert result.stop_reason.step == int(result.state.step) == STOPS_AT
    assert result.history == [] and taken == []
    assert f"stopped at step {STOPS_AT}" in result.stop_reason.message
    assert f"stopped at step {STOPS_AT}" in capsys.readouterr().err
    assert list_steps(tmp_path)[-1] == STOPS_AT


class _Counter:
    """A stateful hook of the user's: counts the steps it saw."""

    def __init__(self, state_key=None):
        self.seen = 0
        if state_key is not None:
            self.state_key = state_key

    def __call__(self, info):
        if info.stop_reason is None:
            self.seen += 1

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def test_a_user_hook_s_state_is_saved_in_every_checkpoint(step, batches):
    seen = []

    class Spy(FakeCheckpointer):
        def save(self, info, *, final):
            super().save(info, final=final)
            seen.append((info.step, info.hook_states))

    counter = _Counter()
    # once, though scheduled twice
    hooks = [every(1, counter), eqtrain.at_end(counter)]
    eqtrain.fit(
        init(), step, batches, num_steps=6, hooks=hooks, checkpointer=Spy(3),
        hook_states={"_Counter": {"seen": 10}},
    )  # fmt: skip
    # the save at step 6, then the final one (same step)
    assert (
        seen
        == [(3, {"_Counter": {"seen": 13}})] + [(6, {"_Counter": {"seen": 16}})] * 2
    )


def test_two_hooks_with_one_state_key_are_refused(step, batches):
    with pytest.raises(ConfigError, match="state_key"):
        eqtrain.fit(init(), step, batches, num_steps=2, hooks=[_Counter(), _Counter()])
    eqtrain.fit(
        init(), step, batches, num_steps=2, hooks=[_Counter(), _Counter("other")]
    )


def test_a_state_that_is_not_json_is_refused_by_name(step, batches):
    class Bad(_Counter):
        def state_dict(self):
            return {"seen": jnp.zeros(())}

    with pytest.raises(ConfigError, match=r"Bad.*seen"):
        eqtrain.fit(init(), step, batches, num_steps=2, hooks=[Bad()])


def test_a_saved_state_no_hook_claims_is_ignored_with_a_warning(step, batches):
    counter = _Counter()
    with pytest.warns(eqtrain.EqtrainWarning, match=r"\['Gone'\] matches no hook"):
        eqtrain.fit(
            init(), step, batches, num_steps=2, hooks=[counter],
            hook_states={"Gone": {"n": 1}, "_Counter": {"seen": 5}},
        )  # fmt: skip
    assert counter.seen == 7
