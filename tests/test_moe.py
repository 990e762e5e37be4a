"""Mixture-of-experts MLPs (`eqtrain.models.SparseMoE` in the shared decoder):
the dispatches against the dense reference, routing and the load-balancing loss
against transformers' modules, the router's terms in the LM losses, capacity,
and expert parallelism on a mesh equal to one device.

Hugging Face import and export of the MoE families: tests/test_hf_moe.py.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqtrain
from eqtrain import losses, models, sharding
from eqtrain._errors import ConfigError
from eqtrain.models import Decoder, DecoderConfig, SparseMoE, load_balancing_loss
from eqtrain.models._experts import MoEOptions, blocked_matmul


def _config(**changes):
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        scan_layers=False,
    )
    return DecoderConfig(**{**base, **changes})


def _randomised(model, std=0.3, seed=1):
    """Every parameter drawn anew (routing far from uniform; NumPy's generator:
    one eager JAX op per shape would compile each)."""
    rng = np.random.default_rng(seed)
    leaves, tree = jax.tree.flatten(model, is_leaf=eqx.is_array)
    new = [
        jnp.asarray(rng.normal(0, std, x.shape), x.dtype) if eqx.is_array(x) else x
        for x in leaves
    ]
    return jax.tree.unflatten(tree, new)


FEATURES = eqx.filter_jit(lambda m, t, **kw: m.batch_features(t, **kw))
"""`model.batch_features`, compiled once per model (eager, each op compiles)."""


def _tokens(rows=4, seq=12, vocab=64, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (rows, seq)))


@pytest.fixture(scope="module")
def qwen_like():
    config = _config(
        moe_intermediate_size=8,
        shared_expert_intermediate_size=16,
        norm_topk_prob=False,
    )
    return _randomised(Decoder(config, jax.random.key(0)))


# -- dispatch ------------------------------------------------------------------------
def test_blocked_matmul_equals_per_row_products():
    rng = np.random.default_rng(0)
    sizes = np.array([5, 0, 17, 3], np.int32)
    x = jnp.asarray(rng.normal(size=(sizes.sum(), 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 7, 6)), jnp.float32)
    group = np.repeat(np.arange(4), sizes)
    want = np.einsum("rk,rnk->rn", np.asarray(x), np.asarray(w)[group])
    for block in (1, 8):
        got = blocked_matmul(x, w, jnp.asarray(sizes), block)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "impl", ["sorted", pytest.param("ragged", marks=pytest.mark.slow)]
)
def test_grouped_dispatch_equals_dense_reference_with_gradients(qwen_like, impl):
    tokens = _tokens()

    def loss(model, which):
        hidden, aux = model.with_options(moe_impl=which).batch_features(tokens)
        return jnp.mean(hidden**2) + load_balancing_loss(aux)

    both = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    value, grads = both(qwen_like, impl)
    ref_value, ref_grads = both(qwen_like, "dense")
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for got, want in zip(
        jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    router = grads.layers.mlp.gate.weight
    assert float(jnp.abs(router).max()) > 0  # the router learns through the weights


def test_rows_routed_alone_equal_the_batch(qwen_like):
    """Dropless routing is per token: a row's logits do not depend on the batch."""
    tokens = _tokens()
    hidden, aux = eqx.filter_jit(lambda m, t: m.batch_features(t))(qwen_like, tokens)
    alone = eqx.filter_jit(lambda m, t: jax.vmap(m.features)(t))(qwen_like, tokens)
    np.testing.assert_allclose(alone, hidden, rtol=1e-5, atol=1e-6)
    assert float(aux["rows"]) == 2 * tokens.size  # two sparse layers
    assert float(aux["counts"].sum()) == 2 * 2 * tokens.size  # top-2


def test_padding_does_not_count_in_the_router_statistics(qwen_like):
    tokens = _tokens()
    segs = jnp.ones_like(tokens).at[:, -4:].set(0)
    _, aux = FEATURES(qwen_like, tokens, segment_ids=segs)
    assert float(aux["rows"]) == 2 * 4 * 8


