"""`eqtrain.sharding` on 8 simulated CPU devices: meshes, rules, and sharded training
that matches the single-device run."""

import functools
import importlib.util
import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqtrain
import eqtrain.losses
from eqtrain import ConfigError, StructureError, sharding
from eqtrain.checkpoint import Checkpointer, restore
from eqtrain.data import Loader
from eqtrain.models import GPT2, GPT2Config, Llama, LlamaConfig

from .conftest import Regressor


LLAMA = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
GPT = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
OPT = optax.adamw(1e-2)
STEPS, BATCH, SEQ = 20, 8, 16
MIN_SIZE = 256  # the tiny models' weights are below the default FSDP threshold
MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]


def rows(num_batches=STEPS):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, size=(num_batches * BATCH, SEQ + 1), dtype=np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}


def batches(num_batches=STEPS):
    data = rows(num_batches)
    return [
        {k: v[i * BATCH : (i + 1) * BATCH] for k, v in data.items()}
        for i in range(num_batches)
    ]


def init(model="llama"):
    net = Llama(LLAMA, jr.key(0)) if model == "llama" else GPT2(GPT, jr.key(0))
    return eqtrain.TrainState.create(net, OPT, key=0)


def mesh_of(axes):
    """`(data, fsdp, tensor)` or `(data, fsdp, tensor, sequence)` as a mesh."""
    names = ("data", "fsdp", "tensor", "sequence")[: len(axes)]
    return sharding.make_mesh(dict(zip(names, axes, strict=True)))


def setup(axes, model="llama"):
    """Mesh, state shardings, batch sharding and the compiled step (cached: one
    compile per mesh for the whole module)."""
    return _setup(axes, model)


@functools.cache
def _setup(axes, model):
    step = eqtrain.train_step(eqtrain.losses.causal_lm_loss, OPT)
    if axes is None:
        return None, None, None, eqtrain.jit(step)
    mesh = mesh_of(axes)
    abstract = eqx.filter_eval_shape(init, model)
    rules = sharding.rules_for(abstract.model, mesh, fsdp_min_size=MIN_SIZE)
    state_sh = sharding.state_shardings(abstract, mesh, rules, optimizer=OPT)
    batch_sh = sharding.batch_sharding(mesh, sequence=len(axes) == 4)
    return mesh, state_sh, batch_sh, eqtrain.jit(step, shardings=(state_sh, batch_sh))


def trajectory(axes, model="llama", num_steps=STEPS):
    """Losses of `num_steps` steps, and the final state."""
    return _trajectory(axes, model, num_steps)


@functools.cache
def _trajectory(axes, model, num_steps):
    _, state_sh, batch_sh, step = setup(axes, model)
    state = init(model)
    if state_sh is not None:
        state = sharding.shard(state, state_sh)
    losses = []
    for batch in batches(num_steps):
        if batch_sh is not None:
            # As the Loader does. Mixing numpy and placed batches would retrace
            # once: a placed array's type carries its (abstract) mesh.
            batch = jax.device_put(batch, batch_sh)
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    return np.asarray(jax.device_get(losses)), state


def assert_placed(state, state_sh):
    """Every array of `state` lies exactly as `state_sh` says."""
    arrays = jtu.tree_leaves(eqx.filter(state, eqx.is_array))
    expected = jtu.tree_leaves(state_sh, is_leaf=lambda x: isinstance(x, NamedSharding))
    assert len(arrays) == len(expected)
    for x, want in zip(arrays, expected, strict=True):
        assert x.sharding.mesh == want.mesh
        assert x.sharding.spec == want.spec


# -- meshes ------------------------------------------------------------------------
def test_make_mesh_axes_and_sizes():
    mesh = sharding.make_mesh({"data": -1, "tensor": 2})
    assert dict(mesh.shape) == {
        "data": 4,
        "fsdp": 1,
        "expert": 1,
        "sequence": 1,
        "tensor": 2,
    }
    assert mesh.axis_names == sharding.AXES
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert dict(sharding.make_mesh().shape)["data"] == 8
    four = sharding.make_mesh({"fsdp": 4}, devices=jax.devices()[:4])
    assert four.devices.size == 4


