"""LoRA runs end to end: `[lora]` in a config, adapter-only checkpoints that
reference their base (and refuse a changed one), exact resume, PEFT and merged
exports, `--dry-run` counts, and bad input before compiling."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from eqtrain import checkpoint, config as config_lib, hf, job, lora
from eqtrain.job import _model
from eqtrain.models import Llama, LlamaConfig

from .test_cli import TEXT, cli


BASE = LlamaConfig(
    vocab_size=259,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def write_base(path, seed=0):
    hf.export(Llama(BASE, jr.key(seed)), BASE, path, overwrite=True)
    return path


def write_config(root, extra=""):
    (root / "train").mkdir(exist_ok=True)
    for i in range(2):
        (root / "train" / f"{i}.txt").write_text(TEXT * (i + 1))
    path = root / "lora.toml"
    path.write_text(
        f"""
run_dir = "{root / "run"}"

[model]
init_from = "{root / "base"}"

[lora]
rank = 4
alpha = 8
dropout = 0.1

[data]
train = "{root / "train"}"
eval = "{root / "train"}"
seq_len = 16
batch_size = 8
eval_rows = 16

[optim]
lr = 1e-2
warmup_steps = 1

[loop]
steps = 6
eval_every = 3

[checkpoint]
every = 3

[log]
progress = "none"
"""
        + extra
    )
    return path


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A finished 6-step LoRA run (checkpoints at 3 and 6, adapter export)."""
    root = tmp_path_factory.mktemp("lora")
    write_base(root / "base")
    path = write_config(root, "\n[export]\nmerged = true\n")
    result = job.run(config_lib.load(path), echo=lambda s: None)
    return root, path, result


