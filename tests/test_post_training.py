"""Post-training runs end to end: `[task]` and the post-training data formats in a
config, DPO's reference model three ways (a frozen copy, the adapters off, log-probs
precomputed once and stored with the run), SFT's masks, every task key reaching the
run, and bad input refused before compiling."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from eqtrain import ConfigError, config as config_lib, data, hf, job
from eqtrain.job import _build, _model, _reference, _rows
from eqtrain.losses import causal_lm_loss
from eqtrain.models import Llama, LlamaConfig
from eqtrain.post_training import preference

from .test_cli import cli


LOG2 = float(np.log(2.0))


def _pairs(n, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        a, b = rng.integers(0, 50, 2)
        rows.append(
            {
                "prompt": f"Q{i}: {a} plus {b}? ",
                "chosen": f"It is {a + b}.",
                "rejected": rng.choice(["No.", "Ask again later.", f"It is {a}."]),
            }
        )
    return rows


def _chats(n, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        a, b = rng.integers(0, 50, 2)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"{a} plus {b}? ({i})"},
                    {"role": "assistant", "content": f"It is {a + b}."},
                ]
            }
        )
    return rows


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("post")
    return {
        "pairs": _write(root / "pairs.jsonl", _pairs(48)),
        "pairs_eval": _write(root / "pairs_eval.jsonl", _pairs(16, seed=1)),
        "chat": _write(root / "chat.jsonl", _chats(64)),
        "pc": _write(
            root / "pc.jsonl",
            [
                {"prompt": m["messages"][0]["content"], "completion": "ok"}
                for m in _chats(32)
            ],
        ),
    }


def tiny(tmp_path, train, *extra):
    return [
        f"run_dir={tmp_path / 'run'}",
        f"data.train={train}",
        "model.hidden_size=32",
        "model.num_layers=1",
        "data.seq_len=64",
        "data.batch_size=8",
        "loop.steps=2",
        "loop.eval_every=0",
        "checkpoint.every=1",
        "log.progress=none",
        "optim.warmup_steps=0",
        *extra,
    ]


def load(tmp_path, train, *extra):
    return config_lib.load(None, tiny(tmp_path, train, *extra))


def run(config, notes=None):
    say = (lambda s: None) if notes is None else notes.append
    return job.run(config, echo=say)


# -- DPO's reference three ways -----------------------------------------------------
@pytest.mark.parametrize(
    "mode",
    [
        "copy",
        # (test_preference.py checks every mode's first loss in the library, fast)
        pytest.param("precomputed", marks=pytest.mark.slow),
        pytest.param("adapters_off", marks=pytest.mark.slow),
    ],
)
def test_dpo_step_one_is_log_2_in_every_reference_mode(mode, files, tmp_path):
    extra = ["task.kind=dpo", f"task.reference={mode}", "loop.steps=1"]
    extra += [f"data.eval={files['pairs_eval']}", "data.eval_rows=8"]
    if mode == "adapters_off":  # three steps: the adapters move off zero
        extra += ["lora.rank=4", "loop.steps=3", "optim.lr=1e-2"]
    config = load(tmp_path, files["pairs"], *extra)
    result = run(config)
    first = result.fit.history[0]
    assert first["loss"] == pytest.approx(LOG2, abs=1e-6)
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert first["weight"] == 8.0  # pairs, not tokens
    assert "eval/rewards/accuracies" in result.fit.metrics
    out = tmp_path / "run" / "hf"
    if mode == "adapters_off":  # the adapter; the policy alone in PEFT's format
        # once trained, the policy differs from its reference (the base): a
        # reference that kept the adapters on would give margins of exactly 0
        assert abs(result.fit.history[-1]["rewards/margins"]) > 1e-4
        assert abs(result.fit.metrics["eval/rewards/margins"]) > 1e-4
        assert (out / "adapter_config.json").exists()
        return
    # the export is the policy alone: a plain model, loadable as any other
    model, _ = hf.load(out)
    assert isinstance(model, Llama)
    # eqtrain eval/export of the run read the policy (and the stored reference)
    evaluated = job.evaluate_run(tmp_path / "run")
    assert evaluated["step"] == 1 and "eval/rewards/accuracies" in evaluated
    again = job.export_run(tmp_path / "run", tmp_path / "again")
    for x, y in zip(
        jax.tree.leaves(hf.load(again)[0]), jax.tree.leaves(model), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _params(state):
    return [
        np.asarray(x) for x in jax.tree.leaves(eqx.filter(state.params, eqx.is_array))
    ]


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_precomputed_reference_equals_the_copy_and_survives_resume(files, tmp_path):
    """The stored log-probs are the initial model's (to 1e-5 of a direct pass);
    a resumed run reads them back, a damaged file is recomputed from the rebuilt
    initial model, and the resumed run ends bit-identical to an uninterrupted
    one (constant schedule: the step count does not move the LR)."""
    extra = [
        "task.kind=dpo",
        "task.reference=precomputed",
        "optim.schedule=constant",
        "optim.lr=1e-3",
        "data.shuffle=false",
    ]
    whole = load(tmp_path / "a", files["pairs"], *extra, "loop.steps=6")
    notes = []
    uninterrupted = run(whole, notes)
    assert any("computing the reference log-probs of 48 pairs" in n for n in notes)
    stored = tmp_path / "a" / "run" / "reference" / "train.safetensors"
    from safetensors.numpy import load_file

    values = load_file(stored)
    built = _build.build(whole)
    rows = _rows.train_rows(built)
    initial = _model.new_model(built)
    chosen, rejected = jax.jit(preference.pair_logprobs)(
        initial, {k: rows[k] for k in _reference.PAIR_KEYS}
    )
    np.testing.assert_allclose(values["reference_chosen"], chosen, rtol=1e-5)
    np.testing.assert_allclose(values["reference_rejected"], rejected, rtol=1e-5)
    # The copy mode computes the same reference inside its step: same first loss.
    copy = run(load(tmp_path / "c", files["pairs"], *extra[:1], *extra[2:]))
    np.testing.assert_allclose(
        copy.fit.history[0]["loss"], uninterrupted.fit.history[0]["loss"], rtol=1e-6
    )

    # (a resume that reads the file back: test_..._survives_a_kill_and_resume)
    b = tmp_path / "b"
    run(load(b, files["pairs"], *extra, "loop.steps=4"))
    damaged = b / "run" / "reference" / "train.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:-7])
    notes = []
    resumed = run(load(b, files["pairs"], *extra, "loop.steps=6"), notes)
    assert any("computing" in n for n in notes), notes
    assert resumed.resumed_from == 4
    for x, y in zip(
        _params(resumed.fit.state), _params(uninterrupted.fit.state), strict=True
    ):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow  # default-suite time: ..._survives_resume reads it back by default
def test_precomputed_reference_is_read_back_or_recomputed(files, tmp_path):
    """The default suite's variant of the slow kill and damage tests: a resumed
    run reads the stored log-probs back (nothing computed); a damaged file is
    recomputed to the same values; a changed data file is recomputed for its
    new rows."""
    from safetensors.numpy import load_file

    pairs = _write(tmp_path / "pairs.jsonl", _pairs(24))
    extra = ["task.kind=dpo", "task.reference=precomputed", "data.shuffle=false"]
    extra += ["optim.schedule=constant", "checkpoint.every=1"]

    def again(steps, **how):
        notes = []
        config = load(tmp_path, pairs, *extra, f"loop.steps={steps}")
        result = job.run(config, echo=notes.append, **how)
        return result, any("computing the reference" in n for n in notes)

    assert again(1)[1]
    stored = tmp_path / "run" / "reference" / "train.safetensors"
    first = load_file(stored)
    result, computed = again(2)
    assert result.resumed_from == 1 and not computed  # read back
    stored.write_bytes(stored.read_bytes()[:-7])
    result, computed = again(3)
    assert result.resumed_from == 2 and computed  # damaged: recomputed
    for name, value in load_file(stored).items():
        np.testing.assert_array_equal(value, first[name])
    _write(pairs, _pairs(24, seed=5))  # the data changed under the run
    result, computed = again(1, resume="never", overwrite=True)
    assert computed
    assert not np.array_equal(
        load_file(stored)["reference_chosen"], first["reference_chosen"]
    )


def test_a_killed_reference_pass_continues_from_its_parts(files, tmp_path, monkeypatch):
    monkeypatch.setattr(_reference, "PART_ROWS", 16)  # three parts of 16 pairs
    config = load(
        tmp_path, files["pairs"], "task.kind=dpo", "task.reference=precomputed"
    )
    compute = _reference._part
    calls = []

    def killed(*args):
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process dies during the third part
        calls.append(args[3])
        return compute(*args)

    monkeypatch.setattr(_reference, "_part", killed)
    with pytest.raises(KeyboardInterrupt):
        job.prepare(config, echo=lambda s: None)
    parts = sorted(p.name for p in (tmp_path / "run" / "reference").iterdir())
    assert parts == ["train.part-0.safetensors", "train.part-16.safetensors"]
    calls.clear()
    monkeypatch.setattr(
        _reference, "_part", lambda *a: calls.append(a[3]) or compute(*a)
    )
    prepared = job.prepare(config, echo=lambda s: None)
    prepared.close()
    prepared.fit_kwargs["checkpointer"].close()
    assert calls == [32]  # only the missing part was computed
    assert [p.name for p in (tmp_path / "run" / "reference").iterdir()] == [
        "train.safetensors"
    ]
    batch = prepared.loader.peek()
    assert {"reference_chosen", "reference_rejected"} <= set(batch)


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_orpo_and_simpo_need_no_reference(files, tmp_path):
    for kind in ("orpo", "simpo"):
        config = load(tmp_path / kind, files["pairs"], f"task.kind={kind}")
        result = run(config)
        assert np.isfinite(result.fit.history[-1]["loss"])
        assert "rewards/accuracies" in result.fit.history[-1]
        assert not (tmp_path / kind / "run" / "reference").exists()


# -- SFT ------------------------------------------------------------------------------
def _tiny_model():
    config = LlamaConfig(
        vocab_size=259,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return Llama(config, jr.key(0))


def test_sft_loss_ignores_prompt_tokens():
    rows, _ = data.sft_rows(_chats(12), data.ByteTokenizer(), seq_len=48)
    model = _tiny_model()
    batch = {k: jnp.asarray(v) for k, v in rows.items()}
    grad = eqx.filter_jit(
        eqx.filter_value_and_grad(lambda m, b: causal_lm_loss(m, b)[0])
    )
    loss, grads = grad(model, batch)
    # any target where the mask is 0 (prompts, user turns, padding) changes nothing
    noise = np.random.default_rng(0).integers(0, 259, rows["targets"].shape)
    changed = np.where(rows["loss_mask"] > 0, rows["targets"], noise).astype(np.int32)
    assert (changed != rows["targets"]).any()
    loss2, grads2 = grad(model, {**batch, "targets": jnp.asarray(changed)})
    assert float(loss) == float(loss2)
    for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(grads2), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # only assistant answers (and their EOS) are learned
    tok = data.ByteTokenizer()
    learned = rows["targets"][rows["loss_mask"] > 0]
    text = tok.decode(learned[learned != tok.eos_id])
    assert text.startswith("It is ") and "plus" not in text


def test_packed_examples_do_not_see_each_other():
    """A packed row's second example gets the logits it gets alone."""
    tok = data.ByteTokenizer()
    chats = _chats(2)
    packed, _ = data.sft_rows(chats, tok, seq_len=128)
    assert packed["tokens"].shape[0] == 1 and packed["segment_ids"].max() == 2
    alone, _ = data.sft_rows(chats[1:], tok, seq_len=128)
    model = _tiny_model()
    seg = packed["segment_ids"][0]
    with_segments = model(
        jnp.asarray(packed["tokens"][0]), segment_ids=jnp.asarray(seg)
    )
    n = int((seg == 2).sum())
    by_itself = model(jnp.asarray(alone["tokens"][0][:n]))
    np.testing.assert_allclose(
        np.asarray(with_segments)[seg == 2], np.asarray(by_itself), atol=2e-5
    )