def test_capacity_drops_the_assignments_past_it(qwen_like):
    tokens = _tokens()
    plenty = qwen_like.with_options(capacity_factor=100.0)
    hidden, aux = FEATURES(plenty, tokens)
    np.testing.assert_allclose(hidden, FEATURES(qwen_like, tokens)[0], atol=1e-5)
    assert float(aux["dropped"]) == 0
    tight = qwen_like.with_options(capacity_factor=0.5)
    hidden, aux = FEATURES(tight, tokens)
    # per layer and expert at most ceil(0.5 * 48 * 2 / 4) = 12 of the 96 kept
    kept = 2 * 96 - float(aux["dropped"])
    assert 0 < kept <= 2 * 4 * 12
    assert np.isfinite(np.asarray(hidden)).all()


def test_capacity_keeps_first_choices_before_second_ones():
    config = _config(num_hidden_layers=1)
    layer = jax.tree.map(lambda a: a[0], Decoder(config, jax.random.key(0)).layers.mlp)
    assert isinstance(layer, SparseMoE)
    # Every token's first choice is expert 0 and its second expert 1.
    gate = jnp.zeros((4, 32)).at[0, 0].set(4.0).at[1, 0].set(2.0)
    layer = eqx.tree_at(lambda m: m.gate.weight, layer, gate)
    x = jnp.zeros((8, 32)).at[:, 0].set(1.0)
    call = eqx.filter_jit(lambda m, x: m(x, options=MoEOptions(capacity_factor=1.0)))
    _, aux = call(layer, x)  # capacity 4
    # 8 first choices for a capacity of 4: 4 dropped; 8 second ones: 4 dropped.
    assert float(aux["dropped"]) == 8


# -- routing rules and the load-balancing loss, against transformers -----------------
def _copy_from_torch(model, sd, layers):
    """An eqtrain MoE decoder with the weights of a transformers one."""

    def stack(fmt):
        return jnp.stack([jnp.asarray(sd[fmt.format(i)]) for i in range(layers)])

    pairs = [
        (lambda m: m.embed_tokens.weight, jnp.asarray(sd["model.embed_tokens.weight"])),
        (lambda m: m.lm_head.weight, jnp.asarray(sd["lm_head.weight"])),
        (lambda m: m.norm.weight, jnp.asarray(sd["model.norm.weight"])),
        (lambda m: m.layers.mlp.gate.weight, stack("model.layers.{}.mlp.gate.weight")),
    ]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        get = lambda m, n=name: getattr(m.layers.self_attn, n)
        pairs.append(
            (
                lambda m, g=get: g(m).weight,
                stack(f"model.layers.{{}}.self_attn.{name}.weight"),
            )
        )
        if get(model).bias is not None:
            b = stack(f"model.layers.{{}}.self_attn.{name}.bias")
            pairs.append((lambda m, g=get: g(m).bias, b))
    for name in ("input_layernorm", "post_attention_layernorm"):
        w = stack(f"model.layers.{{}}.{name}.weight")
        pairs.append((lambda m, n=name: getattr(m.layers, n).weight, w))
    gate_up = stack("model.layers.{}.mlp.experts.gate_up_proj")
    half = gate_up.shape[2] // 2
    experts = lambda m: m.layers.mlp.experts
    pairs += [
        (lambda m: experts(m).gate_proj, gate_up[:, :, :half]),
        (lambda m: experts(m).up_proj, gate_up[:, :, half:]),
        (
            lambda m: experts(m).down_proj,
            stack("model.layers.{}.mlp.experts.down_proj"),
        ),
    ]
    if model.layers.mlp.shared_expert is not None:
        for name in ("gate_proj", "up_proj", "down_proj"):
            w = stack(f"model.layers.{{}}.mlp.shared_expert.{name}.weight")
            pairs.append(
                (lambda m, n=name: getattr(m.layers.mlp.shared_expert, n).weight, w)
            )
        w = stack("model.layers.{}.mlp.shared_expert_gate.weight")
        pairs.append((lambda m: m.layers.mlp.shared_expert_gate.weight, w))
    for where, value in pairs:
        model = eqx.tree_at(where, model, value)
    return model


