"""Nothing lost off the happy path (issue 19): every output target is checked
before training; failed writes, bad files and out-of-memory become one-paragraph
errors (exit 2, no traceback); inputs that used to be silently wrong are refused
or reported. The CLI is called in-process (typer's CliRunner) unless the test is
about the process itself."""

import errno
import json
import os
import warnings

import jax
import jax.random as jr
import pytest
from typer.testing import CliRunner

import eqtrain
import eqtrain.checkpoint
import eqtrain.config
import eqtrain.data
import eqtrain.hf
import eqtrain.job
from eqtrain import ConfigError
from eqtrain.cli import app
from eqtrain.job import _preflight
from eqtrain.models import Llama, LlamaConfig


TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 40


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def assert_clean_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stderr.startswith("error: "), result.stderr
    assert result.stderr.count("\n") == 1, result.stderr  # one paragraph
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


@pytest.fixture
def tiny(tmp_path):
    """A tiny run's config (a few seconds to train) and a writer of variants."""
    (tmp_path / "train.txt").write_text(TEXT)
    base = tmp_path / "tiny.toml"
    base.write_text(
        f"""
run_dir = "{tmp_path / "run"}"

[model]
hidden_size = 16
intermediate_size = 32
num_layers = 1
num_heads = 2

[data]
train = "{tmp_path / "train.txt"}"
eval = "none"
seq_len = 16
batch_size = 8

[optim]
warmup_steps = 1

[loop]
steps = 2
eval_every = 0

[checkpoint]
every = 0
async_save = false

[log]
progress = "none"
"""
    )
    return base


def hf_dir(path, vocab_size=320):
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    eqtrain.hf.export(Llama(config, jr.key(0)), None, path)
    return path


# -- 4. every output target is checked before training --------------------------------
def test_export_into_a_directory_that_is_not_an_export_fails_before_training(tiny):
    run = tiny.parent / "run"
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "notes.txt").write_text("mine")
    result = invoke("fit", tiny)
    assert_clean_error(result, f"{run / 'hf'}", "is not an earlier export", "export.hf")
    assert not (run / "checkpoints").exists()  # nothing trained
    assert (run / "hf" / "notes.txt").read_text() == "mine"


def test_tensorboard_path_that_is_a_file_fails_before_training(tiny):
    run = tiny.parent / "run"
    run.mkdir()
    (run / "tb").write_text("not a directory")
    result = invoke("fit", tiny, "--set", "log.tensorboard=true")
    assert_clean_error(result, f"the TensorBoard directory {run / 'tb'} is a file")
    assert not (run / "checkpoints").exists()


def test_run_dir_under_a_file_fails_before_training(tiny, tmp_path):
    (tmp_path / "afile").write_text("x")
    result = invoke("fit", tiny, "--run-dir", tmp_path / "afile" / "run")
    assert_clean_error(result, f"{tmp_path / 'afile' / 'run'}", "cannot be created")


def test_full_disk_at_start_is_caught_by_the_probe(tiny, monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_preflight, "_fsync", full)
    result = invoke("fit", tiny)
    run = tiny.parent / "run"
    assert_clean_error(result, f"run directory {run}", "No space left on device")
    assert not (run / "config.toml").exists()
    assert [p.name for p in run.iterdir()] == []  # the probe cleaned up


def test_probe_writes_real_bytes(tmp_path, monkeypatch):
    sizes = []
    real = _preflight._fsync

    def spy(fd):
        sizes.append(os.fstat(fd).st_size)
        real(fd)

    monkeypatch.setattr(_preflight, "_fsync", spy)
    config = eqtrain.config.load(None, [f"run_dir={tmp_path / 'r'}", "export.hf="])
    _preflight.check_outputs(config)
    assert sizes and min(sizes) >= 4096


def test_metrics_path_that_is_a_directory_fails_before_training(tiny):
    run = tiny.parent / "run"
    (run / "metrics.jsonl").mkdir(parents=True)
    assert_clean_error(invoke("fit", tiny), f"{run / 'metrics.jsonl'} is a directory")


def test_full_disk_at_the_final_export_is_one_line_naming_the_checkpoint(
    tiny, monkeypatch
):
    from eqtrain.hf import _export

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_export, "_write_weights", full)
    run = tiny.parent / "run"
    result = invoke("fit", tiny)
    assert_clean_error(result, "Hugging Face export", "No space left on device")
    # the final checkpoint is saved before the end hooks (the export among them),
    # and the one-line error names it
    assert eqtrain.checkpoint.list_steps(run) == [2]
    assert f"last complete checkpoint is {run / 'checkpoints' / '2'}" in result.stderr
    assert "No checkpoint" not in result.stderr
    assert not [p for p in run.iterdir() if p.name.startswith(".hf")]  # no temp