@pytest.mark.slow  # the sft.toml example and the chat-template test run SFT jobs
def test_sft_run_trains_on_chat_and_prompt_completion(files, tmp_path):
    result = run(load(tmp_path / "chat", files["chat"], "task.kind=sft"))
    assert result.fit.history[-1]["loss"] > 0
    assert (tmp_path / "chat" / "run" / "hf" / "config.json").exists()
    result = run(load(tmp_path / "pc", files["pc"], "task.kind=sft"))
    assert result.fit.stop_reason.kind == "max_steps"


# -- every key reaches the run --------------------------------------------------------
@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("task.beta", "0.3", {"beta": 0.3}),
        ("task.label_smoothing", "0.2", {"label_smoothing": 0.2}),
        ("task.reference", "precomputed", {"reference": "precomputed"}),
        ("task.orpo_lambda", "0.4", {"orpo_lambda": 0.4}),
        ("task.simpo_gamma", "0.9", {"gamma": 0.9}),
    ],
)
def test_task_keys_reach_the_loss(key, value, expected, files, tmp_path, monkeypatch):
    kind = {"task.orpo_lambda": "orpo", "task.simpo_gamma": "simpo"}.get(key, "dpo")
    seen = {}
    real = preference.preference_loss_fn

    def recorded(kind, **kwargs):
        seen.update(kind=kind, **kwargs)
        return real(kind, **kwargs)

    monkeypatch.setattr(_build.preference, "preference_loss_fn", recorded)
    built = _build.build(
        load(tmp_path, files["pairs"], f"task.kind={kind}", f"{key}={value}")
    )
    assert seen["kind"] == kind
    for name, want in expected.items():
        assert seen[name] == want
    assert built.reference == (seen["reference"] if kind == "dpo" else None)


