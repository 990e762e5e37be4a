"""Tests for `eqtrain.plot`: reading `metrics.jsonl` (resume/restart rules, NaN
strings, truncated and malformed lines) and writing the PNG."""

import json
import math
import sys
import threading

import jax.random as jr
import optax
import pytest
from hypothesis import given, settings, strategies as st
from PIL import Image

import eqtrain
from eqtrain import ConfigError
from eqtrain.hooks import JsonlWriter
from eqtrain.plot import _default_title, plot_run, read_metrics

from .conftest import Regressor, make_batches, mse_loss


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_jsonl(path, records, tail=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("".join(line + "\n" for line in lines) + tail)
    return path


def run_records(start, end, *, tag=0, t0=0.0, **extra):
    """The lines one `fit` call writes for steps start..end (time restarts at t0)."""
    return [
        {"step": s, "time": t0 + s - start, "loss": 1.0 / s, "tag": tag, **extra}
        for s in range(start, end + 1)
    ]


# ----------------------------------------------------------------- read_metrics


def test_resume_rewrites_the_steps_after_the_checkpoint(tmp_path):
    # Run to step 10, crash, resume from the step-5 checkpoint and run to 12.
    write_jsonl(
        tmp_path / "metrics.jsonl",
        run_records(1, 10, tag=0) + run_records(6, 12, tag=1),
    )
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert [r["tag"] for r in records] == [0] * 5 + [1] * 7


def test_restart_from_scratch_drops_the_old_history(tmp_path):
    write_jsonl(
        tmp_path / "metrics.jsonl", run_records(1, 10, tag=0) + run_records(1, 3, tag=1)
    )
    records = read_metrics(tmp_path)
    assert [(r["step"], r["tag"]) for r in records] == [(1, 1), (2, 1), (3, 1)]


def test_final_line_of_the_same_step_is_merged(tmp_path):
    # `at_end(writer)` repeats the last step with the final eval and stop_reason.
    lines = run_records(1, 3, step_time=0.1)
    lines.append({"step": 3, "time": 2.5, "eval/loss": 0.7, "stop_reason": "max_steps"})
    records = read_metrics(write_jsonl(tmp_path / "metrics.jsonl", lines))
    assert len(records) == 3
    assert records[-1]["step_time"] == 0.1  # kept from the step's own line
    assert records[-1]["eval/loss"] == 0.7
    assert records[-1]["stop_reason"] == "max_steps"


def test_same_step_with_time_going_back_is_a_new_run(tmp_path):
    # Resumed from the step-2 checkpoint after step 3 was logged (with an eval):
    # the new step 3 replaces the old one entirely.
    lines = run_records(1, 3, tag=0, t0=10.0)
    lines[-1]["eval/loss"] = 0.5
    lines.append({"step": 3, "time": 0.5, "loss": 0.3, "tag": 1})
    records = read_metrics(write_jsonl(tmp_path / "metrics.jsonl", lines))
    assert records[-1] == {"step": 3, "time": 0.5, "loss": 0.3, "tag": 1}


@settings(derandomize=True, deadline=None, max_examples=20)
@given(
    st.lists(st.tuples(st.integers(1, 15), st.integers(0, 6)), min_size=1, max_size=5)
)
def test_history_matches_a_model_of_resumes(tmp_path_factory, runs):
    # Each run (start, length) resumes at `start`, dropping what was logged from it.
    expected: dict[int, int] = {}
    lines = []
    for tag, (start, length) in enumerate(runs):
        expected = {s: t for s, t in expected.items() if s < start}
        expected.update({s: tag for s in range(start, start + length + 1)})
        lines += run_records(start, start + length, tag=tag)
    path = write_jsonl(tmp_path_factory.mktemp("run") / "metrics.jsonl", lines)
    records = read_metrics(path)
    assert {r["step"]: r["tag"] for r in records} == expected
    assert [r["step"] for r in records] == sorted(expected)


def test_nonfinite_strings_become_floats(tmp_path):
    lines = [
        {"step": 1, "loss": "nan", "grad_norm": "inf", "x": "-inf", "v": [1.0, "nan"]},
        {"step": 2, "loss": 1.0, "stop_reason": "nonfinite"},
    ]
    first, second = read_metrics(write_jsonl(tmp_path / "metrics.jsonl", lines))
    assert math.isnan(first["loss"])
    assert first["grad_norm"] == math.inf and first["x"] == -math.inf
    assert first["v"][0] == 1.0 and math.isnan(first["v"][1])
    assert second["stop_reason"] == "nonfinite"


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path):
    path = write_jsonl(
        tmp_path / "metrics.jsonl", run_records(1, 2), tail='{"step": 3, "lo'
    )
    with pytest.warns(UserWarning, match=r"metrics\.jsonl:3: skipping a truncated"):
        records = read_metrics(path)
    assert [r["step"] for r in records] == [1, 2]


