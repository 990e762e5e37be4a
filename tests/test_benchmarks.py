"""Benchmarks stay runnable: each runs in its quick mode and prints its JSON lines."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def test_overhead_quick():
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "overhead.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["config"] for r in records] == ["base", "many_small_leaves"]
    for r in records:
        assert r["raw_tokens_per_s"] > 0 and r["eqtrain_tokens_per_s"] > 0
        assert r["ratio"] > 0
    assert "warning" not in proc.stderr  # same losses, a single trace


def test_models_quick():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "models.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["config"] == "quick" and record["ratio"] > 0