def test_a_lora_run_trains_only_the_adapters(lora_run):
    root, _, result = lora_run
    state = result.fit.state
    base, _ = hf.load(root / "base")
    trained = lora.adapter_paths(state.model)
    assert len(trained) == 7
    # the frozen base comes out bit-identical; the adapters moved
    plain = lora.unwrap(jax.device_get(state.model))
    for x, y in zip(jax.tree.leaves(plain), jax.tree.leaves(base), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert np.any(np.asarray(state.model.layers.mlp.up_proj.lora_b))
    losses = [h["loss"] for h in result.fit.history if "loss" in h]
    assert losses[-1] < losses[0]


def test_checkpoints_hold_only_what_changes_and_name_their_base(lora_run):
    root, _, _ = lora_run
    manifest = checkpoint.read_manifest(root / "run", step=6)
    model_leaves = [k for k in manifest["leaves"] if k.startswith("model.")]
    assert model_leaves and all(lora.is_adapter_path(k) for k in model_leaves)
    moments = [
        k
        for k in manifest["leaves"]
        if k.endswith(".mu.layers.self_attn.q_proj.lora_a")
    ]
    assert len(moments) == 1  # AdamW state for the adapters
    assert not any(k.endswith("q_proj.weight") for k in manifest["leaves"])
    base = manifest["base"]
    assert base["path"] == str(root / "base")
    assert base["sha256"] == hf.content_hash(root / "base")["sha256"]
    assert set(base["files"]) == {"model.safetensors"}


def test_exports_are_a_peft_adapter_and_a_merged_model(lora_run):
    root, _, result = lora_run
    adapter = root / "run" / "hf"
    assert sorted(os.listdir(adapter)) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert settings["r"] == 4 and settings["lora_alpha"] == 8
    assert settings["peft_type"] == "LORA"
    # the merged export is the adapted model as a plain HF model
    merged, _ = hf.load(root / "run" / "hf-merged")
    tokens = jnp.arange(16) % 259
    ours = np.asarray(result.fit.state.model(tokens))
    np.testing.assert_allclose(np.asarray(merged(tokens)), ours, atol=1e-5)
    # the adapter file re-applied to the base gives the same model
    base, _ = hf.load(root / "base")
    again = hf.load_adapter(base, adapter)
    np.testing.assert_allclose(np.asarray(again(tokens)), ours, atol=1e-6)


@pytest.mark.tuned  # re-run under each CPU setting (test_tuned_settings.py)
def test_resume_is_exact_and_rereads_the_base(lora_run, tmp_path):
    """Continue the finished run's step-3 checkpoint to step 6, from a copy of the
    base at another path (the checkpoint names its base by content): the same
    state as the uninterrupted run, bit for bit."""
    root, path, result = lora_run
    shutil.copytree(root / "base", tmp_path / "base")
    shutil.copytree(root / "run", tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "6")
    config = config_lib.load(
        path,
        [
            f"run_dir={tmp_path / 'run'}",
            f"model.init_from={tmp_path / 'base'}",
            "export.hf=",
        ],
    )
    resumed = job.run(config, echo=lambda s: None)
    assert resumed.resumed_from == 3
    ours = jax.device_get(eqx_arrays(resumed.fit.state))
    theirs = jax.device_get(eqx_arrays(result.fit.state))
    for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def eqx_arrays(state):
    import equinox as eqx

    state = eqx.tree_at(lambda s: s.key, state, jax.random.key_data(state.key))
    return eqx.filter(state, eqx.is_array)


def test_a_changed_base_is_refused_and_nothing_is_lost(tmp_path):
    write_base(tmp_path / "base")
    path = write_config(tmp_path, '\n[export]\nhf = ""\n')
    job.run(config_lib.load(path, ["loop.steps=3"]), echo=lambda s: None)
    before = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
    write_base(tmp_path / "base", seed=1)  # other weights under the same path
    with pytest.raises(checkpoint.BaseChangedError) as info:
        job.run(config_lib.load(path, ["loop.steps=6"]), echo=lambda s: None)
    message = str(info.value)
    assert "was trained on the base" in message and str(tmp_path / "base") in message
    assert "content changed" in message
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == before
    assert checkpoint.list_steps(tmp_path / "run") == [3]


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_adapter_from_continues_a_peft_adapter(lora_run, tmp_path):
    root, path, result = lora_run
    config = config_lib.load(
        path,
        [
            f"run_dir={tmp_path / 'next'}",
            f"model.adapter_from={root / 'run' / 'hf'}",
            "lora.rank=0",  # the adapter decides
            "lora.alpha=",
            "lora.dropout=0",
            "loop.steps=2",
            "export.hf=",
        ],
    )
    built = job.build(config)
    start = _model.new_model(built)
    tokens = jnp.arange(16) % 259
    ours = np.asarray(result.fit.state.model(tokens))
    np.testing.assert_allclose(np.asarray(start(tokens)), ours, atol=1e-6)
    assert built.lora.rank == 4 and built.lora.scale == 2.0
    job.run(config, echo=lambda s: None)


def test_lora_keys_reach_the_run(lora_run, tmp_path):
    _, path, _ = lora_run
    from eqtrain.job import _preflight

    built = job.build(
        config_lib.load(
            path,
            [
                "lora.rank=2",
                "lora.alpha=3",
                "lora.dropout=0.25",
                "lora.rslora=true",
                r"lora.targets=self_attn\.[qv]_proj$",
                "lora.train_also=^norm",
                "export.adapter=false",
                "export.merged=true",
            ],
        )
    )
    abstract = built.abstract
    model = abstract.model
    assert lora.adapter_paths(model) == [
        "layers.self_attn.q_proj",
        "layers.self_attn.v_proj",
    ]
    q = model.layers.self_attn.q_proj
    assert q.lora_a.shape == (2, 2, 32) and q.dropout == 0.25
    assert q.scale == pytest.approx(3 / 2**0.5)  # rsLoRA
    assert abstract.trainable.norm.weight and not abstract.trainable.embed_tokens.weight
    run_dir = tmp_path / "run"
    assert _preflight.export_targets(built.config, run_dir) == {
        "merged": run_dir / "hf"
    }
    both = config_lib.load(path, ["export.merged=true"])
    assert _preflight.export_targets(both, run_dir) == {
        "adapter": run_dir / "hf",
        "merged": run_dir / "hf-merged",
    }
    off = ["lora.rank=0", "lora.alpha=", "lora.dropout=0", "export.merged=false"]
    none = job.build(config_lib.load(path, off))
    assert none.lora is None and not lora.adapter_paths(none.abstract.model)


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_dry_run_shows_trainable_and_frozen(lora_run):
    _, path, _ = lora_run
    text = job.report(config_lib.load(path))
    assert "lora         rank 4, scale 2" in text
    line = next(t for t in text.splitlines() if t.startswith("trainable"))
    assert "%); frozen" in line
    assert "saved" in next(t for t in text.splitlines() if t.startswith("opt. state"))


@pytest.mark.parametrize(
    "sets,fragments",
    [
        (["lora.targets=nothing_here"], ["[lora]", "matches none", "q_proj"]),
        (["lora.rank=20"], ["[lora]", "rank` 20 exceeds", "k_proj", "16 x 32"]),
        (["lora.train_also=nope"], ["train_also", "matches no parameter"]),
        (["lora.rank=0", "lora.alpha=4"], ["`lora.alpha` is set", "lora.rank"]),
        (["model.init_from=", "model.adapter_from=x"], ["model.init_from"]),
        (["lora.targets=("], ["lora.targets", "not a valid regex"]),
    ],
)
def test_bad_lora_settings_fail_before_compiling(lora_run, sets, fragments):
    _, path, _ = lora_run
    with pytest.raises(config_lib_error()) as info:
        job.build(config_lib.load(path, sets))
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def config_lib_error():
    from eqtrain import ConfigError

    return ConfigError


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_cli_export_adapter_and_merged(lora_run, tmp_path):
    root, _, _ = lora_run
    from eqtrain.cli._info import format_info

    info = format_info(job.run_info(root / "run"))
    assert "(2 layers, hidden 32, vocab 259)" in info  # init_from's architecture
    assert "lora:         rank 4" in info
    job.export_run(root / "run", tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    cli("export", root / "run", tmp_path / "merged", "--merged", check_rc=0)
    a, _ = hf.load(tmp_path / "merged")
    b, _ = hf.load(root / "run" / "hf-merged")
    # the command runs with Eigen's dots (`eqtrain.cpu.tune_cpu`), this process with
    # XLA's default ones: `B @ A` of the merge may round differently in the last bit
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-8)


def test_import_with_lora_points_at_init_from(lora_run, tmp_path):
    root, _, _ = lora_run
    from eqtrain import ConfigError

    config = config_lib.load(None, ["lora.rank=4"])
    with pytest.raises(ConfigError, match="model.init_from"):
        job.import_hf(root / "base", tmp_path / "imported", config=config)
    assert not (tmp_path / "imported").exists()
