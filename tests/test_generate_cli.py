"""`eqtrain generate` on a tiny Hugging Face directory written by transformers
(with a word-level tokenizer and a ChatML template, no downloads) and on a run
directory of a tiny `eqtrain fit`; `generate.stream` against `generate`; and
`[log] samples`, which generates during that fit."""

import dataclasses
import json
import shutil

import jax.random as jr
import numpy as np
import pytest

from eqtrain import job, models
from eqtrain.generate import Sampling, generate, left_pad, stream

from .test_cli import assert_clean_error, inproc, write_tiny_config


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}"
    "<|im_end|> {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant "
    "{% endif %}"
)
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_end|>", "<|im_start|>", "<unk>"]
WORDS = "hello world the quick brown fox jumps over lazy dog user assistant".split()


def write_tokenizer(directory, *, template=True):
    """A word-level tokenizer.json of 6 specials and 12 words (ids < 101, the
    tiny model's vocabulary), and its tokenizer_config.json."""
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>"}
    config |= {"eos_token": "</s>", "pad_token": "<pad>"}
    if template:
        config["chat_template"] = CHATML
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """transformers' tiny Llama (vocabulary 101) with the tokenizer above and a
    generation_config.json naming two EOS ids."""
    pytest.importorskip("transformers")
    from . import _hf_families as F

    path = tmp_path_factory.mktemp("hf") / "llama"
    F.save("llama", path)
    write_tokenizer(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


NEW = ["--max-new-tokens", "6"]  # one length throughout: fewer compilations


def test_hf_directory_prompt_file_and_out(hf_dir, tmp_path):
    m = job.open_model(hf_dir)
    assert m.stop_ids == (2, 9)  # the tokenizer's EOS and generation_config's
    done = inproc("generate", hf_dir, "-p", "hello world", *NEW)
    assert done.returncode == 0, done.stderr
    options = job.Options(max_new_tokens=6, stop_ids=m.stop_ids)
    ids = job.prompt_tokens(m, "hello world", chat=False)
    assert ids.tolist() == [1, 6, 7]  # BOS, then the words
    (want,) = job.complete(m, [ids], options)
    assert done.stdout == want.text + "\n"
    out = tmp_path / "out.jsonl"
    done = inproc(*file_args(hf_dir, tmp_path), "--out", out)
    assert done.returncode == 0, done.stderr
    got = read_jsonl(out)
    assert [r["prompt"] for r in got] == ["hello", "the quick fox", "lazy dog"]
    assert [r.get("id") for r in got] == [None, 1, 2]  # other columns copied
    for r in got:
        assert set(r) >= {"prompt", "completion", "tokens", "stop_reason"}
        assert 1 <= r["tokens"] <= 6
        assert r["stop_reason"] == ("length" if r["tokens"] == 6 else "stop")


def file_args(hf_dir, tmp_path):
    """`generate` of a --prompt and a two-line --file, in one batch."""
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "the quick fox", "id": 1}, {"prompt": "lazy dog", "id": 2}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["generate", hf_dir, "--file", prompts, "-p", "hello", *NEW]


@pytest.mark.slow
def test_sampling_is_repeatable_by_seed(hf_dir, tmp_path):
    args = [*file_args(hf_dir, tmp_path), "--temperature", "1", "--top-k", "5"]
    first = inproc(*args, "--seed", "3")
    assert first.returncode == 0, first.stderr
    assert inproc(*args, "--seed", "3").stdout == first.stdout
    assert len(first.stdout.splitlines()) == 3


