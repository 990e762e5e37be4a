"""`data_parallel_step` (explicit `shard_map` + `psum`) equals the automatic step."""

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import optax
import pytest

import eqtrain
from eqtrain import sharding
from eqtrain.losses import causal_lm_loss
from eqtrain.models import Llama, LlamaConfig

from .conftest import Regressor, make_batches, mse_loss


def _losses(step, state, batches, batch_sh):
    losses = []
    for b in batches:
        state, metrics = step(state, jax.device_put(b, batch_sh))
        losses.append(float(metrics["loss"]))
    return state, np.array(losses)


@pytest.mark.parametrize(
    "axes_sizes, axes, accumulate",
    [({"data": 8}, ("data",), 1), ({"data": 2, "fsdp": 4}, ("data", "fsdp"), 2)],
)
def test_equals_the_automatic_step_with_uneven_token_weights(
    axes_sizes, axes, accumulate
):
    mesh = sharding.make_mesh(axes_sizes)
    opt = optax.adam(1e-2)
    batches = make_batches(6, batch_size=16, mask=True)  # shards weigh differently
    rep, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)

    def run(builder):
        state = sharding.shard(TrainStateFor(opt), rep)
        step = eqtrain.jit(builder, shardings=(rep, batch_sh))
        return _losses(step, state, batches, batch_sh)

    auto_state, auto = run(eqtrain.train_step(mse_loss, opt, accumulate=accumulate))
    explicit_state, explicit = run(
        sharding.data_parallel_step(
            mse_loss, opt, mesh, axes=axes, accumulate=accumulate
        )
    )
    np.testing.assert_allclose(explicit, auto, rtol=1e-5, atol=1e-6)
    for a, b in zip(
        jax.tree_util.tree_leaves(eqx.filter(explicit_state.model, eqx.is_array)),
        jax.tree_util.tree_leaves(eqx.filter(auto_state.model, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def TrainStateFor(opt):  # noqa: N802 -- reads like a constructor
    return eqtrain.TrainState.create(Regressor(jr.key(0)), opt, key=0)


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_llama_losses_match_over_twenty_steps():
    mesh = sharding.make_mesh({"data": -1})
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    opt = optax.adamw(3e-3)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (20, 8, 17)).astype(np.int32)
    batches = [
        {"tokens": t[:, :-1], "targets": t[:, 1:], "loss_mask": np.ones((8, 16))}
        for t in tokens
    ]
    rep, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    results = []
    for builder in (
        eqtrain.train_step(causal_lm_loss, opt),
        sharding.data_parallel_step(causal_lm_loss, opt, mesh),
    ):
        state = eqtrain.TrainState.create(Llama(config, jr.key(0)), opt, key=0)
        step = eqtrain.jit(builder, shardings=(rep, batch_sh))
        _, losses = _losses(step, sharding.shard(state, rep), batches, batch_sh)
        results.append(losses)
        assert step.num_traces == 1
    np.testing.assert_allclose(results[1], results[0], atol=1e-5)


def test_errors():
    mesh = sharding.make_mesh({"data": -1})
    with pytest.raises(eqtrain.ConfigError, match="not in the mesh"):
        sharding.data_parallel_step(mse_loss, optax.sgd(0.1), mesh, axes=("batch",))
