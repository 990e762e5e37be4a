"""Off the happy path, round 3 (issue 26): a user's files kept in an export
survive `--overwrite`; exported files are readable by others (the umask's mode);
the CLI's JSON is strict; messages name CLI flags and config keys; data warnings
are one `warning:` paragraph. One tiny run (a subprocess: the real CLI, its real
stderr) serves most tests."""

import json
import math
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

import eqtrain.checkpoint
import eqtrain.config
import eqtrain.data
import eqtrain.hf
from eqtrain.hf import _target
from eqtrain.job import _preflight, _reference


TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n"


from .test_failures_inputs import assert_clean_error, invoke  # noqa: E402


def assert_error_after_warning(result, *fragments):
    """As `assert_clean_error`, after the run's warning about its null row."""
    assert result.exit_code == 2 and "Traceback" not in result.output
    warning, error = result.stderr.splitlines()
    assert warning.startswith("warning: ") and error.startswith("error: "), error
    for fragment in fragments:
        assert fragment in error, error


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A two-step run on JSONL data with a null row, trained by `python -m
    eqtrain.cli` under umask 022; `<run>/../fit.stderr` is what it printed."""
    root = tmp_path_factory.mktemp("round3")
    data = root / "train.jsonl"
    rows = [{"text": TEXT * 4}] * 12 + [{"text": None}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    run_dir = root / "run"
    sets = [
        f"data.train={data}",
        "data.eval=none",
        "data.seq_len=16",
        "data.batch_size=8",
        "model.hidden_size=16",
        "model.intermediate_size=32",
        "model.num_layers=1",
        "model.num_heads=2",
        "loop.steps=2",
        "loop.eval_every=0",
        "checkpoint.every=0",
        "checkpoint.async_save=false",
        "log.progress=none",
    ]
    argv = [sys.executable, "-m", "eqtrain.cli", "fit", "--run-dir", str(run_dir)]
    for item in sets:
        argv += ["--set", item]
    old = os.umask(0o022)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    finally:
        os.umask(old)
    assert done.returncode == 0, done.stderr
    (root / "fit.stderr").write_text(done.stderr)
    return run_dir


def modes(root):
    """`{relative path: permission bits}` of everything under `root`."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = stat.S_IMODE(os.stat(path).st_mode)
    return out


# -- 1. --overwrite never deletes a user's file -------------------------------------
def test_export_overwrite_keeps_a_users_file_in_an_earlier_export(run, tmp_path):
    out = tmp_path / "out"
    assert invoke("export", run, out).exit_code == 0
    (out / "notes.txt").write_text("mine")
    result = invoke("export", run, out, "--overwrite")
    assert_clean_error(result, str(out), "notes.txt", "Move those files out")
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "model.safetensors").exists()  # the earlier export, untouched
    (out / "notes.txt").unlink()
    assert invoke("export", run, out, "--overwrite").exit_code == 0


def test_the_runs_own_export_with_a_users_file_fails_before_training(run):
    notes = run / "hf" / "notes.txt"
    notes.write_text("mine")
    try:
        result = invoke("fit", run / "config.toml", "--set", "loop.steps=3")
        assert_error_after_warning(result, "notes.txt", "export.hf", "Move them out")
    finally:
        assert notes.read_text() == "mine"
        notes.unlink()
    assert eqtrain.checkpoint.list_steps(run) == [2]  # nothing trained


def test_per_step_exports_with_a_users_file_are_refused(tmp_path):
    steps = tmp_path / "run" / "hf-steps" / "step_4"
    steps.mkdir(parents=True)
    (steps / "config.json").write_text("{}")
    (steps / "README.md").write_text("my model card")
    cfg = eqtrain.config.load(None, [f"run_dir={tmp_path / 'run'}", "export.every=2"])
    with pytest.raises(eqtrain.ConfigError, match=r"step_4 holds files .*README\.md"):
        _preflight.check_outputs(cfg)


