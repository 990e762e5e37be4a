"""Memory options: the tiled MLP, remat presets (with host offload), the chunked
loss in training, the config keys behind them, and the dry run's memory report
from the compiled step (`--memory-budget`'s search included)."""

import dataclasses
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqtrain
from eqtrain import config as config_lib, job, losses
from eqtrain.job import _build, _memory, _place, _plan, _steps
from eqtrain.models import GPT2, REMAT_PRESETS, GPT2Config, Llama, LlamaConfig, _layers


LLAMA = LlamaConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
GPT = GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=2, n_head=2)
TOKENS = (jnp.arange(2 * 23).reshape(2, 23) * 7) % 64


def _loss(model):
    logits = jax.vmap(model)(TOKENS)
    return jnp.mean(jnp.square(logits)) + jnp.mean(logits[..., 3])


def _close(a, b, rtol=1e-6, atol=1e-7):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "family", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)]
)
def test_tiled_mlp_equals_the_plain_mlp(family):
    model = Llama(LLAMA, jr.key(0)) if family == "llama" else GPT2(GPT, jr.key(0))
    grad = eqx.filter_jit(eqx.filter_value_and_grad(_loss))
    value, grads = grad(model)
    # 23 tokens: 3 and 5 pieces need padding; "auto" is ceil(23 / 16) = 2 pieces.
    for chunks in (5, "auto"):
        tiled_value, tiled_grads = grad(model.with_options(mlp_chunks=chunks))
        _close(tiled_value, value)
        _close(tiled_grads, grads)


@pytest.mark.parametrize(
    "family",
    [
        pytest.param("llama", marks=pytest.mark.slow),
        "mistral",
        pytest.param("gpt2", marks=pytest.mark.slow),
    ],
)
def test_blocked_attention_equals_attention(family):
    """Packed segments, a sliding window (Mistral), GQA, and blocks that do not
    divide the 23 tokens."""
    if family == "gpt2":
        model = GPT2(GPT, jr.key(0))
    else:
        window = 5 if family == "mistral" else None
        model = Llama(dataclasses.replace(LLAMA, sliding_window=window), jr.key(0))
    segs = jnp.array([[1] * 10 + [2] * 13, [1] * 23])

    def loss(m):
        logits = jax.vmap(lambda t, s: m(t, segment_ids=s))(TOKENS, segs)
        return jnp.mean(jnp.square(logits))

    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    value, grads = grad(model)
    for chunk in (4, 7):
        got_value, got_grads = grad(model.with_options(attention_chunk=chunk))
        _close(got_value, value)
        _close(got_grads, grads, atol=1e-6)


