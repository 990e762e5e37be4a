"""eqtrain.hf against transformers itself: export -> `from_pretrained`, and
`save_pretrained` -> `eqtrain.hf.load`, comparing logits; bit-exact round trips."""

import dataclasses
import json
import os

import pytest


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import jax.tree_util as jtu  # noqa: E402
import numpy as np  # noqa: E402

from eqtrain import hf  # noqa: E402
from eqtrain._errors import ConfigError  # noqa: E402
from eqtrain.hf import _safetensors  # noqa: E402
from eqtrain.models import GPT2, GPT2Config, Llama, LlamaConfig  # noqa: E402


SEQ = 12
LLAMA = LlamaConfig(
    vocab_size=97,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=100.0,  # large angles at short lengths: a RoPE layout bug shows
    max_position_embeddings=64,
)
GPT2_TINY = GPT2Config(vocab_size=97, n_positions=32, n_embd=16, n_layer=2, n_head=2)

VARIANTS = {
    "llama-mha-untied-bias-theta": (
        "llama",
        dict(num_key_value_heads=None, attention_bias=True, rope_theta=5000.0),
    ),
    "llama-gqa-head_dim-mlp_bias": ("llama", dict(head_dim=6, mlp_bias=True)),
    "llama-mqa-tied": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    "mistral-gqa-window": ("mistral", dict(sliding_window=5)),
    "qwen2-tied-head_dim": (
        "qwen2",
        dict(
            attention_bias=True, o_proj_bias=False, tie_word_embeddings=True, head_dim=6
        ),
    ),
    "gpt2": ("gpt2", {}),
}


def _randomize(model, seed=1, scale=0.3):
    """Non-trivial norms and biases (init sets them to 1 and 0)."""
    leaves, treedef = jtu.tree_flatten(model)
    rng = np.random.default_rng(seed)
    new = []
    for x in leaves:
        if eqx.is_inexact_array(x):
            x = x + jnp.asarray(scale * rng.normal(size=x.shape), x.dtype)
        new.append(x)
    return jtu.tree_unflatten(treedef, new)


def _model(name):
    family, changes = VARIANTS[name]
    if family == "gpt2":
        return _randomize(GPT2(GPT2_TINY, jr.key(0)))
    return _randomize(Llama(dataclasses.replace(LLAMA, **changes), jr.key(0)))


def _tokens(vocab=97):
    return np.random.default_rng(0).integers(0, vocab, SEQ).astype(np.int32)


def _hf_load(path, **kwargs):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, **kwargs
    )
    bad = {k: v for k, v in info.items() if v and k != "error_msgs"}
    assert not bad, bad
    return model.eval()


def _hf_logits(model, tokens):
    with torch.no_grad():
        ids = torch.from_numpy(np.asarray(tokens, np.int64))[None]
        return model(input_ids=ids).logits[0].float().numpy()


def _assert_close(ours, theirs):
    ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
    tol = 1e-4 * np.max(np.abs(theirs)) + 1e-4
    assert np.max(np.abs(ours - theirs)) <= tol, np.max(np.abs(ours - theirs))