def test_chat_uses_the_template_and_its_end_of_turn(hf_dir, tmp_path):
    m = job.open_model(hf_dir)
    assert job.chat_stop_ids(m) == (2, 9, 3)  # and <|im_end|>
    messages = [{"role": "user", "content": "hello world"}]
    ids = job.prompt_tokens(m, messages, chat=True)
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(hf_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True
    )
    theirs = theirs if isinstance(theirs, list) else theirs["input_ids"]
    assert ids.tolist() == list(theirs)
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(json.dumps({"messages": messages}) + "\n")
    done = inproc("generate", hf_dir, "--chat", "--file", prompts, *NEW)
    assert done.returncode == 0, done.stderr
    (row,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert row["messages"] == messages and "completion" in row
    # a directory without a template: refused, naming it
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((hf_dir / name).read_bytes())
    write_tokenizer(bare, template=False)
    done = inproc("generate", bare, "--chat", "-p", "hello")
    assert_clean_error(done, "--chat needs a chat template", str(bare))
    (bare / "tokenizer.json").unlink()  # and no tokenizer: bytes do not fit
    done = inproc("generate", bare, "-p", "hello")
    assert_clean_error(done, "has no tokenizer.json", "vocabulary of 101")


# CHATML with a variable of its own before the conversation
LEAD = "{% if lead is defined %}{{ lead }} {% endif %}" + CHATML


def test_chat_template_kwargs_reach_every_prompt_under_a_rows_own(
    hf_dir, tmp_path, monkeypatch
):
    """--chat-template-kwargs gives the chat template its variables in every
    prompt's render, as transformers' apply_chat_template(**kwargs) does; a
    --file line's own chat_template_kwargs win over them."""
    from transformers import AutoTokenizer

    model = tmp_path / "lead"
    shutil.copytree(hf_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = LEAD
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "hello world"}]
    theirs = AutoTokenizer.from_pretrained(model)

    def ids(**kwargs):
        out = theirs.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **kwargs
        )
        return list(out if isinstance(out, list) else out["input_ids"])

    seen = []
    real = job.complete

    def complete(m, prompts, options):
        seen.extend(p.tolist() for p in prompts)
        return real(m, prompts, options)

    monkeypatch.setattr(job, "complete", complete)
    prompts = tmp_path / "chat.jsonl"
    rows = [{"messages": messages}, {"messages": messages}]
    rows[1]["chat_template_kwargs"] = {"lead": "dog"}
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    flag = ["--chat-template-kwargs", '{"lead": "fox"}']
    done = inproc("generate", model, "--chat", "--file", prompts, *flag, *NEW)
    assert done.returncode == 0, done.stderr
    assert seen == [ids(lead="fox"), ids(lead="dog")]
    assert ids(lead="fox") != ids()  # the variable changed the prompt
    # a run's own data.chat_template_kwargs are under the flag's (with_kwargs)
    m = job.open_model(model)
    m = dataclasses.replace(m, template=m.template.with_kwargs({"lead": "the"}))
    given = job.with_template_kwargs(m, {"lead": "fox"})
    assert job.prompt_tokens(given, messages, chat=True).tolist() == ids(lead="fox")
    assert job.with_template_kwargs(m, {}) is m


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--chat", "--chat-template-kwargs", "{ lead"], ["not valid JSON"]),
        (["--chat", "--chat-template-kwargs", "[1]"], ["must be a mapping"]),
        (["--chat", "--chat-template-kwargs", '{"tools": 1}'], ["sets 'tools'"]),
        (["--chat-template-kwargs", "{}"], ["needs --chat"]),
    ],
)
def test_bad_chat_template_kwargs_are_one_paragraph(hf_dir, args, fragments):
    done = inproc("generate", hf_dir, "-p", "hi", *args)
    assert_clean_error(done, "--chat-template-kwargs", *fragments)


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["{missing}", "-p", "hi"], ["is not a directory"]),
        (["{hf}"], ["nothing to complete"]),
        (["{hf}", "-p", "hi", "--temperature", "-1"], ["`temperature` must be"]),
        (["{hf}", "-p", "hi", "--top-p", "0"], ["`top_p` must be"]),
        (["{hf}", "-p", "hi", "--max-new-tokens", "0"], ["--max-new-tokens must"]),
        (["{hf}", "-p", "hi", "--step", "3"], ["drop --step"]),
        (["{hf}", "--file", "{bad}"], ["line 2", '{"prompt": "..."}']),
        (["{hf}", "--file", "{msgs}"], ["needs --chat"]),
    ],
)
def test_bad_input_is_one_paragraph(hf_dir, tmp_path, args, fragments):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n{"text": "no prompt"}\n')
    msgs = tmp_path / "msgs.jsonl"
    msgs.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    names = {"hf": hf_dir, "missing": tmp_path / "nope", "bad": bad, "msgs": msgs}
    done = inproc("generate", *[a.format(**names) for a in args])
    assert_clean_error(done, *fragments)


