"""Issue 58, points 3 and 4: copying a model or state that a donating step would
consume (`eqtrain.copy`), `DonatedStateError` wherever a consumed state can go,
and the mesh helpers on any `jax.sharding.Mesh` (`jax.make_mesh` ones too)."""

import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import eqtrain
from eqtrain import sharding, step as S


DOCS = Path(__file__).resolve().parent.parent / "docs"
OPT = optax.sgd(0.1)


def loss_fn(model, batch, key):
    pred = jax.vmap(model)(batch["x"])[:, 0]
    return jnp.mean((pred - batch["y"]) ** 2), {}


def tiny_mlp(seed=0):
    return eqx.nn.MLP(2, 1, 4, 1, key=jr.key(seed))


BATCH = {  # two rows per device of the 8, for two micro-batches of one
    "x": np.linspace(-1, 1, 32, dtype=np.float32).reshape(16, 2),
    "y": np.linspace(0, 1, 16, dtype=np.float32),
}


@pytest.fixture(scope="module")
def donating_step():
    """One compiled donating step, shared by the tests (compiled once)."""
    return eqtrain.jit(eqtrain.train_step(loss_fn, OPT))


def consumed_state(step):
    """A state whose arrays a donating step has consumed, and the state it made."""
    state = eqtrain.TrainState.create(tiny_mlp(), OPT, key=0)
    new, _ = step(state, BATCH)
    return state, new


def jax_mesh(names=("data",), types=AxisType.Auto):
    """A mesh as docs/checkpoint.md and docs/data.md build it: `jax.make_mesh`."""
    return jax.make_mesh(
        (jax.device_count(),) + (1,) * (len(names) - 1),
        names,
        axis_types=(types,) * len(names),
    )


# -- 3. copying, and donated states -----------------------------------------------


def test_copy_copies_an_mlp_whose_activation_is_no_array():
    model = tiny_mlp()
    with pytest.raises(TypeError):  # the recipe the docs used to give
        jax.tree.map(jnp.copy, model)
    copied = eqtrain.copy(model)
    assert eqx.tree_equal(copied, model)
    assert copied.activation is model.activation  # non-arrays kept as they are
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(copied), strict=True):
        if eqx.is_array(a):
            assert b is not a
            assert b.unsafe_buffer_pointer() != a.unsafe_buffer_pointer()


def test_a_copy_outlives_a_donating_step(donating_step):
    state = eqtrain.TrainState.create(tiny_mlp(), OPT, key=0)
    kept = eqtrain.copy(state)
    donating_step(state, BATCH)
    assert state.model.layers[0].weight.is_deleted()
    assert not any(
        x.is_deleted() for x in jax.tree.leaves(eqx.filter(kept, eqx.is_array))
    )
    # the copy is a state like the original: the same step runs on it again
    again, _ = donating_step(kept, BATCH)
    assert int(again.step) == 1
    assert donating_step.num_traces == 1


def test_copy_keeps_each_arrays_sharding_and_numpy_leaves():
    mesh = sharding.make_mesh({"data": -1})
    state = eqtrain.TrainState.create(tiny_mlp(), OPT, key=0)
    split = NamedSharding(mesh, P("data"))
    tree = {
        "state": sharding.shard(state, sharding.replicated(mesh)),
        "rows": jax.device_put(jnp.arange(16.0), split),
        "host": np.arange(3),
        "name": "run",
    }
    copied = eqtrain.copy(tree)
    assert copied["rows"].sharding == split
    assert copied["state"].step.sharding == tree["state"].step.sharding
    assert copied["name"] == "run"
    assert isinstance(copied["host"], np.ndarray)
    assert copied["host"] is not tree["host"]
    np.testing.assert_array_equal(copied["host"], tree["host"])
    assert (
        jax.random.key_data(copied["state"].key).tolist()
        == jax.random.key_data(state.key).tolist()
    )