@pytest.mark.parametrize(
    "axes, match",
    [
        ({"data": 3}, r"multiply to 3, but there are 8 devices.*data=-1"),
        ({"data": 2, "tensor": 2}, r"\{'data': 2, 'tensor': 2\} multiply to 4"),
        ({"data": -1, "tensor": 3}, "multiply to 3, but there are 8"),
        ({"data": -1, "fsdp": -1}, "at most one mesh axis may be -1"),
        ({"model": 8}, r"unknown mesh axes \['model'\].*'data', 'fsdp'"),
        ({"data": 0, "fsdp": 8}, "positive ints or -1"),
    ],
)
def test_make_mesh_errors(axes, match):
    with pytest.raises(ConfigError, match=match):
        sharding.make_mesh(axes)


def test_mesh_advice_fits_the_axes_given():
    # mesh.sequence = 4 on one device, data = -1 already: advising `data=-1`
    # (issue 26) was no advice; the divisors of the device count are.
    with pytest.raises(ConfigError) as caught:
        sharding.make_mesh({"data": -1, "sequence": 4}, devices=jax.devices()[:1])
    message = str(caught.value)
    assert "e.g. data=-1" not in message and "set data=-1" not in message
    assert "there is 1 device, which 4 does not divide" in message
    # No axis can take the rest (sequence = 4 on 2 devices): no -1 advice at all.
    with pytest.raises(ConfigError) as caught:
        sharding.make_mesh({"data": 1, "sequence": 4}, devices=jax.devices()[:2])
    assert "-1" not in str(caught.value)


def test_batch_sharding_and_check():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "sequence": 2})
    assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp", "expert"))
    assert sharding.batch_sharding(mesh, sequence=True).spec == P(
        ("data", "fsdp", "expert"), "sequence"
    )
    sharding.check_batch(8, mesh, seq_len=16)
    with pytest.raises(
        ConfigError, match=r"batch of 6 .* data x fsdp x expert = 4 devices"
    ):
        sharding.check_batch(6, mesh)
    with pytest.raises(ConfigError, match="in 4 micro-batches of 2 does not split"):
        sharding.check_batch(8, mesh, accumulate=4)
    with pytest.raises(ConfigError, match="sequence length 15"):
        sharding.check_batch(8, mesh, seq_len=15)


# -- rules -------------------------------------------------------------------------
def test_rules_first_match_padding_and_fsdp():
    mesh = mesh_of((2, 2, 2))
    rules = sharding.Rules(
        (
            (r"a\.w$", P("tensor")),
            (r"\.w$", P(None, "tensor")),
            (r"stack", P("layers")),
        ),
        fsdp_min_size=16,
    )
    spec = lambda path, shape: rules.spec_for(path, shape, mesh)
    assert spec("a.w", (8, 8, 2)) == P("tensor", "fsdp", None)  # ties: the last
    assert spec("b.w", (8, 6, 6)) == P("fsdp", "tensor", None)  # 6 % 2 == 0 too
    assert spec("b.w", (8, 6, 3)) == P("fsdp", "tensor", None)
    assert spec("stack.x", (64, 4)) == P(None, "fsdp")  # never the layer axis
    assert spec("stack.x", (64, 3)) == P(None, None)
    assert spec("small", (3, 5)) == P(None, None)  # nothing divisible
    assert spec("small", (2, 4)) == P(None, None)  # below fsdp_min_size
    assert spec("scalar", ()) == P()
    no_fsdp = sharding.Rules(rules.patterns, fsdp_min_size=None)
    assert no_fsdp.spec_for("a.w", (8, 8), mesh) == P("tensor", None)


