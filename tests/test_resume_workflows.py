"""Resuming must just work: `eqtrain fit/eval/info` as a hurried user runs them on
one small trained run (steps 3 and 6), copied per test: the same fit twice, a
kill switch left behind, a rollback, damaged files, two runs on one directory.
Most go through the real CLI in a subprocess; the fast ones call `eqtrain.job`
(what the CLI runs) in-process."""

import json
import os
import shutil
import subprocess
import time
import warnings

import numpy as np
import pytest

import eqtrain
import eqtrain.checkpoint as ckpt
import eqtrain.config as config_lib
from eqtrain import job

from .test_cli import EQTRAIN, assert_clean_error, cli, write_tiny_config


def ok(done):
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "Event loop" not in done.stderr
    return done


def refused(done, *fragments):
    assert_clean_error(done, *fragments)
    return done


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A config and a run trained to step 6 (checkpoints 3 and 6)."""
    root = tmp_path_factory.mktemp("workflows")
    config = write_tiny_config(root, extra='\n[export]\nhf = ""\n')
    ok(cli("fit", config))
    assert ckpt.list_steps(root / "run") == [3, 6]
    return config, root / "run"


@pytest.fixture
def run(trained, tmp_path):
    """A private copy of the trained run, and `fit(*args)` on it (the CLI)."""
    config, original = trained
    copy = tmp_path / "run"
    shutil.copytree(original, copy)

    def fit(*args):
        return cli("fit", *fit_args(*args))

    def fit_args(*args):
        return [str(config), "--run-dir", str(copy), *map(str, args)]

    fit.args = fit_args
    return copy, fit


def _metric_lines(run_dir):
    return (run_dir / "metrics.jsonl").read_text().splitlines()


def _truncate_arrays(step_dir):
    for f in (step_dir / "state").rglob("d/*"):
        if f.is_file():
            f.write_bytes(f.read_bytes()[:7])


def _plain_load(state_dir):
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as c:
        return [np.asarray(x) for x in _leaves(c.restore(state_dir))]


def _flip_one_bit_in_an_array(step_dir):
    """Flip one bit in the largest array file, where the files still decode: plain
    Orbax loads it silently with changed values (only a checksum can tell)."""
    state = step_dir / "state"
    before = _plain_load(state)
    big = max(state.rglob("d/*"), key=lambda f: f.stat().st_size)
    original = big.read_bytes()
    for where in (0.7, 0.5, 0.6, 0.8, 0.3, 0.4, 0.9):
        data = bytearray(original)
        data[int(len(data) * where)] ^= 0x10
        big.write_bytes(bytes(data))
        try:
            after = _plain_load(state)  # still loads...
        except Exception:  # noqa: BLE001 -- hit a structure: try elsewhere
            continue
        if any(not np.array_equal(x, y) for x, y in zip(before, after, strict=True)):
            return  # ... with other values
    raise AssertionError("no silent bit flip found")


def _leaves(tree):
    if isinstance(tree, dict):
        for _, v in sorted(tree.items()):
            yield from _leaves(v)
    else:
        yield tree


# -- 1. resuming must just work --------------------------------------------------
def test_finished_run_again_does_nothing_then_continues_when_raised(run):
    run_dir, fit = run
    before = _metric_lines(run_dir)
    done = ok(fit())
    assert "already at step 6 of 6; nothing to do" in done.stderr
    assert _metric_lines(run_dir) == before  # trained nothing, logged nothing
    assert ckpt.list_steps(run_dir) == [3, 6]
    done = ok(fit("--set", "loop.steps=9"))
    assert f"resumed from {run_dir / 'checkpoints' / '6'}" in done.stderr
    assert ckpt.list_steps(run_dir) == [3, 6, 9]
    ids = {ckpt.read_manifest(run_dir, step=s)["run_id"] for s in (3, 6, 9)}
    assert len(ids) == 1  # one run, one identity


def test_kill_switch_left_behind_is_named_before_starting(run):
    run_dir, fit = run
    (run_dir / "STOP").touch()
    refused(fit("--set", "loop.steps=9"), f"remove {run_dir / 'STOP'} to continue")
    assert ckpt.list_steps(run_dir) == [3, 6]


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_rollback_asks_for_overwrite_before_training(run):
    run_dir, fit = run
    before = _metric_lines(run_dir)
    step3 = run_dir / "checkpoints" / "3"
    refused(fit("--resume", step3), "rolls the run back", "[6]", "--overwrite")
    assert _metric_lines(run_dir) == before  # refused before training
    done = ok(fit("--resume", step3, "--overwrite"))
    assert "discarded checkpoint(s) [6]" in done.stderr
    assert ckpt.list_steps(run_dir) == [3, 6]
    assert ckpt.read_manifest(run_dir, step=6)["step"] == 6


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_truncated_latest_is_moved_aside_once_and_never_blocks_again(run):
    run_dir, fit = run
    _truncate_arrays(run_dir / "checkpoints" / "6")
    done = ok(fit())
    warned = [line for line in done.stderr.splitlines() if "warning:" in line]
    assert len(warned) == 1 and "checkpoints/6" in warned[0], done.stderr
    assert "moved aside to 6.damaged-" in warned[0]
    assert ckpt.list_steps(run_dir) == [3, 6]  # 4-6 retrained and saved
    aside = [
        p.name for p in (run_dir / "checkpoints").iterdir() if ".damaged-" in p.name
    ]
    assert len(aside) == 1 and aside[0].startswith("6.damaged-")
    done = ok(fit())  # a retry: no warning, nothing to do
    assert "warning" not in done.stderr and "nothing to do" in done.stderr
    # the redone steps 4-6 replaced the first run's lines: one story
    lines = [json.loads(x) for x in _metric_lines(run_dir)]
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5, 6]
    assert [("stop_reason" in line) for line in lines] == [False] * 5 + [True]


def test_bit_flip_is_caught_by_the_checksums(run):
    run_dir, fit = run
    good = json.loads(ok(cli("eval", run_dir / "checkpoints" / "3")).stdout)
    _flip_one_bit_in_an_array(run_dir / "checkpoints" / "6")
    done = refused(cli("eval", run_dir / "checkpoints" / "6"), "checksums")
    assert len(done.stderr.splitlines()) <= 2 and "tensorstore_spec" not in done.stderr
    done = ok(cli("eval", run_dir))  # the run: falls back to step 3, loudly
    assert json.loads(done.stdout) == good
    assert "warning:" in done.stderr and "checkpoints/6" in done.stderr


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_two_fits_on_one_directory_then_kill_switch_and_again(run):
    run_dir, fit = run
    first = subprocess.Popen(
        [*EQTRAIN, "fit", *fit.args("--set", "loop.steps=100000")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / ".lock").exists():
            assert time.monotonic() < deadline and first.poll() is None
            time.sleep(0.05)
        refused(
            fit("--set", "loop.steps=100000"),
            f"{run_dir} is in use by PID {first.pid} since",
        )
        (run_dir / "STOP").touch()  # the kill switch ends the first one cleanly
        out, err = first.communicate(timeout=120)
        assert first.returncode == 0, err
        assert "stopped: kill_switch" in out
    finally:
        first.kill()
        first.wait()
    assert not (run_dir / ".lock").exists()  # released at the end
    steps = [json.loads(x).get("step") for x in _metric_lines(run_dir)]
    assert steps == sorted(steps)  # one writer
    stopped = ckpt.list_steps(run_dir)[-1]
    (run_dir / "STOP").unlink()
    result = job.run(_config(run_dir, f"loop.steps={stopped + 2}"), echo=print)
    assert result.resumed_from == stopped
    assert ckpt.list_steps(run_dir)[-1] == stopped + 2


# -- in-process: the same job the CLI runs -------------------------------------------
def _config(run_dir, *overrides):
    return config_lib.load(
        run_dir / "config.toml",
        [f"run_dir={run_dir}", "log.progress=none", *overrides],
    )


def test_stale_lock_is_taken_over_with_a_note(run, capsys):
    run_dir, _ = run
    dead = subprocess.Popen(["true"])
    dead.wait()
    (run_dir / ".lock").write_text(
        json.dumps({"pid": dead.pid, "host": os.uname().nodename, "started": 0})
    )
    result = job.run(_config(run_dir, "loop.steps=7"), echo=lambda s: None)
    assert result.fit.stop_reason.kind == "max_steps"
    assert f"took over the stale lock {run_dir / '.lock'}" in capsys.readouterr().err
    assert not (run_dir / ".lock").exists()


def test_nonfinite_stopped_run_runs_again(tmp_path, trained):
    config, _ = trained
    cfg = config_lib.load(
        config,
        [f"run_dir={tmp_path / 'nan'}", "optim.lr=1e30", "log.progress=none"],
    )
    first = job.run(cfg, echo=lambda s: None)
    assert first.fit.stop_reason.kind == "nonfinite"
    last = ckpt.list_steps(tmp_path / "nan")[-1]
    before = _metric_lines(tmp_path / "nan")
    again = job.run(cfg, echo=lambda s: None)  # not "written by another run"
    assert again.resumed_from == last
    assert again.fit.stop_reason.kind == "nonfinite"
    # the rerun redid the same steps: the log is the same story, no NaN row
    # claiming a step the state never reached
    after = _metric_lines(tmp_path / "nan")
    assert [json.loads(x)["step"] for x in after] == list(range(1, last + 1))
    assert [json.loads(x)["step"] for x in after] == [
        json.loads(x)["step"] for x in before
    ]
    assert json.loads(after[-1])["stop_reason"] == "nonfinite"
    assert all(json.loads(x)["loss"] != "nan" for x in after)


def test_resumed_runs_tell_one_story_in_every_log(run):
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    from eqtrain.plot import read_metrics

    run_dir, _ = run
    ckpts = run_dir / "checkpoints"
    (ckpts / "6" / "manifest" / "manifest.json").unlink()  # resumes from 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ckpt.CheckpointWarning)
        job.run(_config(run_dir, "loop.steps=8", "log.tensorboard=true"))
        assert ckpt.list_steps(run_dir) == [3, 6, 8]
        (ckpts / "8" / "manifest" / "manifest.json").unlink()  # resumes from 6
        job.run(_config(run_dir, "loop.steps=9", "log.tensorboard=true"))
    lines = [json.loads(x) for x in _metric_lines(run_dir)]
    assert [line["step"] for line in lines] == list(range(1, 10))
    assert sum("stop_reason" in line for line in lines) == 1
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, 10))
    assert job.run_info(run_dir)["last_metrics"]["step"] == 9
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps == list(range(4, 10))  # 7 and 8 once: the redone ones replaced
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    assert all(losses[r["step"]] == pytest.approx(r["loss"]) for r in lines[3:])


@pytest.mark.parametrize("how", ["manifest", "empty_later_step"])
def test_damage_variants(run, how):
    run_dir, _ = run
    ckpts = run_dir / "checkpoints"
    if how == "manifest":
        (ckpts / "6" / "manifest" / "manifest.json").unlink()
        info = job.run_info(run_dir)
        assert info["steps_trained"] == 3  # an unreadable step is not "trained"
        assert "error" in info["checkpoints"][-1]
    else:
        (ckpts / "20").mkdir()
        assert job.run_info(run_dir)["steps_trained"] == 6
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = job.run(_config(run_dir, "loop.steps=9"), echo=lambda s: None)
    assert result.fit.stop_reason.kind == "max_steps"
    assert ckpt.list_steps(run_dir) == [3, 6, 9]
    damaged = [w for w in seen if issubclass(w.category, ckpt.CheckpointWarning)]
    assert len(damaged) == (1 if how == "manifest" else 0)


def test_refused_resume_keeps_config_toml(run):
    run_dir, _ = run
    before = (run_dir / "config.toml").read_text()
    with pytest.raises(ckpt.IncompatibleCheckpointError):
        job.run(_config(run_dir, "model.hidden_size=64"), echo=lambda s: None)
    assert (run_dir / "config.toml").read_text() == before
    assert not (run_dir / ".lock").exists()


def test_start_from_another_run_names_the_source_and_reruns(run, tmp_path):
    run_dir, _ = run
    said = []
    cfg = _config(run_dir, f"run_dir={tmp_path / 'new'}", "loop.steps=8")
    source = str(run_dir / "checkpoints" / "6")
    result = job.run(cfg, resume=source, echo=said.append)
    assert f"resumed from {source}" in said
    assert ckpt.list_steps(tmp_path / "new") == [8]
    again = job.run(cfg, resume=source, echo=said.append)  # the same command again
    assert again.resumed_from == 8 and "nothing to do" in said[-1]
    assert result.resumed_from == 6


def test_damaged_source_of_another_run_is_one_clear_error(run, tmp_path):
    run_dir, _ = run
    _truncate_arrays(run_dir / "checkpoints" / "6")
    cfg = _config(run_dir, f"run_dir={tmp_path / 'new'}")
    with pytest.raises(
        ckpt.CheckpointError, match="cannot restore the checkpoint you named"
    ):
        job.run(cfg, resume=str(run_dir / "checkpoints" / "6"), echo=lambda s: None)


@pytest.mark.parametrize("char", ["[", "*", "?"])
def test_pattern_characters_in_the_run_directory_are_refused(trained, tmp_path, char):
    config, _ = trained
    run_dir = tmp_path / f"run{char}1"
    cfg = config_lib.load(config, [f"run_dir={run_dir}", "log.progress=none"])
    with pytest.raises(eqtrain.ConfigError, match="could never be read back"):
        job.run(cfg, echo=lambda s: None)
    assert not (run_dir / "checkpoints").exists()


def test_config_without_checkpoints_is_a_run_not_yet_trained(run, tmp_path):
    run_dir, _ = run
    shutil.rmtree(run_dir / "checkpoints")
    with pytest.raises(Exception, match="holds no checkpoint yet"):
        job.evaluate_run(run_dir)
