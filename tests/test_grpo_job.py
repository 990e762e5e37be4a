"""`task.kind = "grpo"` end to end: the prompts and columns the reward functions
see, the metrics under TRL's names, a KL penalty against a frozen copy, several
passes per sampled batch, exact resume (the sampling key is part of the state),
and bad settings and failing reward functions as one-paragraph errors."""

import json
import sys
import textwrap

import numpy as np
import pytest

from eqtrain import ConfigError, config as config_lib, job

from .test_cli import inproc


PROMPTS = [{"prompt": f"{i}+{i % 3}=", "answer": str(i + i % 3)} for i in range(16)]

# A reward module of the test's own: it records every call (one JSON line each),
# and rewards the completions that start with the answer's first digit.
REWARDS = """
import json, os

def recorded(prompts, completions, answer, **columns):
    with open(os.environ["GRPO_CALLS"], "a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions,
                            "answer": answer, "columns": sorted(columns)}) + "\\n")
    return [float(c[:1] == a[:1]) for c, a in zip(completions, answer)]

def short(prompts, completions, **columns):
    return [1.0 / (1 + len(c)) for c in completions]

def boom(prompts, completions, **columns):
    raise ValueError("boom inside")
"""


@pytest.fixture
def files(tmp_path, monkeypatch):
    """The prompt file (with an extra `level` column) and the reward module."""
    rows = [{**r, "level": i % 2} for i, r in enumerate(PROMPTS)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "grpo_rewards_mod.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("GRPO_CALLS", str(tmp_path / "calls.jsonl"))
    yield tmp_path
    sys.modules.pop("grpo_rewards_mod", None)


def tiny(root, run="run", *extra):
    return [
        f"run_dir={root / run}",
        "task.kind=grpo",
        f"data.train={root / 'prompts.jsonl'}",
        "data.eval=none",
        "data.seq_len=16",
        "data.batch_size=8",
        "task.group_size=2",
        "task.max_completion_len=4",
        "task.rewards=grpo_rewards_mod:recorded,grpo_rewards_mod:short",
        "task.reward_weights=1,0.5",
        "model.hidden_size=32",
        "model.num_layers=1",
        "loop.steps=3",
        "log.progress=none",
        "optim.warmup_steps=0",
        *extra,
    ]


def run(root, *extra, run_name="run"):
    config = config_lib.load(None, tiny(root, run_name, *extra))
    return job.run(config, echo=lambda _: None)


def metrics(root, run_name="run"):
    lines = (root / run_name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"reward"' in line]


@pytest.mark.tuned  # re-run under each CPU setting (test_tuned_settings.py)
def test_rewards_see_the_prompts_groups_and_columns(files):
    result = run(files)
    assert result.fit.stop_reason.kind == "max_steps"
    calls = [json.loads(x) for x in (files / "calls.jsonl").read_text().splitlines()]
    # the rows are scored where they live: one call per device (8) and step, each
    # with its device's 16 / 8 rows, here one group of 2
    assert len(calls) == 3 * 8
    by_prompt = {r["prompt"]: r["answer"] for r in PROMPTS}
    for call in calls:
        prompts = call["prompts"]
        assert len(prompts) == 2 and prompts[0] == prompts[1]  # a group of 2
        assert [by_prompt[p] for p in prompts] == call["answer"]
        assert call["columns"] == ["level"]  # the other columns, by name
        assert all(len(c) <= 4 for c in call["completions"])
    seen = [call["prompts"][0] for call in calls]
    assert len(set(seen[:16])) == 16  # the first epoch (2 steps): every prompt once
    rows = metrics(files)
    names = {
        "reward", "reward_std", "frac_reward_zero_std", "entropy", "loss",
        "rewards/grpo_rewards_mod:recorded/mean",
        "rewards/grpo_rewards_mod:short/std",
        "completions/mean_length", "completions/clipped_ratio",
        "clip_ratio/region_mean", "time/generate", "time/reward",
    }  # fmt: skip
    assert names <= set(rows[-1])
    # the reward is the weighted sum of the functions' means
    r = rows[-1]
    total = r["rewards/grpo_rewards_mod:recorded/mean"]
    total += 0.5 * r["rewards/grpo_rewards_mod:short/mean"]
    assert r["reward"] == pytest.approx(total, rel=1e-5)


@pytest.mark.slow
def test_kl_to_a_frozen_copy_and_several_passes(files):
    run(files, "task.beta=0.1", "task.reference=copy", "task.passes=2")
    rows = metrics(files)
    assert "kl" in rows[0] and rows[0]["kl"] >= 0
    assert all(np.isfinite(r["loss"]) for r in rows)
    # the metrics are the second pass's, after one update away from the copy
    assert 0 < rows[0]["kl"] < 0.05


@pytest.mark.tuned  # re-run under each CPU setting (test_tuned_settings.py)
@pytest.mark.slow
def test_resume_is_exact(files):
    # a constant schedule: with another loop.steps a cosine one would differ
    sets = ("checkpoint.every=2", "export.hf=hf", "optim.schedule=constant")
    run(files, "loop.steps=4", *sets, run_name="straight")
    run(files, "loop.steps=2", *sets, run_name="split")
    run(files, "loop.steps=4", *sets, run_name="split")
    straight, split = metrics(files, "straight"), metrics(files, "split")
    keys = ("reward", "completions/mean_length", "rewards/grpo_rewards_mod:short/mean")
    for a, b in zip(straight[2:], split[-2:], strict=True):
        assert a["step"] == b["step"]
        assert [a[k] for k in keys] == [b[k] for k in keys]  # the same samples
    weights = [
        (files / name / "hf" / "model.safetensors").read_bytes()
        for name in ("straight", "split")
    ]
    assert weights[0] == weights[1]


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["task.rewards=format", "task.reward_weights="], "task.format_regex"),
        (["task.rewards=nope_module:fn"], "task.rewards"),
        (["task.reward_weights=1"], "task.reward_weights"),
        (["task.max_completion_len=16"], "task.max_completion_len"),
        (["task.beta=0.1", "task.reference=precomputed"], "precomputed"),
        (["data.max_prompt_len=4"], "data.max_prompt_len"),
        (["task.group_size=1"], "task.group_size"),
    ],
)
def test_bad_settings_are_refused_before_training(files, extra, fragment):
    with pytest.raises(ConfigError, match=fragment.replace(".", r"\.")):
        config_lib.load(None, tiny(files, "run", *extra))


