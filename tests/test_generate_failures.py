"""`eqtrain generate` when something goes wrong: `--out` is written all or
nothing (a refused prompt, running out of memory or Ctrl-C leave an earlier file
as it was, even --file's own), a missing --out directory is refused before the
model loads, and SIGINT ends a long batch within a moment with one line and
exit 130. Only the Ctrl-C test compiles (in its own process)."""

import json
import os
import signal
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import pytest

from eqtrain import hf, models
from eqtrain.generate import Generation

from .test_cli import assert_clean_error, inproc


OLD = '{"prompt": "an earlier file", "completion": "kept"}\n'


def export_zeros(cls, config, path):
    """A model of `cls` with all-zero weights (no initialisation to run: what
    it generates does not matter here) exported in Hugging Face format (no
    tokenizer.json: the byte tokenizer)."""
    shapes = eqx.filter_eval_shape(cls, config, jr.key(0))
    is_shape = lambda x: isinstance(x, jax.ShapeDtypeStruct)
    zeros = lambda x: np.zeros(x.shape, x.dtype) if is_shape(x) else x
    hf.export(jax.tree.map(zeros, shapes, is_leaf=is_shape), config, path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny byte-level Llama, with room for long completions."""
    config = models.LlamaConfig(
        vocab_size=259, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
    )  # fmt: skip
    return export_zeros(models.Llama, config, tmp_path_factory.mktemp("gen") / "llama")


@pytest.fixture
def prompts(tmp_path):
    """A two-line prompt file, and an earlier --out file beside it."""
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "hello", "id": 1}, {"prompt": "world", "id": 2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "out.jsonl").write_text(OLD)
    return path


def leftovers(directory):
    """Files other than the test's own (a temporary file left behind)."""
    return sorted(p.name for p in directory.iterdir() if p.suffix != ".jsonl")


def test_a_missing_out_directory_is_refused_before_the_model_loads(tmp_path):
    out = tmp_path / "nope" / "x.jsonl"
    # the source does not exist either: only --out is checked before loading it
    done = inproc("generate", tmp_path / "no-model", "-p", "hi", "--out", out)
    assert_clean_error(done, f"--out {out}", "does not exist", "Nothing was generated")
    (tmp_path / "file").write_text("")
    done = inproc("generate", tmp_path / "no-model", "-p", "hi", "--out",
                  tmp_path / "file" / "x.jsonl")  # fmt: skip
    assert_clean_error(done, "is not a directory")


def test_a_refused_prompt_leaves_out_as_it_was(tmp_path, prompts):
    config = models.GPT2Config(
        vocab_size=259, n_positions=32, n_embd=16, n_layer=1, n_head=2
    )
    export_zeros(models.GPT2, config, tmp_path / "gpt2")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x" * 40}) + "\n")
    out = prompts.parent / "out.jsonl"
    done = inproc("generate", tmp_path / "gpt2", "--file", long, "--out", out)
    assert_clean_error(done, "more than the model's 32")
    assert out.read_text() == OLD
    # --out naming --file itself: the prompts survive the refusal
    before = long.read_text()
    done = inproc("generate", tmp_path / "gpt2", "--file", long, "--out", long)
    assert_clean_error(done, "more than the model's 32")
    assert long.read_text() == before
    assert leftovers(tmp_path) == ["gpt2"]


def fake_generate(calls):
    """`eqtrain.generate.generate` without compiling: each row's new tokens are
    its prompt's last token, three times."""

    def generate(model, tokens, lengths, *, max_new_tokens, **kwargs):
        calls.append(len(tokens))
        last = np.asarray(tokens)[:, -1:]
        new = np.repeat(last, 3, axis=1).astype(np.int32)
        lengths = np.full(len(tokens), 3, np.int32)
        return Generation(new, lengths, np.zeros(new.shape, np.float32))

    return generate


def test_out_is_replaced_whole_and_may_be_the_prompt_file(llama, prompts, monkeypatch):
    from eqtrain.job import _generate

    calls = []
    monkeypatch.setattr(_generate, "generate", fake_generate(calls))
    out = prompts.parent / "out.jsonl"
    os.chmod(out, 0o640)
    done = inproc("generate", llama, "--file", prompts, "--out", out)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["id"], r["completion"], r["tokens"]) for r in rows] == [
        (1, "ooo", 3), (2, "ddd", 3),
    ]  # fmt: skip
    assert os.stat(out).st_mode & 0o777 == 0o640  # the file's mode is kept
    done = inproc("generate", llama, "--file", prompts, "--out", prompts)
    assert done.returncode == 0, done.stderr
    assert prompts.read_text() == out.read_text()
    assert leftovers(prompts.parent) == []


def test_out_of_memory_is_one_paragraph_and_out_survives(llama, prompts, monkeypatch):
    from eqtrain.job import _generate

    def exhausted(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.00GiB.\n"
            "BufferAssignment OOM Debugging."
        )

    monkeypatch.setattr(_generate, "generate", exhausted)
    out = prompts.parent / "out.jsonl"
    args = ["--file", prompts, "--out", out, "--batch-size", "2"]
    done = inproc("generate", llama, *args)
    assert_clean_error(
        done, "generation ran out of memory (RESOURCE_EXHAUSTED: Out of memory",
        "--batch-size (now 2)", "--max-new-tokens (now 128)",
    )  # fmt: skip
    assert len(done.stderr.strip().splitlines()) == 1
    assert out.read_text() == OLD
    assert leftovers(prompts.parent) == []


def _guarded(pid):
    """Whether the process has installed a SIGTERM handler (the signal guard:
    Python itself catches SIGINT from the start)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(ln for ln in f if ln.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration):
        return False
    return bool(int(caught, 16) >> (signal.SIGTERM - 1) & 1)


def test_ctrl_c_ends_a_long_batch_at_once(llama, prompts):
    """A real SIGINT to a real `eqtrain generate` in the middle of a batch that
    takes tens of seconds: exit 130 within a moment, one line, --out as it was."""
    out = prompts.parent / "out.jsonl"
    args = ["--file", prompts, "--out", out, "--max-new-tokens", "12000"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "eqtrain.cli", "generate", llama, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not _guarded(proc.pid):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no signal guard after 60 s"
            time.sleep(0.01)
        time.sleep(3)  # importing JAX, loading, compiling, generating (~30 s)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, err
    assert took < 3, took  # the batch alone takes far longer
    assert err.strip() == f"error: interrupted by SIGINT; {out} was left as it was."
    assert out.read_text() == OLD
    assert leftovers(prompts.parent) == []