def test_write_error_message_names_the_writer():
    e = OSError(errno.EROFS, os.strerror(errno.EROFS))  # write() names no file
    text = eqtrain.job.write_error_message(e, "/runs/x")
    assert text.startswith("writing into /runs/x failed: Read-only file system.")
    assert "No checkpoint of /runs/x" in text
    e = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/x/metrics.jsonl")
    assert "writing /runs/x/metrics.jsonl failed: No space left" in (
        eqtrain.job.write_error_message(e)
    )
    assert eqtrain.job.is_write_error(e)
    assert not eqtrain.job.is_write_error(OSError(errno.ECONNRESET, "reset"))


# -- 5. clear errors everywhere the CLI touches files --------------------------------
@pytest.fixture
def imported(tmp_path):
    """A run directory from `eqtrain import` (a step-0 checkpoint, no training)."""
    hf = hf_dir(tmp_path / "hf_src")
    run = tmp_path / "imported"
    result = invoke("import", hf, run, "--set", "data.seq_len=16")
    assert result.exit_code == 0, result.output
    return run


def test_import_onto_an_existing_file(tmp_path):
    hf = hf_dir(tmp_path / "src")
    (tmp_path / "taken").write_text("x")
    result = invoke("import", hf, tmp_path / "taken")
    assert_clean_error(result, f"{tmp_path / 'taken'} exists and is a file")


def test_import_with_a_relative_out_stores_an_absolute_run_dir(tmp_path, monkeypatch):
    hf = hf_dir(tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    result = invoke("import", hf, "rel/out", "--set", "data.seq_len=16")
    assert result.exit_code == 0, result.output
    written = eqtrain.config.read_toml(tmp_path / "rel" / "out" / "config.toml")
    assert written["run_dir"] == str(tmp_path / "rel" / "out")
    assert str(tmp_path / "rel" / "out") in result.stdout
    # From elsewhere, the config still points at the imported weights.
    monkeypatch.chdir(tmp_path / "src")
    cfg = eqtrain.config.load(tmp_path / "rel" / "out" / "config.toml")
    assert eqtrain.checkpoint.list_steps(cfg.run_dir) == [0]


def test_export_overwrite_onto_a_file_or_foreign_directory(imported, tmp_path):
    (tmp_path / "file").write_text("x")
    result = invoke("export", imported, tmp_path / "file", "--overwrite")
    assert_clean_error(result, "not an export and will not be overwritten")
    assert "pass --overwrite" not in result.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        result = invoke("export", imported, tmp_path / "mine", *extra)
        assert_clean_error(result, "is not an earlier export", "not be overwritten")
        assert "pass overwrite" not in result.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"
    out = tmp_path / "ok"
    assert invoke("export", imported, out).exit_code == 0
    result = invoke("export", imported, out)  # an earlier export: --overwrite helps
    assert_clean_error(result, "holds an earlier export", "--overwrite")


def write_metrics(run, lines):
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")


GOOD = [b'{"step": 1, "loss": 2.0}', b'{"step": 2, "loss": 1.5}']


def test_plot_to_a_directory_writes_plot_png_inside(tmp_path):
    write_metrics(tmp_path / "run", GOOD)
    (tmp_path / "figs").mkdir()
    result = invoke("plot", tmp_path / "run", "-o", tmp_path / "figs")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "figs" / "plot.png").stat().st_size > 0


def test_plot_to_an_unwritable_place(tmp_path, monkeypatch):
    write_metrics(tmp_path / "run", GOOD)
    (tmp_path / "afile").write_text("x")
    result = invoke("plot", tmp_path / "run", "-o", tmp_path / "afile" / "p.png")
    assert_clean_error(result, f"cannot write the plot to {tmp_path / 'afile'}")

    def read_only(figure, out):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(out))

    monkeypatch.setattr(eqtrain.plot, "_write_png", read_only)
    result = invoke("plot", tmp_path / "run")
    assert_clean_error(result, "Read-only file system", "-o/--output")


