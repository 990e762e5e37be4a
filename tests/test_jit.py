import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqtrain
from eqtrain import StructureError, TrainState

from .conftest import Regressor, mse_loss


def _setup():
    opt = optax.adam(1e-2)
    state = TrainState.create(Regressor(jr.key(0)), opt, key=0)
    return state, eqtrain.train_step(mse_loss, opt)


def test_matches_unjitted_step(batches):
    state, step = _setup()
    ref_state, ref_m = step(state, batches[0])
    out_state, out_m = eqtrain.jit(step, donate=False)(state, batches[0])
    assert eqx.tree_equal(ref_state, out_state, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(out_m["loss"], ref_m["loss"], rtol=1e-6)


def test_donation_consumes_input_and_never_retraces(batches):
    state, step = _setup()
    compiled = eqtrain.jit(step)
    old = state
    state, _ = compiled(state, batches[0])
    assert old.model.scale.is_deleted()  # donated
    for b in batches[1:5]:
        state, _ = compiled(state, b)
    assert compiled.num_traces == 1
    assert int(state.step) == 5
    with pytest.raises(eqtrain.DonatedStateError, match=r"\.model\.mlp"):
        compiled(old, batches[0])  # reusing a consumed state: a clear error


def test_returns_without_waiting_for_the_device():
    def slow_step(state, batch):
        x = batch
        for _ in range(8):
            x = jnp.tanh(x @ x)
        return dataclasses.replace(state, step=state.step + 1), {"x": x.sum()}

    state, _ = _setup()
    compiled = eqtrain.jit(slow_step)
    heavy = jnp.full((1024, 1024), 1.0 / 1024)
    state, m = compiled(state, heavy)  # compile
    m["x"].block_until_ready()
    state, m = compiled(state, heavy)
    assert not m["x"].is_ready()  # the call returned while the device still works
    m["x"].block_until_ready()
    assert int(state.step) == 2


def test_eval_function_mode(batches):
    state, _ = _setup()
    evaluate = eqtrain.jit(eqtrain.eval_step(mse_loss), donate=False)
    m = evaluate(state, batches[0])
    assert evaluate.mode == "fn" and set(m) == {"loss", "mae", "weight"}
    evaluate(state, batches[1])
    assert evaluate.num_traces == 1
    assert not state.model.scale.is_deleted()


def test_donating_a_non_step_is_a_structure_error(batches):
    state, _ = _setup()
    with pytest.raises(StructureError, match="donate=False"):
        eqtrain.jit(eqtrain.eval_step(mse_loss))(state, batches[0])


def test_step_changing_static_structure_is_named(batches):
    state, step = _setup()

    def bad(state, batch):
        new, m = step(state, batch)
        mlp = eqx.tree_at(lambda l: l.activation, new.model.mlp, jax.nn.tanh)
        return dataclasses.replace(
            new, model=eqx.tree_at(lambda m: m.mlp, new.model, mlp)
        ), m

    with pytest.raises(StructureError, match="activation"):
        eqtrain.jit(bad)(state, batches[0])


def test_new_state_structure_is_recompiled_not_confused(batches):
    state, step = _setup()
    compiled = eqtrain.jit(step, donate=False)
    compiled(state, batches[0])
    opt = optax.adam(1e-2)
    other = TrainState.create(Regressor(jr.key(1), width=8), opt, key=0)
    new, _ = compiled(other, batches[0])
    assert new.model.mlp.layers[0].weight.shape == (8, 4)


def test_shardings_data_parallel_on_8_devices(batches):
    assert len(jax.devices()) == 8
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    replicated = NamedSharding(mesh, P())
    by_data = NamedSharding(mesh, P("data"))
    opt = optax.sgd(0.1)
    model = Regressor(jr.key(0))
    ref_state, ref_m = eqtrain.train_step(mse_loss, opt)(
        TrainState.create(model, opt, key=0), batches[0]
    )

    state = TrainState.create(model, opt, key=0)
    state = jax.device_put(eqx.filter(state, eqx.is_array), replicated)
    state = eqx.combine(state, TrainState.create(model, opt, key=0))
    compiled = eqtrain.jit(
        eqtrain.train_step(mse_loss, opt), shardings=(replicated, by_data)
    )
    out, m = compiled(state, batches[0])
    np.testing.assert_allclose(m["loss"], ref_m["loss"], rtol=1e-5, atol=1e-6)
    assert out.model.scale.sharding == replicated
    out, m = compiled(out, batches[1])
    assert compiled.num_traces == 1


def test_per_leaf_shardings_must_match(batches):
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    state, step = _setup()
    with pytest.raises(StructureError, match="arrays"):
        eqtrain.jit(step, shardings=([NamedSharding(mesh, P())], None))(
            state, batches[0]
        )