def test_fsdp_where_the_rule_says_if_it_splits():
    mesh = mesh_of((2, 2, 2))
    rules = sharding.Rules(
        ((r"emb", P(("tensor", "fsdp"), None)), (r"w", P("layers", "fsdp"))),
        fsdp_min_size=16,
    )
    spec = lambda path, shape: rules.spec_for(path, shape, mesh)
    assert spec("emb", (8, 16)) == P(("tensor", "fsdp"), None)  # not the larger dim
    assert spec("emb", (6, 16)) == P("tensor", "fsdp")  # 6 % 4: the pass decides
    assert spec("emb", (6, 3)) == P("tensor", None)  # nowhere: replicated over fsdp
    assert spec("emb", (2, 4)) == P("tensor", None)  # small: replicated over fsdp
    assert spec("w", (4, 3, 8)) == P(None, None, "fsdp")
    # With the pass off, a rule's fsdp is binding like any axis.
    strict = sharding.Rules(rules.patterns, fsdp_min_size=None)
    assert strict.spec_for("emb", (4, 2), mesh) == P(("tensor", "fsdp"), None)
    with pytest.raises(ConfigError, match=r"`emb` \(shape \(6, 16\)\)"):
        strict.spec_for("emb", (6, 16), mesh)
    with pytest.raises(ConfigError, match="'layers' marks a whole dimension"):
        sharding.Rules(((r"x", P(("layers", "fsdp"))),))


def test_rule_errors_name_the_leaf():
    mesh = mesh_of((2, 1, 4))
    rules = sharding.Rules(((r"q_proj\.weight$", P(None, "tensor")),))
    with pytest.raises(
        ConfigError,
        match=r"`model.q_proj.weight` \(shape \(2, 6, 8\)\).*dimension 1 of size 6"
        r".*'tensor' \(4 ways; mesh axes \{'data': 2, 'tensor': 4\}\)",
    ):
        rules.spec_for("model.q_proj.weight", (2, 6, 8), mesh)
    with pytest.raises(
        ConfigError, match=r"gives P\(None, .tensor.\) \(2 dimensions\).* shape \(8,\)"
    ):
        rules.spec_for("model.q_proj.weight", (8,), mesh)
    with pytest.raises(ConfigError, match="unknown axis 'model'"):
        sharding.Rules(((r"x", P("model")),))
    with pytest.raises(ConfigError, match="'tensor' appears twice"):
        sharding.Rules(((r"x", P("tensor", "tensor")),))


def test_rules_for_models():
    tp = mesh_of((2, 2, 2))
    llama = sharding.rules_for(init().model, tp)
    assert llama.match("model.layers.self_attn.k_proj.weight") == P(
        "layers", "tensor", "fsdp"
    )
    assert llama.match("model.layers.mlp.down_proj.weight") == P(
        "layers", "fsdp", "tensor"
    )
    assert llama.match("model.layers.input_layernorm.weight") == P("layers")
    assert llama.match("model.lm_head.weight") == P(("tensor", "fsdp"), None)
    # tensor = 1: the TP entries are dropped, the layer and fsdp marks stay.
    fsdp = sharding.rules_for(init().model, mesh_of((1, 8, 1)))
    q = "model.layers.self_attn.q_proj.weight"
    assert fsdp.match(q) == P("layers", None, "fsdp")
    assert fsdp.match("model.embed_tokens.weight") == P("fsdp", None)
    extra = sharding.rules_for(init().model, tp, extra=[(r"lm_head", P())])
    assert extra.match("model.lm_head.weight") == P()
    with pytest.raises(ConfigError, match="Regressor has no tensor-parallel rules"):
        sharding.rules_for(Regressor(jr.key(0)), tp)
    # GPT-2's real vocabulary (50257) does not split: the error names the leaf.
    big = GPT2(
        GPT2Config(vocab_size=51, n_positions=8, n_embd=8, n_layer=1, n_head=2),
        jr.key(0),
    )
    rules = sharding.rules_for(big, tp)
    with pytest.raises(ConfigError, match=r"`wte.weight` \(shape \(51, 8\)\)"):
        sharding.state_shardings(big, tp, rules)