def _assert_bit_exact(a, b, *, structure=True):
    la, lb = jtu.tree_leaves(a), jtu.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    if structure:
        assert jtu.tree_structure(a) == jtu.tree_structure(b)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_export_loads_in_transformers_and_round_trips(tmp_path, name):
    model = _model(name)
    out = hf.export(model, model.config, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == VARIANTS[name][0]
    assert config["dtype"] == config["torch_dtype"] == "float32"
    hf_model = _hf_load(out)
    assert type(hf_model).__name__ == config["architectures"][0]
    tokens = _tokens()
    _assert_close(model(jnp.asarray(tokens)), _hf_logits(hf_model, tokens))
    loaded, loaded_config = hf.load(out)
    assert loaded_config == model.config
    _assert_bit_exact(loaded, model)


@pytest.mark.parametrize("name", ["llama-mqa-tied", "qwen2-tied-head_dim", "gpt2"])
def test_file_names_shapes_dtypes_match_save_pretrained(tmp_path, name):
    model = _model(name)
    hf.export(model, None, tmp_path / "ours")
    _hf_load(tmp_path / "ours").save_pretrained(tmp_path / "theirs")
    ours = _safetensors.read_header(str(tmp_path / "ours" / "model.safetensors"))
    theirs = _safetensors.read_header(str(tmp_path / "theirs" / "model.safetensors"))
    assert ours.pop("__metadata__") == theirs.pop("__metadata__") == {"format": "pt"}
    strip = lambda h: {k: (v["dtype"], v["shape"]) for k, v in h.items()}
    assert strip(ours) == strip(theirs)
    assert "lm_head.weight" not in ours
    assert not any("inv_freq" in k for k in ours)


def _randomize_torch(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval()


def _hf_model(family, **overrides):
    common = dict(
        vocab_size=97,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=300.0,
    )
    if family == "gpt2":
        gpt2 = dict(vocab_size=97, n_positions=32, n_embd=16, n_layer=2, n_head=4)
        cfg = transformers.GPT2Config(**{**gpt2, **overrides})
        return _randomize_torch(transformers.GPT2LMHeadModel(cfg))
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    cfg = cls[0](**{**common, **overrides})
    return _randomize_torch(cls[1](cfg))


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("llama", dict(attention_bias=True, head_dim=6)),
        ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True)),
        ("mistral", dict(sliding_window=4)),
        ("qwen2", dict(tie_word_embeddings=True)),
        ("gpt2", {}),
    ],
)
def test_save_pretrained_loads_in_eqtrain(tmp_path, family, overrides):
    theirs = _hf_model(family, **overrides)
    theirs.save_pretrained(tmp_path)
    model, _ = hf.load(tmp_path)
    tokens = _tokens()
    _assert_close(model(jnp.asarray(tokens)), _hf_logits(theirs, tokens))


