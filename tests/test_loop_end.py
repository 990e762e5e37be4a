"""How `fit` ends: the final checkpoint before the end hooks, a save on the way out of
an exception, the grouped `Evaluation` / `StopConditions` options, and plain-function
hooks that never make the loop wait (and say so when they would need to)."""

import numpy as np
import optax
import pytest

import eqtrain
from eqtrain import (
    ConfigError,
    Evaluation,
    Reading,
    StopConditions,
    StopKind,
    at,
    at_end,
    checkpoint,
    every,
)
from eqtrain._fit._loop import failed_at

from .conftest import make_batches, mse_loss
from .test_loop import FakeCheckpointer, _spy_on, fresh_state


OPT = optax.adam(1e-2)


@pytest.fixture(scope="module")
def step():
    return eqtrain.jit(eqtrain.train_step(mse_loss, OPT))


@pytest.fixture(scope="module")
def batches():
    return make_batches(12)


class Recorder(FakeCheckpointer):
    def __init__(self, every_n, events):
        super().__init__(every_n)
        self.events = events

    def save(self, info, *, final):
        super().save(info, final=final)
        self.events.append(("save", info.step, final))


def test_final_checkpoint_is_saved_before_the_end_hooks(step, batches):
    events = []
    ckpt = Recorder(100, events)

    def export(info):
        events.append(("end hook", info.step, None))
        raise OSError(28, "No space left on device")  # e.g. the final export

    with pytest.raises(OSError, match="No space"):
        eqtrain.fit(
            fresh_state(), step, batches, num_steps=5, hooks=[at_end(export)],
            checkpointer=ckpt,
        )  # fmt: skip
    assert events == [("save", 5, True), ("end hook", 5, None)]
    assert ckpt.finals == [(5, 5, ckpt.finals[0][2])]
    assert ckpt.finals[0][2].kind == StopKind.MAX_STEPS
    assert ckpt.closed == 1


def test_a_hook_error_saves_the_latest_state_then_propagates(step, batches, capsys):
    ckpt = FakeCheckpointer(100)

    def broken(info):
        if info.step == 4:
            raise RuntimeError("the hook broke")

    with pytest.raises(RuntimeError, match="the hook broke"):
        eqtrain.fit(
            fresh_state(), step, batches, num_steps=10,
            hooks=[at([4], broken, uses_state=True)], checkpointer=ckpt,
        )  # fmt: skip
    assert ckpt.saves == []
    [(saved_step, state_step, reason)] = ckpt.finals
    assert saved_step == state_step == 4  # the hook waited for step 4: exact state
    assert reason.kind == StopKind.ERROR and "the hook broke" in reason.message
    assert ckpt.closed == 1
    assert "the state of step 4 was saved first" in capsys.readouterr().err


class _DeviceError(RuntimeError):
    pass


class _Poisoned:
    """A result of a step that failed on the device: reading it raises."""

    def __array__(self, *args, **kwargs):
        raise _DeviceError("RESOURCE_EXHAUSTED: out of memory")


@pytest.mark.parametrize(
    "late, read_every, saved",
    [(False, 1, 2), (True, 5, None)],
    ids=["raised-at-dispatch", "reported-late"],
)
def test_fit_names_the_step_a_device_error_came_from(
    step, batches, monkeypatch, capsys, late, read_every, saved
):
    """Step 3 fails: at once (its dispatch raises), or late, as on an accelerator
    (its results carry the error, and so does every later dispatch)."""
    call_flat, calls = eqtrain.Jitted.call_flat, []

    def failing(self, arrays, batch):
        calls.append(None)
        if len(calls) > 3 or len(calls) == 3 and not late:
            raise _DeviceError("RESOURCE_EXHAUSTED: out of memory")
        new, metrics = call_flat(self, arrays, batch)
        return new, {k: _Poisoned() for k in metrics} if len(calls) == 3 else metrics

    monkeypatch.setattr(eqtrain.Jitted, "call_flat", failing)
    ckpt = FakeCheckpointer(100)
    with pytest.raises(_DeviceError) as raised:
        eqtrain.fit(
            fresh_state(), step, batches, num_steps=10, checkpointer=ckpt,
            reading=Reading(every=read_every, seconds=1e9),
        )  # fmt: skip
    where = failed_at(raised.value)
    assert (where.step, where.finished, str(where)) == (3, 2, "at step 3")
    err = capsys.readouterr().err
    assert "_DeviceError ended the run at step 3" in err
    if saved is None:  # the state of any step from 3 on is not what it should be
        assert ckpt.finals == [] and "none was saved" in err
    else:
        assert [s for s, _, _ in ckpt.finals] == [saved]


