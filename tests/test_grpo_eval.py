"""`task.kind = "grpo"` with `data.eval`: held-out prompts completed by the
current policy (greedy by default) and scored with the training's rewards at
every `loop.eval_every` steps; `checkpoint.best = "eval/reward"` keeps the
highest; a bad eval file is a config error naming `data.eval`; resume stays
exact."""

import json
import sys
import textwrap

import jax
import jax.random as jr
import numpy as np
import pytest

from eqtrain import ConfigError, config as config_lib, job
from eqtrain.generate import Sampling, generate
from eqtrain.job import _grpo, _rows
from eqtrain.post_training import rollout as rollout_lib


TRAIN = [{"prompt": f"{i}+{i % 3}=", "answer": str(i + i % 3)} for i in range(16)]
HELD_OUT = [
    {"prompt": f"{i}+{i % 4}=", "answer": str(i + i % 4)} for i in range(20, 30)
]

REWARDS = """
def digit(prompts, completions, answer, **columns):
    return [float(c[:1] == a[:1]) for c, a in zip(completions, answer)]

def short(prompts, completions, **columns):
    return [1.0 / (1 + len(c)) for c in completions]
"""
NAMES = ("grpo_eval_rewards:digit", "grpo_eval_rewards:short")


@pytest.fixture
def files(tmp_path, monkeypatch):
    for name, rows in (("train.jsonl", TRAIN), ("eval.jsonl", HELD_OUT)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "grpo_eval_rewards.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("grpo_eval_rewards", None)


def tiny(root, run, *extra):
    return [
        f"run_dir={root / run}",
        "task.kind=grpo",
        f"data.train={root / 'train.jsonl'}",
        f"data.eval={root / 'eval.jsonl'}",
        "data.seq_len=16",
        "data.batch_size=8",  # 10 held-out prompts: a full batch and a padded one
        "task.group_size=2",
        "task.max_completion_len=4",
        f"task.rewards={','.join(NAMES)}",
        "task.reward_weights=1,0.5",
        "model.hidden_size=32",
        "model.num_layers=1",
        "loop.steps=4",
        "loop.eval_every=2",
        "checkpoint.every=2",
        "optim.lr=3e-2",
        "optim.schedule=constant",
        "optim.warmup_steps=0",
        "log.progress=none",
        *extra,
    ]


def run(root, run_name, *extra):
    config = config_lib.load(None, tiny(root, run_name, *extra))
    return job.run(config, echo=lambda _: None)


def eval_rows(root, run_name):
    lines = (root / run_name / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if "eval/reward" in r}


def direct_reward(config, state):
    """The mean total reward of greedy completions of the held-out prompts by
    `state`'s model, computed here: one `generate` call, decoded, scored."""
    built = job.build(config)
    rows = _rows.grpo_rows(built, config.data.eval, "data.eval")
    rows = _rows.first_rows(rows, rows.num_rows)
    stops = _grpo.stop_ids(built)
    out = generate(
        state.model,
        rows["prompt"],
        rows["prompt_len"],
        max_new_tokens=config.task.max_completion_len,
        key=jr.key(0),
        sampling=Sampling(temperature=0.0),
        stop_ids=stops,
        pad_id=_grpo.pad_id(built.tokenizer),
        vocab_size=built.vocab_size,
    )
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    texts = []
    for t, n in zip(tokens, lengths, strict=True):
        n = int(n) - int(n > 0 and t[n - 1] in stops)  # a final stop left out
        texts.append(built.tokenizer.decode(t[:n]))
    answers = [HELD_OUT[int(i)]["answer"] for i in rows["index"]]
    digit = [float(c[:1] == a[:1]) for c, a in zip(texts, answers, strict=True)]
    short = [1.0 / (1 + len(c)) for c in texts]
    return float(np.mean(digit) + 0.5 * np.mean(short)), float(np.mean(lengths))


def test_eval_reward_logged_exact_compiled_once_and_best_kept(files, monkeypatch):
    traces = []
    made = rollout_lib.grpo_eval_step

    def counted(rollout):
        step = made(rollout)

        def traced(state, batch):
            traces.append(1)
            return step(state, batch)

        return traced

    monkeypatch.setattr(rollout_lib, "grpo_eval_step", counted)
    sets = ("checkpoint.best=eval/reward", "checkpoint.keep_last=1")
    result = run(files, "straight", *sets)
    rows = eval_rows(files, "straight")
    assert sorted(rows) == [2, 4]  # loop.eval_every (the end is step 4: not twice)
    names = {
        "eval/reward", "eval/weight", *(f"eval/rewards/{n}/mean" for n in NAMES),
        "eval/completions/mean_length", "eval/completions/min_length",
        "eval/completions/max_length", "eval/completions/clipped_ratio",
    }  # fmt: skip
    assert names <= set(rows[2]) and names <= set(rows[4])
    assert rows[4]["eval/weight"] == len(HELD_OUT)  # greedy: one each, no padding
    # two evaluations of two batches each, one compiled program
    assert len(traces) == 1
    # the logged reward is the direct computation's on the final state
    reward, length = direct_reward(result.config, result.fit.state)
    assert rows[4]["eval/reward"] == pytest.approx(reward, abs=1e-6)
    assert rows[4]["eval/completions/mean_length"] == pytest.approx(length)
    r = rows[4]
    total = (
        r[f"eval/rewards/{NAMES[0]}/mean"] + 0.5 * r[f"eval/rewards/{NAMES[1]}/mean"]
    )
    assert r["eval/reward"] == pytest.approx(total, abs=1e-6)
    # checkpoint.best = eval/reward keeps the highest (best_mode auto: max)
    assert rows[2]["eval/reward"] != rows[4]["eval/reward"]  # a real ranking
    best = max((rows[s]["eval/reward"], s) for s in rows)[1]
    steps = {int(p.name) for p in (files / "straight" / "checkpoints").iterdir()
             if p.name.isdigit()}  # fmt: skip
    assert steps == {4, best}

    # resume stays exact with evaluation on
    run(files, "split", *sets, "loop.steps=2")
    run(files, "split", *sets)
    split = eval_rows(files, "split")
    assert sorted(split) == [2, 4]
    for step in (2, 4):
        assert {k: split[step][k] for k in names} == {k: rows[step][k] for k in names}


def test_best_mode_auto_maximises_rewards():
    def mode(best, *extra):
        sets = ["task.kind=grpo", "data.train=t.jsonl", "data.eval=e.jsonl"]
        sets += [f"checkpoint.best={best}"]
        return config_lib.best_mode(config_lib.load(None, [*sets, *extra]))

    assert mode("eval/reward") == "max"
    assert mode("eval/rewards/exact_answer/mean") == "max"
    assert mode("eval/completions/mean_length") == "min"
    assert mode("eval/reward", "checkpoint.best_mode=min") == "min"
    assert (
        config_lib.best_mode(config_lib.load(None, ["checkpoint.best=eval/loss"]))
        == "min"
    )


def test_a_bad_eval_file_names_data_eval(files):
    (files / "bad.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    (files / "no_answer.jsonl").write_text('{"prompt": "1+1="}\n')
    cases = (
        ("bad.jsonl", "`prompt`"),  # no prompt column
        ("missing.jsonl", "does not exist"),
        ("no_answer.jsonl", "['answer']"),  # the rewards' column
    )
    for source, says in cases:
        with pytest.raises(ConfigError, match="data.eval") as e:
            run(files, f"bad_{source}", f"data.eval={files / source}")
        assert says in str(e.value)
    assert jax.devices()  # nothing left half-built


def test_eval_temperature_reaches_the_eval_rollout(files):
    """`task.eval_temperature`: 0 completes each held-out prompt once, greedily;
    above 0 it samples `task.group_size` completions (no training here)."""
    from eqtrain.job import _build, _rows

    for temperature, group in ((0.0, 1), (0.7, 3)):
        sets = [
            f"task.eval_temperature={temperature}",
            "task.group_size=3",
            "task.top_k=5",
        ]
        built = _build.build(config_lib.load(None, tiny(files, "keys", *sets)))
        _rows.eval_rows(built)  # reads the held-out prompts
        r = _grpo.make_eval_rollout(built)
        assert (r.sampling.temperature, r.group_size, r.passes) == (
            temperature,
            group,
            1,
        )
        assert r.sampling.top_k == 5 and r.reward_names == tuple(NAMES)
