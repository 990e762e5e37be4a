"""The built-in hooks: JSONL metrics, progress bar, console logger."""

import io
import json

import jax.random as jr
import optax
import pytest

import eqtrain
from eqtrain import StepInfo, StopKind, StopReason, TrainState, at_end, every
from eqtrain.hooks import ConsoleLogger, JsonlWriter, ProgressBar, format_line

from .conftest import Regressor, mse_loss


OPT = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)


@pytest.fixture(scope="module")
def step():
    return eqtrain.jit(eqtrain.train_step(mse_loss, OPT))


def _tokens_batches(batches):
    # a `tokens` entry makes the loop report tokens/s (its shape is all it reads)
    import numpy as np

    return [dict(b, tokens=np.zeros((8, 16), np.int32)) for b in batches]


def test_jsonl_writer_lines_fields_and_resume(step, batches, tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    writer = JsonlWriter(path)
    state = TrainState.create(Regressor(jr.key(0)), OPT, key=0)
    result = eqtrain.fit(
        state,
        step,
        _tokens_batches(batches),
        num_steps=5,
        hooks=[writer, at_end(writer)],
    )
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    # one line per step: the end completes step 5's line
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    assert "step_time" in lines[-1] and "stop_reason" not in lines[-2]
    first = lines[0]
    for key in (
        "time",
        "loss",
        "grad_norm",
        "learning_rate",
        "skipped",
        "weight",
        "mae",
        "step_time",
        "data_time",
        "tokens_per_second",
    ):
        assert key in first, key
    assert first["tokens_per_second"] > 0 and first["learning_rate"] == pytest.approx(
        1e-2
    )
    assert lines[-1]["stop_reason"] == "max_steps"
    assert lines[-1]["stop_message"] == "reached 5 steps"
    # resuming from step 5 continues the same file; step 5 no longer ends it
    writer2 = JsonlWriter(path, start=5)
    eqtrain.fit(result.state, step, batches, num_steps=7, hooks=[writer2])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6, 7]
    assert "stop_reason" not in lines[4] and "loss" in lines[4]


def test_jsonl_a_resumed_run_replaces_the_steps_it_redoes(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = JsonlWriter(path)
    for k in range(1, 7):
        first(StepInfo(step=k, metrics={"loss": float(k)}, num_steps=9))
    end = StopReason(StopKind.SIGNAL, 6, "SIGTERM")
    first(StepInfo(step=6, metrics={}, num_steps=9, stop_reason=end))
    first.close()
    # the run resumes from its checkpoint at step 3 and redoes 4..6
    again = JsonlWriter(path, start=3)
    for k in range(4, 10):
        again(StepInfo(step=k, metrics={"loss": 10.0 + k}, num_steps=9))
    done = StopReason(StopKind.MAX_STEPS, 9, "reached 9 steps")
    again(StepInfo(step=9, metrics={"eval/loss": 1.5}, num_steps=9, stop_reason=done))
    again.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 10))
    assert [line["loss"] for line in lines] == [1, 2, 3, 14, 15, 16, 17, 18, 19]
    assert [line.get("stop_reason") for line in lines][-1] == "max_steps"
    assert sum("stop_reason" in line for line in lines) == 1
    assert lines[-1]["eval/loss"] == 1.5
    # a fresh start (step 0) empties the file; no checkpoint, no story
    JsonlWriter(path, start=0)(StepInfo(step=1, metrics={"loss": 0.5}, num_steps=9))
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1]


def test_jsonl_a_halted_step_gets_no_line(tmp_path):
    # nonfinite="stop": the state froze at step 2; steps 3.. did not train
    path = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(path)
    writer(StepInfo(step=1, metrics={"loss": 1.0, "halted": 0}, num_steps=9))
    writer(StepInfo(step=2, metrics={"loss": 0.9, "halted": 0}, num_steps=9))
    for k in (3, 4):
        nan = {"loss": float("nan"), "halted": 1}
        writer(StepInfo(step=k, metrics=nan, num_steps=9))
    end = StopReason(StopKind.NONFINITE, 3, "non-finite loss or gradients at step 3")
    writer(StepInfo(step=2, metrics={}, num_steps=9, stop_reason=end))
    writer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert lines[-1]["loss"] == 0.9 and lines[-1]["stop_reason"] == "nonfinite"
    assert "at step 3" in lines[-1]["stop_message"]