def test_an_error_outside_the_steps_is_located_after_them(step, batches):
    def broken(info):
        if info.step == 4:
            raise RuntimeError("the hook broke")

    with pytest.raises(RuntimeError) as raised:
        eqtrain.fit(
            fresh_state(), step, batches, num_steps=10,
            hooks=[at([4], broken, uses_state=True)],
        )  # fmt: skip
    where = failed_at(raised.value)
    assert (where.step, str(where)) == (None, "after step 4, outside the training step")


def test_a_late_hook_error_saves_the_newest_dispatched_state(step, batches):
    ckpt = FakeCheckpointer(100)

    @eqtrain.metrics_only  # runs late, while later steps run
    def broken(info):
        if info.step == 3:
            raise RuntimeError("late")

    with pytest.raises(RuntimeError, match="late"):
        eqtrain.fit(
            fresh_state(), step, batches, num_steps=12, hooks=[broken],
            checkpointer=ckpt, reading=Reading(every=5, seconds=1e9),
        )  # fmt: skip
    [(saved_step, state_step, reason)] = ckpt.finals
    assert saved_step == state_step >= 3  # a newer, complete state: nothing lost
    assert reason.kind == StopKind.ERROR


def test_a_data_error_saves_the_steps_done(step, batches):
    ckpt = FakeCheckpointer(100)

    def data():
        yield from batches[:3]
        raise ValueError("corrupt record 3")

    with pytest.raises(ValueError, match="corrupt record"):
        eqtrain.fit(fresh_state(), step, data(), num_steps=10, checkpointer=ckpt)
    assert [(s, k) for s, k, _ in ckpt.finals] == [(3, 3)]


def test_an_error_before_the_first_step_saves_nothing(step):
    ckpt = FakeCheckpointer(100)

    def data():
        raise ValueError("no data today")
        yield

    with pytest.raises(ValueError, match="no data today"):
        eqtrain.fit(fresh_state(), step, data(), num_steps=10, checkpointer=ckpt)
    assert ckpt.finals == [] and ckpt.closed == 1


def test_a_failing_checkpointer_is_not_retried_and_its_error_propagates(step, batches):
    class Full(FakeCheckpointer):
        def save(self, info, *, final):
            super().save(info, final=final)
            raise OSError(28, "No space left on device")

    ckpt = Full(2)
    with pytest.raises(OSError, match="No space") as raised:
        eqtrain.fit(fresh_state(), step, batches, num_steps=10, checkpointer=ckpt)
    assert type(raised.value) is OSError  # not a wrapper
    assert ckpt.saves == [(2, 2, None)] and ckpt.finals == []
    assert ckpt.closed == 1


def test_a_frozen_nonfinite_state_is_not_saved_on_error():
    stop_step = eqtrain.jit(eqtrain.train_step(mse_loss, OPT, nonfinite="stop"))
    batches = make_batches(8)
    batches[2] = {**batches[2], "y": np.full_like(batches[2]["y"], np.nan)}
    ckpt = FakeCheckpointer(100)

    def broken(info):
        if info.step == 3:  # the step that froze the state
            raise RuntimeError("after the freeze")

    with pytest.raises(RuntimeError):
        eqtrain.fit(
            fresh_state(), stop_step, batches, num_steps=8, checkpointer=ckpt,
            hooks=[broken], reading=Reading(every=1),
            stop=StopConditions(handle_signals=False),
        )  # fmt: skip
    assert ckpt.finals == []


def test_an_error_with_a_real_checkpointer_resumes_from_the_saved_step(
    tmp_path, step, batches
):
    ckpt = checkpoint.Checkpointer(tmp_path, every_steps=100)

    def broken(info):
        if info.step == 6:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        eqtrain.fit(
            fresh_state(), step, batches, num_steps=12, checkpointer=ckpt,
            hooks=[every(6, broken, uses_state=True)],
        )  # fmt: skip
    restored = checkpoint.restore(tmp_path, fresh_state)
    assert restored.step == 6 and int(restored.state.step) == 6
    assert restored.manifest["stop_reason"]["kind"] == "error"


