"""Runs that stand on their own (a run started from a Hugging Face directory keeps
that directory's config and tokenizer files, so eval/export/resume work after it
is moved or deleted), and progress lines that keep a log file short."""

import json
import shutil

import jax.random as jr
import pytest

from eqtrain import EqtrainError, checkpoint, config as config_lib, data, hf, job
from eqtrain.models import Llama, LlamaConfig

from .test_cli import TEXT


@pytest.fixture
def base(tmp_path):
    """An HF directory with a BPE tokenizer (tokenizer.json) and a tiny Llama."""
    from .test_data_chat import build_bpe

    (tmp_path / "bpe").mkdir()
    tok = data.HFTokenizer.from_file(build_bpe(tmp_path / "bpe"), eos="</s>")
    config = LlamaConfig(
        vocab_size=400,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    out = tmp_path / "base"
    hf.export(Llama(config, jr.key(0)), config, out, tokenizer=tok)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text(TEXT * 3)
    return out


def _config(tmp_path, base, *extra):
    return config_lib.load(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.init_from={base}",
            f"data.train={tmp_path / 'text'}",
            f"data.eval={tmp_path / 'text'}",
            "data.seq_len=16",
            "data.batch_size=8",
            "data.eval_rows=16",
            "loop.steps=4",
            "loop.eval_every=2",
            "checkpoint.every=2",
            "optim.warmup_steps=1",
            "log.progress=none",
            *extra,
        ],
    )


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_a_run_from_an_hf_directory_stands_on_its_own(tmp_path, base):
    job.run(_config(tmp_path, base), echo=lambda s: None)
    run = tmp_path / "run"
    record = run / "init_from"
    assert {p.name for p in record.iterdir()} >= {"config.json", "tokenizer.json"}
    manifest = checkpoint.read_manifest(run)
    assert manifest["init_from"]["config"] == json.loads(
        (base / "config.json").read_text()
    )
    shutil.move(base, tmp_path / "moved")  # the base directory is gone

    assert job.evaluate_run(run)["step"] == 4
    assert job.evaluate_run(run / "checkpoints" / "2")["step"] == 2
    out = job.export_run(run, tmp_path / "out")
    assert (out / "tokenizer.json").exists()
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 400
    info = job.run_info(run)
    assert info["config"]["model"]["hidden_size"] == 32
    # resuming a full fine-tuning run needs the architecture only
    result = job.run(_config(tmp_path, base, "loop.steps=6"), echo=lambda s: None)
    assert result.resumed_from == 4 and result.fit.state.step == 6
    # the record's copy is what a run reads, even if the base comes back changed
    shutil.move(tmp_path / "moved", base)
    settings = json.loads((base / "config.json").read_text())
    settings["hidden_size"] = 48
    (base / "config.json").write_text(json.dumps(settings))
    assert job.evaluate_run(run)["step"] == 6


def test_a_lora_run_without_its_base_says_so(tmp_path, base):
    job.run(_config(tmp_path, base, "lora.rank=2"), echo=lambda s: None)
    shutil.rmtree(base)
    with pytest.raises(EqtrainError, match="base"):
        job.evaluate_run(tmp_path / "run")


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_progress_in_a_log_file_is_about_twenty_lines(tmp_path, base, capfd):
    config = _config(
        tmp_path, base, "loop.steps=40", "checkpoint.every=0", "loop.eval_every=0"
    )
    config = config_lib.apply_overrides(config, ["log.progress=auto", "export.hf="])
    job.run(config, echo=lambda s: None)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("step ")]
    assert 18 <= len(lines) <= 22, lines
    assert lines[-1].startswith("step 40/40")
    # log.every, when set, sets the period of the lines
    config = config_lib.apply_overrides(config, ["log.every=20", "loop.steps=100"])
    job.run(config, echo=lambda s: None)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("step ")]
    assert [ln.split(" |")[0] for ln in lines] == [
        "step 60/100",
        "step 80/100",
        "step 100/100",
    ]