def test_tiled_mlp_holds_one_piece_of_the_intermediate():
    """The `[seq, intermediate]` activations exist one piece at a time."""
    model = Llama(dataclasses.replace(LLAMA, intermediate_size=512), jr.key(0))
    x = jr.normal(jr.key(1), (256, 16))
    mlp = jax.tree.map(lambda a: a[0], model.layers.mlp)

    def temp(chunks):
        fn = lambda m, x: jnp.sum(_layers.tiled(lambda c, k: m(c), x, chunks))  # noqa: E731
        compiled = jax.jit(jax.grad(fn)).lower(mlp, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp(8) * 3 < temp(1)


def _preset(preset):
    if preset == "custom":
        return {"remat": preset, "remat_save": ("query", "mlp_in")} | {
            "remat_offload": ("value",)
        }
    return {"remat": preset}


# Presets whose policies the default suite checks; the rest under `nox -s slow`
# (custom: by default in test_every_remat_preset_trains_like_none).
QUICK_PRESETS = ("full", "save_qkv", "offload_layer_input")


@pytest.mark.parametrize(
    "presets",
    [
        QUICK_PRESETS,
        pytest.param(
            tuple(p for p in REMAT_PRESETS if p not in QUICK_PRESETS),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_every_remat_preset_gives_the_gradients_of_none(presets):
    model = Llama(LLAMA, jr.key(0))
    grad = eqx.filter_jit(eqx.filter_value_and_grad(_loss))
    value, grads = grad(model)
    for preset in presets:
        got_value, got_grads = grad(model.with_options(**_preset(preset)))
        _close(got_value, value, rtol=1e-5)
        _close(got_grads, grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "presets",  # the default suite: custom (saves and offloads); slow: every one
    [("custom",), pytest.param(REMAT_PRESETS, marks=pytest.mark.slow)],
    ids=["custom", "all"],
)
def test_every_remat_preset_trains_like_none(presets):
    """Three AdamW steps under each preset give the losses of `remat="none"`."""
    model = Llama(LLAMA, jr.key(0))
    batch = {"tokens": TOKENS[:, :-1], "targets": TOKENS[:, 1:]}
    optimizer = optax.adamw(1e-2)

    def curve(m):
        state = eqtrain.TrainState.create(m, optimizer, key=0)
        step = eqtrain.jit(
            eqtrain.train_step(losses.causal_lm_loss, optimizer), donate=False
        )
        out = []
        for _ in range(3):
            state, metrics = step(state, batch)
            out.append(float(metrics["loss"]))
        return out

    reference = curve(model)
    for preset in presets:
        got = curve(model.with_options(**_preset(preset)))
        np.testing.assert_allclose(got, reference, rtol=1e-5, err_msg=preset)


@pytest.mark.parametrize(
    "options, host",
    [
        ({"remat": "offload_layer_input"}, True),
        pytest.param(
            {"remat": "custom", "remat_offload": ("layer_input",)},
            True,
            marks=pytest.mark.slow,
        ),
        ({"remat": "full"}, False),
    ],
)
def test_offload_puts_the_layer_inputs_in_host_memory(options, host):
    """The CPU backend compiles host offload (and then drops it), so the policy
    is checked where it acts: the backward pass's residuals live in host
    memory (`f32<host>` in the jaxpr)."""
    model = Llama(LLAMA, jr.key(0)).with_options(**options)
    jaxpr = str(jax.make_jaxpr(eqx.filter_grad(_loss))(model))
    assert ("<host>" in jaxpr) == host
    eqx.filter_jit(eqx.filter_grad(_loss)).lower(model).compile()  # and it compiles


def test_offload_needs_host_memory(monkeypatch):
    device = types.SimpleNamespace(
        platform="fake",
        addressable_memories=lambda: [types.SimpleNamespace(kind="device")],
    )
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    with pytest.raises(eqtrain.ConfigError, match="pinned_host"):
        dataclasses.replace(LLAMA, remat="offload_layer_input")
    dataclasses.replace(LLAMA, remat="full")  # no offload: fine


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_chunked_loss_trains_the_same_curve():
    """20 AdamW steps with the chunked loss follow the plain loss's curve."""
    model = Llama(dataclasses.replace(LLAMA, tie_word_embeddings=False), jr.key(3))
    data = jnp.tile(jr.randint(jr.key(4), (5, 4, 17), 0, 64), (4, 1, 1))
    mask = (jr.uniform(jr.key(5), (20, 4, 16)) > 0.2).astype(jnp.float32)
    optimizer = optax.adamw(3e-3)

    def curve(loss_fn):
        state = eqtrain.TrainState.create(model, optimizer, key=0)
        step = eqtrain.jit(eqtrain.train_step(loss_fn, optimizer), donate=False)
        out = []
        for i in range(20):
            batch = {  # 5 batches, 4 times: a curve that goes down
                "tokens": data[i, :, :-1],
                "targets": data[i, :, 1:],
                "loss_mask": mask[i],
            }
            state, metrics = step(state, batch)
            out.append(float(metrics["loss"]))
        return out

    plain = curve(losses.causal_lm_loss)
    chunked = curve(losses.chunked_causal_lm_loss_fn(chunk=24))
    np.testing.assert_allclose(chunked, plain, rtol=1e-5)
    assert plain[-1] < plain[0]


# -- config keys ------------------------------------------------------------------
def _overrides(tmp_path, *overrides):
    return [
        f"run_dir={tmp_path / 'run'}",
        "model.hidden_size=32",
        "model.num_layers=1",
        "data.seq_len=16",
        "data.batch_size=8",
        "loop.steps=4",
        *overrides,
    ]


def _config(tmp_path, *overrides):
    return config_lib.load(overrides=_overrides(tmp_path, *overrides))


def test_memory_keys_reach_the_job(tmp_path):
    built = job.build(
        _config(
            tmp_path,
            "model.remat=custom",
            "model.remat_save=query, key",
            "model.remat_offload=layer_input",
            "model.mlp_chunks=4",
            "model.loss_chunk=64",
            "model.attention_chunk=8",
            "model.attention_impl=pallas",
        )
    )
    m = built.model_config
    assert m.attention_impl == "pallas"
    assert job.build(_config(tmp_path)).model_config.attention_impl == "auto"
    assert (m.remat, m.remat_save, m.remat_offload) == (
        "custom",
        ("query", "key"),
        ("layer_input",),
    )
    assert m.mlp_chunks == 4 and built.loss_chunk == 64 and m.attention_chunk == 8
    assert built.loss_fn.__qualname__.startswith("chunked_causal_lm_loss_fn")
    # auto: the byte vocabulary (259 ids) keeps the plain loss; 8192 ids chunk,
    # but not on a sequence axis
    assert job.build(_config(tmp_path)).loss_chunk == 0
    big = job.build(_config(tmp_path, "model.vocab_size=8192"))
    assert big.loss_chunk == config_lib.AUTO_LOSS_CHUNK
    split = ["model.vocab_size=8192", "mesh.sequence=2", "model.sequence_parallel=ring"]
    assert job.build(_config(tmp_path, *split)).loss_chunk == 0
    assert (
        job.build(_config(tmp_path, "model.mlp_chunks=auto")).model_config.mlp_chunks
        == "auto"
    )
    off = job.build(_config(tmp_path, "model.vocab_size=8192", "model.loss_chunk=0"))
    assert off.loss_chunk == 0


def test_memory_keys_read_toml_lists(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        '[model]\nremat = "custom"\nremat_save = ["query", "key"]\n'
        'mlp_chunks = "auto"\nloss_chunk = 128\n'
    )
    config = config_lib.load(path)
    assert config.model.remat_save == "query,key"
    assert config.model.mlp_chunks == "auto" and config.model.loss_chunk == 128
    again = tmp_path / "again.toml"
    again.write_text(config_lib.to_toml(config))
    assert config_lib.load(again) == config


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.remat=ful"], "Did you mean .full"),
        (["model.remat=custom"], "needs `model.remat_save` and/or"),
        (["model.remat=custom", "model.remat_save=querry"], "Did you mean 'query'"),
        (["model.remat=full", "model.remat_save=query"], "apply only to"),
        (
            ["model.remat=custom", "model.remat_save=key", "model.remat_offload=key"],
            "both saved",
        ),
        (
            ["model.mlp_chunks=5"],
            r"`model.mlp_chunks` \(5\) must divide `data.seq_len` \(16\)",
        ),
        (["model.mlp_chunks=lots"], "integer or 'auto'"),
        (["model.loss_chunk=-1"], ">= 0"),
    ],
)
def test_bad_memory_settings_are_one_sentence(tmp_path, overrides, match):
    with pytest.raises(eqtrain.ConfigError, match=match):
        config_lib.validate(_config(tmp_path, *overrides))


def test_chunked_head_refuses_lora_dropout_on_the_head(tmp_path):
    lora = ["lora.rank=4", "lora.dropout=0.1", "lora.targets=lm_head|q_proj"]
    untied = "model.tie_embeddings=false"
    with pytest.raises(eqtrain.ConfigError, match="model.loss_chunk = 64"):
        job.build(_config(tmp_path, untied, "model.loss_chunk=64", *lora))
    auto = job.build(_config(tmp_path, untied, "model.vocab_size=8192", *lora))
    assert auto.loss_chunk == 0  # auto falls back to the plain loss


# -- the memory report ------------------------------------------------------------
def test_dry_run_reports_the_compiled_step(tmp_path):
    """The report's peak is XLA's analysis of the run's own step, and it sees
    what the memory options save."""
    config = _config(tmp_path, "model.vocab_size=8192", "mesh.fsdp=2")
    text = job.report(config)
    assert "XLA's memory analysis" in text and "peak" in text
    assert "loss chunked, 256 tokens (auto)" in text
    # XLA's own figures for the step a run of this config compiles, on a batch
    # of its shapes (independently of the report's StepMemory)
    planned = _plan.plan(config)
    rows, size = planned.rows, config.data.batch_size
    batch = {
        k: jax.ShapeDtypeStruct((size, *v.shape[1:]), v.dtype)
        for k, v in rows.take(np.arange(1)).items()
    }

    def analysis(built):
        step = _steps.train_step(built, planned.placement)
        return step.lower(built.abstract, batch).compile().memory_analysis()

    chunked = analysis(planned.job)
    peak = (
        chunked.argument_size_in_bytes
        + chunked.output_size_in_bytes
        - chunked.alias_size_in_bytes
        + chunked.temp_size_in_bytes
    )
    assert f"peak              {eqtrain.sharding.format_bytes(peak)}" in text
    # the arguments are this device's share of the state (fsdp = 2) and batch:
    # the report compiled neither an unsharded nor a smaller state
    abstract = eqx.filter(planned.job.abstract, _is_struct)
    state = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
    assert state // 2 < chunked.argument_size_in_bytes < state
    plain_config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, loss_chunk=0)
    )
    plain = analysis(_build.build(plain_config))
    logits = 16 * 8192 * 4  # [8, 16, 8192] float32 logits, a row per device
    assert chunked.temp_size_in_bytes + logits <= plain.temp_size_in_bytes
    assert not (tmp_path / "run").exists()