# Mixtral's: slow (tests/test_hf_moe.py imports every family with its routing)
@pytest.mark.parametrize(
    "family", [pytest.param("mixtral", marks=pytest.mark.slow), "qwen2_moe"]
)
def test_routing_and_aux_loss_equal_transformers(family):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    sizes = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
    )
    if family == "mixtral":
        hf = transformers.MixtralConfig(num_local_experts=4, rope_theta=1e4, **sizes)
        ours = _config(rms_norm_eps=hf.rms_norm_eps, rope_theta=1e4)
    else:
        hf = transformers.Qwen2MoeConfig(
            num_experts=4,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=16,
            norm_topk_prob=False,
            **sizes,
        )
        ours = _config(
            moe_intermediate_size=8,
            shared_expert_intermediate_size=16,
            norm_topk_prob=False,
            attention_bias=True,
            o_proj_bias=False,
            rms_norm_eps=hf.rms_norm_eps,
        )
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(hf).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.3)
    sd = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    model = _copy_from_torch(Decoder(ours, jax.random.key(0)), sd, 2)
    tokens = np.asarray(_tokens(3, 12))
    with torch.no_grad():
        out = reference(torch.tensor(tokens), output_router_logits=True)
    hidden, aux = FEATURES(model, jnp.asarray(tokens))
    logits = hidden @ model.head_weight().T
    np.testing.assert_allclose(logits, out.logits.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(load_balancing_loss(aux), float(out.aux_loss), rtol=1e-5)


# -- the losses ----------------------------------------------------------------------
def test_lm_losses_add_the_router_penalty_and_report_it(qwen_like):
    tokens = _tokens(4, 13)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    model = qwen_like.with_options(router_aux_loss_coef=0.5, router_z_loss_coef=0.01)
    chunked_loss = losses.chunked_causal_lm_loss_fn(chunk=16)

    @eqx.filter_jit
    def everything(model):
        hidden, router = model.batch_features(batch["tokens"])
        logits = hidden @ model.head_weight().T
        return (
            losses.causal_lm_loss(model, batch),
            chunked_loss(model, batch),
            jax.nn.log_softmax(logits),
            router,
        )

    (loss, aux), (chunked, c_aux), logp, router = everything(model)
    targets = np.asarray(batch["targets"])
    ce = -np.take_along_axis(np.asarray(logp), targets[..., None], -1).mean()
    want = ce + 0.5 * aux["moe/aux_loss"] + 0.01 * aux["moe/z_loss"]
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(aux["moe/aux_loss"], load_balancing_loss(router))
    assert float(aux["moe/aux_loss"]) >= 1.0  # E * sum f P >= 1, equality if even
    loads = [float(aux[f"moe/expert_load/{i}"]) for i in range(4)]
    np.testing.assert_allclose(np.mean(loads), 1.0, rtol=1e-6)
    assert float(aux["moe/expert_load_max"]) == max(loads)
    np.testing.assert_allclose(chunked, loss, rtol=1e-5)
    np.testing.assert_allclose(c_aux["moe/aux_loss"], aux["moe/aux_loss"], rtol=1e-6)


def test_flops_count_the_active_parameters():
    from eqtrain.models.decoder import flops_per_token

    dense = _config(num_experts=0, intermediate_size=16)
    sparse = _config(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8)
    router = 6 * 2 * 32 * 8  # 6 x layers x hidden x experts
    assert flops_per_token(sparse, 12) == flops_per_token(dense, 12) + router


def test_config_refusals():
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        _config(num_experts_per_tok=5)
    with pytest.raises(ConfigError, match="capacity_factor"):
        _config(capacity_factor=0)
    with pytest.raises(ConfigError, match="moe_impl"):
        _config(moe_impl="fast")
    with pytest.raises(ConfigError, match="sequence parallelism"):
        _config(sequence_parallel="ring")


# -- expert parallelism --------------------------------------------------------------
OPT = optax.sgd(0.05, momentum=0.9)
KEY = jax.random.key(0)


def _train(model, axes=None, steps=3):
    model = jax.tree.map(lambda a: jnp.array(a, copy=True), model)  # steps donate
    state = eqtrain.TrainState.create(model, OPT, key=0)
    step = eqtrain.train_step(losses.causal_lm_loss, OPT)
    shardings = None
    if axes is not None:
        mesh = sharding.make_mesh(axes)
        rules = sharding.rules_for(state.model, mesh, fsdp_min_size=256)
        state_sh = sharding.state_shardings(state, mesh, rules, optimizer=OPT)
        shardings = (state_sh, sharding.batch_sharding(mesh))
        state = sharding.shard(state, state_sh)
        step = models.under_mesh(step, mesh)  # as `eqtrain fit` traces its step
    jitted = eqtrain.jit(step, shardings=shardings)
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        tokens = rng.integers(0, 64, (8, 17)).astype(np.int32)
        batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
        if shardings is not None:
            batch = jax.device_put(batch, shardings[1])
        state, metrics = jitted(state, batch)
        out.append((metrics["loss"], metrics["moe/aux_loss"]))
    assert jitted.num_traces == 1
    return np.asarray(jax.device_get(out)), state


@pytest.mark.parametrize(
    "impl, axes",
    [
        ("sorted", {"data": 2, "expert": 2, "tensor": 2}),
        pytest.param(
            "ragged", {"data": 2, "expert": 2, "tensor": 2}, marks=pytest.mark.slow
        ),
        pytest.param(
            "sorted", {"fsdp": 2, "expert": 2, "tensor": 2}, marks=pytest.mark.slow
        ),
    ],
    ids=["sorted", "ragged", "fsdp"],
)
@pytest.mark.tuned  # re-run under each CPU setting (test_tuned_settings.py)
def test_expert_parallel_mesh_training_equals_one_device(qwen_like, impl, axes):
    # scanned layers and full remat: the router statistics ride the scan's carry
    model = qwen_like.with_options(moe_impl=impl, scan_layers=True, remat="full")
    reference, ref_state = _train(model)
    got, state = _train(model, axes)
    np.testing.assert_allclose(got, reference, rtol=1e-5)
    for a, b in zip(
        jax.tree.leaves(jax.device_get(state.model)),
        jax.tree.leaves(jax.device_get(ref_state.model)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    experts = state.model.layers.mlp.experts
    assert tuple(experts.gate_proj.sharding.spec)[:2] == (None, "expert")
    # the tokens really travel: all_to_all in the step's program
    mesh = sharding.make_mesh({"data": 2, "expert": 2, "tensor": 2})
    fn = models.under_mesh(lambda m, t: m.batch_features(t)[0], mesh)
    text = jax.jit(fn).lower(model, _tokens(8, 4)).as_text()
    assert "all_to_all" in text
    batch = sharding.batch_sharding(mesh)
    assert batch.spec == P(("data", "fsdp", "expert"))


def test_expert_axis_must_divide_the_experts(qwen_like):
    mesh = sharding.make_mesh({"expert": 8})
    fn = models.under_mesh(lambda m, t: m.batch_features(t)[0], mesh)
    with pytest.raises(ConfigError, match="must divide the number of experts"):
        jax.jit(fn).lower(qwen_like, _tokens(8, 4))


def test_capacity_with_an_expert_axis_is_refused(qwen_like):
    mesh = sharding.make_mesh({"expert": 2, "data": -1})
    model = qwen_like.with_options(capacity_factor=1.0)
    fn = models.under_mesh(lambda m, t: m.batch_features(t)[0], mesh)
    with pytest.raises(ConfigError, match="capacity_factor"):
        jax.jit(fn).lower(model, _tokens(8, 4))


def test_with_options_keeps_the_arrays(qwen_like):
    other = qwen_like.with_options(moe_impl="dense", capacity_factor=2.0)
    assert other.config.capacity_factor == 2.0
    assert other.layers.mlp.experts.gate_proj is qwen_like.layers.mlp.experts.gate_proj
    assert dataclasses.replace(other.config, moe_impl="auto", capacity_factor=None) == (
        qwen_like.config
    )


# -- LoRA and remat ----------------------------------------------------------------
def test_lora_adapts_attention_and_the_shared_expert_and_refuses_experts(qwen_like):
    from eqtrain import lora

    adapted = lora.apply(qwen_like, lora.LoRA(rank=2), key=jax.random.key(0))
    paths = lora.adapter_paths(adapted)
    assert any("self_attn.q_proj" in p for p in paths)
    assert any("shared_expert.down_proj" in p for p in paths)
    assert not any(".experts." in p for p in paths)
    router = lora.apply(qwen_like, lora.LoRA(2, targets=r"mlp\.gate$"), key=KEY)
    assert lora.adapter_paths(router) == ["layers.mlp.gate"]
    with pytest.raises(ConfigError, match="experts is not supported"):
        lora.apply(qwen_like, lora.LoRA(2, targets="experts"), key=jax.random.key(0))
    with pytest.raises(ConfigError, match="the router"):
        lora.apply(qwen_like, lora.LoRA(2, targets="(gate|up)_proj$"), key=KEY)
    # the adapted model trains: the router's adapter gets gradients
    tokens = _tokens(4, 13)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    router = jax.tree.map(
        lambda x: x + 0.1 if eqx.is_array(x) and x.ndim == 4 else x, router
    )
    grads = eqx.filter_jit(
        eqx.filter_grad(lambda m: losses.causal_lm_loss(m, batch)[0])
    )(router)
    assert float(jnp.abs(grads.layers.mlp.gate.lora_b).max()) > 0


@pytest.mark.slow  # the default suite's time: the EP test runs scanned and remat'd
@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_and_scanned_layers_equal_the_plain_model(qwen_like, remat):
    tokens = _tokens(4, 13)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    grad = eqx.filter_jit(
        eqx.filter_value_and_grad(lambda m: losses.causal_lm_loss(m, batch)[0])
    )
    value, grads = grad(qwen_like)
    other = qwen_like.with_options(remat=remat, scan_layers=True)
    o_value, o_grads = grad(other)
    np.testing.assert_allclose(o_value, value, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(o_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# -- a whole run -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_dirs(tmp_path_factory):
    from tests.test_job import TEXT

    root = tmp_path_factory.mktemp("text")
    (root / "train").mkdir()
    (root / "eval").mkdir()
    for i in range(3):
        (root / "train" / f"{i}.txt").write_text(TEXT * (i + 1))
    (root / "eval" / "0.txt").write_text(TEXT[::-1])
    return root


def _fit(text_dirs, run, *extra):
    from eqtrain import config as config_lib, job
    from tests.test_job import tiny

    sets = [
        *tiny(text_dirs, run.parent),
        f"run_dir={run}",
        "model.num_experts=4",
        "model.expert_size=16",
        "model.num_layers=2",
        "model.router_aux_loss_coef=0.01",
        "mesh.expert=2",
        *extra,
    ]
    return job.run(config_lib.load(overrides=sets), echo=lambda s: None)


def _final(run):
    from eqtrain import hf

    model, _ = hf.load(run / "hf")
    return model


@pytest.fixture(scope="module")
def straight_run(text_dirs, tmp_path_factory):
    run = tmp_path_factory.mktemp("moe") / "straight"
    _fit(text_dirs, run)
    return run


@pytest.mark.slow  # the default suite's time: the resume machinery is the dense one
def test_a_run_on_the_expert_axis_resumes_bit_for_bit(
    text_dirs, straight_run, tmp_path
):
    _fit(text_dirs, tmp_path / "resumed", "loop.steps=2")
    _fit(text_dirs, tmp_path / "resumed")  # resume=auto: steps 3 and 4
    for a, b in zip(
        jax.tree.leaves(_final(straight_run)),
        jax.tree.leaves(_final(tmp_path / "resumed")),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)


def test_a_run_on_the_expert_axis_logs_the_router_and_exports_mixtral(straight_run):
    import json

    lines = (straight_run / "metrics.jsonl").read_text().splitlines()
    last = json.loads(lines[-1])
    assert last["step"] == 4
    logged = [json.loads(x) for x in lines if '"moe/aux_loss"' in x]
    assert logged and all(m["moe/aux_loss"] >= 1.0 for m in logged)
    config = json.loads((straight_run / "hf" / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
    assert config["intermediate_size"] == 16


def test_moe_keys_reach_the_run(text_dirs, tmp_path):
    from eqtrain import config as config_lib, job
    from tests.test_job import tiny

    sets = [
        *tiny(text_dirs, tmp_path),
        "model.arch=qwen2_moe",
        "model.num_experts=4",
        "model.experts_per_token=3",
        "model.expert_size=8",
        "model.shared_expert_size=12",
        "model.norm_topk_prob=false",
        "model.router_aux_loss_coef=0.05",
        "model.router_z_loss_coef=0.001",
        "model.capacity_factor=1.5",
        "model.moe_impl=dense",
        "mesh.expert=2",
    ]
    p = job.prepare(config_lib.load(overrides=sets))
    p.close()
    p.fit_kwargs["checkpointer"].close()
    model = p.state.model
    c = model.config
    assert (c.num_experts, c.num_experts_per_tok, c.norm_topk_prob) == (4, 3, False)
    assert (c.router_aux_loss_coef, c.router_z_loss_coef) == (0.05, 0.001)
    assert (c.capacity_factor, c.moe_impl) == (1.5, "dense")
    assert model.layers.mlp.experts.gate_proj.shape[1:3] == (4, 8)
    assert model.layers.mlp.shared_expert.up_proj.weight.shape[1] == 12
    assert dict(p.placement.mesh.shape)["expert"] == 2
    spec = model.layers.mlp.experts.down_proj.sharding.spec
    assert tuple(spec)[:2] == (None, "expert")
