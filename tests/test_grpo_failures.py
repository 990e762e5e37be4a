"""GRPO when something goes wrong: prompt rows that are null or not text are
skipped with one warning naming the file and line (none left: an error), a reward
function that calls `sys.exit` is an error naming it, and a finished run is
exported, described and opened for generation without importing its reward
module. One tiny GRPO fit (module-scoped) compiles."""

import json
import shutil
import sys
import textwrap
import types

import pytest

from eqtrain import ConfigError, config as config_lib, data, job
from eqtrain.job import _build, _grpo, _plan
from eqtrain.post_training import rewards
from eqtrain.post_training.rollout import Rollout

from .test_cli import assert_clean_error, inproc


PROMPTS = [{"prompt": f"{i}+{i % 3}=", "answer": str(i + i % 3)} for i in range(16)]

# The run's reward module: step 1's calls score (one per device: each scores its
# device's rows), the next one ends the process.
REWARDS = """
import sys

import jax

calls = []

def flaky(prompts, completions, **columns):
    calls.append(len(completions))
    if len(calls) > jax.local_device_count():
        sys.exit(3)
    return [1.0 / (1 + len(c)) for c in completions]
"""
MODULE = "grpo_failures_rewards"


def tiny(root, *extra):
    """test_grpo_job's tiny run, on `root/prompts.jsonl`, scored by `flaky`."""
    return [
        f"run_dir={root / 'run'}",
        "task.kind=grpo",
        f"data.train={root / 'prompts.jsonl'}",
        "data.eval=none",
        "data.seq_len=16",
        "data.batch_size=8",
        "task.group_size=2",
        "task.max_completion_len=4",
        f"task.rewards={MODULE}:flaky",
        "model.hidden_size=32",
        "model.num_layers=1",
        "loop.steps=2",
        "checkpoint.every=1",
        "log.progress=none",
        "optim.warmup_steps=0",
        *extra,
    ]


def write_prompts(root, rows):
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def module_on_path(tmp_path, monkeypatch):
    """The reward module, importable from `tmp_path`."""
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop(MODULE, None)


def prompt_rows(root, *extra):
    built = _build.build(config_lib.load(None, tiny(root, *extra)))
    return built, _grpo.rows(built, str(root / "prompts.jsonl"), "data.train")


def test_prompts_that_are_not_text_are_skipped_naming_file_and_line(module_on_path):
    root = module_on_path
    bad = [{"prompt": None, "answer": "x"}, {"answer": "y"}]
    write_prompts(root, PROMPTS[:3] + bad + PROMPTS[3:])
    path = root / "prompts.jsonl"
    with pytest.warns(data.DataWarning) as caught:
        built, rows = prompt_rows(root)
    (message,) = [str(w.message) for w in caught]
    assert message == (
        f"{path}: skipped 2 of 18 rows: 2 whose 'prompt' is not a string (the "
        f"first: {path}:4)."
    )
    assert len(rows["prompt"]) == 16
    assert built.grpo.prompts.prompts == [r["prompt"] for r in PROMPTS]
    assert built.grpo.prompts.columns["answer"] == [r["answer"] for r in PROMPTS]
    # a chat file: a null `messages` is skipped the same way
    chats = [{"messages": [{"role": "user", "content": r["prompt"]}]} for r in PROMPTS]
    write_prompts(root, [{"messages": None}, *chats])
    with pytest.warns(data.DataWarning, match=r"1 whose 'messages' is not a list"):
        built, rows = prompt_rows(root, "data.seq_len=40")  # room for the template
    assert len(rows["prompt"]) == 16
    # nothing left: one error naming the file
    write_prompts(root, bad)
    with pytest.raises(ConfigError, match=r"holds no usable prompt: all 2 rows"):
        prompt_rows(root)