@settings(derandomize=True, deadline=None, max_examples=30)
@given(
    shape=st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]), max_size=4),
    axes=st.sampled_from(MESHES),
    leading_layers=st.booleans(),
)
def test_fsdp_pass_properties(shape, axes, leading_layers):
    mesh = _MESHES[axes]
    patterns = ((r"", P("layers")),) if leading_layers and shape else ()
    spec = sharding.Rules(patterns, fsdp_min_size=4).spec_for("x", tuple(shape), mesh)
    assert len(spec) == len(shape)
    fsdp = [i for i, e in enumerate(spec) if e == "fsdp"]
    assert len(fsdp) <= 1
    if fsdp:
        assert shape[fsdp[0]] % mesh.shape["fsdp"] == 0
        assert not (leading_layers and fsdp[0] == 0)
    elif mesh.shape["fsdp"] > 1 and np.prod(shape) >= 4:
        first = 1 if leading_layers else 0
        assert all(n % mesh.shape["fsdp"] for n in shape[first:])


_MESHES = {axes: mesh_of(axes) for axes in MESHES}


# -- state shardings ---------------------------------------------------------------
def test_state_shardings_follow_parameters():
    model = Regressor(jr.key(0), width=64)
    state = eqtrain.TrainState.create(
        model,
        OPT,
        key=0,
        ema=True,
        trainable=lambda x: eqx.is_array(x) and x.ndim == 2,  # weights only
    )
    mesh = mesh_of((1, 8, 1))
    with_opt = sharding.state_shardings(state, mesh, None, optimizer=OPT)
    by_structure = sharding.state_shardings(state, mesh)
    specs = lambda tree: [s.spec for s in jtu.tree_leaves(tree)]
    assert len(specs(with_opt)) == len(jtu.tree_leaves(eqx.filter(state, eqx.is_array)))
    assert specs(with_opt) == specs(by_structure)
    rules = sharding.Rules(fsdp_min_size=65)  # the [64, 64] weight, not the biases
    sh = sharding.state_shardings(state, mesh, rules, optimizer=OPT)
    assert sh.model.mlp.layers[1].weight.spec == P(None, "fsdp")
    assert sh.model.mlp.layers[1].bias.spec == P(None)  # 64 elements: replicated
    assert sh.opt_state[0].mu.mlp.layers[1].weight.spec == P(None, "fsdp")
    assert sh.opt_state[0].mu.mlp.layers[1].bias is None  # frozen: no moments
    assert sh.opt_state[0].count.spec == P()
    assert sh.ema.mlp.layers[1].weight.spec == P(None, "fsdp")
    assert sh.step.spec == sh.key.spec == sh.skipped.spec == P()
    placed = sharding.shard(state, sh)
    assert_placed(placed, sh)
    # A bare model (any pytree) follows the rules too.
    assert sharding.state_shardings(model, mesh, rules).mlp.layers[1].weight.spec == (
        P(None, "fsdp")
    )


@pytest.mark.parametrize("kind", ["masked", "multi_steps", "chain"])
def test_optimizer_state_of_wrapped_optimizers(kind):
    model = Regressor(jr.key(0), width=64)
    mask = jax.tree.map(lambda x: x.ndim == 2, eqx.filter(model, eqx.is_array))
    opt = {
        "masked": optax.masked(optax.adam(1e-3), mask),
        "multi_steps": optax.MultiSteps(optax.adam(1e-3), 4).gradient_transformation(),
        "chain": optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    }[kind]
    state = eqtrain.TrainState.create(model, opt, key=0)
    mesh, rules = mesh_of((1, 8, 1)), sharding.Rules(fsdp_min_size=65)
    with_opt = sharding.state_shardings(state, mesh, rules, optimizer=opt)
    by_structure = sharding.state_shardings(state, mesh, rules)
    specs = lambda sh: [x.spec for x in jtu.tree_leaves(sh.opt_state)]
    assert specs(with_opt) == specs(by_structure)
    assert len(specs(with_opt)) == len(
        jtu.tree_leaves(eqx.filter(state.opt_state, eqx.is_array))
    )
    moments = {"masked": 2, "multi_steps": 3, "chain": 2}[kind]  # + accumulated grads
    assert specs(with_opt).count(P(None, "fsdp")) == moments  # the [64, 64] weight
    assert_placed(sharding.shard(state, with_opt), with_opt)