def _is_struct(x):
    return isinstance(x, jax.ShapeDtypeStruct)


@pytest.mark.slow  # default-suite time: the dry run's report is tested by default
def test_memory_budget_finds_the_longest_seq_len(tmp_path):
    config = _config(tmp_path)
    rows = _plan.plan(config).rows
    peaks = {}
    for length in (64, 128):
        data = dataclasses.replace(config.data, seq_len=length)
        built = _build.build(dataclasses.replace(config, data=data))
        batch = _memory.abstract_batch(built, rows, config.data.seq_len)
        peaks[length] = _memory.step_memory(built, _place.placement(built), batch).peak
    assert peaks[64] < peaks[128]
    budget = (peaks[64] + peaks[128]) // 2
    # through `eqtrain fit --memory-budget` (a dry run: nothing written)
    from typer.testing import CliRunner

    from eqtrain.cli import app

    sets = [x for o in _overrides(tmp_path) for x in ("--set", o)]
    cli = CliRunner().invoke(app, ["fit", *sets, "--memory-budget", str(budget)])
    assert cli.exit_code == 0, cli.output
    assert "XLA's memory analysis" in cli.stdout  # the dry run's report first
    text = cli.stdout
    assert not (tmp_path / "run").exists()
    assert f"seq_len      64: {eqtrain.sharding.format_bytes(peaks[64])}" in text
    assert f"seq_len     128: {eqtrain.sharding.format_bytes(peaks[128])}" in text
    assert "-> data.seq_len = 64" in text
    bad = CliRunner().invoke(app, ["fit", *sets, "--memory-budget", "lots"])
    assert bad.exit_code == 2 and bad.stderr.startswith("error: `--memory-budget`")
    none = _memory.longest_seq_len(config, peaks[64] // 2, rows, max_compiles=3)
    assert none.seq_len is None and none.tried == [(64, peaks[64])]
