"""What identifies a run (issue 52): a finished Llama run resumed with
`--set model.arch=gemma` has the same shapes and must still be refused by name,
before anything is written; `eqtrain import` keeps the model's chat template
(and the EOS it names), and a failed import leaves nothing behind. One tiny run
is trained for the module; the rest compiles nothing."""

import dataclasses
import json
import shutil

import jax.random as jr
import pytest

import eqtrain.checkpoint as ckpt
import eqtrain.config as config_lib
import eqtrain.hf
from eqtrain import ConfigError, job, models
from eqtrain.config import Config, LoRAConfig, ModelConfig
from eqtrain.job import _build, _identity, _import, _resolve

from .test_cli import assert_clean_error, inproc
from .test_generate_cli import CHATML, write_tokenizer


TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A config and its Llama run, trained to its last step (2)."""
    root = tmp_path_factory.mktemp("identity")
    (root / "train.txt").write_text(TEXT)
    config = root / "tiny.toml"
    config.write_text(
        f"""
run_dir = "{root / "run"}"
[model]
hidden_size = 16
intermediate_size = 32
num_layers = 1
num_heads = 2
[data]
train = "{root / "train.txt"}"
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
[export]
hf = ""
"""
    )
    inproc("fit", config, check_rc=0)
    assert ckpt.list_steps(root / "run") == [2]
    return config, root / "run"


@pytest.fixture
def run(trained, tmp_path):
    """A private copy of the trained run, and the `fit` arguments for it."""
    config, original = trained
    copy = tmp_path / "run"
    shutil.copytree(original, copy)
    return copy, ["fit", config, "--run-dir", copy]


def _untouched(run_dir):
    """What a refused resume must leave as it was."""
    files = ("config.toml", "checkpoints/2/manifest/manifest.json")
    return {f: (run_dir / f).read_bytes() for f in files}


# -- 2. what identifies a run ------------------------------------------------------
def test_another_architecture_of_the_same_shapes_is_refused_by_name(run):
    run_dir, fit = run
    before = _untouched(run_dir)
    done = inproc(*fit, "--set", "model.arch=gemma")
    assert_clean_error(done, "model.arch = 'gemma' here, 'llama' there", "--run-dir")
    assert "nothing to do" not in done.stderr
    assert _untouched(run_dir) == before  # config.toml still says llama
    assert not (run_dir / ".lock").exists()
    # `eqtrain eval --set` reads the weights as the config says: refused too,
    # and so is a new run started from this run's checkpoint.
    done = inproc("eval", run_dir, "--set", "model.arch=gemma")
    assert_clean_error(done, "model.arch = 'gemma' here, 'llama' there", "--set")
    other = ["--run-dir", run_dir.parent / "new", "--resume", run_dir / "checkpoints/2"]
    done = inproc(*fit[:2], *other, "--set", "model.norm_eps=0.001")
    assert_clean_error(done, "model.norm_eps = 0.001 here, unset there")
    assert not (run_dir.parent / "new").exists()
    # What only changes how the model computes or trains may change.
    runtime = ["model.scan_layers=false", "model.remat=full", "optim.lr=1e-4"]
    done = inproc(*fit, *(a for s in runtime for a in ("--set", s)))
    assert done.returncode == 0, done.stderr
    assert "nothing to do" in done.stderr


def test_a_manifest_without_an_identity_is_compared_by_its_config(run):
    run_dir, fit = run
    manifest = run_dir / "checkpoints/2/manifest/manifest.json"
    written = json.loads(manifest.read_text())
    assert written["identity"]["model.arch"] == "llama"
    assert written["identity"]["data.tokenizer"] == "byte"
    del written["identity"]  # as written before the identity was recorded
    manifest.write_text(json.dumps(written))
    done = inproc(*fit, "--set", "model.tie_embeddings=false")
    assert_clean_error(done, "model.tie_embeddings = False here, True there")
    done = inproc(*fit, "--set", "loop.steps=2")
    assert done.returncode == 0, done.stderr


def test_the_identity_is_every_model_and_lora_key_but_the_listed_ones():
    config = Config(lora=LoRAConfig(rank=4))
    identity = _identity.of_settings(config_lib.to_dict(config))
    for section, cls in (("model", ModelConfig), ("lora", LoRAConfig)):
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            assert (key in identity) != (key in _identity.NOT_IDENTITY), key
    assert _identity.NOT_IDENTITY <= set(config_lib.schema())  # no stale names
    # The models' runtime options never change an array.
    runtime = models.runtime_options(ModelConfig(scan_layers=False))
    assert {f"model.{k}" for k in runtime} <= _identity.NOT_IDENTITY
    # Without LoRA its keys say nothing; an unset alpha is the rank.
    assert {
        k for k in _identity.of_settings(config_lib.to_dict(Config())) if "lora" in k
    } == {"lora.rank"}
    assert identity["lora.alpha"] == 4


def test_the_tokenizer_is_identified_by_its_content(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_tokenizer(tmp_path / name)
    raw = json.loads((tmp_path / "b" / "tokenizer.json").read_text())
    vocab = raw["model"]["vocab"]
    vocab["fox"], vocab["dog"] = vocab["dog"], vocab["fox"]  # same size, new ids
    (tmp_path / "b" / "tokenizer.json").write_text(json.dumps(raw))

    def identity(directory):
        data = dataclasses.replace(Config().data, tokenizer=str(directory))
        return _identity.of_config(dataclasses.replace(Config(), data=data))

    a, b = identity(tmp_path / "a"), identity(tmp_path / "b")
    assert [k for k, _, _ in _identity.differences(a, b)] == ["data.tokenizer"]
    shutil.copytree(tmp_path / "a", tmp_path / "moved")
    assert _identity.differences(a, identity(tmp_path / "moved")) == []


def test_an_init_from_run_is_identified_by_its_base_config(tmp_path):
    base = hf_dir(tmp_path / "base", tokenizer=True)
    cfg = config_lib.load(None, [f"model.init_from={base}", "data.seq_len=16"])
    built = _build.build(cfg)
    resolved = built.config  # what the manifests' config holds
    identity = _identity.of_config(cfg)  # what a resume compares
    assert identity == _identity.of_config(resolved) == _identity.of_job(built)
    assert identity["model.hidden_size"] == 8
    assert identity["data.tokenizer"].startswith("sha256:")
    assert (
        _identity.differences(
            _identity.of_settings(config_lib.to_dict(resolved)), identity
        )
        == []
    )
    # The same directory with another RoPE base: the same shapes, another model.
    config_json = json.loads((base / "config.json").read_text())
    config_json["rope_theta"] = 500000.0
    config_json.get("rope_parameters", {})["rope_theta"] = 500000.0
    (base / "config.json").write_text(json.dumps(config_json))
    changed = _identity.differences(identity, _identity.of_config(cfg))
    assert [k for k, _, _ in changed] == ["model.rope_theta"]


def hf_dir(path, *, tokenizer=False):
    """A tiny Llama in Hugging Face format (vocabulary 320), with the word-level
    tokenizer and ChatML template of test_generate_cli when asked."""
    config = models.LlamaConfig(
        vocab_size=320,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=32,
    )
    eqtrain.hf.export(models.Llama(config, jr.key(0)), None, path)
    if tokenizer:
        write_tokenizer(path)
    return path


# -- 3. import keeps the chat template; a failed import leaves nothing ----------------
def test_import_keeps_the_chat_template_and_its_end_of_turn(tmp_path):
    src = hf_dir(tmp_path / "src", tokenizer=True)
    out = tmp_path / "imported"
    inproc("import", src, out, "--set", "data.seq_len=16", check_rc=0)
    m = job.open_model(out)
    assert getattr(m.template, "source", None) == CHATML
    assert 3 in job.chat_stop_ids(m)  # <|im_end|>, which the template writes
    # SFT on the run renders conversations with the model's template.
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    cfg = config_lib.load(out / "config.toml", ["task.kind=sft", f"data.train={chat}"])
    assert _resolve.chat_template_of(cfg).source == CHATML
    back = tmp_path / "back"
    inproc("export", out, back, check_rc=0)
    assert (back / "chat_template.jinja").read_text() == CHATML
    assert (
        json.loads((back / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    )


def test_a_failed_import_leaves_nothing(tmp_path, monkeypatch):
    src = hf_dir(tmp_path / "src", tokenizer=True)
    out = tmp_path / "out"
    config = config_lib.load(None, ["data.seq_len=16"])

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(_import, "_save_step_zero", full_disk)
        with pytest.raises(OSError, match="No space"):
            job.import_hf(src, out, config=config)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    job.import_hf(src, out, config=config)  # the retry needs no --overwrite
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with monkeypatch.context() as patch:
        patch.setattr(_import, "_save_step_zero", full_disk)
        with pytest.raises(OSError, match="No space"):
            job.import_hf(src, out, config=config, overwrite=True)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    assert ckpt.list_steps(out) == [0]
    # --overwrite replaces a run, never a directory of someone's files.
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is not a run directory"):
        job.import_hf(src, notes, config=config, overwrite=True)
    assert (notes / "todo.txt").read_text() == "mine"