def test_malformed_middle_line_raises(tmp_path):
    lines = run_records(1, 1) + ['{"step": 2, "lo'] + run_records(3, 3)
    with pytest.raises(ConfigError, match=r"metrics\.jsonl:2: malformed line"):
        read_metrics(write_jsonl(tmp_path / "metrics.jsonl", lines))
    with pytest.raises(ConfigError, match=r"m2\.jsonl:1: malformed line"):
        read_metrics(write_jsonl(tmp_path / "m2.jsonl", ["[1, 2]", '{"step": 1}']))
    with pytest.raises(ConfigError, match="`step` must be an integer"):
        read_metrics(write_jsonl(tmp_path / "m3.jsonl", ['{"step": "1"}']))


def test_missing_file_raises(tmp_path):
    with pytest.raises(ConfigError, match="no metrics.jsonl in .*was this run started"):
        read_metrics(tmp_path)
    with pytest.raises(ConfigError, match="no metrics.jsonl in"):
        read_metrics(tmp_path / "not_a_run")
    with pytest.raises(ConfigError, match="no metrics.jsonl in"):
        plot_run(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize("text", ["", "\n\n", '{"config": 1}\n'])
def test_file_without_step_records_raises(tmp_path, text):
    (tmp_path / "metrics.jsonl").write_text(text)
    with pytest.raises(ConfigError, match="holds no step records"):
        read_metrics(tmp_path)


# ----------------------------------------------------------------- plot_run


def png_size(path):
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        return image.size


def full_records(n=120):
    lines = []
    for s in range(1, n + 1):
        r = {
            "step": s,
            "time": 0.1 * s,
            "loss": 3.0 / s**0.5,
            "grad_norm": 1.0,
            "learning_rate": 1e-3 * min(1.0, s / 10),
            "skipped": int(s == 50),
            "step_time": 0.1,
            "data_time": 0.001,
            "tokens_per_second": 4096.0,
            "tokens_seen": 409 * s,
            "mfu": 0.4,
        }
        if s == 50:
            r["loss"] = "nan"
        if s % 40 == 0:
            r.update({"eval/loss": 1.0, "eval/accuracy": 0.5, "eval/weight": 64.0})
        lines.append(r)
    lines.append({"step": n, "time": 99.0, "stop_reason": "max_steps"})
    return lines


def test_plot_run_writes_a_png_to_the_default_path(tmp_path):
    write_jsonl(tmp_path / "metrics.jsonl", full_records())
    out = plot_run(tmp_path)
    assert out == tmp_path / "plot.png"
    width, height = png_size(out)
    assert 800 <= width <= 2000 and 500 <= height <= 1500
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "plot.png"]


def test_plot_run_to_a_given_path_from_the_file(tmp_path):
    path = write_jsonl(tmp_path / "run" / "metrics.jsonl", full_records(20))
    out = plot_run(path, tmp_path / "figs" / "curves.png", title="my run")
    assert out == tmp_path / "figs" / "curves.png"
    png_size(out)
    # Overwriting an existing plot works (the rename replaces it).
    assert plot_run(path, out) == out


def test_sparse_run_still_plots(tmp_path):
    # No eval, no tokens, no learning rate, a non-finite loss: panels say "no data".
    lines = [
        {"step": 1, "loss": 2.0, "step_time": 0.5},
        {"step": 2, "loss": "inf", "step_time": 0.0},
        {"step": 3, "loss": 1.0},
    ]
    png_size(plot_run(write_jsonl(tmp_path / "metrics.jsonl", lines)))
    write_jsonl(tmp_path / "bare" / "metrics.jsonl", [{"step": 1}])
    png_size(plot_run(tmp_path / "bare"))


def test_plot_run_from_threads(tmp_path):
    dirs = [tmp_path / f"run{i}" for i in range(2)]
    for d in dirs:
        write_jsonl(d / "metrics.jsonl", full_records(30))
    threads = [threading.Thread(target=plot_run, args=(d,)) for d in dirs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for d in dirs:
        png_size(d / "plot.png")


def test_default_title_names_the_run_and_stop_reason(tmp_path):
    run = tmp_path / "exp1"
    assert _default_title(run, [{"step": 7}]) == "exp1: 7 steps"
    title = _default_title(run, [{"step": 7, "stop_reason": "time_limit"}])
    assert title == "exp1: 7 steps, stopped: time_limit"


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "metrics.jsonl", run_records(1, 2))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ConfigError, match=r"pip install 'eqtrain\[plot\]'"):
        plot_run(tmp_path)
    assert not (tmp_path / "plot.png").exists()


def test_plot_of_a_real_run(tmp_path):
    opt = optax.adam(1e-2)
    state = eqtrain.TrainState.create(Regressor(jr.key(0)), opt, key=0)
    step = eqtrain.jit(eqtrain.train_step(mse_loss, opt))
    evaluate = eqtrain.jit(eqtrain.eval_step(mse_loss), donate=False)
    writer = JsonlWriter(tmp_path / "metrics.jsonl")
    batches = make_batches(8)
    eqtrain.fit(
        state,
        step,
        batches,
        num_steps=6,
        hooks=[writer, eqtrain.at_end(writer)],
        evaluation=eqtrain.Evaluation(evaluate, batches[:2], every=3),
    )
    writer.close()
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 7))
    assert records[-1]["stop_reason"] == "max_steps"
    assert "step_time" in records[-1] and "eval/loss" in records[-1]
    png_size(plot_run(tmp_path))
