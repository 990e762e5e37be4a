"""Training features on every decoder family of `tests/_hf_families.py`, starting
from tiny random `transformers` models: LoRA adapters through `peft` both ways
(and merged), chunked losses on soft-capped / scaled logits, sharded and
sequence-parallel training equal to one device, remat and scanned layer groups,
and `eqtrain fit` with `model.init_from` exporting what transformers loads.

The default suite runs one case per feature (phi3's LoRA, gemma2's chunked loss
and mesh, one CLI fit); `slow` runs every family."""

import copy
import json
import os
import re
import subprocess
import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqtrain
from eqtrain import hf, lora, losses, models, sharding
from eqtrain.models import decoder
from eqtrain.post_training import preference

from . import _hf_families as fam


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

slow = pytest.mark.slow
# one variant per Hugging Face model_type
MODEL_TYPES = sorted({model_type for model_type, _ in fam.VARIANTS.values()})


def _only(default, names):
    """`names` as params, all but `default` marked slow."""
    return [n if n == default else pytest.param(n, marks=slow) for n in names]


def _hf_model(variant, seed=0, **overrides):
    """`fam.hf_model(variant)` with config fields changed (derived fields such as
    `layer_types` follow `num_hidden_layers`)."""
    model_type, kwargs = fam.VARIANTS[variant]
    config = transformers.AutoConfig.for_model(
        model_type, **copy.deepcopy({**kwargs, **overrides})
    )
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    fam._randomize(model, seed)
    return model.eval()


def _save(path, variant, **overrides):
    _hf_model(variant, **overrides).save_pretrained(path, safe_serialization=True)
    return path


def _tokens(vocab=101, shape=(2, 40), seed=0):
    """Past the windows (8) and the longrope switch (32) of the variants."""
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


@eqx.filter_jit
def _batch_logits(model, tokens):
    return jax.vmap(model)(tokens)


def _logits(model, tokens):
    return np.asarray(_batch_logits(model, jnp.asarray(tokens)))


def _assert_close(got, want, rtol=1e-4):
    """Equal to `rtol` relative to the largest entry (f32 logits)."""
    want = np.asarray(want)
    err = np.max(np.abs(np.asarray(got) - want))
    assert err <= rtol * np.max(np.abs(want)), (err, np.max(np.abs(want)))


def _assert_trees_close(got, want, rtol=1e-5):
    """Leaf by leaf, to `rtol` of the leaf's largest entry (and 1e-7 absolute)."""
    got = jtu.tree_leaves(eqx.filter(got, eqx.is_array))
    want = jtu.tree_leaves(eqx.filter(want, eqx.is_array))
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape
        err = np.max(np.abs(x - y), initial=0.0)
        assert err <= rtol * np.max(np.abs(y), initial=0.0) + 1e-7, err


def _copy(tree):
    """Fresh buffers (a jitted step donates its state)."""
    return jtu.tree_map(
        lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, tree
    )


# -- 1. LoRA through peft ----------------------------------------------------------
def _randomize_adapters(model, seed=3):
    """Every adapter array ~ N(0, 0.2) (numpy: no compile per shape)."""
    rng = np.random.default_rng(seed)

    def fill(path, x):
        if not lora.is_adapter_path(jtu.keystr(path, simple=True, separator=".")):
            return x
        return jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype)

    return jtu.tree_map_with_path(fill, model)