def test_save_pretrained_sharded_bf16_loads_in_eqtrain(tmp_path):
    theirs = _hf_model("llama").to(torch.bfloat16)
    theirs.save_pretrained(tmp_path, max_shard_size="4KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model, config = hf.load(tmp_path)
    assert config.param_dtype == "bfloat16"
    assert model.embed_tokens.weight.dtype == jnp.bfloat16
    model32, _ = hf.load(tmp_path, dtype="float32")
    tokens = _tokens()
    # Reloaded in f32 (not `theirs.float()`: `.to(bf16)` also rounded the rotary
    # `inv_freq` buffer, which a fresh load recomputes).
    hf32 = _hf_load(tmp_path, dtype=torch.float32)
    _assert_close(model32(jnp.asarray(tokens)), _hf_logits(hf32, tokens))


def test_bf16_export(tmp_path):
    model = _model("llama-gqa-head_dim-mlp_bias")
    hf.export(model, None, tmp_path, dtype="bfloat16", overwrite=True)
    header = _safetensors.read_header(str(tmp_path / "model.safetensors"))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    loaded, loaded_config = hf.load(tmp_path)
    assert loaded_config.param_dtype == "bfloat16"
    cast = jtu.tree_map(lambda x: x.astype(jnp.bfloat16), model)
    _assert_bit_exact(loaded, cast, structure=False)  # config says f32
    # The same bf16 weights, computed in f32 on both sides.
    hf_model = _hf_load(tmp_path, dtype=torch.float32)
    up, _ = hf.load(tmp_path, dtype="float32")
    tokens = _tokens()
    _assert_close(up(jnp.asarray(tokens)), _hf_logits(hf_model, tokens))


def test_sharded_export(tmp_path):
    model = _model("llama-mha-untied-bias-theta")
    hf.export(model, None, tmp_path / "hf", max_shard_size="8KB")
    files = sorted(os.listdir(tmp_path / "hf"))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors" not in files
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    hf_model = _hf_load(tmp_path / "hf")
    tokens = _tokens()
    _assert_close(model(jnp.asarray(tokens)), _hf_logits(hf_model, tokens))
    _assert_bit_exact(hf.load(tmp_path / "hf")[0], model)


def test_parse_size():
    assert hf.parse_size("5GB") == 5 * 10**9
    assert hf.parse_size("2GiB") == 2 * 2**30
    assert hf.parse_size(123) == 123
    with pytest.raises(ConfigError, match="max_shard_size"):
        hf.parse_size("lots")


# -- bad inputs -------------------------------------------------------------------
def test_load_errors(tmp_path):
    with pytest.raises(hf.HFFileNotFoundError, match="no config.json"):
        hf.load(tmp_path)
    with pytest.raises(hf.HFFileNotFoundError, match="not a directory"):
        hf.load(tmp_path / "nope")
    model = _model("llama-mqa-tied")
    hf.export(model, None, tmp_path / "a")
    config = json.loads((tmp_path / "a" / "config.json").read_text())

    def write(changes):
        (tmp_path / "a" / "config.json").write_text(json.dumps({**config, **changes}))

    write({"model_type": "bert"})
    with pytest.raises(hf.HFFormatError, match="unknown model_type 'bert'"):
        hf.load(tmp_path / "a")
    write({"intermediate_size": 20})
    with pytest.raises(hf.HFFormatError, match=r"wrong shape: .*mlp.down_proj.weight"):
        hf.load(tmp_path / "a")
    write({"tie_word_embeddings": False})
    with pytest.raises(hf.HFFormatError, match=r"1 missing: lm_head.weight \[97, 16\]"):
        hf.load(tmp_path / "a")
    write({"num_hidden_layers": 1})
    with pytest.raises(hf.HFFormatError, match=r"unexpected: model.layers.1."):
        hf.load(tmp_path / "a")
    # a rope type transformers has and eqtrain does not: refused by name
    write({"rope_parameters": {"rope_type": "mrope", "mrope_section": [2, 2]}})
    with pytest.raises(hf.HFFormatError, match="rope_parameters.mrope_section"):
        hf.load(tmp_path / "a")
    write({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(hf.HFFormatError, match="low_freq_factor"):
        hf.load(tmp_path / "a")


def test_load_refuses_pickles(tmp_path):
    theirs = _hf_model("llama")
    theirs.config.save_pretrained(tmp_path)
    torch.save(theirs.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(hf.HFFormatError, match="pytorch_model.bin.*arbitrary code"):
        hf.load(tmp_path)


def test_load_rejects_damaged_safetensors(tmp_path):
    hf.export(_model("gpt2"), None, tmp_path, overwrite=True)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(hf.HFFormatError, match="not a valid safetensors file"):
        hf.load(tmp_path)


def test_export_refuses_to_overwrite(tmp_path):
    model = _model("gpt2")
    hf.export(model, None, tmp_path / "a")
    with pytest.raises(hf.HFExportExistsError, match="overwrite=True"):
        hf.export(model, None, tmp_path / "a")
    hf.export(model, None, tmp_path / "a", overwrite=True, dtype="float16")
    assert hf.load(tmp_path / "a")[1].param_dtype == "float16"
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "notes.txt").write_text("mine")
    with pytest.raises(hf.HFExportExistsError, match="is not an earlier export"):
        hf.export(model, None, tmp_path / "b", overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]  # no temporary left behind


def test_model_type_inference_and_errors():
    base = dataclasses.replace(LLAMA)
    assert hf.infer_model_type(base, None) == "llama"
    assert hf.infer_model_type(dataclasses.replace(base, sliding_window=4), None) == (
        "mistral"
    )
    qwen = dataclasses.replace(base, attention_bias=True, o_proj_bias=False)
    assert hf.infer_model_type(qwen, None) == "qwen2"
    assert hf.infer_model_type(GPT2_TINY, None) == "gpt2"
    with pytest.raises(ConfigError, match="cannot express"):
        hf.infer_model_type(dataclasses.replace(base, attention_bias=True), "mistral")
    with pytest.raises(ConfigError, match="cannot express"):
        hf.infer_model_type(qwen, "llama")
    with pytest.raises(ConfigError, match="unknown `model_type`"):
        hf.infer_model_type(base, "bert")
    with pytest.raises(ConfigError, match="cannot be exported as 'gpt2'"):
        hf.infer_model_type(base, "gpt2")


# -- the training hook ------------------------------------------------------------
def test_export_hook_in_fit(tmp_path):
    import optax

    import eqtrain

    model = _model("llama-mqa-tied")
    state = eqtrain.TrainState.create(model, optax.sgd(1e-2), key=0, ema=True)

    def loss_fn(m, batch, key):
        logits = jnp.stack([m(t) for t in batch["tokens"]])
        logp = jax.nn.log_softmax(logits[:, :-1])
        nll = -jnp.take_along_axis(logp, batch["tokens"][:, 1:, None], -1)
        return jnp.mean(nll), {}

    batch = {"tokens": jnp.asarray(np.stack([_tokens(), _tokens()[::-1]]))}
    hook = hf.export_hook(tmp_path / "hf", which="both")
    result = eqtrain.fit(
        state,
        eqtrain.train_step(loss_fn, optax.sgd(1e-2)),
        [batch] * 3,
        num_steps=3,
        hooks=[eqtrain.every(2, hook), eqtrain.at_end(hook)],
        stop=eqtrain.StopConditions(handle_signals=False),
    )
    assert sorted(os.listdir(tmp_path / "hf")) == [
        "step_2",
        "step_2_ema",
        "step_3",
        "step_3_ema",
    ]
    final = result.state
    _assert_bit_exact(hf.load(tmp_path / "hf" / "step_3")[0], final.model)
    _assert_bit_exact(hf.load(tmp_path / "hf" / "step_3_ema")[0], final.ema_model)
    single = hf.export_hook(tmp_path / "last", per_step=False)
    single(eqtrain.StepInfo(step=1, metrics={}, num_steps=1, _state=final))
    assert os.path.exists(tmp_path / "last" / "config.json")


def test_export_writes_hf_tokenizer_files(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from eqtrain.data import HFTokenizer

    vocab = {w: i for i, w in enumerate(["<s>", "</s>", "hello", "world", "[UNK]"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = HFTokenizer.from_file(tmp_path / "tokenizer.json", bos="<s>", eos="</s>")
    hf.export(_model("gpt2"), None, tmp_path / "hf", tokenizer=ours)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (0, 1)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs.encode("hello world", add_special_tokens=False) == [2, 3]
    assert (theirs.bos_token_id, theirs.eos_token_id) == (0, 1)


@pytest.mark.parametrize(
    "family",
    [
        # default-suite time: test_families_training fits starcoder2 from its HF
        # directory through the CLI by default
        pytest.param("qwen2", marks=pytest.mark.slow),
        pytest.param("gpt2", marks=pytest.mark.slow),
    ],
)
def test_fine_tune_from_hf_directory_and_export(tmp_path, family):
    """`model.init_from`: a run starts from `save_pretrained`'s weights exactly,
    trains, and its final export loads in transformers with eqtrain's logits."""
    from eqtrain import config as config_lib, job

    overrides = {} if family == "gpt2" else dict(max_position_embeddings=32)
    theirs = _hf_model(family, vocab_size=300, **overrides)
    theirs.save_pretrained(tmp_path / "base")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("def f(x):\n    return x + 1\n" * 80)
    config = config_lib.load(
        overrides=[
            f"run_dir={tmp_path / 'run'}",
            f"model.init_from={tmp_path / 'base'}",
            f"data.train={tmp_path / 'text'}",
            "data.eval=none",
            "loop.eval_every=0",
            "data.seq_len=16",
            "data.batch_size=8",
            "loop.steps=3",
            "optim.warmup_steps=0",
            "log.progress=none",
        ]
    )
    prepared = job.prepare(config)
    prepared.close()
    prepared.fit_kwargs["checkpointer"].close()
    start, _ = hf.load(tmp_path / "base")
    scan = prepared.state.model.config.scan_layers  # model.scan_layers = "auto"
    start = start.with_options(scan_layers=scan)
    _assert_bit_exact(prepared.state.model, start)
    assert prepared.job.config.model.arch == family
    assert prepared.job.config.model.vocab_size == 300
    result = job.run(config, echo=lambda s: None)
    trained = result.fit.state.model
    assert not np.array_equal(
        np.asarray(jtu.tree_leaves(trained)[0]), np.asarray(jtu.tree_leaves(start)[0])
    )
    exported = _hf_load(tmp_path / "run" / "hf")
    tokens = _tokens(vocab=300)
    _assert_close(trained(jnp.asarray(tokens)), _hf_logits(exported, tokens))
    reloaded, _ = hf.load(tmp_path / "run" / "hf")
    _assert_bit_exact(reloaded.with_options(scan_layers=scan), trained)