def test_a_file_put_in_the_export_while_it_is_written_is_kept(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(eqtrain.hf.HFExportExistsError, match="notes.txt"):
        with _target.atomic_dir(str(out), True) as tmp:
            (out / "notes.txt").write_text("mine")
    assert not os.path.exists(tmp)
    assert (out / "notes.txt").read_text() == "mine"
    # Appearing after the last check (between it and the rename): kept as well.
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text("{}")
    (old / "notes.txt").write_text("mine")
    with pytest.warns(eqtrain.hf.HFExportWarning, match="notes.txt"):
        _target._remove_export(str(old))
    assert os.listdir(old) == ["notes.txt"]


# -- 2. what eqtrain writes others can read ----------------------------------------
def test_exports_checkpoints_and_config_get_the_umask_mode(run, tmp_path):
    old = os.umask(0o022)
    try:
        assert invoke("export", run, tmp_path / "out").exit_code == 0
        path = tmp_path / "ref.safetensors"
        _reference._write(path, {"x": np.zeros(3, np.float32)}, "key")
    finally:
        os.umask(old)
    found = {**modes(run), **modes(tmp_path)}
    assert "hf/model.safetensors" in found and "out/model.safetensors" in found
    assert "config.toml" in found and "ref.safetensors" in found
    assert any(name.endswith("manifest.json") for name in found)
    for name, mode in found.items():
        is_dir = os.path.isdir(run / name) or os.path.isdir(tmp_path / name)
        assert mode == (0o755 if is_dir else 0o644), (name, oct(mode))


# -- 3. strict JSON ----------------------------------------------------------------
def strict(text):
    data = json.loads(text, parse_constant=lambda name: pytest.fail(name))
    json.dumps(data, allow_nan=False)
    return data


def test_eval_and_info_print_strict_json(run, monkeypatch):
    import eqtrain.job

    nan = {"eval/loss": math.nan, "eval/accuracy": math.inf, "step": 2}
    monkeypatch.setattr(eqtrain.job, "evaluate_run", lambda path, sets: dict(nan))
    result = invoke("eval", run)
    assert result.exit_code == 0, result.output
    assert strict(result.stdout) == {
        "eval/loss": "nan",
        "eval/accuracy": "inf",
        "step": 2,
    }

    real = eqtrain.job.run_info(run)
    real["checkpoints"][0]["metrics"] = {"loss": -math.inf, "eval/loss": math.nan}
    monkeypatch.setattr(eqtrain.job, "run_info", lambda path: real)
    result = invoke("info", run, "--json")
    assert result.exit_code == 0, result.output
    shown = strict(result.stdout)["checkpoints"][0]["metrics"]
    assert shown == {"loss": "-inf", "eval/loss": "nan"}


# -- 4. and 5. advice a CLI user can follow ----------------------------------------
def test_tensorboard_advice_names_what_can_change(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "tb").write_text("a file")
    cfg = eqtrain.config.load(
        None, [f"run_dir={tmp_path / 'run'}", "log.tensorboard=true"]
    )
    with pytest.raises(eqtrain.ConfigError) as caught:
        _preflight.check_outputs(cfg)
    message = str(caught.value)
    assert "log.tensorboard = false" in message and "--run-dir" in message
    assert "another place with log.tensorboard" not in message


def test_resume_never_on_a_run_names_the_flags(run):
    result = invoke("fit", run / "config.toml", "--resume", "never")
    assert_error_after_warning(result, "--resume auto", "--overwrite")
    assert "overwrite=True to" not in result.stderr
    assert eqtrain.checkpoint.list_steps(run) == [2]


def test_data_messages_name_the_config_keys(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(eqtrain.data.DataError, match=r"data\.text_column"):
        eqtrain.data.text_column(eqtrain.data.from_files(tmp_path / "d.jsonl"), "text")
    (tmp_path / "docs").mkdir()
    with pytest.raises(eqtrain.data.DataError, match=r"data\.pattern"):
        eqtrain.data.load_text_dir(tmp_path / "docs")
    (tmp_path / "x.dat").write_text("x")
    with pytest.raises(eqtrain.ConfigError, match="Rename the files"):
        eqtrain.data.from_files(tmp_path / "x.dat")
    (tmp_path / "bad.jinja").write_text("{% if %}")
    with pytest.raises(eqtrain.data.DataError, match=r"data\.chat_template = 'b"):
        eqtrain.data.chat_template(tmp_path / "bad.jinja")


# -- 6. data warnings under the CLI --------------------------------------------------
def test_null_rows_warn_in_one_plain_paragraph(run):
    stderr = (run.parent / "fit.stderr").read_text()
    lines = [line for line in stderr.splitlines() if "skipped 1 of 13" in line]
    assert len(lines) == 1 and lines[0].startswith("warning: "), stderr
    assert "UserWarning" not in stderr and "DataWarning" not in stderr
    assert "text_column(" not in stderr  # Python's source line
