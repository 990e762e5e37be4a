import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import optax
import pytest

import eqtrain
from eqtrain import ConfigError, TrainState

from .conftest import Regressor


def test_create_defaults(model):
    state = TrainState.create(model, optax.adam(1e-3), key=0)
    assert int(state.step) == 0 and state.step.dtype == jnp.int32
    assert int(state.skipped) == 0
    assert state.model_state is None and state.ema is None
    # every floating leaf is trainable
    n_float = len(jtu.tree_leaves(eqx.filter(model, eqx.is_inexact_array)))
    assert sum(jtu.tree_leaves(state.trainable)) == n_float


def test_trainable_filter_callable_and_prefix(model):
    only_last = jtu.tree_map(lambda _: False, model)
    only_last = eqx.tree_at(lambda m: m.mlp.layers[-1], only_last, True)
    state = TrainState.create(model, optax.adam(1e-3), key=0, trainable=only_last)
    params = jtu.tree_leaves(state.params)
    assert len(params) == 2  # weight + bias of the last layer
    # frozen leaves have no optimizer state: adam's mu holds only the trained leaves
    mu = state.opt_state[0].mu
    assert len(jtu.tree_leaves(mu)) == 2
    assert mu.scale is None and mu.mlp.layers[0].weight is None

    by_ndim = TrainState.create(
        model,
        optax.sgd(0.1),
        key=0,
        trainable=lambda x: eqx.is_array(x) and x.ndim == 2,
    )
    assert all(p.ndim == 2 for p in jtu.tree_leaves(by_ndim.params))


def test_integer_leaves_never_trainable():
    model = {"w": jnp.ones(3), "ids": jnp.arange(3), "fn": jax.nn.relu}
    state = TrainState.create(model, optax.sgd(0.1), key=0, trainable=True)
    assert state.trainable == {"w": True, "ids": False, "fn": False}


def test_bad_filter_spec_is_a_config_error(model):
    with pytest.raises(ConfigError, match="trainable"):
        TrainState.create(model, optax.adam(1e-3), key=0, trainable="yes")
    with pytest.raises(ConfigError, match="prefix"):
        TrainState.create(model, optax.adam(1e-3), key=0, trainable=[True, False])


def test_abstract_init_allocates_nothing(model):
    abstract = eqx.filter_eval_shape(
        lambda m: TrainState.create(m, optax.adamw(1e-3), key=jr.key(0), ema=True),
        model,
    )
    assert isinstance(abstract.step, jax.ShapeDtypeStruct)
    assert isinstance(abstract.model.scale, jax.ShapeDtypeStruct)
    concrete = TrainState.create(model, optax.adamw(1e-3), key=0, ema=True)
    assert jtu.tree_structure(abstract) == jtu.tree_structure(concrete)


def test_abstract_model_still_masks_floating_leaves(model):
    # eqx.is_array is False for ShapeDtypeStruct: the mask must still see floats.
    abstract_model = eqx.filter_eval_shape(Regressor, jr.key(0))
    mask = eqtrain.trainable_mask(abstract_model, True)
    assert sum(jtu.tree_leaves(mask)) == len(
        jtu.tree_leaves(eqx.filter(model, eqx.is_inexact_array))
    )


def test_ema_model_and_error(model):
    state = TrainState.create(model, optax.adam(1e-3), key=0, ema=True)
    assert eqx.tree_equal(state.ema_model, model)
    # the EMA is a copy, not an alias (donation would otherwise free it twice)
    assert state.ema.scale is not state.model.scale
    with pytest.raises(ConfigError, match="ema=True"):
        _ = TrainState.create(model, optax.adam(1e-3), key=0).ema_model


def test_state_is_an_immutable_pytree(model):
    state = TrainState.create(model, optax.adam(1e-3), key=jr.key(3))
    with pytest.raises(AttributeError):
        state.step = jnp.ones((), jnp.int32)  # type: ignore[misc]
    leaves = jtu.tree_leaves(state)
    assert all(eqx.is_array(x) or callable(x) for x in leaves)