def test_task_kind_and_data_keys_reach_the_rows(files, tmp_path):
    def rows(train, *extra):
        return _rows.train_rows(_build.build(load(tmp_path, train, *extra)))

    sft = rows(files["chat"], "task.kind=sft")
    assert 0 < sft["loss_mask"].mean() < 0.5  # answers only
    dpo = rows(files["pairs"], "task.kind=dpo")
    assert set(dpo) == {
        f"{s}_{w}"
        for s in ("chosen", "rejected")
        for w in ("tokens", "targets", "mask")
    }
    # data.pack: one chat per row when off
    wide = ("task.kind=sft", "data.seq_len=128")
    assert len(rows(files["chat"], *wide, "data.pack=false")["tokens"]) == 64
    assert len(rows(files["chat"], *wide)["tokens"]) < 40
    # data.format: explicit, and checked against the data
    pc = rows(files["pc"], "task.kind=sft", "data.format=prompt_completion")
    assert pc["loss_mask"].sum() > 0
    with pytest.raises(ConfigError, match="holds 'prompt_completion' data"):
        rows(files["pc"], "task.kind=sft", "data.format=chat")
    # data.max_prompt_len: prompts keep their last tokens
    cut = rows(files["pairs"], "task.kind=dpo", "data.max_prompt_len=4")
    first = int(np.argmax(cut["chosen_mask"][0] > 0))
    assert first == 3  # 4 prompt tokens: targets from position 3 are the answer
    # data.chat_template: a .jinja file renders the chats
    jinja = tmp_path / "t.jinja"
    jinja.write_text(
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    templated = rows(files["chat"], "task.kind=sft", f"data.chat_template={jinja}")
    text = data.ByteTokenizer().decode(templated["tokens"][0][:12])
    assert text.startswith("[user] ")


# -- bad input: one sentence, before compiling -----------------------------------------
@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["task.kind=sft", "data.train=stdlib"], "needs 'chat' data"),
        (["task.beta=0.5"], "does not use it"),
        (["task.kind=orpo", "task.reference=copy"], "`task.reference` is set"),
        (["task.kind=dpo", "task.reference=adapters_off"], "LoRA is off"),
        (["task.kind=dpo", "data.format=chat"], "trains on 'preference' data"),
        (["data.pack=false"], "applies to post-training data"),
        (["task.kind=dpo", "checkpoint.best=eval/rewards/accuracy"], "accuracies"),
    ],
)
def test_bad_task_settings_are_one_sentence(extra, fragment, files, tmp_path):
    with pytest.raises(ConfigError, match=fragment):
        config = load(tmp_path, files["pairs"], *extra)
        job.report(config)


