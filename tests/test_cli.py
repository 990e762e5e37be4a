"""The `eqtrain` command, run as a real subprocess: every command, resume after
an interruption, the dry run, and every class of bad input (exit 2, one
paragraph, no traceback). (Where one test runs many commands, the ones after
its first `fit` run in-process, `inproc`: each subprocess costs an interpreter
and JAX's start.)"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import eqtrain
import eqtrain.checkpoint
import eqtrain.config
import eqtrain.hf


EQTRAIN = [sys.executable, "-m", "eqtrain.cli"]
TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 80


def cli(*args, cwd=None, timeout=240, check_rc=None):
    done = subprocess.run(
        [*EQTRAIN, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200"},
    )
    if check_rc is not None:
        assert done.returncode == check_rc, done.stdout + done.stderr
    return done


class _Done:
    """`subprocess.CompletedProcess`'s face on a typer `Result`."""

    def __init__(self, result):
        self.returncode = result.exit_code
        self.stdout = result.stdout
        self.stderr = result.stderr


def inproc(*args, check_rc=None):
    """`cli(*args)` in this process (typer's `CliRunner`)."""
    from typer.testing import CliRunner

    from eqtrain.cli import app

    done = _Done(CliRunner().invoke(app, list(map(str, args))))
    if check_rc is not None:
        assert done.returncode == check_rc, done.stdout + done.stderr
    return done


def write_tiny_config(root, extra=""):
    """A one-layer byte Llama on small text dirs under `root`: 6 steps, eval and
    checkpoints every 3; `extra` TOML is appended. Returns the config path."""
    (root / "train").mkdir()
    (root / "eval").mkdir()
    for i in range(3):
        (root / "train" / f"{i}.txt").write_text(TEXT * (i + 1))
    (root / "eval" / "0.txt").write_text(TEXT[::-1])
    config = root / "tiny.toml"
    config.write_text(
        f"""
run_dir = "{root / "run"}"

[model]
hidden_size = 32
num_layers = 1

[data]
train = "{root / "train"}"
eval = "{root / "eval"}"
seq_len = 16
batch_size = 8
eval_rows = 16

[optim]
warmup_steps = 1

[loop]
steps = 6
eval_every = 3

[checkpoint]
every = 3

[log]
progress = "lines"
"""
        + extra
    )
    return config


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    return write_tiny_config(tmp_path_factory.mktemp("cli"))


def assert_clean_error(done, *fragments):
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error: "), done.stderr
    for fragment in fragments:
        assert fragment in done.stderr, done.stderr


def test_fit_with_no_config_runs_the_default(tmp_path):
    run_dir = tmp_path / "default"
    done = cli(
        "fit",
        "--set",
        "loop.steps=2",
        "--set",
        "loop.eval_every=0",
        "--run-dir",
        run_dir,
        check_rc=0,
    )
    assert "stopped: max_steps" in done.stdout
    assert str(run_dir) in done.stdout
    assert eqtrain.checkpoint.list_steps(run_dir) == [2]
    assert (run_dir / "hf" / "model.safetensors").exists()
    written = eqtrain.config.load(run_dir / "config.toml")
    assert written.data.train == "stdlib" and written.model.arch == "llama"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert "eval/loss" in json.loads(lines[-1])  # evaluated at the end