@pytest.mark.slow
def test_a_prompt_too_long_for_gpt2_is_refused(tmp_path):
    from eqtrain import hf

    config = models.GPT2Config(
        vocab_size=259, n_positions=32, n_embd=16, n_layer=1, n_head=2
    )
    hf.export(models.GPT2(config, jr.key(0)), config, tmp_path / "gpt2")
    done = inproc("generate", tmp_path / "gpt2", "-p", "x" * 20)
    assert_clean_error(done, "more than the model's 32", "n_positions")


@pytest.mark.slow
def test_a_prompt_that_fits_gpt2_exactly_runs(tmp_path):
    from eqtrain import hf

    config = models.GPT2Config(
        vocab_size=259, n_positions=32, n_embd=16, n_layer=1, n_head=2
    )
    hf.export(models.GPT2(config, jr.key(0)), config, tmp_path / "gpt2")
    # BOS + 19 + 12 = 32 fits (the padding is cut to fit the positions)
    done = inproc(
        "generate", tmp_path / "gpt2", "-p", "x" * 19, "--max-new-tokens", "12"
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "sampling",
    [Sampling(0.0), pytest.param(Sampling(1.0, top_k=20), marks=pytest.mark.slow)],
)
def test_stream_equals_generate(sampling):
    config = models.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    model = models.Llama(config, jr.key(1))
    prompt = [3, 17, 9, 40, 2, 33, 5]
    key = jr.key(7)
    tokens, lengths = left_pad([prompt], pad_id=0)
    full = generate(
        model, tokens, lengths, max_new_tokens=20, key=key, sampling=sampling
    )
    whole = np.asarray(full.tokens[0, : int(full.lengths[0])])
    pieces = list(
        stream(model, prompt, max_new_tokens=20, key=key, sampling=sampling, chunk=3)
    )
    assert [len(p) for p in pieces[:2]] == [1, 3]  # the prefill's token, a chunk
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    # a stop id ends both at the same token (included)
    stop = int(whole[5])
    cut = generate(model, tokens, lengths, max_new_tokens=20, key=key,
                   sampling=sampling, stop_ids=(stop,))  # fmt: skip
    pieces = stream(
        model, prompt, max_new_tokens=20, key=key, sampling=sampling,
        stop_ids=(stop,), chunk=3,
    )  # fmt: skip
    got = np.concatenate(list(pieces))
    np.testing.assert_array_equal(got, cut.tokens[0, : int(cut.lengths[0])])
    assert got[-1] == stop and stop not in got[:-1]


@pytest.mark.slow
def test_terminal_output_streams(hf_dir, monkeypatch, capsys):
    from eqtrain.cli import _generate

    monkeypatch.setattr(_generate, "_is_terminal", lambda: True)
    m = job.open_model(hf_dir)
    options = job.Options(max_new_tokens=7, stop_ids=m.stop_ids)
    ids = job.prompt_tokens(m, "the lazy dog", chat=False)
    (want,) = job.complete(m, [ids], options)
    pieces = list(job.stream_text(m, ids, options))
    assert pieces[-1].tokens.tolist() == want.tokens.tolist()
    assert "".join(pieces[:-1]) == want.text
    _generate._print_one(m, ids, options)
    assert capsys.readouterr().out == want.text + "\n"


