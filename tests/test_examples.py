"""Every example runs end to end with --smoke (in a subprocess, as a user would)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_smoke(script, tmp_path):
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopped: max_steps" in proc.stdout
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[-1])["step"] > 0


@pytest.mark.slow
def test_llama_learns_the_stdlib(tmp_path):
    """A few hundred CPU steps clearly lower the held-out loss (slow: ~2 minutes)."""
    script = Path(__file__).parent.parent / "examples" / "llama_stdlib.py"
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(script), "--steps", "300", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["eval_loss_before"] > 5.0  # about ln(259) at initialisation
    assert summary["eval_loss_after"] < 0.5 * summary["eval_loss_before"]
    assert summary["data_position"] == {"epoch": 0, "index": 300}
