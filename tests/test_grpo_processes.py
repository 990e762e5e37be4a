"""GRPO across processes: `eqtrain fit` of a GRPO config in two processes on
127.0.0.1 (one device each) trains what one process with two devices trains:
each process samples and scores the rows its device holds (its own reward calls),
the advantages are the same, and so are the losses and rewards of every step.
The same under the Ray launcher: test_ray.py (slow, on its module's Ray)."""

import json
import os
import sys
import textwrap

import pytest

from .test_distributed import _env, _start_pair


PROMPTS = [{"prompt": f"{i}+{i % 3}=", "answer": str(i + i % 3)} for i in range(16)]
REWARDS = """
import json, os

def first_digit(prompts, completions, answer, **columns):
    with open(os.environ["GRPO_CALLS"], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "rows": len(prompts)}) + "\\n")
    return [float(c[:1] == a[:1]) + 0.1 * len(c) for c, a in zip(completions, answer)]
"""


def _settings(root, run):
    return [
        f"run_dir={root / run}",
        "task.kind=grpo",
        f"data.train={root / 'prompts.jsonl'}",
        "data.eval=none",
        "data.seq_len=16",
        "data.batch_size=4",
        "task.group_size=2",
        "task.max_completion_len=4",
        "task.rewards=grpo_mp_rewards:first_digit",
        "model.hidden_size=32",
        "model.num_layers=1",
        "loop.steps=3",
        "log.progress=none",
        "optim.warmup_steps=0",
        "export.hf=",
        f"log.samples={root / 'samples.txt'}",
        "log.samples_every=2",
        "log.samples_max_new_tokens=4",
    ]


def _argv(root, run):
    command = [sys.executable, "-m", "eqtrain.cli", "fit"]
    return command + sum((["--set", s] for s in _settings(root, run)), [])


def _steps(root, run):
    lines = (root / run / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(x) for x in lines]
    return [
        {k: r[k] for k in ("step", "loss", "reward", "reward_std")}
        for r in rows
        if "reward" in r
    ]


def _two_devices(root):
    """The files, and the run of one process with two devices: its steps, its
    reward calls, and the variables the runs of two processes need."""
    import subprocess

    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    (root / "grpo_mp_rewards.py").write_text(textwrap.dedent(REWARDS))
    (root / "samples.txt").write_text("1+1=\n2+0=\n")
    calls = root / "calls.jsonl"
    extra = {"PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    extra["GRPO_CALLS"] = str(calls)
    single = subprocess.run(
        _argv(root, "one"), capture_output=True, text=True, timeout=300,
        env=_env(2, **extra),
    )  # fmt: skip
    assert single.returncode == 0, single.stderr[-3000:]
    one_calls = [json.loads(x) for x in calls.read_text().splitlines()]
    calls.unlink()
    return _steps(root, "one"), one_calls, extra


def _equal_steps(one, two):
    assert len(one) == len(two) == 3
    for a, b in zip(one, two, strict=True):
        assert a["step"] == b["step"]
        for key in ("loss", "reward", "reward_std"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-6), (key, a, b)


def test_two_processes_train_what_two_devices_train(tmp_path):
    one, one_calls, extra = _two_devices(tmp_path)
    calls = tmp_path / "calls.jsonl"

    argv = _argv(tmp_path, "two") + ["--set", "distributed.processes=2"]
    procs, _ = _start_pair(tmp_path / "two", argv=argv, each=(extra, extra))
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    _equal_steps(one, _steps(tmp_path, "two"))
    # the samples hook: the same completions, written once
    samples = [(tmp_path / run / "samples.jsonl").read_text() for run in ("one", "two")]
    assert samples[0] == samples[1] and samples[0].count("\n") == 2 * 2
    # one process scored both devices' rows; two processes one device's each
    two_calls = [json.loads(x) for x in calls.read_text().splitlines()]
    assert len({c["pid"] for c in one_calls}) == 1
    assert len({c["pid"] for c in two_calls}) == 2
    assert all(c["rows"] == 4 for c in one_calls + two_calls)  # 4 x 2 / 2 devices