def test_the_deprecated_flat_keywords_warn_and_equal_the_groups(step, batches):
    evaluate = eqtrain.jit(eqtrain.eval_step(mse_loss), donate=False)
    eval_data = make_batches(2, seed=1)
    with pytest.warns(DeprecationWarning) as warned:
        flat = eqtrain.fit(
            fresh_state(), step, batches, num_steps=6, eval_step=evaluate,
            eval_data=eval_data, eval_every=3, time_limit=1e6, handle_signals=False,
            history=4, read_every=2,
        )  # fmt: skip
    messages = [str(w.message) for w in warned]
    assert len(messages) == 7
    assert "`fit(eval_every=...)` is deprecated: pass `evaluation=eqtrain." \
        "Evaluation(every=...)` instead" in messages[2]  # fmt: skip
    assert "`reading=eqtrain.Reading(every=...)`" in messages[6]
    grouped = eqtrain.fit(
        fresh_state(), step, batches, num_steps=6,
        evaluation=Evaluation(evaluate, eval_data, every=3),
        stop=StopConditions(time_limit=1e6, handle_signals=False),
        reading=Reading(history=4, every=2),
    )  # fmt: skip
    assert len(grouped.history) == 4
    assert flat.history == grouped.history
    assert flat.history[0]["step"] == 3  # the oldest two were dropped
    assert flat.history[0]["eval/loss"] == grouped.history[0]["eval/loss"]


def test_grouped_and_keyword_options_are_not_mixed(step, batches):
    evaluate = eqtrain.eval_step(mse_loss)
    mixed = [
        dict(evaluation=Evaluation(evaluate, batches), eval_every=1),
        dict(stop=StopConditions(time_limit=5), kill_switch="STOP"),
        dict(reading=Reading(every=2), read_seconds=1.0),
    ]
    for options in mixed:
        with pytest.raises(ConfigError, match="not both"):
            with pytest.warns(DeprecationWarning):
                eqtrain.fit(fresh_state(), step, batches, num_steps=2, **options)
    with pytest.raises(TypeError, match="unexpected keyword argument 'eval_evry'"):
        eqtrain.fit(fresh_state(), step, batches, num_steps=2, eval_evry=1)
    with pytest.raises(ConfigError, match="read_every"):
        Reading(every=0)
    with pytest.raises(ConfigError, match="time_limit"):
        StopConditions(time_limit=0)
    with pytest.raises(ConfigError, match="agree_every"):
        StopConditions(agree_every=0)
    with pytest.raises(ConfigError, match="re-iterable"):
        Evaluation(evaluate, iter(batches))


@pytest.mark.parametrize("declared", [False, True])
def test_a_plain_function_never_makes_the_loop_wait(batches, monkeypatch, declared):
    step = eqtrain.jit(eqtrain.train_step(mse_loss, OPT))
    events, _ = _spy_on(step, monkeypatch)
    seen = []

    def log(info):  # what a hurried user writes
        seen.append(info.metrics["loss"])

    if declared:  # the same, declared (undoes an earlier `uses_state`)
        log = eqtrain.metrics_only(eqtrain.uses_state(log))
    eqtrain.fit(
        fresh_state(), step, batches, num_steps=6, hooks=[log],
        reading=Reading(every=3, seconds=1e9),
    )  # fmt: skip
    # step k+1 is always dispatched before step k is read: no wait per step
    assert events == [
        ("dispatch", 1), ("dispatch", 2), ("dispatch", 3), ("dispatch", 4),
        ("read", [1, 2, 3]), ("dispatch", 5), ("dispatch", 6), ("read", [4, 5, 6]),
    ]  # fmt: skip
    assert len(seen) == 6 and getattr(log, "uses_state", False) is False


def test_a_plain_function_reading_the_state_is_told_to_declare_it(batches, step):
    def peek(info):
        return info.state.model

    with pytest.raises(eqtrain.StateUnavailableError, match="@eqtrain.uses_state"):
        eqtrain.fit(fresh_state(), step, batches, num_steps=4, hooks=[peek])
    seen = []
    declared = eqtrain.uses_state(lambda info: seen.append(int(info.state.step)))
    assert declared.uses_state is True
    eqtrain.fit(fresh_state(), step, batches, num_steps=4, hooks=[declared])
    assert seen == [1, 2, 3, 4]


def test_a_late_hooks_stop_lands_later_and_says_so(batches, step):
    def stop_at_2(info):
        if info.step == 2:
            raise eqtrain.StopTraining("enough")

    with pytest.warns(UserWarning, match=r"after step 2.*stops at step 4.*uses_state"):
        result = eqtrain.fit(
            fresh_state(), step, batches, num_steps=12, hooks=[stop_at_2],
            reading=Reading(every=3, seconds=1e9),
        )  # fmt: skip
    # steps 1-3 are read once step 4 is dispatched: the run stops after step 4,
    # and the reason names the step the state is at
    assert result.stop_reason.kind == StopKind.HOOK
    assert result.stop_reason.message == "enough"
    assert result.stop_reason.step == int(result.state.step) == 4
