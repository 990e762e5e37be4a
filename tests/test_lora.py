"""eqtrain.lora: adapters as more leaves, the trainable filter, merge/disable, and
adapter sharding (a (2,2,2) mesh run equals one device)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqtrain
from eqtrain import lora, sharding
from eqtrain.config._schema import LORA_TARGETS
from eqtrain.losses import causal_lm_loss
from eqtrain.models import GPT2, GPT2Config, Llama, LlamaConfig


LLAMA = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
GPT = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
SPEC = lora.LoRA(rank=4, alpha=8)
TOKENS = jnp.arange(12) % 64


def base(kind="llama", **options):
    if kind == "llama":
        return Llama(LLAMA, jr.key(0)).with_options(**options)
    return GPT2(GPT, jr.key(0)).with_options(**options)


def adapted(kind="llama", spec=SPEC, **options):
    return lora.apply(base(kind, **options), spec, key=jr.key(1))


def randomize_adapters(model, seed=2, scale=0.1):
    """Non-zero `lora_b` (and new `lora_a`), as after some training."""
    paths = [p for p in _array_paths(model) if lora.is_adapter_path(p)]
    keys = iter(jr.split(jr.key(seed), len(paths)))

    def fill(path, x):
        if not lora.is_adapter_path(path):
            return x
        return scale * jr.normal(next(keys), x.shape, x.dtype)

    return _map_with_path(fill, model)


def _array_paths(model):
    flat, _ = jtu.tree_flatten_with_path(model)
    return [jtu.keystr(k, simple=True, separator=".") for k, _ in flat]


def _map_with_path(fn, tree):
    return jtu.tree_map_with_path(
        lambda k, x: fn(jtu.keystr(k, simple=True, separator="."), x), tree
    )


# -- the adapted model computes what the base did, until trained ----------------------
@pytest.mark.parametrize(
    "kind,options",
    [
        ("llama", {}),
        pytest.param("llama", {"scan_layers": False}, marks=pytest.mark.slow),
        pytest.param("llama", {"remat": "full"}, marks=pytest.mark.slow),
        pytest.param("gpt2", {}, marks=pytest.mark.slow),
        pytest.param("gpt2", {"scan_layers": False}, marks=pytest.mark.slow),
    ],
)
def test_step_zero_is_bit_identical(kind, options):
    """Op by op (`jax.disable_jit`), the adapted model's logits are the base's bit
    for bit: `lora_b = 0` adds exact zeros. Compiled, XLA fuses the two graphs
    differently (it already gives the base itself other last bits jitted than op
    by op), so there they agree to float32 rounding."""
    plain = base(kind, **options)
    spec = lora.LoRA(rank=4, alpha=16, dropout=0.1)
    model = lora.apply(plain, spec, key=jr.key(1))
    with jax.disable_jit():
        expected = np.asarray(plain(TOKENS))
        for key in (None, jr.key(5)):  # dropout active with a key: B is still zero
            got = np.asarray(model(TOKENS, key=key))
            np.testing.assert_array_equal(got, expected)
    compiled = jax.jit(lambda m, k: m(TOKENS, key=k))
    np.testing.assert_allclose(
        np.asarray(compiled(model, jr.key(5))),
        np.asarray(compiled(plain, jr.key(5))),
        rtol=0,
        atol=1e-6,
    )


def test_adapters_wrap_the_projections_and_keep_base_paths():
    model = adapted()
    linears = lora.linear_paths(base())
    assert lora.adapter_paths(model) == [p for p in linears if p != "lm_head"]
    assert len(lora.adapter_paths(model)) == 7 and "lm_head" in linears
    assert lora.adapter_paths(adapted("gpt2")) == [
        "h.attn.c_attn",
        "h.attn.c_proj",
        "h.mlp.c_fc",
        "h.mlp.c_proj",
    ]
    plain = base()
    q = lora.apply(plain, SPEC, key=jr.key(1)).layers.self_attn.q_proj
    assert q.weight is plain.layers.self_attn.q_proj.weight  # shared, not copied
    assert q.lora_a.shape == (2, 4, 32) and q.lora_b.shape == (2, 32, 4)
    k = model.layers.self_attn.k_proj
    assert k.lora_a.shape == (2, 4, 32) and k.lora_b.shape == (2, 16, 4)
    assert not np.any(np.asarray(q.lora_b)) and np.any(np.asarray(q.lora_a))
    assert abs(float(jnp.max(jnp.abs(q.lora_a)))) <= 1 / np.sqrt(32)
    assert q.scale == 2.0
    assert lora.DEFAULT_TARGETS == LORA_TARGETS  # the config's default is the same


def test_scales_and_rslora():
    assert lora.LoRA(rank=8).scale == 1.0
    assert lora.LoRA(rank=8, alpha=16).scale == 2.0
    assert lora.LoRA(rank=16, alpha=8, rslora=True).scale == pytest.approx(2.0)
    model = lora.apply(base(), lora.LoRA(rank=4, alpha=8, rslora=True), key=jr.key(1))
    assert model.layers.mlp.up_proj.scale == pytest.approx(4.0)


def test_targets_subset_and_dropout_uses_the_key():
    spec = lora.LoRA(rank=2, targets=r"self_attn\.[qv]_proj$", dropout=0.5)
    model = randomize_adapters(lora.apply(base(), spec, key=jr.key(1)))
    assert lora.adapter_paths(model) == [
        "layers.self_attn.q_proj",
        "layers.self_attn.v_proj",
    ]
    call = jax.jit(lambda m, k: m(TOKENS, key=k))
    a, b = call(model, jr.key(1)), call(model, jr.key(1))
    c, plain = call(model, jr.key(2)), call(model, None)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # deterministic
    assert not np.allclose(np.asarray(a), np.asarray(c))  # the key matters
    assert not np.allclose(np.asarray(a), np.asarray(plain))  # no key, no dropout


# -- frozen base, optimizer state for the adapters only ----------------------------
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_frozen_base_is_untouched_and_has_no_optimizer_state(kind):
    model = adapted(kind)
    state = eqtrain.TrainState.create(
        model, optax.adamw(1e-2), key=0, trainable=lora.trainable(model)
    )
    adapters = lora.num_adapter_params(model)
    opt_elems = sum(x.size for x in jax.tree.leaves(state.opt_state) if eqx.is_array(x))
    assert opt_elems == 2 * adapters + 1  # adam's mu and nu, and its count
    step = eqtrain.jit(eqtrain.train_step(causal_lm_loss, optax.adamw(1e-2)))
    rng = np.random.default_rng(0)
    batch = {
        "tokens": rng.integers(0, 64, (4, 12), dtype=np.int32),
        "targets": rng.integers(0, 64, (4, 12), dtype=np.int32),
    }
    before = jax.device_get(state.model)
    for _ in range(3):
        state, metrics = step(state, batch)
    after = jax.device_get(state.model)
    for path, x, y in zip(
        _array_paths(before),
        jax.tree.leaves(before),
        jax.tree.leaves(after),
        strict=True,
    ):
        if lora.is_adapter_path(path):
            continue
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=path)
    b = after.layers if kind == "llama" else after.h
    assert np.any(np.asarray(jax.tree.leaves(b)[0]))
    changed = [
        p
        for p, x, y in zip(
            _array_paths(before),
            jax.tree.leaves(before),
            jax.tree.leaves(after),
            strict=True,
        )
        if not np.array_equal(np.asarray(x), np.asarray(y))
    ]
    assert changed and all(lora.is_adapter_path(p) for p in changed)


def test_train_also_adds_leaves_by_regex():
    model = adapted()
    mask = lora.trainable(model, also=r"norm")
    flat, _ = jtu.tree_flatten_with_path(mask)
    chosen = {jtu.keystr(k, simple=True, separator=".") for k, f in flat if f}
    assert "norm.weight" in chosen and "layers.input_layernorm.weight" in chosen
    assert "embed_tokens.weight" not in chosen
    assert not any(p.endswith(".weight") and "proj" in p for p in chosen)


# -- merge, disable, unwrap ---------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_merge_equals_the_adapted_model(kind):
    model = randomize_adapters(adapted(kind))
    merged = lora.merge(model)
    assert not lora.adapter_paths(merged)
    assert type(merged) is type(base(kind))
    np.testing.assert_allclose(
        np.asarray(merged(TOKENS)), np.asarray(model(TOKENS)), rtol=0, atol=2e-5
    )
    # the merged model's structure is the base's: it exports like any model
    assert jtu.tree_structure(merged) == jtu.tree_structure(base(kind))


def test_disable_is_the_base_without_a_copy():
    model = randomize_adapters(adapted())
    off = lora.disable(model)
    q_on, q_off = model.layers.self_attn.q_proj, off.layers.self_attn.q_proj
    assert not q_off.enabled and q_on.enabled
    assert q_off.weight is q_on.weight and q_off.lora_a is q_on.lora_a  # shared
    np.testing.assert_array_equal(np.asarray(off(TOKENS)), np.asarray(base()(TOKENS)))
    assert not np.allclose(np.asarray(model(TOKENS)), np.asarray(base()(TOKENS)))
    back = lora.enable(off)
    np.testing.assert_array_equal(np.asarray(back(TOKENS)), np.asarray(model(TOKENS)))
    # unwrap: the base model itself, arrays shared
    plain = lora.unwrap(model)
    assert plain.layers.self_attn.q_proj.weight is q_on.weight
    assert jtu.tree_structure(plain) == jtu.tree_structure(base())

    # inside one jitted function: the reference (adapters off) and the policy
    @jax.jit
    def both(m):
        return m(TOKENS), lora.disable(m)(TOKENS)

    policy, reference = both(model)
    expected = jax.jit(lambda m: m(TOKENS))(base())
    np.testing.assert_allclose(np.asarray(reference), np.asarray(expected), atol=1e-6)
    np.testing.assert_allclose(np.asarray(policy), np.asarray(model(TOKENS)), atol=1e-6)


# -- bad input ----------------------------------------------------------------------
def test_errors_name_the_problem():
    with pytest.raises(eqtrain.ConfigError, match=r"matches none.*q_proj"):
        lora.apply(base(), lora.LoRA(rank=2, targets="qproj"), key=jr.key(0))
    with pytest.raises(eqtrain.ConfigError, match=r"rank. 20 exceeds.*k_proj.*16 x 32"):
        lora.apply(base(), lora.LoRA(rank=20), key=jr.key(0))
    with pytest.raises(eqtrain.ConfigError, match="has none"):
        lora.apply(eqx.nn.MLP(2, 2, 4, 1, key=jr.key(0)), SPEC, key=jr.key(0))
    with pytest.raises(eqtrain.ConfigError, match="already carries"):
        lora.apply(adapted(), SPEC, key=jr.key(0))
    with pytest.raises(eqtrain.ConfigError, match="train_also.*matches no"):
        lora.trainable(adapted(), also="nonexistent")
    with pytest.raises(eqtrain.ConfigError, match="no LoRA adapters"):
        lora.trainable(base())
    with pytest.raises(eqtrain.ConfigError, match="rank. must be >= 1"):
        lora.LoRA(rank=0)
    with pytest.raises(eqtrain.ConfigError, match="not a valid regex"):
        lora.LoRA(rank=2, targets="(")
    with pytest.raises(eqtrain.ConfigError, match="dropout"):
        lora.LoRA(rank=2, dropout=1.0)


def test_a_plain_export_refuses_adapters(tmp_path):
    from eqtrain import hf

    with pytest.raises(eqtrain.ConfigError, match="LoRA adapters.*export_adapter"):
        hf.export(adapted(), None, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


# -- sharding: adapters follow their base weights; a mesh run equals one device -----
def test_adapter_rules_follow_the_base_weights():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sharding.rules_for(adapted(), mesh, fsdp_min_size=None)
    assert rules.match("model.layers.self_attn.q_proj.lora_a") == P(
        "layers", None, "fsdp"
    )
    assert rules.match("model.layers.self_attn.q_proj.lora_b") == P(
        "layers", "tensor", None
    )
    assert rules.match("opt_state.0.mu.layers.mlp.down_proj.lora_a") == P(
        "layers", None, "tensor"
    )
    assert rules.match("model.layers.mlp.down_proj.lora_b") == P("layers", "fsdp", None)
    assert rules.match("model.layers.self_attn.q_proj.weight") == P(
        "layers", "tensor", "fsdp"
    )


def _lora_run(axes, kind, steps=6):
    opt = optax.adamw(1e-2)
    model = randomize_adapters(adapted(kind, lora.LoRA(rank=4, alpha=8)), scale=0.05)
    state = eqtrain.TrainState.create(
        model, opt, key=0, trainable=lora.trainable(model, also="norm|ln_")
    )
    step = eqtrain.train_step(causal_lm_loss, opt)
    shardings = None
    if axes is not None:
        mesh = sharding.make_mesh(
            dict(zip(("data", "fsdp", "tensor"), axes, strict=True))
        )
        rules = sharding.rules_for(state.model, mesh, fsdp_min_size=64)
        state_sh = sharding.state_shardings(state, mesh, rules, optimizer=opt)
        shardings = (state_sh, sharding.batch_sharding(mesh))
        state = sharding.shard(state, state_sh)
    jitted = eqtrain.jit(step, shardings=shardings)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        tokens = rng.integers(0, 64, (8, 13), dtype=np.int32)
        batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
        if shardings is not None:
            batch = jax.device_put(batch, shardings[1])
        state, metrics = jitted(state, batch)
        losses.append(metrics["loss"])
    return np.asarray(jax.device_get(losses)), state


@pytest.mark.parametrize(
    "kind, steps",  # the default suite: llama for 3 steps; `nox -s slow`: the rest
    [
        ("llama", 3),
        pytest.param("llama", 6, marks=pytest.mark.slow),
        pytest.param("gpt2", 6, marks=pytest.mark.slow),
    ],
)
def test_lora_on_a_2x2x2_mesh_equals_one_device(kind, steps):
    reference, ref_state = _lora_run(None, kind, steps)
    losses, state = _lora_run((2, 2, 2), kind, steps)
    np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-5)
    got = jax.device_get(eqx.filter(state.model, eqx.is_array))
    want = jax.device_get(eqx.filter(ref_state.model, eqx.is_array))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-5)
    layers = state.model.layers if kind == "llama" else state.model.h
    proj = layers.self_attn.q_proj if kind == "llama" else layers.attn.c_attn
    assert proj.weight.sharding.spec == P(None, "tensor", "fsdp")
    assert proj.lora_a.sharding.spec == P(None, None, "fsdp")  # `in`, as the weight
    assert proj.lora_b.sharding.spec[1] == "tensor"  # `out`, as the weight


# -- checkpoints of the trained part, over a referenced base ------------------------
def test_checkpoint_stores_trained_leaves_and_checks_the_base(tmp_path):
    from eqtrain import checkpoint

    def init():
        model = adapted()
        return eqtrain.TrainState.create(
            model, optax.adam(1e-3), key=0, trainable=lora.trainable(model)
        )

    state = init()
    trained = randomize_adapters(state.model)
    state = eqx.tree_at(lambda s: s.model, state, trained)
    ref = {"path": None, "seed": 0, "sha256": "a" * 64}
    ckpt = checkpoint.Checkpointer(tmp_path, async_save=False, base=ref)
    ckpt.save(eqtrain.StepInfo(step=1, metrics={}, num_steps=1, _state=state))
    ckpt.close()
    manifest = checkpoint.read_manifest(tmp_path, step=1)
    assert manifest["base"] == ref
    assert not any(k.endswith(".weight") for k in manifest["leaves"])
    restored = checkpoint.restore(tmp_path, init, init=init, base=ref).state
    for x, y in zip(
        jax.tree.leaves(eqx.filter(restored.model, eqx.is_array)),
        jax.tree.leaves(eqx.filter(state.model, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(checkpoint.CheckpointError, match="only the trained leaves"):
        checkpoint.restore(tmp_path, init)
    with pytest.raises(checkpoint.BaseChangedError, match="seed it was trained with"):
        checkpoint.restore(tmp_path, init, init=init, base={**ref, "sha256": "b" * 64})
    with pytest.raises(eqtrain.ConfigError, match="sha256"):
        checkpoint.Checkpointer(tmp_path / "other", base={"path": "x"})
