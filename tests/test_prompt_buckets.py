"""GRPO prompts bucketed by length (`data.PromptBuckets`): the ladder of widths,
an epoch's order (a permutation that groups prompts of one width), the width
every process gives a batch, exact resume, and rollouts of a cut batch equal to
those of the full-width one."""

import json
import sys
import textwrap

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from eqtrain import data
from eqtrain.data import Loader, PromptBuckets, bucket_widths
from eqtrain.models import llama
from eqtrain.post_training import rollout as rollout_lib


def test_widths_halve_down_to_the_minimum():
    assert bucket_widths(448, 4) == (64, 112, 224, 448)  # 56 is raised to 64
    assert bucket_widths(448, 2) == (224, 448)
    assert bucket_widths(1000, 3) == (256, 504, 1000)
    assert bucket_widths(100, 4) == (64, 100)
    assert bucket_widths(64, 4) == (64,)
    assert bucket_widths(40, 4) == (40,)
    assert bucket_widths(4096, 1) == (4096,)
    assert bucket_widths(40, 3, minimum=8) == (16, 24, 40)


class Prompts:
    """A row source of left-padded prompts, as `PostRows` of kind "prompt"."""

    def __init__(self, lengths, width, pad=0):
        self.lengths = np.asarray(lengths)
        self.width, self.pad = width, pad
        self.num_rows = len(lengths)

    def take(self, indices):
        out = np.full((len(indices), self.width), self.pad, np.int32)
        for i, r in enumerate(indices):
            n = self.lengths[r]
            out[i, self.width - n :] = 1 + (r * 7 + np.arange(n)) % 50
        return {
            "prompt": out,
            "prompt_len": self.lengths[indices].astype(np.int32),
            "index": np.asarray(indices, np.int32),
        }


def _skewed(n, width, seed=0):
    """Prompt lengths most of which are short, a few near the width."""
    rng = np.random.default_rng(seed)
    return np.minimum(width, 4 + rng.geometric(1 / 20, n)).astype(np.int64)


def _buckets(n=640, width=256, batch=16, group=16):
    lengths = _skewed(n, width)
    rows = Prompts(lengths, width)
    widths = bucket_widths(width, 4)
    return rows, PromptBuckets(rows, lengths, widths, batch, group=group)


def test_an_epoch_is_a_permutation_grouped_by_width():
    _, pb = _buckets()
    order = pb.epoch_order(0, seed=3, shuffle=True)
    assert np.array_equal(np.sort(order), np.arange(pb.num_rows))
    assert np.array_equal(order, pb.epoch_order(0, seed=3, shuffle=True))
    assert not np.array_equal(order, pb.epoch_order(1, seed=3, shuffle=True))
    assert np.array_equal(pb.epoch_order(0, seed=3, shuffle=False), np.arange(640))
    batches = order.reshape(-1, 16)
    grouped = np.mean([pb.width(b) for b in batches])
    plain = np.random.default_rng([3, 0]).permutation(640).reshape(-1, 16)
    ungrouped = np.mean([pb.width(b) for b in plain])
    assert grouped < 0.7 * ungrouped  # grouping is what makes buckets pay
    assert len({pb.width(b) for b in batches}) >= 2


def test_every_process_cuts_a_batch_to_the_same_width():
    rows, pb = _buckets()
    whole = Loader(pb, 16, seed=1, prefetch=0, process_index=0, process_count=1)
    parts = [
        Loader(pb, 16, seed=1, prefetch=0, process_index=p, process_count=2)
        for p in range(2)
    ]
    seen = set()
    for _, one, a, b in zip(range(40), whole, *parts, strict=False):
        w = one["prompt"].shape[1]
        seen.add(w)
        assert a["prompt"].shape[1] == b["prompt"].shape[1] == w
        assert w >= one["prompt_len"].max()
        assert np.array_equal(np.concatenate([a["index"], b["index"]]), one["index"])
        full = rows.take(one["index"])["prompt"]
        assert np.array_equal(one["prompt"], full[:, -w:])  # only padding was cut
        assert not full[:, :-w].any()
    assert len(seen) >= 2


def test_a_resumed_loader_yields_the_same_batches():
    _, pb = _buckets()
    first = Loader(pb, 16, seed=5, prefetch=0)
    it = iter(first)
    for _ in range(7):
        next(it)
    position = first.position
    expected = [next(it) for _ in range(50)]  # past an epoch's end (40 batches)
    again = Loader(pb, 16, seed=5, prefetch=0, position=position)
    for want, got in zip(expected, iter(again), strict=False):
        assert want["prompt"].shape == got["prompt"].shape
        assert np.array_equal(want["index"], got["index"])