def _peft_load(base_dir, adapter_dir):
    """peft's loader on the transformers base; any warning fails (peft's missing
    or unexpected keys), but transformers 5's deprecation notice at peft 0.21's
    own `is_gradient_checkpointing` call."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
        )
        model = peft.PeftModel.from_pretrained(fam.load(base_dir), adapter_dir)
    return model.eval()


def _adapted_modules(adapter_dir):
    from safetensors.numpy import load_file

    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    return {re.sub(r"\.lora_[AB]\.weight$", "", k) for k in tensors}


@pytest.mark.parametrize("variant", _only("phi3", MODEL_TYPES))
def test_lora_through_peft_both_ways_and_merged(variant, tmp_path):
    base_dir = _save(tmp_path / "base", variant)
    base, _ = hf.load(base_dir)
    tokens = _tokens()
    spec = lora.LoRA(rank=4, alpha=8)
    model = _randomize_adapters(lora.apply(base, spec, key=jr.key(0)))
    ours = hf.export_adapter(model, tmp_path / "ours", spec=spec)

    # The default targets are PEFT's "all-linear": every attention and MLP
    # projection (Phi-3's fused qkv_proj and gate_up_proj), not the head.
    all_linear = peft.get_peft_model(
        fam.load(base_dir), peft.LoraConfig(r=2, target_modules="all-linear")
    )
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in all_linear.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    all_linear.save_pretrained(tmp_path / "theirs")
    assert _adapted_modules(ours) == _adapted_modules(tmp_path / "theirs")
    fused = {"qkv_proj", "gate_up_proj"} if variant == "phi3" else set()
    assert fused <= {p.rsplit(".", 1)[-1] for p in lora.adapter_paths(model)}

    # eqtrain -> peft
    theirs = _peft_load(base_dir, ours)
    expected = fam.hf_logits(theirs, tokens)
    _assert_close(_logits(model, tokens), expected)
    plain = fam.hf_logits(fam.load(base_dir), tokens)
    assert np.max(np.abs(plain - expected)) > 1e-2  # the adapters matter

    # peft -> eqtrain
    loaded = hf.load_adapter(base, tmp_path / "theirs")
    _assert_close(_logits(loaded, tokens), fam.hf_logits(all_linear.eval(), tokens))

    # merged: eqtrain's export equals peft's merge_and_unload
    hf.export(lora.merge(model), None, tmp_path / "merged")
    merged = fam.hf_logits(fam.load(tmp_path / "merged"), tokens)
    _assert_close(merged, fam.hf_logits(theirs.merge_and_unload().eval(), tokens))


# -- 2. chunked losses on transformed logits --------------------------------------
def _imported(variant, tmp_path, **overrides):
    model, _ = hf.load(_save(tmp_path / variant, variant, **overrides))
    return model


def _lm_batch(vocab=101, rows=4, seq=20):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, vocab, (rows, seq + 1)).astype(np.int32)
    mask = (rng.random((rows, seq)) > 0.2).astype(np.float32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}


TRANSFORMED = {
    "gemma2": {"logit_scale": 1.0, "softcap": 3.0},
    "granite": {"logit_scale": 1 / 3.0, "softcap": None},
}


@pytest.mark.parametrize("variant", _only("gemma2", TRANSFORMED))
def test_chunked_lm_loss_equals_full_logits(variant, tmp_path):
    model = _imported(variant, tmp_path)
    assert model.logit_options() == pytest.approx(TRANSFORMED[variant])
    batch = _lm_batch()
    plain = losses.causal_lm_loss_fn(z_loss=1e-3)
    chunked = losses.chunked_causal_lm_loss_fn(chunk=24, z_loss=1e-3)  # 80 tokens

    @eqx.filter_jit
    def both(model):
        grad = lambda fn: eqx.filter_value_and_grad(fn, has_aux=True)(model, batch)
        return grad(plain), grad(chunked)

    ((loss, aux), grads), ((c_loss, c_aux), c_grads) = both(model)
    np.testing.assert_allclose(c_loss, loss, rtol=1e-6)
    np.testing.assert_allclose(c_aux["z_loss"], aux["z_loss"], rtol=1e-5)
    np.testing.assert_allclose(c_aux["accuracy"], aux["accuracy"], rtol=1e-6)
    _assert_trees_close(c_grads, grads)


@slow
@pytest.mark.parametrize("variant", list(TRANSFORMED))
@pytest.mark.parametrize("kind", ["orpo", "simpo"])
def test_chunked_preference_logprobs_equal_full_logits(variant, kind, tmp_path):
    model = _imported(variant, tmp_path)
    b = _lm_batch()
    pairs = {
        f"{side}_{name}": b[key][rows]
        for side, rows in (("chosen", slice(0, 2)), ("rejected", slice(2, 4)))
        for name, key in (("tokens", "tokens"), ("targets", "targets"))
        + (("mask", "loss_mask"),)
    }

    @eqx.filter_jit
    def both(model):
        out = []
        for chunk in (None, 16):
            fn = preference.preference_loss_fn(kind, reference=None, chunk=chunk)
            value = eqx.filter_value_and_grad(lambda m, fn=fn: fn(m, pairs, None)[0])(
                model
            )
            out.append((value, preference.pair_logprobs(model, pairs, chunk=chunk)))
        return out

    ((loss, grads), logps), ((c_loss, c_grads), c_logps) = both(model)
    np.testing.assert_allclose(c_logps, logps, rtol=1e-5)
    np.testing.assert_allclose(c_loss, loss, rtol=1e-5)
    _assert_trees_close(c_grads, grads)


# -- 3. meshes -----------------------------------------------------------------------
# vocab 384: the embedding and head split their vocab over tensor x fsdp = 4
# Small steps, linear in the gradients: those agree to f32 rounding (up to ~3e-5
# of a leaf's largest entry for phi3; the mesh's as close to float64 as one
# device's), which Adam (an update ~ lr * sign(g) for g near 0) or large steps
# (phi3 with SGD at 0.3) magnify into 1e-4 differences within three steps.
OPT = optax.sgd(0.05, momentum=0.9)
STEPS, BATCH, SEQ = 3, 8, 24


def _train(model, axes=None, num_steps=STEPS, trainable=True):
    """Losses of `num_steps` steps of `train_step` (on a `(data, fsdp, tensor)`
    mesh, or one device) and the final state."""
    state = eqtrain.TrainState.create(_copy(model), OPT, key=0, trainable=trainable)
    step = eqtrain.train_step(losses.causal_lm_loss, OPT)
    shardings = None
    if axes is not None:
        mesh = sharding.make_mesh(
            dict(zip(("data", "fsdp", "tensor"), axes, strict=True))
        )
        rules = sharding.rules_for(state.model, mesh, fsdp_min_size=256)
        state_sh = sharding.state_shardings(state, mesh, rules, optimizer=OPT)
        shardings = (state_sh, sharding.batch_sharding(mesh))
        state = sharding.shard(state, state_sh)
    jitted = eqtrain.jit(step, shardings=shardings)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    out = []
    for _ in range(num_steps):
        tokens = rng.integers(0, vocab, (BATCH, SEQ + 1)).astype(np.int32)
        batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
        if shardings is not None:
            batch = jax.device_put(batch, shardings[1])
        state, metrics = jitted(state, batch)
        out.append(metrics["loss"])
    assert jitted.num_traces == 1
    return np.asarray(jax.device_get(out)), state


# Every family under `nox -s slow`; the default suite's 2x2x2 mesh check is
# test_sharding's Llama (the decoder's rules are shared by every family here).
@pytest.mark.slow
@pytest.mark.parametrize("variant", MODEL_TYPES)
def test_2x2x2_mesh_training_equals_one_device(variant, tmp_path):
    model = _imported(variant, tmp_path, vocab_size=384)
    reference, ref_state = _train(model)
    got, state = _train(model, (2, 2, 2))
    np.testing.assert_allclose(got, reference, rtol=1e-5)
    _assert_trees_close(
        jax.device_get(state.model), jax.device_get(ref_state.model), rtol=1e-4
    )
    layers = state.model.layers
    if variant == "phi3":  # fused: fsdp only (a tensor split would cut q|k|v)
        spec = P(None, None, "fsdp")
        assert layers.self_attn.qkv_proj.weight.sharding.spec == spec
        assert layers.mlp.gate_up_proj.weight.sharding.spec == spec
    else:
        assert layers.self_attn.q_proj.weight.sharding.spec == P(None, "tensor", "fsdp")
    down = layers.mlp.c_proj if variant == "starcoder2" else layers.mlp.down_proj
    assert down.weight.sharding.spec == P(None, "fsdp", "tensor")


@slow
@pytest.mark.parametrize("variant", ["phi3", "starcoder2"])
def test_lora_on_a_2x2x2_mesh_equals_one_device(variant, tmp_path):
    """Adapters on fused (Phi-3) and plain-MLP (StarCoder2) projections follow
    their base weights' placement and train as on one device."""
    base = _imported(variant, tmp_path, vocab_size=384)
    model = _randomize_adapters(lora.apply(base, lora.LoRA(rank=4), key=jr.key(0)))
    mask = lora.trainable(model)
    reference, ref_state = _train(model, trainable=mask)
    got, state = _train(model, (2, 2, 2), trainable=mask)
    np.testing.assert_allclose(got, reference, rtol=1e-5)
    _assert_trees_close(
        jax.device_get(state.model), jax.device_get(ref_state.model), rtol=1e-4
    )
    layers = state.model.layers
    if variant == "phi3":
        qkv = layers.self_attn.qkv_proj
        assert qkv.lora_a.sharding.spec == P(None, None, "fsdp")  # `in`
        assert "tensor" not in qkv.lora_b.sharding.spec  # `out`, as the weight
    else:
        c_fc = layers.mlp.c_fc
        assert c_fc.lora_b.sharding.spec[1] == "tensor"  # `out`, as the weight