def test_metrics_with_invalid_utf8(tmp_path, imported):
    write_metrics(tmp_path / "run", [GOOD[0], b'{"step": 2, "loss": "\xff"}', GOOD[1]])
    result = invoke("plot", tmp_path / "run")
    assert_clean_error(result, "metrics.jsonl:2: malformed line", "utf-8")
    # A half-written last line is skipped with a warning, as for bad JSON.
    write_metrics(tmp_path / "run2", [*GOOD, b'{"step": 3, "lo\xc3'])
    with pytest.warns(UserWarning, match="truncated last line"):
        assert [r["step"] for r in eqtrain.plot.read_metrics(tmp_path / "run2")] == [
            1,
            2,
        ]
    # `info` on a run whose metrics file is damaged still describes the run.
    write_metrics(imported, [GOOD[0], b"\xff\xfe", GOOD[1]])
    result = invoke("info", imported)
    assert result.exit_code == 0, result.output
    assert "step        0" in result.stdout


def test_out_of_memory_at_the_first_step_says_what_lowers_it(tiny, monkeypatch):
    from eqtrain.job import _run

    class XlaRuntimeError(RuntimeError):  # jaxlib's class name, as raised by XLA
        pass

    def oom(*args, **kwargs):
        raise XlaRuntimeError(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 12.5GiB."
        )

    monkeypatch.setattr(_run, "fit", oom)
    result = invoke("fit", tiny)
    assert_clean_error(
        result,
        "ran out of device memory (RESOURCE_EXHAUSTED: Out of memory",
        "--dry-run",
        "puts the compiled training step's peak at ",
        "per device",
        "data.batch_size (8)",
        "optim.accumulate (1",
        "model.remat",
        "model.attention_chunk",
        "--memory-budget",
        "loop.precision",
    )
    assert eqtrain.job._preflight.is_out_of_memory(
        jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")
    )
    assert not eqtrain.job._preflight.is_out_of_memory(RuntimeError("Out of memory"))


class XlaRuntimeError(RuntimeError):  # jaxlib's class name, as raised by XLA
    pass


OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 12.5GiB."


class _Poisoned:
    """A result of a step that failed on the device: reading it raises."""

    def __array__(self, *args, **kwargs):
        raise XlaRuntimeError(OOM)


def _failing_step(monkeypatch, *, at, late):
    """The training step fails at call `at`: at once (its dispatch raises), or
    `late` (as on an accelerator: its results carry the error, and so does
    every later dispatch)."""
    call_flat, calls = eqtrain.Jitted.call_flat, []

    def failing(self, arrays, batch):
        calls.append(None)
        if len(calls) == at and not late or len(calls) > at:
            raise XlaRuntimeError(OOM)
        new, metrics = call_flat(self, arrays, batch)
        if len(calls) == at:
            return new, {k: _Poisoned() for k in metrics}
        return new, metrics

    monkeypatch.setattr(eqtrain.Jitted, "call_flat", failing)