@pytest.mark.slow  # the default suite's time: `nox -s slow`
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tensor_parallel_with_the_byte_vocabulary_matches_one_device(arch, tmp_path):
    """data=2, fsdp=2, tensor=2 with the byte tokenizer (259 ids, which split
    over no axis): the embedding and head are padded to 260 rows, the padded
    logits masked, the padded rows stay zero, and the run matches the unpadded
    data-parallel one (the same math as one device); the export has 259 rows."""
    import numpy as np
    from safetensors.numpy import load_file

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text(TEXT * 3)
    results = {}
    for name, mesh in (("tp", (2, 2, 2)), ("dp", (8, 1, 1))):
        config = config_lib.load(
            None,
            [
                f"run_dir={tmp_path / name}",
                f"model.arch={arch}",
                f"data.train={tmp_path / 'text'}",
                "model.hidden_size=32",
                "model.num_layers=2",
                "model.num_heads=4",
                "data.seq_len=16",
                "data.batch_size=8",
                "loop.steps=6",
                "loop.eval_every=0",
                "checkpoint.every=0",
                "optim.warmup_steps=1",
                "log.progress=none",
                *(
                    f"mesh.{k}={v}"
                    for k, v in zip(("data", "fsdp", "tensor"), mesh, strict=True)
                ),
            ],
        )
        if name == "tp":
            assert job.build(config).model_config.vocab_size == 260
        results[name] = job.run(config, echo=lambda s: None)
    tp, dp = results["tp"].fit, results["dp"].fit
    np.testing.assert_allclose(
        [h["loss"] for h in tp.history], [h["loss"] for h in dp.history], rtol=1e-5
    )
    state = tp.state.model
    embed = state.embed_tokens if arch == "llama" else state.wte
    assert embed.weight.shape[0] == 260
    np.testing.assert_array_equal(np.asarray(embed.weight[259:]), 0.0)
    ours = load_file(tmp_path / "tp" / "hf" / "model.safetensors")
    theirs = load_file(tmp_path / "dp" / "hf" / "model.safetensors")
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        assert ours[key].shape == value.shape  # 259 rows, as the tokenizer has
        np.testing.assert_allclose(ours[key], value, atol=1e-4)
    exported = json.loads((tmp_path / "tp" / "hf" / "config.json").read_text())
    assert exported["vocab_size"] == 259


def test_the_base_is_read_straight_onto_the_mesh(tmp_path, base, monkeypatch):
    """`eqtrain fit` reads `model.init_from` block by block into the shardings of
    the run's mesh (FSDP over 8 devices here), not whole onto one device."""
    from eqtrain.job import _model

    loaded = []
    real = _model.hf.load

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        loaded.append((kwargs.get("shardings"), out[0]))
        return out

    monkeypatch.setattr(_model.hf, "load", recording)
    config = _config(tmp_path, base, "mesh.data=1", "mesh.fsdp=8")
    prepared = job.prepare(config, echo=lambda s: None)
    prepared.close()
    prepared.fit_kwargs["checkpointer"].close()
    ((shardings, model),) = loaded
    assert shardings is not None
    # on the run's mesh, with the sharding the placed state has
    placed = prepared.state.model.embed_tokens.weight.sharding
    assert model.embed_tokens.weight.sharding.mesh.shape == placed.mesh.shape
    assert model.embed_tokens.weight.sharding.spec == placed.spec
    assert len(model.embed_tokens.weight.sharding.device_set) == 8
    reference, _ = real(base)
    import numpy as np

    np.testing.assert_array_equal(
        np.asarray(prepared.state.model.embed_tokens.weight),
        np.asarray(reference.embed_tokens.weight),
    )


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_import_keeps_what_the_model_section_cannot_say(tmp_path):
    """`eqtrain import` of a GPT-2 with exact GELU and per-layer attention scaling
    ([model] has no keys for them): the run keeps the directory's config.json as
    its architecture, so it trains and exports that model, not plain GPT-2."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")

    settings = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=300, n_positions=64)
    variant = transformers.GPT2Config(
        **settings,
        activation_function="gelu",
        scale_attn_by_inverse_layer_idx=True,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(variant).save_pretrained(tmp_path / "g2")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text(TEXT * 3)
    run = job.import_hf(tmp_path / "g2", tmp_path / "run")
    config = config_lib.load(
        run / "config.toml",
        [
            f"data.train={tmp_path / 'text'}",
            "data.eval=none",
            "loop.eval_every=0",
            "data.seq_len=16",
            "data.batch_size=8",
            "loop.steps=2",
            "optim.warmup_steps=1",
            "log.progress=none",
        ],
    )
    result = job.run(config, echo=lambda s: None)
    assert result.resumed_from == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(run / "hf")
    assert exported.config.activation_function == "gelu"
    assert exported.config.scale_attn_by_inverse_layer_idx is True
    assert exported.config.tie_word_embeddings is False
    assert result.fit.state.model.config.activation_function == "gelu"