def _packed_rows(vocab=101, rows=4, seq=32):
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, vocab, (rows, seq + 1)).astype(np.int32)
    seg = np.ones((rows, seq), np.int32)
    seg[0, 12:] = 2  # packed: 12 + 20 tokens
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg}


_grad = eqx.filter_value_and_grad(lambda m, b: losses.causal_lm_loss(m, b)[0])


@slow
@pytest.mark.parametrize("scheme", ["ulysses", "ring", "all_gather"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize(
    "axes", [{"data": 2, "sequence": 4}, {"data": 2, "tensor": 2, "sequence": 2}]
)
def test_gemma2_sequence_parallel_equals_one_device(scheme, layout, axes, tmp_path):
    """Sliding windows (8) across the devices' blocks (4 or 8 tokens), attention
    soft-capping (5) and the 1/sqrt(24) scale in every scheme's kernel."""
    model = _imported("gemma2", tmp_path).with_options(scan_layers=False)
    assert model.config.attn_logit_softcapping == 5.0
    rows = _packed_rows()
    want = eqx.filter_jit(_grad)(model, rows)
    mesh = sharding.make_mesh(axes)
    laid = models.sequence_rows(rows, layout=layout, ways=axes["sequence"])
    sh = NamedSharding(mesh, P("data", "sequence"))
    batch = {k: jax.device_put(v, sh) for k, v in laid.items()}
    split = model.with_options(sequence_parallel=scheme, sequence_layout=layout)
    loss, grads = jax.jit(models.under_mesh(_grad, mesh))(split, batch)
    np.testing.assert_allclose(loss, want[0], rtol=1e-6)
    _assert_trees_close(grads, want[1], rtol=1e-5)


@pytest.fixture(scope="module")
def gemma3_deep(tmp_path_factory):
    """Gemma 3 with 14 layers: its 5:1 pattern (period 6) scans in 2 groups of 6
    and unrolls the last 2, as a 26-layer Gemma 3 1B scans 4 groups + 2. (With 8
    layers, one group, `run_layers` unrolls them all.)"""
    path = tmp_path_factory.mktemp("gemma3")
    model = _imported("gemma3_text", path, num_hidden_layers=14)
    kinds = model.config.layer_kinds()
    assert kinds[5] == kinds[11] == (None, "global") and kinds[0] == (8, "local")
    batch = _lm_batch(seq=24)
    unrolled = model.with_options(scan_layers=False)
    return model, batch, eqx.filter_jit(_grad)(unrolled, batch)


@slow
@pytest.mark.parametrize(
    "scan, remat",
    [(True, r) for r in models.REMAT_PRESETS if r != "nothing_saveable"]
    + [(False, "full"), (False, "save_qkv")],
)
def test_gemma3_remat_and_scanned_groups_equal_unrolled(gemma3_deep, scan, remat):
    model, batch, (loss, grads) = gemma3_deep
    extra = {"remat_save": ("query", "mlp_out")} if remat == "custom" else {}
    changed = model.with_options(scan_layers=scan, remat=remat, **extra)
    got_loss, got_grads = eqx.filter_jit(_grad)(changed, batch)
    np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
    _assert_trees_close(got_grads, grads)


# -- 4. eqtrain fit from a transformers directory -------------------------------------
TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 40
EQTRAIN = [sys.executable, "-m", "eqtrain.cli"]


def _cli(*args, devices=1):
    """`eqtrain ARGS` on one CPU device (without the 8 simulated ones of the
    tests: a plain machine's run, and a faster compile), or on 8."""
    env = dict(os.environ)
    if devices == 1:
        env.pop("XLA_FLAGS", None)
    done = subprocess.run(
        [*EQTRAIN, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _fit_config(tmp_path, variant):
    """A 3-step run from the variant (vocab 384: the byte tokenizer's 259 ids fit)
    written by `save_pretrained`, exporting at the end."""
    base = _save(tmp_path / "base", variant, vocab_size=384)
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text(TEXT)
    config = tmp_path / "fit.toml"
    config.write_text(
        f"""
run_dir = "{tmp_path / "run"}"

[model]
init_from = "{base}"

[data]
train = "{tmp_path / "text"}"
eval = "none"
tokenizer = "byte"
seq_len = 32
batch_size = 8

[optim]
warmup_steps = 0

[loop]
steps = 3
eval_every = 0

[log]
progress = "none"
"""
    )
    return base, config


# fields each family's export must keep (beside the shapes)
KEPT = {
    "gemma2": (
        "sliding_window",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "query_pre_attn_scalar",
        "layer_types",
    ),
    # (eqtrain writes longrope's `factor`, 128 / 32, as transformers advises;
    # transformers' own file leaves it to be derived)
    "phi3": (
        "original_max_position_embeddings",
        "rope_parameters.rope_type",
        "rope_parameters.short_factor",
        "rope_parameters.long_factor",
        "rope_parameters.rope_theta",
    ),
    "qwen3": ("head_dim", "rms_norm_eps"),
    "starcoder2": ("sliding_window", "use_bias", "norm_epsilon", "hidden_act"),
    "llama": ("head_dim", "rope_parameters.rope_theta"),
    "mistral": ("sliding_window",),
    "qwen2": ("tie_word_embeddings",),
    "smollm3": ("no_rope_layers",),
    "gemma": ("hidden_act", "tie_word_embeddings"),
    "gemma3_text": ("sliding_window", "layer_types", "query_pre_attn_scalar"),
    "olmo2": ("rms_norm_eps",),
    "granite": (
        "embedding_multiplier",
        "residual_multiplier",
        "logits_scaling",
        "attention_multiplier",
    ),
}


@pytest.mark.parametrize("variant", _only("starcoder2", KEPT))
def test_fit_from_hf_directory_exports_what_transformers_loads(variant, tmp_path):
    base, config = _fit_config(tmp_path, variant)
    out = _cli("fit", config)
    assert "stopped: max_steps" in out and "HF export" in out
    export = tmp_path / "run" / "hf"
    theirs = fam.load(export)  # no missing, unexpected or mismatched keys
    written = json.loads((export / "config.json").read_text())
    original = json.loads((base / "config.json").read_text())
    assert written["model_type"] == variant and written["vocab_size"] == 384
    for key in KEPT[variant]:
        got, want = written, original
        for part in key.split("."):
            got, want = got[part], want[part]
        assert got == want, key
    trained, _ = hf.load(export)
    start, _ = hf.load(base)
    tokens = _tokens(vocab=384)
    _assert_close(_logits(trained, tokens), fam.hf_logits(theirs, tokens))
    assert np.max(np.abs(_logits(start, tokens) - _logits(trained, tokens))) > 1e-3

    info = _cli("info", tmp_path / "run")
    assert f"model:        {variant} (" in info
    assert "3 / 3 steps" in info and str(export) in info


@slow
def test_dry_run_of_a_family_prints_flops_and_memory(tmp_path):
    base, config = _fit_config(tmp_path, "phi3")
    mesh = ["--set", "mesh.fsdp=2", "--set", "mesh.tensor=2"]
    out = _cli("fit", config, "--dry-run", *mesh, devices=8)
    model_config, _ = hf.load_config(base)
    flops = decoder.flops_per_token(model_config, 32)
    assert f"compute      {flops:,.0f} training FLOPs per token" in out
    assert "model        phi3" in out and "fsdp=2" in out and "tensor=2" in out
    fused = re.search(r"model\.layers\.self_attn\.qkv_proj\.weight .*", out)
    assert fused and "P(None, None, 'fsdp')" in fused.group(0)
    assert "memory per device" in out and re.search(r"peak +\d", out)
    assert not (tmp_path / "run").exists()