def test_fit_eval_info_export_import_plot(tiny_config, tmp_path):
    run_dir = tiny_config.parent / "run"
    done = cli("fit", tiny_config, check_rc=0)
    assert "HF export" in done.stdout
    assert eqtrain.checkpoint.list_steps(run_dir) == [3, 6]
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])

    evaluated = json.loads(inproc("eval", run_dir, check_rc=0).stdout)
    assert evaluated["step"] == 6
    assert evaluated["eval/loss"] == pytest.approx(last["eval/loss"], rel=1e-6)
    at3 = json.loads(inproc("eval", run_dir / "checkpoints" / "3", check_rc=0).stdout)
    assert at3["step"] == 3

    info = inproc("info", run_dir, check_rc=0).stdout
    assert "6 / 6 steps" in info and "step        3" in info
    data = json.loads(inproc("info", run_dir, "--json", check_rc=0).stdout)
    assert [c["step"] for c in data["checkpoints"]] == [3, 6]

    out = tmp_path / "exported"
    inproc("export", run_dir, out, "--dtype", "bfloat16", check_rc=0)
    model, _ = eqtrain.hf.load(out)
    assert str(model.embed_tokens.weight.dtype) == "bfloat16"
    again = inproc("export", run_dir, out)
    assert_clean_error(again, "already exists")

    # HF -> a new run -> HF again is bit-exact (f32).
    imported = tmp_path / "imported"
    inproc("import", run_dir / "hf", imported, check_rc=0)
    assert eqtrain.checkpoint.list_steps(imported) == [0]
    back = tmp_path / "back"
    inproc("export", imported, back, check_rc=0)
    original, _ = eqtrain.hf.load(run_dir / "hf")
    roundtrip, _ = eqtrain.hf.load(back)
    for a, b in zip(
        jax.tree_util.tree_leaves(original),
        jax.tree_util.tree_leaves(roundtrip),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # ... and the imported run fine-tunes from its step-0 checkpoint.
    inproc(
        "fit",
        imported / "config.toml",
        "--set",
        f"data.train={tiny_config.parent / 'train'}",
        "--set",
        "loop.steps=2",
        "--set",
        "loop.eval_every=0",
        check_rc=0,
    )
    assert eqtrain.checkpoint.list_steps(imported)[-1] == 2

    plotted = inproc("plot", run_dir, "-o", tmp_path / "p.png", check_rc=0)
    assert "p.png" in plotted.stdout
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # the default suite's time (export.every: test_job's key table)
def test_periodic_exports_live_beside_the_final_one(tiny_config, tmp_path):
    run_dir = tmp_path / "exports"
    args = ["fit", tiny_config, "--run-dir", run_dir, "--set", "export.every=3"]
    cli(*args, check_rc=0)
    final, steps = run_dir / "hf", run_dir / "hf-steps"
    assert (final / "config.json").is_file() and (final / "model.safetensors").is_file()
    assert sorted(p.name for p in steps.iterdir()) == ["step_3", "step_6"]
    assert all((steps / n / "config.json").is_file() for n in ("step_3", "step_6"))
    again = cli(*args, "--set", "loop.steps=9", check_rc=0)  # continue: 3 more
    assert sorted(p.name for p in steps.iterdir()) == ["step_3", "step_6", "step_9"]
    assert (final / "config.json").is_file(), again.stderr
    (steps / "notes.txt").write_text("mine")  # not ours to mix exports into
    refused = cli(*args, "--set", "loop.steps=12")
    assert_clean_error(refused, str(steps), "step_<k>")


def test_config_show_prints_resolved_toml(tiny_config, tmp_path):
    shown = cli("config", "--show", tiny_config, "--set", "optim.lr=2e-4", check_rc=0)
    path = tmp_path / "resolved.toml"
    path.write_text(shown.stdout)
    resolved = eqtrain.config.load(path)
    assert resolved.optim.lr == 2e-4 and resolved.model.hidden_size == 32
    assert resolved == eqtrain.config.load(tiny_config, ["optim.lr=2e-4"])


def test_dry_run_trains_nothing(tiny_config, tmp_path):
    run_dir = tmp_path / "dry"
    done = cli(
        "fit", tiny_config, "--dry-run", "--run-dir", run_dir, "--set", "mesh.fsdp=2"
    )
    assert done.returncode == 0, done.stderr
    assert "fsdp=2" in done.stdout and "parameters" in done.stdout
    assert "model.layers.mlp.up_proj.weight" in done.stdout
    assert "memory per device" in done.stdout
    assert not run_dir.exists()


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_resume_auto_after_an_interrupted_run(tiny_config, tmp_path):
    run_dir = tmp_path / "interrupted"
    args = [
        *EQTRAIN,
        "fit",
        str(tiny_config),
        "--run-dir",
        str(run_dir),
        "--set",
        "loop.steps=100000",
        "--set",
        "checkpoint.every=5",
        "--set",
        "loop.eval_every=0",
        "--set",
        "export.hf=",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 180
        checkpoints = run_dir / "checkpoints"
        while not (checkpoints.is_dir() and eqtrain.checkpoint.list_steps(run_dir)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()
    assert "stopped: signal" in out.decode()
    stopped_at = eqtrain.checkpoint.list_steps(run_dir)[-1]
    target = stopped_at + 3
    done = cli(
        "fit",
        tiny_config,
        "--run-dir",
        run_dir,
        "--resume",
        "auto",
        "--set",
        f"loop.steps={target}",
        "--set",
        "loop.eval_every=0",
        check_rc=0,
    )
    assert f"resumed from {run_dir / 'checkpoints' / str(stopped_at)}" in done.stderr
    assert eqtrain.checkpoint.list_steps(run_dir)[-1] == target
    steps = [
        json.loads(line)["step"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps[-1] == target and stopped_at + 1 in steps
    # --resume never refuses to mix runs
    never = cli("fit", tiny_config, "--run-dir", run_dir, "--resume", "never")
    assert_clean_error(never, "resume='never'")


@pytest.mark.parametrize(
    "setup, args, fragments",
    [
        ("bad.toml", ["fit", "{bad}"], ["not valid TOML", "bad.toml"]),
        (
            None,
            ["fit", "--set", "optim.lrr=1"],
            ["unknown key `lrr`", "Did you mean `lr`"],
        ),
        (None, ["fit", "--set", "loop.steps=ten"], ["`loop.steps`", "integer"]),
        (None, ["fit", "--set", "optim.b1=2"], ["`optim.b1` must be < 1"]),
        (None, ["fit", "--set", "optim.name=adamm"], ["'adamw'", "Did you mean"]),
        (None, ["fit", "{missing}"], ["does not exist"]),
        ("file", ["fit", "--run-dir", "{blocked}", "--dry-run"], []),
        (
            "file",
            ["fit", "--run-dir", "{blocked}", "--set", "loop.steps=1"],
            ["cannot be created", "Not a directory"],
        ),
        (None, ["fit", "--set", "model.vocab_size=100"], ["does not fit the model"]),
        (None, ["fit", "--set", "mesh.data=3"], ["mesh"]),
        (None, ["eval", "{missing}"], ["does not exist"]),
        (None, ["export", "{missing}", "{out}"], ["does not exist"]),
        (None, ["info", "{missing}"], ["does not exist"]),
        (None, ["plot", "{missing}"], ["metrics.jsonl"]),
        (None, ["import", "{missing}", "{out}"], ["not a directory"]),
        (
            None,
            ["config", "--set", "loop.time_limit=soon"],
            ["loop.time_limit", "duration"],
        ),
    ],
)
def test_bad_input_exits_2_with_one_paragraph(tmp_path, setup, args, fragments):
    (tmp_path / "bad.toml").write_text("[optim\nlr = 1\n")
    (tmp_path / "file").write_text("x")
    names = dict(
        bad=tmp_path / "bad.toml",
        missing=tmp_path / "missing",
        blocked=tmp_path / "file" / "run",
        out=tmp_path / "out",
    )
    args = [a.format(**names) for a in args]
    done = cli(*args, cwd=tmp_path)
    if "--dry-run" in args:  # a dry run writes nothing, so any run_dir is fine
        assert done.returncode == 0, done.stderr
        return
    assert_clean_error(done, *fragments)
    assert not (tmp_path / "runs").exists()  # found before any work


def test_help_shows_defaults_and_every_command():
    top = cli("--help", check_rc=0).stdout
    for command in ("fit", "eval", "export", "import", "info", "plot", "config"):
        assert command in top
    fit_help = cli("fit", "--help", check_rc=0).stdout
    assert "--dry-run" in fit_help and "--resume" in fit_help and "--set" in fit_help
    assert "default" in cli("export", "--help", check_rc=0).stdout