def test_copy_works_inside_jit():
    model = tiny_mlp()
    out = eqx.filter_jit(eqtrain.copy)(model)
    assert eqx.tree_equal(out, model)


def test_copy_of_a_consumed_state_names_the_first_deleted_leaf(donating_step):
    state, _ = consumed_state(donating_step)
    with pytest.raises(eqtrain.DonatedStateError, match=r"eqtrain\.copy.*layers\[0\]"):
        eqtrain.copy(state)


def test_shard_of_a_consumed_state_raises_donated_state_error(donating_step):
    state, _ = consumed_state(donating_step)
    mesh = sharding.make_mesh({"data": -1})
    with pytest.raises(eqtrain.DonatedStateError, match=r"sharding\.shard"):
        sharding.shard(state, sharding.replicated(mesh))
    with pytest.raises(eqtrain.DonatedStateError, match=r"sharding\.shard"):
        sharding.shard(state, sharding.state_shardings(state, mesh))


def test_create_from_a_consumed_model_raises_donated_state_error(donating_step):
    state, new = consumed_state(donating_step)
    with pytest.raises(eqtrain.DonatedStateError, match=r"TrainState\.create.*new"):
        eqtrain.TrainState.create(state.model, OPT, key=0, ema=True)
    with pytest.raises(eqtrain.DonatedStateError, match=r"TrainState\.create"):
        eqtrain.TrainState.create(state.model, OPT, key=0)
    eqtrain.TrainState.create(new.model, OPT, key=0, ema=True)  # the live one


def test_evaluate_of_a_consumed_state_raises_donated_state_error(donating_step):
    state, _ = consumed_state(donating_step)
    with pytest.raises(eqtrain.DonatedStateError):
        eqtrain.evaluate(state, eqtrain.eval_step(loss_fn), [BATCH])


@pytest.mark.parametrize("page", ["state.md", "lora.md"])
def test_the_docs_copy_with_eqtrain_copy(page):
    text = (DOCS / page).read_text(encoding="utf-8")
    assert "eqtrain.copy(" in text
    assert not re.search(r"tree(_util)?\.(tree_)?map\(\s*jnp\.copy", text)


def test_no_doc_copies_a_model_with_a_bare_jnp_copy():
    pages = [*DOCS.glob("**/*.md"), DOCS.parent / "README.md"]
    bad = [
        p.name
        for p in pages
        if re.search(r"tree(_util)?\.(tree_)?map\(\s*jnp\.copy", p.read_text("utf-8"))
    ]
    assert not bad


# -- 4. meshes ----------------------------------------------------------------------


def _one_step(step, mesh, state, batch):
    rep = sharding.replicated(mesh)
    batch_sh = sharding.batch_sharding(mesh)
    jitted = eqtrain.jit(step, shardings=(rep, batch_sh))
    return jitted(sharding.shard(state, rep), jax.device_put(batch, batch_sh))


@pytest.fixture(scope="module")
def reference_loss():
    state = eqtrain.TrainState.create(tiny_mlp(), OPT, key=0)
    step = eqtrain.jit(eqtrain.train_step(loss_fn, OPT), donate=False)
    return float(step(state, BATCH)[1]["loss"])


@pytest.mark.parametrize("types", [AxisType.Auto, AxisType.Explicit])
def test_data_parallel_step_runs_on_a_jax_make_mesh(reference_loss, types):
    mesh = jax_mesh(("data",), types)
    state = eqtrain.TrainState.create(tiny_mlp(), OPT, key=0)
    step = sharding.data_parallel_step(loss_fn, OPT, mesh)
    new, metrics = _one_step(step, mesh, state, BATCH)
    assert int(new.step) == 1
    np.testing.assert_allclose(float(metrics["loss"]), reference_loss, rtol=1e-5)