def test_out_of_memory_names_the_failed_step_and_the_dry_runs_peak(tiny, monkeypatch):
    dry = invoke("fit", tiny, "--dry-run")
    assert dry.exit_code == 0, dry.output
    peak = next(ln for ln in dry.stdout.splitlines() if ln.strip().startswith("peak"))
    peak = peak.split("peak", 1)[1].strip()
    # The first step fails, but the device says so only when step 2 is dispatched
    # (the other cases: tests/test_loop_end.py).
    _failing_step(monkeypatch, at=1, late=True)
    result = CliRunner().invoke(app, ["fit", str(tiny)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: training ran out of device memory at step 1 (")
    assert f"puts the compiled training step's peak at {peak} per device" in error
    assert "after step 2" not in result.stderr
    assert "ended the run at step 1; the states from that step on" in result.stderr


def test_second_signal_during_the_final_save_says_what_was_saved(tiny, monkeypatch):
    # The note the signal guard writes before it ends the process (the real
    # signals are sent in tests/test_signals.py).
    from eqtrain._fit import _signals
    from eqtrain.job import _run

    notes = []

    def fit(*args, **kwargs):
        notes.append(_signals.active().note())
        raise eqtrain.ConfigError("stopped by the test")

    monkeypatch.setattr(_run, "fit", fit)
    result = CliRunner().invoke(app, ["fit", str(tiny)])
    assert result.exit_code == 2 and _signals.active() is None
    assert "was not completed" in notes[0] and "No checkpoint of" in notes[0]
    assert "eqtrain export" in notes[0] and "--overwrite" in notes[0]


# -- 6. inputs that are silently wrong -------------------------------------------------
def test_jsonl_rows_whose_text_is_null_are_skipped_with_a_warning(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"text": "hello"}, {"text": None}, {"text": 3}, {"text": "world"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    table = eqtrain.data.from_files(path)
    with pytest.warns(UserWarning, match=r"skipped 2 of 4 rows .* \(the first: row 1"):
        texts = eqtrain.data.text_column(table, "text", source=str(path))
    assert "None" not in texts and texts[0] == "hello" and texts[-1] == "world"
    records = [{"text": "a"}, {"text": None}, {"text": 3}]
    with pytest.warns(UserWarning, match=r"skipped 2 of 3 rows"):
        assert eqtrain.data.text_column(records, "text") == ["a"]
    (tmp_path / "n.jsonl").write_text('{"text": null}\n{"text": null}\n')
    with pytest.raises(eqtrain.data.DataError, match="all 2 values are null"):
        eqtrain.data.text_column(eqtrain.data.from_files(tmp_path / "n.jsonl"), "text")


def test_jsonl_null_rows_never_reach_training(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "abc"}\n{"text": null}\n')
    for attempt in ("built", "reused"):  # said again when the store is reused
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store = eqtrain.data.prepare(path, eqtrain.data.ByteTokenizer())
        assert store.num_documents == 1 and store.num_tokens == 4, attempt  # abc EOS
        assert any("skipped 1 of 2 rows" in str(w.message) for w in caught), attempt


def test_hf_model_with_a_large_vocab_and_no_tokenizer_json_is_refused(tmp_path):
    src = hf_dir(tmp_path / "big", vocab_size=32000)
    result = invoke("import", src, tmp_path / "out")
    assert_clean_error(result, "vocabulary of 32000 ids but no tokenizer.json")
    assert not (tmp_path / "out").exists()
    (src / "tokenizer.model").write_bytes(b"sentencepiece")
    result = invoke("import", src, tmp_path / "out")
    assert_clean_error(result, "It holds tokenizer.model", "data.tokenizer")
    # Explicit is fine: the user said what they mean.
    result = invoke(
        "import", src, tmp_path / "out", "--set", "data.tokenizer=byte",
        "--set", "data.seq_len=16",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    # A small vocabulary (an eqtrain byte-level export) still pairs with bytes.
    assert eqtrain.hf.tokenizer_for(hf_dir(tmp_path / "small", 320)) == "byte"


def test_checkpoint_best_typo_is_refused_before_training(tiny):
    result = invoke(
        "fit", tiny, "--set", "checkpoint.best=eval/los", "--set", "data.eval=" +
        str(tiny.parent / "train.txt"), "--set", "loop.eval_every=1",
        "--set", "checkpoint.every=1",
    )  # fmt: skip
    assert_clean_error(result, "is not a metric this run produces", "eval/loss")
    assert not (tiny.parent / "run").exists()


@pytest.mark.parametrize("bad", ["2h30", "1.5.5m", "3s2h"])
def test_time_limit_typos_are_refused(tiny, bad):
    result = invoke("fit", tiny, "--set", f"loop.time_limit={bad}", "--dry-run")
    assert_clean_error(result, "`loop.time_limit`", "expected a duration like")


def test_lr_inf_is_refused(tiny):
    result = invoke("fit", tiny, "--set", "optim.lr=inf", "--dry-run")
    assert_clean_error(result, "`optim.lr` must be a finite number; got inf")


def test_config_must_hold_a_finite_lr():
    with pytest.raises(ConfigError, match="finite"):
        eqtrain.config.from_dict({"optim": {"lr": float("inf")}})


def test_a_template_that_refuses_most_rows_is_named_in_the_too_few_rows_error(
    tmp_path,
):
    # raise_exception on any system message: 36 of 40 chats are refused
    chats = []
    for i in range(40):
        turns = [{"role": "user", "content": f"hi {i}"}]
        if i % 10:
            turns.insert(0, {"role": "system", "content": "be brief"})
        turns.append({"role": "assistant", "content": f"hello {i}"})
        chats.append(json.dumps({"messages": turns}))
    (tmp_path / "chat.jsonl").write_text("\n".join(chats) + "\n")
    (tmp_path / "tpl.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "<|{{ m['role'] }}|>{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}"
        "{% endif %}\n{% endfor %}"
    )
    config = tmp_path / "sft.toml"
    config.write_text(
        f"""run_dir = "{tmp_path / "run"}"
[model]
hidden_size = 32
num_layers = 1
[data]
train = "{tmp_path / "chat.jsonl"}"
eval = "none"
chat_template = "{tmp_path / "tpl.jinja"}"
seq_len = 64
batch_size = 8
[task]
kind = "sft"
[loop]
eval_every = 0
"""
    )
    result = invoke("fit", config)
    assert_clean_error(
        result,
        "has 4 rows of 64 tokens, fewer than one batch",
        "36 of 40 rows skipped: 36 rejected by the chat template (System role not "
        "supported) (first: row 1)",
        "check the data against data.chat_template",
    )
    assert "data.max_prompt_len" not in result.stderr