# -- a run directory, and samples during its training ---------------------------
@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory):
    """The tiny fit of test_cli.py (6 steps, checkpoints at 3 and 6) with
    `[log] samples` every 3 steps and TensorBoard on."""
    pytest.importorskip("tensorboardX")
    root = tmp_path_factory.mktemp("gen")
    (root / "prompts.txt").write_text("def f(x):\n\nclass A\n")
    extra = (
        f'samples = "{root / "prompts.txt"}"\nsamples_every = 3\n'
        "samples_max_new_tokens = 8\ntensorboard = true\n"
    )
    config = write_tiny_config(root, extra)
    done = inproc("fit", config, check_rc=0)
    return root / "run", done


def test_samples_during_training(sampled_run):
    run, _ = sampled_run
    rows = read_jsonl(run / "samples.jsonl")
    assert [(r["step"], r["prompt"]) for r in rows] == [
        (3, "def f(x):"), (3, "class A"), (6, "def f(x):"), (6, "class A"),
    ]  # fmt: skip
    assert all(isinstance(r["completion"], str) for r in rows)
    # the last samples are the final model's greedy completions
    m = job.open_model(run)
    options = job.Options(max_new_tokens=8, stop_ids=m.stop_ids)
    ids = [job.prompt_tokens(m, p, chat=False) for p in ("def f(x):", "class A")]
    assert [c.text for c in job.complete(m, ids, options)] == [
        r["completion"] for r in rows[2:]
    ]
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    events = EventAccumulator(str(run / "tb"), size_guidance={"tensors": 0})
    events.Reload()
    tag = "samples/1/text_summary"  # tensorboardX's name of text "samples/1"
    assert {"samples/0/text_summary", tag} <= set(events.Tags()["tensors"])
    assert [e.step for e in events.Tensors(tag)] == [3, 6]
    text = events.Tensors(tag)[-1].tensor_proto.string_val[0].decode()
    assert "class A" in text and rows[3]["completion"] in text


def test_generate_from_a_run_directory(sampled_run, tmp_path):
    run, _ = sampled_run
    done = inproc("generate", run, "-p", "def f(x):", "--max-new-tokens", "8")
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(run / "samples.jsonl")
    assert done.stdout == rows[2]["completion"] + "\n"
    done = inproc("generate", run, "-p", "def f(x):", "--max-new-tokens", "8",
                  "--step", "3")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == rows[0]["completion"] + "\n"
    # a plain-text run's --chat: eqtrain's built-in template
    m = job.open_model(run)
    ids = job.prompt_tokens(m, "hi", chat=True)
    assert m.tokenizer.decode(ids) == "<|user|>\nhi\n<|assistant|>\n"
    done = inproc("generate", run, "--chat", "-p", "hi", "--max-new-tokens", "8")
    assert done.returncode == 0, done.stderr
    done = inproc("generate", run, "-p", "x", "--step", "4")
    assert_clean_error(done, "no checkpoint of step 4", "3, 6")


def test_a_bad_samples_file_is_refused_before_training(tmp_path):
    (tmp_path / "p.csv").write_text("a,b\n")
    config = write_tiny_config(tmp_path, f'samples = "{tmp_path / "p.csv"}"\n')
    done = inproc("fit", config)
    assert_clean_error(done, "`log.samples`", "must be a .txt or .jsonl")
    done = inproc("fit", config, "--set", f"log.samples={tmp_path / 'none.txt'}")
    assert_clean_error(done, "`log.samples`", "does not exist")


@pytest.mark.slow
def test_dry_run_lists_the_samples(tmp_path):
    (tmp_path / "p.txt").write_text("def f(x):\n")
    config = write_tiny_config(tmp_path, f'samples = "{tmp_path / "p.txt"}"\n')
    done = inproc("fit", config, "--dry-run", check_rc=0)
    assert "samples      1 prompts" in done.stdout
    assert "every 100 steps and at the end" in done.stdout