def test_the_docs_data_parallel_recipe_runs_on_a_jax_make_mesh(reference_loss):
    mesh = jax_mesh(("data",))
    grads = S.microbatched(S.value_and_grad(loss_fn), 2)
    step = S.skip_nonfinite(S.gradient_step(sharding.data_parallel(grads, mesh), OPT))
    state = eqtrain.TrainState.create(tiny_mlp(), OPT, key=0)
    _, metrics = _one_step(step, mesh, state, BATCH)
    np.testing.assert_allclose(float(metrics["loss"]), reference_loss, rtol=1e-5)


def test_a_missing_axis_is_named_with_the_function_called_and_the_fix():
    mesh = jax_mesh(("data",))
    with pytest.raises(eqtrain.ConfigError) as caught:
        sharding.data_parallel_step(loss_fn, OPT, mesh, axes=("data", "fsdp"))
    text = str(caught.value)
    assert text.startswith("data_parallel_step")
    assert "'fsdp'" in text
    assert "make_mesh" in text and "axis_names" in text


def test_data_parallel_names_itself_not_data_parallel_step():
    mesh = jax_mesh(("data",))
    with pytest.raises(eqtrain.ConfigError, match=r"^data_parallel:") as caught:
        sharding.data_parallel(S.value_and_grad(loss_fn), mesh, axes=("fsdp",))
    assert "data_parallel_step" not in str(caught.value)


def test_a_mesh_without_any_batch_axis_says_what_to_pass():
    mesh = jax_mesh(("batch",))
    with pytest.raises(eqtrain.ConfigError) as caught:
        sharding.data_parallel_step(loss_fn, OPT, mesh)
    text = str(caught.value)
    assert text.startswith("data_parallel_step")
    assert "axes=('batch',)" in text and "make_mesh" in text


def test_data_parallel_refuses_a_model_state_in_its_own_name():
    mesh = jax_mesh(("data",))
    parallel = sharding.data_parallel(S.value_and_grad(loss_fn), mesh)
    with pytest.raises(eqtrain.ConfigError, match=r"^data_parallel does not"):
        parallel(
            None,
            None,
            BATCH,
            jr.key(0),
            eqx.nn.State(eqx.nn.BatchNorm(2, "b", mode="batch")),
        )


def test_rules_naming_an_axis_the_mesh_lacks_count_it_as_size_1():
    mesh = jax_mesh(("data",))
    state = eqtrain.TrainState.create(tiny_mlp(), OPT, key=0)
    rules = [(r"layers\.0\.weight$", P("tensor", "sequence"))]
    sh = sharding.state_shardings(state, mesh, rules)
    assert sh.model.layers[0].weight.spec == P(None, None)
    # the same placement as on eqtrain's own mesh, where those axes have size 1
    own = sharding.state_shardings(state, sharding.make_mesh({"data": -1}), rules)
    shape = state.model.layers[0].weight.shape
    assert own.model.layers[0].weight.shard_shape(shape) == shape


def test_batch_sharding_sequence_names_the_missing_axis_and_the_fix():
    mesh = jax_mesh(("data",))
    assert sharding.batch_sharding(mesh).spec == P(("data",))
    with pytest.raises(eqtrain.ConfigError) as caught:
        sharding.batch_sharding(mesh, sequence=True)
    text = str(caught.value)
    assert text.startswith("batch_sharding")
    assert "'sequence'" in text and "axis_names" in text


def test_shard_copies_replicated_leaves_too():
    """`device_put(..., may_alias=False)` hands back the source's own buffer for
    a replicated placement on the source's device: `shard` copies such a leaf,
    so a donating step on the placed tree leaves the source alive."""
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    source = {"norm": jnp.arange(8.0), "w": jnp.ones((8, 4))}
    placed = eqtrain.sharding.shard(source, NamedSharding(mesh, P()))
    jax.jit(lambda t: jax.tree.map(lambda a: a * 2, t), donate_argnums=0)(placed)
    assert not any(a.is_deleted() for a in jax.tree.leaves(source))
    assert float(source["norm"].sum()) == 28.0
