"""Every example runs end to end with --smoke (in a subprocess, as a user would)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.py"))


# llama_stdlib.py under `nox -s slow`: pretrain_stdlib.toml (below) trains the
# same Llama on the same data by default (the default suite's time)
@pytest.mark.parametrize(
    "script",
    [
        pytest.param(p, marks=pytest.mark.slow) if p.name == "llama_stdlib.py" else p
        for p in EXAMPLES
    ],
    ids=lambda p: p.name,
)
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


CONFIGS = sorted((Path(__file__).parent.parent / "examples" / "configs").glob("*.toml"))


# the default suite's time: these two run full-size under `nox -s slow`, and
# small (test_lora_and_dpo_configs_run_small) by default
SLOW_CONFIGS = ("dpo.toml", "lora.toml")
# sharded_simulated.toml: slow only; the default suite's whole runs on 8 devices
# (test_job's mesh keys, test_sequence's fit, test_lora's 2x2x2 mesh) cover it.
# pretrain_stdlib.toml is the built-in default run (test_cli runs that), and
# finetune_hf.toml / sft.toml are covered by test_interop / test_post_training;
# moe_stdlib.toml by test_moe's run on mesh.expert = 2; the GRPO example's two
# configs by test_grpo_example_learns (slow) and test_grpo_job's runs.
SLOW_ONLY = (
    "arithmetic_sft.toml",
    "grpo.toml",
    "moe_stdlib.toml",
    "sharded_simulated.toml",
    "pretrain_stdlib.toml",
    "finetune_hf.toml",
    "sft.toml",
)


@pytest.mark.parametrize(
    "path",
    [
        pytest.param(p, marks=pytest.mark.slow)
        if p.name in SLOW_CONFIGS + SLOW_ONLY
        else p
        for p in CONFIGS
    ],
    ids=lambda p: p.name,
)
def test_example_configs_run(path, tmp_path, small=()):
    """Each ready config validates, dry-runs, and trains two steps (8 simulated
    devices, as the sharded example asks)."""
    import jax.random as jr

    from eqtrain import config as config_lib, hf, job
    from eqtrain.models import Llama, LlamaConfig

    overrides = [f"run_dir={tmp_path / 'run'}", "log.progress=none", *small]
    if "init_from" in path.read_text():  # stands in for runs/pretrain_stdlib/hf
        base = LlamaConfig(
            vocab_size=259,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            max_position_embeddings=128,
        )
        hf.export(Llama(base, jr.key(0)), base, tmp_path / "base")
        overrides.append(f"model.init_from={tmp_path / 'base'}")
    if 'kind = "distill"' in path.read_text():  # stands in for runs/sft/hf
        overrides.append(f"task.teacher={_teacher(tmp_path)}")
    config = config_lib.load(path, overrides)
    if not small:
        assert "memory per device" in job.report(config)
    short = config_lib.load(
        path,
        [
            *overrides,
            "loop.steps=2",
            "loop.eval_every=0",
            "data.eval_rows=16",
            "optim.warmup_steps=0",
            "checkpoint.best=",
            "loop.time_limit=",
        ],
    )
    result = job.run(short, echo=lambda s: None)
    assert result.fit.stop_reason.kind == "max_steps"
    if config.lora.rank:  # the adapter in PEFT's format, and the merged model
        assert (tmp_path / "run" / "hf" / "adapter_config.json").exists()
        assert (tmp_path / "run" / "hf-merged" / "config.json").exists()
    else:
        assert (tmp_path / "run" / "hf" / "config.json").exists()


def _teacher(root):
    """A byte-tokenizer Llama with sharp (scaled-head) distributions, standing in
    for sft.toml's trained model as distill.toml's teacher."""
    import equinox as eqx
    import jax.random as jr

    from eqtrain import hf
    from eqtrain.models import Llama, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=259,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        max_position_embeddings=128,
    )
    model = Llama(cfg, jr.key(1))
    model = eqx.tree_at(lambda m: m.lm_head.weight, model, model.lm_head.weight * 60)
    if not (root / "teacher" / "config.json").exists():
        hf.export(model, cfg, root / "teacher")
    return root / "teacher"


def test_distill_example_learns(tmp_path):
    """distill.toml as written (its teacher stood in for, 20 of its steps): the
    student's loss falls, and some steps are on-policy."""
    import json

    from eqtrain import config as config_lib, job

    path = CONFIGS[[p.name for p in CONFIGS].index("distill.toml")]
    config = config_lib.load(
        path,
        [
            f"run_dir={tmp_path / 'run'}",
            f"task.teacher={_teacher(tmp_path)}",
            "loop.steps=20",
            "loop.eval_every=0",
            "log.every=1",
            "log.progress=none",
        ],
    )
    job.run(config, echo=lambda s: None)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "on_policy" in r]
    losses = [r["loss"] for r in steps]
    assert sum(losses[-4:]) < 0.95 * sum(losses[:4]), losses  # 20 steps
    assert 0 < sum(r["on_policy"] for r in steps) < len(steps)


@pytest.mark.parametrize(
    "name",
    # default-suite time: DPO runs by default in test_post_training
    ["lora.toml", pytest.param("dpo.toml", marks=pytest.mark.slow)],
    ids=lambda n: n.removesuffix(".toml"),
)
def test_lora_and_dpo_configs_run_small(name, tmp_path):
    """The slow-only configs as written, on smaller batches (and, for lora.toml,
    short rows of a small text: tokenizing the Python standard library takes
    most of its full-size time)."""
    (tmp_path / "small.txt").write_text("def f(x):\n    return x + 1\n" * 400)
    small = ["data.batch_size=8", "data.eval_rows=8"]
    if name == "lora.toml":
        small += [f"data.train={tmp_path / 'small.txt'}", "data.seq_len=32"]
        small += ["data.eval=none", "loop.eval_every=0"]
    test_example_configs_run(
        CONFIGS[[p.name for p in CONFIGS].index(name)], tmp_path, small
    )


@pytest.mark.slow
def test_grpo_example_learns(tmp_path):
    """docs/post-training.md's worked example as written (SFT warm-up, then GRPO):
    the mean reward of the last 20 steps clearly beats the first 20's, and the
    held-out reward of the last evaluation the first's."""
    import json

    from eqtrain import config as config_lib, job

    root = Path(__file__).parent.parent
    sft = config_lib.load(
        root / "examples/configs/arithmetic_sft.toml",
        [f"run_dir={tmp_path / 'sft'}", "log.progress=none"],
    )
    job.run(sft, echo=lambda s: None)
    grpo = config_lib.load(
        root / "examples/configs/grpo.toml",
        [
            f"run_dir={tmp_path / 'grpo'}",
            f"model.init_from={tmp_path / 'sft' / 'hf'}",
            "log.every=1",
            "log.progress=none",
        ],
    )
    job.run(grpo, echo=lambda s: None)
    lines = (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()
    rewards = [r["reward"] for r in map(json.loads, lines) if "reward" in r]
    first, last = sum(rewards[:20]) / 20, sum(rewards[-20:]) / 20
    assert last > first + 0.15, (first, last)
    # the held-out prompts are evaluated every 25 steps (greedy, one answer each)
    evals = [r for r in map(json.loads, lines) if "eval/reward" in r]
    assert [r["step"] for r in evals] == list(range(25, 201, 25))
    assert all(r["eval/weight"] == 64 for r in evals)
    # and the held-out reward rises too (2,000 training sums: not learned by heart)
    assert evals[-1]["eval/reward"] > evals[0]["eval/reward"] + 0.1, evals