def test_bad_data_files_fail_before_compiling(files, tmp_path):
    with pytest.raises(ConfigError, match="holds 'chat' data"):
        job.report(load(tmp_path, files["chat"], "task.kind=dpo"))
    with pytest.raises(ConfigError, match="reads records from"):
        job.report(load(tmp_path, tmp_path, "task.kind=sft"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(files["pairs"].read_text()[:500] + '\n{"prompt": "x", \n')
    with pytest.raises(ConfigError, match=r"broken.jsonl:\d+ is not valid JSON"):
        job.report(load(tmp_path, broken, "task.kind=dpo"))
    bad = _write(
        tmp_path / "bad.jsonl",
        [{"prompt": "p", "chosen": "same", "rejected": "same"}] * 9
        + [{"prompt": "p", "chosen": "a"}],
    )
    with pytest.raises(
        ConfigError,
        match=r"bad.jsonl\): all 10 rows were skipped: 9 with chosen == rejected",
    ):
        job.report(load(tmp_path, bad, "task.kind=dpo"))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_skipped_rows_are_said_at_the_start(files, tmp_path):
    rows = _pairs(16) + [{"prompt": "p", "chosen": "x", "rejected": "x"}] * 2
    path = _write(tmp_path / "some_bad.jsonl", rows)
    config = load(tmp_path, path, "task.kind=dpo", "loop.steps=1")
    report = job.report(config)
    assert "2 of 18 rows skipped" in report and "of the data" not in report
    # most rows too long for data.seq_len: the note says what to check
    short = load(tmp_path, path, "task.kind=dpo", "data.seq_len=24")
    assert "of the data: check data.seq_len" in job.report(short)
    notes = []
    run(config, notes)
    assert any("data.train (some_bad.jsonl): 2 of 18 rows skipped" in n for n in notes)


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_cli_refuses_a_bad_task_with_one_line(files, tmp_path):
    proc = cli(
        "fit",
        "--set",
        f"run_dir={tmp_path / 'run'}",
        "--set",
        "task.kind=dpo",
        "--set",
        f"data.train={files['chat']}",
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert "chat" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_sft_then_dpo_from_an_hf_directory_keep_its_chat_template(tmp_path):
    """`model.init_from` with a tokenizer and a Jinja chat template: the rows are
    rendered with the model's template, and the exports carry it, so that
    transformers' `apply_chat_template` on the fine-tuned model formats prompts
    exactly as the training data was formatted."""
    transformers = pytest.importorskip("transformers")
    from .test_data_chat import CHATML, build_bpe

    base = tmp_path / "base"
    (tmp_path / "bpe").mkdir()
    tok = data.HFTokenizer.from_file(
        build_bpe(tmp_path / "bpe"), eos="<|im_end|>", pad="<pad>"
    )
    config = LlamaConfig(
        vocab_size=400,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    hf.export(Llama(config, jr.key(0)), config, base, tokenizer=tok, overwrite=True)
    settings = json.loads((base / "tokenizer_config.json").read_text())
    settings["chat_template"] = CHATML
    (base / "tokenizer_config.json").write_text(json.dumps(settings))

    chats = _write(tmp_path / "chat.jsonl", _chats(40))
    sft = config_lib.load(
        None,
        [
            o
            for o in tiny(tmp_path / "sft", chats, "task.kind=sft")
            if not o.startswith("model.")
        ]
        + [f"model.init_from={base}"],
    )
    built = _build.build(sft)
    assert isinstance(built.template, data.JinjaChatTemplate)
    run(sft)
    out = tmp_path / "sft" / "run" / "hf"
    assert (out / "chat_template.jinja").read_text() == CHATML
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    messages = _chats(1)[0]["messages"]
    ids = theirs.apply_chat_template(messages, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    ours, _ = built.template.encode(messages, built.tokenizer)
    assert list(map(int, ids)) == ours.tolist()
    # DPO on the SFT model's export: its template again, and the policy exported
    pairs = [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in _pairs(16)
    ]
    dpo = config_lib.load(
        None,
        [
            o
            for o in tiny(tmp_path / "dpo", _write(tmp_path / "p.jsonl", pairs))
            if not o.startswith("model.")
        ]
        + [f"model.init_from={out}", "task.kind=dpo", "loop.steps=1"],
    )
    result = run(dpo)
    assert result.fit.history[0]["loss"] == pytest.approx(LOG2, abs=1e-6)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dpo/run/hf")
    assert model.config.vocab_size == 400
    assert (tmp_path / "dpo" / "run" / "hf" / "chat_template.jinja").exists()


@pytest.mark.slow  # default: the in-process stop, damage and resume test above
def test_precomputed_reference_survives_a_kill_and_resume(files, tmp_path):
    """`eqtrain fit` with a precomputed reference, SIGKILLed after its reference
    file and a checkpoint are written, then run again: the stored log-probs are
    read back (not recomputed) and the run ends with the same weights as one
    that was never interrupted."""
    import os
    import signal
    import subprocess
    import time

    from safetensors.numpy import load_file

    from .test_cli import EQTRAIN

    def args(run_dir):
        sets = tiny(tmp_path, files["pairs"], "task.kind=dpo", "loop.steps=12")
        sets = [s for s in sets if not s.startswith(("run_dir", "log.progress"))]
        sets += ["task.reference=precomputed", "log.progress=lines"]
        sets += ["checkpoint.every=3", "checkpoint.async_save=false"]
        return [
            *EQTRAIN,
            "fit",
            "--run-dir",
            str(run_dir),
            *[x for s in sets for x in ("--set", s)],
        ]

    # the same run uninterrupted, through the CLI as well: the command applies
    # its CPU settings (eqtrain.cpu.tune_cpu's XLA flags), which change the last bits
    # of a run in this process
    straight = subprocess.run(
        args(tmp_path / "straight"), capture_output=True, text=True, timeout=240
    )
    assert straight.returncode == 0, straight.stderr[-2000:]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        args(killed), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 180
    while not (killed / "checkpoints" / "6").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert "computing the reference" in proc.stderr.read()
    again = subprocess.run(args(killed), capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resumed from" in again.stderr
    assert "computing the reference" not in again.stderr
    ours = load_file(killed / "hf" / "model.safetensors")
    theirs = load_file(tmp_path / "straight" / "hf" / "model.safetensors")
    for name, value in theirs.items():
        np.testing.assert_array_equal(ours[name], value)


def test_changing_the_reference_layout_of_a_run_is_refused_before_work(files, tmp_path):
    """A run trained with a reference copy in its state cannot resume without
    one (or the reverse): one sentence, nothing computed, nothing touched."""
    first = load(tmp_path, files["pairs"], "task.kind=dpo", "loop.steps=1")
    run(first)
    steps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    changed = load(
        tmp_path, files["pairs"], "task.kind=dpo", "task.reference=precomputed"
    )
    with pytest.raises(ConfigError, match="task.reference = 'copy'.*new run dir"):
        run(changed)
    assert not (tmp_path / "run" / "reference").exists()
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == steps