def test_a_file_without_prompts_is_refused(files):
    (files / "prompts.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n' * 8)
    done = inproc("fit", *sum((["--set", s] for s in tiny(files)), []))
    assert done.returncode == 2
    assert "`prompt` (text) or `messages`" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_failing_reward_is_one_paragraph(files, capfd):
    sets = tiny(
        files, "run", "task.rewards=grpo_rewards_mod:boom", "task.reward_weights="
    )
    done = inproc("fit", *sum((["--set", s] for s in sets), []))
    assert done.returncode == 2, done.stderr
    err = done.stderr + capfd.readouterr().err
    assert "reward 'grpo_rewards_mod:boom' raised ValueError: boom inside" in err
    assert "Traceback" not in err
    assert "stopped" not in done.stdout or "nonfinite" not in done.stdout


def test_grpo_keys_reach_the_run(files, monkeypatch):
    """Every [task] key of GRPO reaches the rollout or the loss (no training)."""
    from eqtrain.job import _build, _grpo
    from eqtrain.post_training import grpo

    seen = {}
    real = grpo.grpo_loss_fn
    monkeypatch.setattr(
        grpo, "grpo_loss_fn", lambda **kw: seen.update(kw) or real(**kw)
    )
    sets = [
        "task.group_size=4", "task.max_completion_len=5", "task.temperature=0.7",
        "task.top_k=5", "task.top_p=0.9", "task.min_p=0.05",
        "task.rewards=grpo_rewards_mod:short,format", "task.reward_weights=2,3",
        "task.format_regex=[0-9]+", "task.scale_rewards=none", "task.loss_type=dr_grpo",
        "task.epsilon=0.1", "task.epsilon_high=0.3", "task.passes=3",
        "task.beta=0.05", "task.reference=copy", "task.kl_bias_correction=false",
        "task.importance_sampling_level=sequence",
    ]  # fmt: skip
    job_ = _build.build(config_lib.load(None, tiny(files, "run", *sets)))
    rows = _grpo.rows(job_, str(files / "prompts.jsonl"), "data.train")
    assert rows["prompt"].shape == (16, 16 - 5)  # seq_len - max_completion_len
    r = _grpo.make_rollout(job_)
    assert (r.group_size, r.max_new_tokens, r.passes, r.scale) == (4, 5, 3, "none")
    assert (r.sampling.temperature, r.sampling.top_k) == (0.7, 5)
    assert (r.sampling.top_p, r.sampling.min_p) == (0.9, 0.05)
    assert r.reward_names == ("grpo_rewards_mod:short", "format")
    total, per = r.score(np.arange(2), np.full((2, 5), ord("7")), np.array([1, 5]))
    assert per["format"].tolist() == [1.0, 1.0]  # "7" and "77777" match [0-9]+
    assert total.tolist() == pytest.approx([2 / 2 + 3, 2 / 6 + 3])
    assert seen["loss_type"] == "dr_grpo" and seen["max_completion_length"] == 5
    assert (seen["epsilon_low"], seen["epsilon_high"]) == (0.1, 0.3)
    assert (seen["beta"], seen["reference"], seen["temperature"]) == (0.05, "copy", 0.7)
    assert seen["kl_bias_correction"] is False
    assert seen["importance_sampling_level"] == "sequence"
    assert job_.reference == "copy"