def test_model_state_replicated_unless_a_rule_matches():
    model, model_state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
        64, "batch", mode="ema"
    )
    state = eqtrain.TrainState.create(model, OPT, key=0, model_state=model_state)
    mesh = mesh_of((1, 8, 1))
    specs = lambda sh: [s.spec for s in jtu.tree_leaves(sh.model_state)]
    sh = sharding.state_shardings(state, mesh, sharding.Rules(fsdp_min_size=1))
    assert specs(sh) == [P(), P(None), P(None)]  # a flag, running mean and var
    assert sh.model.weight.spec == P("fsdp")
    rules = sharding.Rules(((r"^model_state\.1\.", P("fsdp")),), fsdp_min_size=1)
    sh = sharding.state_shardings(state, mesh, rules)
    assert specs(sh) == [P(), P("fsdp"), P("fsdp")]


def test_shard_copies_so_donation_keeps_the_original():
    state = init()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    local = sharding.shard(state, one)
    step = setup(None)[3]
    step(sharding.shard(local, one), batches(1)[0])
    assert not local.model.embed_tokens.weight.is_deleted()
    with pytest.raises(StructureError, match="has 3 shardings but the tree has"):
        sharding.shard(state, [one] * 3)


def test_describe_table():
    state = init()
    _, state_sh, _, _ = setup((2, 2, 2))
    rows_ = sharding.describe(state, state_sh)
    by_path = {r.path: r for r in rows_}
    q = by_path["model.layers.self_attn.q_proj.weight"]
    assert q.shape == (2, 32, 32) and q.dtype == "float32"
    assert q.spec == "P(None, 'tensor', 'fsdp')"
    assert q.bytes == 2 * 32 * 32 * 4 and q.bytes_per_device == q.bytes // 4
    assert by_path["opt_state.0.count"].spec == "P()"
    assert by_path["key"].bytes_per_device == 8
    table = sharding.format_table(rows_)
    assert "model.layers.self_attn.q_proj.weight" in table
    assert table.splitlines()[-1].startswith("total: ")
    abstract = eqx.filter_eval_shape(init)
    assert sharding.describe(abstract, state_sh) == rows_


# -- sharded training equals single-device training ----------------------------------
# pure data (8x1x1), pure FSDP (1x8x1) and 1x2x4 under `nox -s slow` (default-suite
# time): 2x2x2 takes every axis
@pytest.mark.parametrize(
    "axes",
    [a if a == (2, 2, 2) else pytest.param(a, marks=pytest.mark.slow) for a in MESHES],
    ids=lambda a: "x".join(map(str, a)),
)
def test_llama_meshes_match_single_device(axes):
    reference, _ = trajectory(None)
    losses, state = trajectory(axes)
    np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-5)
    _, state_sh, _, step = setup(axes)
    assert step.num_traces == 1
    assert_placed(state, state_sh)  # after 20 steps: the out-shardings are pinned
    if axes == (2, 2, 2):
        q = P(None, "tensor", "fsdp")
        assert state.model.layers.self_attn.q_proj.weight.sharding.spec == q
        assert state.opt_state[0].nu.layers.self_attn.q_proj.weight.sharding.spec == q
        down = state.opt_state[0].mu.layers.mlp.down_proj.weight.sharding.spec
        assert down == P(None, "fsdp", "tensor")
        assert state.opt_state[0].count.sharding.spec == P()
        vocab = P(("tensor", "fsdp"), None)  # FSDP on the vocab, not the hidden
        assert state.model.lm_head.weight.sharding.spec == vocab


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_sequence_axis_matches_single_device():
    reference, _ = trajectory(None)
    losses, state = trajectory((2, 2, 1, 2))
    np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-5)
    assert setup((2, 2, 1, 2))[2].spec == P(("data", "fsdp", "expert"), "sequence")


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_gpt2_tensor_parallel_matches_single_device():
    reference, _ = trajectory(None, "gpt2", 10)
    losses, state = trajectory((2, 2, 2), "gpt2", 10)
    np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-5)
    c_attn = state.model.h.attn.c_attn.weight.sharding.spec
    assert c_attn == P(None, "tensor", "fsdp")
    assert state.model.h.mlp.c_proj.weight.sharding.spec == P(None, "fsdp", "tensor")
    assert state.model.wte.weight.sharding.spec == P(("tensor", "fsdp"), None)


