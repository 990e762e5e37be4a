"""Distillation (`eqtrain.post_training.distill`, `task.kind = "distill"`): the
loss and its gradients against TRL's own `GKDTrainer.generalized_jsd_loss`, the
on-policy steps, the teacher's checks, a LoRA student and a run through
`eqtrain fit`."""

import dataclasses
import json
import os
import textwrap
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

from eqtrain import ConfigError, TrainState, config as config_lib, hf, lora, train_step
from eqtrain.data import ByteTokenizer
from eqtrain.models import Llama, LlamaConfig
from eqtrain.post_training import distill

from .test_cli import inproc


os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
torch = pytest.importorskip("torch")
GKDTrainer = pytest.importorskip("trl.experimental.gkd").GKDTrainer

V = 259  # the byte tokenizer's ids
CFG = LlamaConfig(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def trl_loss(student_logits, teacher_logits, mask, *, beta, temperature=1.0):
    """TRL's loss and its gradient w.r.t. the student's logits (labels -100
    where `mask` is 0)."""
    s = torch.tensor(np.asarray(student_logits, np.float32), requires_grad=True)
    labels = torch.where(torch.tensor(np.asarray(mask)) > 0, 1, -100)
    loss = GKDTrainer.generalized_jsd_loss(
        s,
        torch.tensor(np.asarray(teacher_logits, np.float32)),
        labels=labels,
        beta=beta,
        temperature=temperature,
    )
    loss.backward()
    return loss.item(), s.grad.numpy()


def _peaked(model, scale=8.0):
    """`model` with its head scaled: sharp distributions, a teacher worth
    learning from."""
    return eqx.tree_at(lambda m: m.lm_head.weight, model, model.lm_head.weight * scale)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_loss_and_gradients_equal_trl(beta):
    """Plain logits and the chunked path (from hidden states and head
    matrices) against TRL, temperature 0.7, with masked tokens."""
    rng = np.random.default_rng(0)
    rows, seq, d, vocab = 2, 6, 8, 23
    hs = rng.normal(size=(rows * seq, d)).astype(np.float32)
    ws = rng.normal(size=(vocab, d)).astype(np.float32)
    ht = rng.normal(size=(rows * seq, 5)).astype(np.float32)
    wt = 2 * rng.normal(size=(vocab, 5)).astype(np.float32)
    mask = np.ones((rows, seq), np.float32)
    mask[0, :2] = 0
    mask[1, 5] = 0
    zs, zt = (hs @ ws.T).reshape(rows, seq, vocab), (ht @ wt.T).reshape(rows, seq, -1)
    hs, ws, ht, wt, zt = map(jnp.asarray, (hs, ws, ht, wt, zt))
    want, want_grad = trl_loss(zs, zt, mask, beta=beta, temperature=0.7)

    plain = lambda z: distill.generalized_jsd(z, zt, mask, beta=beta, temperature=0.7)
    got, grad = jax.value_and_grad(plain)(jnp.asarray(zs))
    assert abs(float(got) - want) <= 1e-5
    np.testing.assert_allclose(grad, want_grad, atol=1e-5)

    def chunked(h, w):
        total = distill.chunked_divergence(
            h, w, ht, wt, mask.reshape(-1), chunk=5, beta=beta, temperature=0.7
        )
        return total / mask.sum()

    got, (dh, dw) = jax.value_and_grad(chunked, argnums=(0, 1))(hs, ws)
    assert abs(float(got) - want) <= 1e-5
    g = want_grad.reshape(rows * seq, vocab)  # d loss / d logits, back to h and w
    np.testing.assert_allclose(dh, g @ ws, atol=1e-5)
    np.testing.assert_allclose(dw, g.T @ hs, atol=1e-5)


def _models():
    student = Llama(CFG, jr.key(0))
    teacher = _peaked(Llama(CFG, jr.key(1)))
    return student, teacher


def _batch(rows=4, seq=16):
    """SFT rows: prompts of 3 to 6 tokens, then completions, then padding."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, 255, size=(rows, seq + 1)).astype(np.int32)
    mask = np.zeros((rows, seq), np.float32)
    for r in range(rows):
        p, n = 3 + r, 5 + r
        mask[r, p - 1 : p - 1 + n] = 1
        tokens[r, p + n :] = 0
    seg = np.arange(seq)[None] < (np.argmax(tokens[:, 1:] == 0, axis=1))[:, None] + 1
    return {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "loss_mask": mask,
        "segment_ids": seg.astype(np.int32),
    }


def _logits(model, tokens, seg):
    return jax.vmap(lambda t, s: model(t, segment_ids=s))(tokens, seg)


def test_loss_fn_on_models_equals_trl_plain_and_chunked():
    student, teacher = _models()
    model = distill.with_teacher(student, teacher)
    batch = _batch()
    zs = _logits(student, batch["tokens"], batch["segment_ids"])
    zt = _logits(teacher, batch["tokens"], batch["segment_ids"])
    want, _ = trl_loss(zs, zt, batch["loss_mask"], beta=0.5)
    for chunk in (None, 7):
        loss_fn = eqx.filter_jit(distill.distill_loss_fn(beta=0.5, chunk=chunk))
        loss, aux = loss_fn(model, batch)
        assert abs(float(loss) - want) <= 1e-5, chunk
        assert float(aux["weight"]) == batch["loss_mask"].sum()
    # no gradient reaches the teacher
    loss_fn = distill.distill_loss_fn(chunk=7)
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: loss_fn(m, batch)[0]))(model)
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(grads.teacher))
    assert float(jnp.abs(grads.student.lm_head.weight).max()) > 0


def _state(model, trainable=True, optimizer=None):
    return TrainState.create(
        model,
        optimizer or optax.sgd(0.5),
        key=0,
        trainable=distill.teacher_trainable(model, trainable),
    )


@pytest.mark.parametrize("lmbda", [0.0, 1.0])
def test_on_policy_steps(lmbda):
    """lmbda = 1: the step trains on completions sampled from the student, and
    its loss is TRL's on those rows; lmbda = 0: on the data's rows."""
    student, teacher = _models()
    model = distill.with_teacher(student, teacher)
    on = distill.OnPolicy(lmbda=lmbda, max_new_tokens=6, stop_ids=(258,))
    loss_fn = distill.distill_loss_fn(beta=0.5)
    step = jax.jit(distill.distill_step(train_step(loss_fn, optax.sgd(0.5)), on))
    state, batch = _state(model), _batch()
    _, metrics = step(state, batch)
    rows, source = distill.distill_batch(model, batch, jr.split(state.key)[1], on)
    assert int(source) == int(lmbda) == float(metrics["on_policy"])
    zs = _logits(student, rows["tokens"], rows["segment_ids"])
    zt = _logits(teacher, rows["tokens"], rows["segment_ids"])
    want, _ = trl_loss(zs, zt, rows["loss_mask"], beta=0.5)
    assert abs(float(metrics["loss"]) - want) <= 1e-5
    data = {k: np.asarray(v) for k, v in batch.items()}
    got = {k: np.asarray(v) for k, v in rows.items()}
    if lmbda == 0:
        for k in data:
            np.testing.assert_array_equal(got[k], data[k])
        return
    # each row keeps its prompt; the mask covers the new completion only
    for r in range(4):
        p = 3 + r
        np.testing.assert_array_equal(got["tokens"][r, :p], data["tokens"][r, :p])
        n = int(got["loss_mask"][r].sum())
        assert 1 <= n <= 6 and got["loss_mask"][r, p - 1 : p - 1 + n].all()


def test_seq_kd_steps_sample_from_the_teacher():
    """task.seq_kd: the steps that are not on-policy (all of them at lmbda = 0)
    train on completions the teacher sampled, and the loss is TRL's on them; the
    job passes the key on."""
    from eqtrain.job import _distill

    student, teacher = _models()
    model = distill.with_teacher(student, teacher)
    on = distill.OnPolicy(lmbda=0.0, seq_kd=True, max_new_tokens=6, stop_ids=(258,))
    loss_fn = distill.distill_loss_fn(beta=0.5)
    step = jax.jit(distill.distill_step(train_step(loss_fn, optax.sgd(0.5)), on))
    state, batch = _state(model), _batch()
    _, metrics = step(state, batch)
    assert float(metrics["on_policy"]) == 0 and float(metrics["teacher_sampled"]) == 1
    rows, _ = distill.distill_batch(model, batch, jr.split(state.key)[1], on)
    assert not np.array_equal(np.asarray(rows["tokens"]), np.asarray(batch["tokens"]))
    zs = _logits(student, rows["tokens"], rows["segment_ids"])
    zt = _logits(teacher, rows["tokens"], rows["segment_ids"])
    want, _ = trl_loss(zs, zt, rows["loss_mask"], beta=0.5)
    assert abs(float(metrics["loss"]) - want) <= 1e-5
    task = dataclasses.replace(config_lib.load(None, []).task, lmbda=0.0, seq_kd=True)
    job = types.SimpleNamespace(
        config=types.SimpleNamespace(
            task=task, model=types.SimpleNamespace(init_from=None)
        ),
        tokenizer=ByteTokenizer(),
        vocab_size=None,
    )
    assert _distill.on_policy(job).seq_kd is True


def test_sampled_rows_from_prompts():
    """`prompts_of` right-aligns each row's prompt; `completion_rows` puts it
    back at position 0 with the completion after it."""
    batch = _batch()
    prompt, length = distill.prompts_of(
        jnp.asarray(batch["tokens"]), jnp.asarray(batch["loss_mask"])
    )
    np.testing.assert_array_equal(length, [3, 4, 5, 6])
    np.testing.assert_array_equal(prompt[1, -4:], batch["tokens"][1, :4])
    completion = jnp.full((4, 3), 7, jnp.int32)
    rows = distill.completion_rows(
        prompt, length, completion, jnp.array([3, 2, 1, 3]), 16
    )
    np.testing.assert_array_equal(
        rows["tokens"][1, :7], [*batch["tokens"][1, :4], 7, 7, 0]
    )
    np.testing.assert_array_equal(rows["loss_mask"][1, :7], [0, 0, 0, 1, 1, 0, 0])
    np.testing.assert_array_equal(rows["targets"][1, 3:6], [7, 7, 0])


def test_vocab_mismatch_is_refused():
    student = Llama(CFG, jr.key(0))
    other = Llama(dataclasses.replace(CFG, vocab_size=300), jr.key(1))
    with pytest.raises(ConfigError, match="300 tokens and the student's 259"):
        distill.with_teacher(student, other)
    with pytest.raises(ConfigError, match=r"`beta` must be in \[0, 1\]"):
        distill.distill_loss_fn(beta=1.5)
    with pytest.raises(ConfigError, match="WithTeacher"):
        distill.distill_loss_fn()(student, _batch())


def test_lora_student():
    """Only the student's adapters train; the teacher and the base stay."""
    student, teacher = _models()
    student = lora.apply(student, lora.LoRA(rank=2), key=jr.key(2))
    model = distill.with_teacher(student, teacher)
    state = _state(model, lora.trainable(student), optax.adam(1e-2))
    step = jax.jit(train_step(distill.distill_loss_fn(chunk=8), optax.adam(1e-2)))
    batch, losses = _batch(), []
    new = state
    for _ in range(5):
        new, metrics = step(new, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    before, after = state.model, new.model
    assert eqx.tree_equal(before.teacher, after.teacher)
    w = lambda m: m.student.layers.self_attn.q_proj
    assert eqx.tree_equal(w(before).weight, w(after).weight)
    assert not eqx.tree_equal(w(before).lora_b, w(after).lora_b)


# -- the job ---------------------------------------------------------------------
def _files(root):
    records = [
        {"prompt": f"What is {i} plus {i % 7}?", "completion": f" {i + i % 7}."}
        for i in range(64)
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "eval.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records[:16])
    )
    hf.export(_peaked(Llama(CFG, jr.key(1)), 60.0), CFG, root / "teacher")
    hf.export(_peaked(Llama(CFG, jr.key(5)), 3.0), CFG, root / "other")
    big = dataclasses.replace(CFG, vocab_size=300)
    hf.export(Llama(big, jr.key(1)), big, root / "wide")
    config = root / "distill.toml"
    config.write_text(
        textwrap.dedent(
            f"""
            run_dir = "{root / "run"}"
            [model]
            hidden_size = 32
            num_layers = 1
            [task]
            kind = "distill"
            teacher = "{root / "teacher"}"
            lmbda = 0.5
            max_completion_len = 6
            temperature = 0.9
            [data]
            train = "{root / "train.jsonl"}"
            eval = "{root / "eval.jsonl"}"
            seq_len = 32
            batch_size = 8
            eval_rows = 8
            [optim]
            lr = 3e-2
            warmup_steps = 0
            [loop]
            steps = 12
            eval_every = 0
            [log]
            every = 1
            progress = "none"
            [checkpoint]
            every = 6
            """
        )
    )
    return config


def test_a_distillation_run_through_eqtrain_fit(tmp_path):
    """`eqtrain fit` on a tiny config: the dry run counts the teacher, the
    student's loss falls, some steps are on-policy, the checkpoints hold no
    teacher, and a resume with another teacher (or a wider one) is refused."""
    config = _files(tmp_path)
    dry = inproc("fit", config, "--dry-run", check_rc=0)
    assert "task         distill: teacher llama" in dry.stdout
    assert "frozen; beta 0.5; 0.5 of the steps sampled" in dry.stdout
    inproc("fit", config, check_rc=0)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if "loss" in r and "step" in r]
    losses = [r["loss"] for r in steps]
    assert np.mean(losses[-3:]) < 0.9 * np.mean(losses[:3]), losses  # 12 steps
    assert 0 < sum(r["on_policy"] for r in steps) < len(steps)
    manifest = next((tmp_path / "run" / "checkpoints").glob("*/manifest.json"), None)
    if manifest is not None:  # the stored leaves: the student's only
        text = manifest.read_text()
        assert "model.student." in text and "model.teacher." not in text
    assert (tmp_path / "run" / "hf" / "config.json").exists()  # the student
    other = inproc(
        "fit", config, "--set", f"task.teacher={tmp_path / 'other'}", "--set",
        "loop.steps=14",
    )  # fmt: skip
    assert other.returncode == 2 and "task.teacher" in other.stderr, other.stderr
    assert "Traceback" not in other.stderr
    wide = inproc(
        "fit", config, "--set", f"task.teacher={tmp_path / 'wide'}", "--set",
        f"run_dir={tmp_path / 'run2'}",
    )  # fmt: skip
    assert wide.returncode == 2 and "vocabulary of 300" in wide.stderr, wide.stderr


def test_distill_config_errors(tmp_path):
    from eqtrain import config as config_lib

    base = ["task.kind=distill", "data.train=x.jsonl"]
    with pytest.raises(ConfigError, match="needs a teacher"):
        config_lib.load(None, base)
    with pytest.raises(ConfigError, match="outside"):
        config_lib.load(None, [*base, "task.teacher=t", "task.beta=2"])
    with pytest.raises(ConfigError, match="data.pack"):
        config_lib.load(None, [*base, "task.teacher=t", "data.pack=true"])
    with pytest.raises(ConfigError, match="task.lmbda"):
        config_lib.load(None, ["task.lmbda=0.3"])