def test_a_reward_that_calls_sys_exit_is_an_error_naming_it():
    def leave(prompts, completions, **columns):
        sys.exit(3)

    with pytest.raises(rewards.RewardError, match=r"reward 'mod:leave' called sys"):
        rewards.score([("mod:leave", leave, 1.0)], ["p"], ["c"])


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A GRPO run whose reward function scored step 1 and called `sys.exit` in
    step 2 (the CLI's result), with its reward module gone afterwards."""
    root = tmp_path_factory.mktemp("grpo")
    write_prompts(root, PROMPTS)
    (root / "mod").mkdir()
    (root / "mod" / f"{MODULE}.py").write_text(textwrap.dedent(REWARDS))
    sys.path.insert(0, str(root / "mod"))
    try:
        done = inproc("fit", *sum((["--set", s] for s in tiny(root)), []))
    finally:
        sys.path.remove(str(root / "mod"))
        sys.modules.pop(MODULE, None)
    shutil.rmtree(root / "mod")
    return root / "run", done


def test_sys_exit_in_a_reward_ends_the_run_with_one_paragraph(finished):
    _, done = finished
    assert_clean_error(
        done, f"reward '{MODULE}:flaky' called sys.exit(3)", "`task.rewards`"
    )


def test_a_finished_run_needs_no_reward_module(finished, tmp_path):
    run, _ = finished
    cfg = config_lib.load(run / "config.toml")  # names the reward: imports nothing
    with pytest.raises(ConfigError, match=f"no module '{MODULE}'"):
        _plan.plan(cfg)  # training again would need it (the plan imports it)
    done = inproc("info", run)
    assert done.returncode == 0, done.stderr
    assert "task:         grpo" in done.stdout
    done = inproc("export", run, tmp_path / "hf")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "hf" / "model.safetensors").exists()
    m = job.open_model(run)  # what `eqtrain generate RUN` opens
    assert m.stop_ids == (258,)  # the byte tokenizer's EOS


def test_the_reward_check_raises_the_first_failure():
    rollout = Rollout(group_size=2, max_new_tokens=1, score=lambda *args: None)
    rollout.failures.append(SystemExit(3))
    check = _grpo.RewardCheck(types.SimpleNamespace(grpo=_grpo.Online(None, rollout)))
    with pytest.raises(ConfigError, match=r"`task.rewards`: .* SystemExit: 3"):
        check(None)
    rollout.failures.clear()
    check(None)  # nothing failed: nothing happens


def test_a_reward_failure_is_not_recorded_as_nonfinite_nor_exported(finished):
    run, _ = finished
    assert "nonfinite" not in (run / "metrics.jsonl").read_text()
    assert not (run / "hf").exists()  # nothing trained on the failed step
    reasons = [c.get("stop_reason") for c in job.run_info(run)["checkpoints"]]
    assert all(r is None or r["kind"] != "nonfinite" for r in reasons), reasons


def test_grpo_under_the_clis_cpu_settings_plans_and_trains(tmp_path):
    """Issue 52, case 1 (issue 51): wherever `tune_cpu` put Eigen's products in
    `XLA_FLAGS` (`fixed` included), generation compiled with options of its own
    and GRPO's step, which samples inside, was refused by JAX at step 1 and in
    `--dry-run` ("compiler_options can only be passed to top-level jax.jit").
    The real `eqtrain` command, with its CPU settings, plans and trains."""
    import os
    import subprocess

    write_prompts(tmp_path, PROMPTS)
    sets = tiny(tmp_path, "task.rewards=exact_answer", "checkpoint.every=0")
    argv = [sys.executable, "-m", "eqtrain.cli", "fit"]
    argv += [f"--set={s}" for s in sets]
    env = {**os.environ, "EQTRAIN_CPU_TUNING": "fixed"}
    for extra in (["--dry-run"], []):
        done = subprocess.run(
            argv + extra, capture_output=True, text=True, env=env, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        if extra:
            assert "eigen_dots, unrolled layers (EQTRAIN_CPU_TUNING=fixed)" in (
                done.stdout
            )
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows if "reward" in r] == [1, 2]