def test_checkpoint_moves_to_another_mesh(tmp_path):
    """Train 10 steps on (2,2,2) with the loader, save, restore on (1,2,4) and go on:
    the losses are those of the uninterrupted (2,2,2) run."""
    straight, _ = trajectory((2, 2, 2))
    _, sh_a, batch_a, step_a = setup((2, 2, 2))
    loader = Loader(rows(), BATCH, shuffle=False, sharding=batch_a)
    first = eqtrain.fit(
        sharding.shard(init(), sh_a),
        step_a,
        loader,
        num_steps=10,
        checkpointer=Checkpointer(tmp_path, data=loader),
    )
    assert [h["loss"] for h in first.history] == pytest.approx(straight[:10], abs=1e-6)
    mesh_b, sh_b, batch_b, step_b = setup((1, 2, 4))
    restored = restore(tmp_path, init, shardings=sh_b)
    assert restored.step == 10 and restored.manifest["mesh"]["tensor"] == 2
    assert_placed(restored.state, sh_b)
    loader_b = Loader(
        rows(), BATCH, shuffle=False, sharding=batch_b, position=restored.data_position
    )
    second = eqtrain.fit(restored.state, step_b, loader_b, num_steps=STEPS)
    losses = [h["loss"] for h in second.history]
    np.testing.assert_allclose(losses, straight[10:], rtol=0, atol=1e-5)
    assert step_a.num_traces == 1 and step_b.num_traces == 1
    assert_placed(second.state, sh_b)
    assert second.state.model.layers.mlp.up_proj.weight.sharding.mesh == mesh_b


def test_batch_arrays_are_split():
    mesh = mesh_of((2, 2, 2))
    batch = jax.device_put(jnp.zeros((8, 16)), sharding.batch_sharding(mesh))
    assert {s.data.shape for s in batch.addressable_shards} == {(2, 16)}


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_mesh_benchmark_quick(capsys, monkeypatch):
    """`benchmarks/mesh.py --quick` runs (in this process: it has the 8 devices)."""
    path = Path(__file__).parent.parent / "benchmarks" / "mesh.py"
    monkeypatch.syspath_prepend(str(path.parent))  # its `_machine` helper
    spec = importlib.util.spec_from_file_location("mesh_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--quick"])
    out = capsys.readouterr().out
    records = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert records.pop(0)["machine"]["cores"]  # the machine first
    reference = records.pop(0)  # the one-device step the ratios are relative to
    assert reference["mesh"] == "1 device" and reference["step_ms"] > 0
    assert all(r["step_time_vs_1_device"] > 0 for r in records)
    assert [r["model"] for r in records] == [
        "llama",
        "gpt2:split_packed",
        "gpt2:replicated",
    ]
    for r in records:
        assert r["max_loss_diff"] < 1e-5 and r["flops_per_device"] > 0
    packed, replicated = records[1:]
    assert packed["state_bytes_per_device"] < replicated["state_bytes_per_device"]