def test_jsonl_writes_nonfinite_as_strings(tmp_path):
    writer = JsonlWriter(tmp_path / "m.jsonl")
    writer(
        StepInfo(step=1, metrics={"loss": float("nan"), "g": float("inf")}, num_steps=3)
    )
    writer.close()
    line = json.loads((tmp_path / "m.jsonl").read_text())
    assert line["loss"] == "nan" and line["g"] == "inf"


def test_console_logger_format():
    out = io.StringIO()
    info = StepInfo(
        step=10,
        metrics={"loss": 2.34119, "learning_rate": 1e-3, "eval/loss": 2.5},
        num_steps=100,
        tokens_per_second=12345.0,
    )
    ConsoleLogger(stream=out)(info)
    assert (
        out.getvalue()
        == "step 10/100 | loss 2.3412 | lr 0.0010 | eval/loss 2.5000 | 12.3k tok/s\n"
    )
    assert format_line(info, ("loss",)) == "step 10/100 | loss 2.3412 | 12.3k tok/s"


def test_progress_bar_plain_when_not_a_tty(step, batches):
    out = io.StringIO()
    bar = ProgressBar(stream=out, plain_every=4)
    state = TrainState.create(Regressor(jr.key(0)), OPT, key=0)
    eqtrain.fit(state, step, batches, num_steps=10, hooks=[bar])
    lines = out.getvalue().splitlines()
    assert [line.split("|")[0].strip() for line in lines] == [
        "step 4/10",
        "step 8/10",
        "step 10/10",
    ]
    assert "eta" in lines[0] and "loss" in lines[0]


def test_progress_bar_rich_on_a_terminal(step, batches):
    out = io.StringIO()
    bar = ProgressBar(stream=out, force_terminal=True)
    state = TrainState.create(Regressor(jr.key(0)), OPT, key=0)
    eqtrain.fit(state, step, _tokens_batches(batches), num_steps=6, hooks=[bar])
    text = out.getvalue()
    assert "6/6" in text and "loss" in text and "tok/s" in text


def test_builtin_hooks_never_need_the_state():
    for hook in (JsonlWriter("x"), ConsoleLogger(), ProgressBar()):
        assert hook.uses_state is False
        assert every(5, hook).uses_state is False


def test_stop_reason_str():
    reason = StopReason(StopKind.SIGNAL, 12, "SIGTERM")
    assert str(reason) == "signal at step 12: SIGTERM"
    assert reason.kind == "signal"


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(derandomize=True, deadline=None, max_examples=30)
@given(n=st.integers(1, 50), last=st.integers(1, 300))
def test_every_is_due_exactly_on_multiples(n, last):
    sched = every(n, print)
    assert [k for k in range(1, last + 1) if sched.due(k, 0.0)] == list(
        range(n, last + 1, n)
    )


@settings(derandomize=True, deadline=None, max_examples=30)
@given(steps=st.sets(st.integers(1, 200), max_size=10))
def test_at_is_due_exactly_on_its_steps(steps):
    sched = eqtrain.at(steps, print)
    assert {k for k in range(1, 201) if sched.due(k, 0.0)} == steps


@settings(derandomize=True, deadline=None, max_examples=30)
@given(
    period=st.floats(0.5, 10),
    gaps=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=40),
)
def test_every_seconds_never_fires_faster_than_its_period(period, gaps):
    sched = eqtrain.every_seconds(period, print)
    sched.start(0.0)
    t, fired = 0.0, [0.0]
    for gap in gaps:
        t += gap
        if sched.due(1, t):
            fired.append(t)
    assert all(b - a >= period - 1e-9 for a, b in zip(fired, fired[1:], strict=False))