def test_a_rollout_of_a_cut_batch_equals_the_full_width_one():
    """Left padding is never attended to: sampling a batch cut to its width
    gives the completions, rewards and training rows (less the padding) of the
    batch at the full width."""
    config = llama.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = llama.Llama(config, jr.key(0))
    rows = Prompts([5, 9, 3, 12], width=48)
    batch = rows.take(np.arange(4))

    def score(index, tokens, lengths):
        r = (tokens[:, 0] % 3).astype(np.float32) + index
        return r, {"first": r}

    rollout = rollout_lib.Rollout(
        group_size=2, max_new_tokens=6, score=score, reward_names=("first",),
        sampling=data_sampling(),
    )  # fmt: skip
    key = jr.key(7)
    full, _ = rollout_lib.sample_and_score(model, batch, key, rollout)
    cut_batch = dict(batch, prompt=batch["prompt"][:, -16:])
    cut, _ = rollout_lib.sample_and_score(model, cut_batch, key, rollout)
    n = cut["tokens"].shape[1]
    assert n < full["tokens"].shape[1]
    np.testing.assert_array_equal(cut["advantages"], full["advantages"])
    for name in ("tokens", "targets", "completion_mask", "segment_ids", "positions"):
        np.testing.assert_array_equal(cut[name], full[name][:, -n:])


def data_sampling():
    from eqtrain.generate import Sampling

    return Sampling(temperature=1.0)


def test_post_rows_lengths_are_the_prompts(tmp_path):
    """`PostRows.lengths()` (what the job buckets by) equals each prompt row's
    `prompt_len`, read from the store's ends alone."""
    path = tmp_path / "prompts.jsonl"
    texts = ["a" * n for n in (3, 40, 7, 90, 12)]
    path.write_text("".join(f'{{"prompt": "{t}"}}\n' for t in texts))
    rows = data.prepare_post(
        path, data.ByteTokenizer(), kind="prompt", width=128, seq_len=160,
        resolve=lambda cols: {"chat": False}, pad=0, cache_dir=tmp_path / "cache",
    )  # fmt: skip
    taken = rows.take(np.arange(rows.num_rows))
    np.testing.assert_array_equal(rows.lengths(), taken["prompt_len"])
    jax.block_until_ready(jnp.zeros(1))


LONG = [{"prompt": f"{i}+{i % 3}=" + " " * (40 + 13 * i), "answer": str(i + i % 3)}
        for i in range(8)]  # fmt: skip


def _files(root):
    from .test_grpo_job import PROMPTS, REWARDS

    rows = [*PROMPTS, *LONG] * 2
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "grpo_rewards_mod.py").write_text(textwrap.dedent(REWARDS))


@pytest.fixture
def files(tmp_path, monkeypatch):
    _files(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("GRPO_CALLS", str(tmp_path / "calls.jsonl"))
    yield tmp_path
    sys.modules.pop("grpo_rewards_mod", None)


def _sets(root, run, *extra):
    from .test_grpo_job import tiny

    return [*tiny(root, run, *extra), "data.seq_len=160"]  # prompts up to 156


def test_prompt_buckets_reach_the_run(files):
    from eqtrain import config as config_lib
    from eqtrain.job import _build, _rows

    built = _build.build(config_lib.load(None, _sets(files, "run")))
    rows = _rows.train_rows(built)
    assert isinstance(rows, PromptBuckets) and tuple(rows.widths) == (64, 80, 156)
    assert rows.num_rows == 48 and rows.take(np.arange(2))["prompt"].shape == (2, 156)
    one = config_lib.load(None, _sets(files, "run", "task.prompt_buckets=1"))
    assert not isinstance(_rows.train_rows(_build.build(one)), PromptBuckets)


@pytest.mark.slow
def test_bucketed_grpo_resumes_exactly(files):
    """A run whose batches come in two widths: stopped and resumed, it samples
    the same completions and ends with the same weights as a straight one."""
    from eqtrain import config as config_lib, job

    from .test_grpo_job import metrics

    sets = ("checkpoint.every=2", "export.hf=hf", "optim.schedule=constant")

    def run(name, steps):
        config = config_lib.load(None, _sets(files, name, f"loop.steps={steps}", *sets))
        return job.run(config, echo=lambda _: None)

    run("straight", 4)
    run("split", 2)
    run("split", 4)
    straight, split = metrics(files, "straight"), metrics(files, "split")
    keys = ("reward", "completions/mean_length")
    for a, b in zip(straight[2:], split[-2:], strict=True):
        assert a["step"] == b["step"] and [a[k] for k in keys] == [b[k] for k in keys]
    weights = [
        (files / n / "hf" / "model.safetensors").read_bytes()
        for n in ("straight", "split")
    ]
    assert weights[0] == weights[1]
