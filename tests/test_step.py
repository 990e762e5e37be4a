"""Contract and equivalence tests for the step builders."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import eqtrain
from eqtrain import ConfigError, TrainState

from .conftest import Regressor, make_batches, mse_loss


class BNModel(eqx.Module):
    lin: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jr.split(key)
        self.lin = eqx.nn.Linear(4, 8, key=k1)
        self.bn = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
        self.out = eqx.nn.Linear(8, 1, key=k2)

    def __call__(self, x, state):
        h, state = self.bn(self.lin(x), state)
        return self.out(jax.nn.relu(h))[0], state


def bn_loss(model, batch, key, *, model_state):
    pred, new_state = jax.vmap(
        model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
    )(batch["x"], model_state)
    return jnp.mean((pred - batch["y"]) ** 2), {}, new_state


def _case_plain():
    opt = optax.adam(1e-2)
    return TrainState.create(Regressor(jr.key(0)), opt, key=0), eqtrain.train_step(
        mse_loss, opt
    )


def _case_accumulate():
    opt = optax.sgd(0.05)
    state = TrainState.create(Regressor(jr.key(0)), opt, key=0)
    return state, eqtrain.train_step(mse_loss, opt, accumulate=2)


def _case_bf16_policy():
    opt = optax.adamw(1e-2)
    state = TrainState.create(Regressor(jr.key(0)), opt, key=0)
    return state, eqtrain.train_step(mse_loss, opt, precision="bf16")


def _case_bf16_params():
    opt = optax.adam(1e-2)
    state = TrainState.create(Regressor(jr.key(0), dtype=jnp.bfloat16), opt, key=0)
    return state, eqtrain.train_step(mse_loss, opt)


def _case_ema():
    opt = optax.adam(1e-2)
    state = TrainState.create(Regressor(jr.key(0)), opt, key=0, ema=True)
    return state, eqtrain.train_step(mse_loss, opt, ema=0.9)


def _case_frozen():
    opt = optax.adam(1e-2)
    model = Regressor(jr.key(0))
    spec = eqx.tree_at(lambda m: m.scale, jtu.tree_map(lambda _: True, model), False)
    state = TrainState.create(model, opt, key=0, trainable=spec)
    return state, eqtrain.train_step(mse_loss, opt)


def _case_stateful():
    opt = optax.adam(1e-2)
    model, mstate = eqx.nn.make_with_state(BNModel)(jr.key(0))
    state = TrainState.create(model, opt, key=0, model_state=mstate)
    return state, eqtrain.train_step(bn_loss, opt, accumulate=2)


def _case_stop_schedule():
    opt = optax.inject_hyperparams(optax.adam)(
        learning_rate=optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    )
    state = TrainState.create(Regressor(jr.key(0)), opt, key=0)
    return state, eqtrain.train_step(mse_loss, opt, nonfinite="stop")


def _case_optax_chain_clip():
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.lion(1e-3))
    state = TrainState.create(Regressor(jr.key(0)), opt, key=0)
    return state, eqtrain.train_step(
        mse_loss, opt, nonfinite="ignore", schedule=optax.constant_schedule(1e-3)
    )


CASES = {
    "plain": _case_plain,
    "accumulate": _case_accumulate,
    "bf16_policy": _case_bf16_policy,
    "bf16_params": _case_bf16_params,
    "ema": _case_ema,
    "frozen": _case_frozen,
    "stateful": _case_stateful,
    "stop_schedule": _case_stop_schedule,
    "chain_clip_ignore": _case_optax_chain_clip,
}


def _copy(tree):
    return jtu.tree_map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, tree)


def _arrays(tree):
    return jtu.tree_leaves(eqx.filter(tree, eqx.is_array))


def _shapes(tree):
    return jtu.tree_map(lambda x: (x.shape, x.dtype) if eqx.is_array(x) else x, tree)


@pytest.mark.parametrize("name", sorted(CASES))
def test_contract_no_retrace_stable_state(name, batches):
    state, step = CASES[name]()
    before = _shapes(state)
    compiled = eqtrain.jit(step)
    for b in batches[:3]:
        state, metrics = compiled(state, b)
    assert compiled.num_traces == 1
    assert compiled.mode == "step"
    # structure, shapes and dtypes (including bf16 params) are preserved
    assert jtu.tree_structure(before) == jtu.tree_structure(_shapes(state))
    assert before == _shapes(state)
    assert int(state.step) == 3
    for key in ("loss", "grad_norm", "skipped", "weight"):
        assert key in metrics and metrics[key].shape == ()
    assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_contract_filter_jit_traces_once(name, batches):
    state, step = CASES[name]()
    jitted = eqx.filter_jit(eqx.debug.assert_max_traces(step, max_traces=1))
    for b in batches[:3]:
        state, _ = jitted(state, b)


@pytest.mark.parametrize("name", sorted(CASES))
def test_contract_abstract(name, batches):
    state, step = CASES[name]()
    abstract = eqx.filter_eval_shape(lambda: state)
    out, metrics = eqx.filter_eval_shape(step, abstract, batches[0])
    assert eqx.tree_equal(abstract, out)
    assert all(isinstance(v, jax.ShapeDtypeStruct) for v in metrics.values())


def test_learning_rate_metric_follows_schedule(batches):
    state, step = _case_stop_schedule()
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    compiled = eqtrain.jit(step)
    for i, b in enumerate(batches[:4]):
        state, m = compiled(state, b)
        np.testing.assert_allclose(float(m["learning_rate"]), schedule(i), rtol=1e-6)


def test_schedule_argument_reports_lr(batches):
    state, step = _case_optax_chain_clip()
    _, m = eqtrain.jit(step)(state, batches[0])
    np.testing.assert_allclose(float(m["learning_rate"]), 1e-3)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_accumulation_equals_full_batch_token_weighted(n):
    # Uneven masks: micro-batches hold different token counts, so a plain mean of
    # micro-batch losses would be wrong; the weighted one must equal the full batch.
    (batch,) = make_batches(1, batch_size=16, seed=3, mask=True)
    opt = optax.sgd(0.1)
    model = Regressor(jr.key(1))
    full_state, full_m = eqtrain.train_step(mse_loss, opt)(
        TrainState.create(model, opt, key=0), batch
    )
    acc_state, acc_m = eqtrain.train_step(mse_loss, opt, accumulate=n)(
        TrainState.create(model, opt, key=0), batch
    )
    np.testing.assert_allclose(acc_m["loss"], full_m["loss"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        acc_m["grad_norm"], full_m["grad_norm"], rtol=1e-5, atol=1e-6
    )
    assert float(acc_m["weight"]) == float(batch["loss_mask"].sum())
    for a, b in zip(_arrays(acc_state.model), _arrays(full_state.model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_accumulation_weight_from_aux():
    (batch,) = make_batches(1, batch_size=8, seed=4, mask=True)

    def loss_with_weight(model, batch, key):
        loss, aux = mse_loss(model, batch, key)
        return loss, {**aux, "weight": jnp.sum(batch["loss_mask"])}

    opt = optax.sgd(0.1)
    model = Regressor(jr.key(1))
    renamed = {"x": batch["x"], "y": batch["y"], "loss_mask": batch["loss_mask"]}
    s1, m1 = eqtrain.train_step(loss_with_weight, opt)(
        TrainState.create(model, opt, key=0), renamed
    )
    s4, m4 = eqtrain.train_step(loss_with_weight, opt, accumulate=4)(
        TrainState.create(model, opt, key=0), renamed
    )
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-5, atol=1e-6)
    assert "weight" in m4 and float(m4["weight"]) == float(batch["loss_mask"].sum())


def test_accumulate_must_divide_batch(model):
    opt = optax.sgd(0.1)
    step = eqtrain.train_step(mse_loss, opt, accumulate=3)
    with pytest.raises(ConfigError, match="accumulate=3"):
        step(TrainState.create(model, opt, key=0), make_batches(1, batch_size=8)[0])


def test_bad_arguments_raise_config_errors():
    opt = optax.sgd(0.1)
    with pytest.raises(ConfigError, match="accumulate"):
        eqtrain.train_step(mse_loss, opt, accumulate=0)
    with pytest.raises(ConfigError, match="nonfinite"):
        eqtrain.train_step(mse_loss, opt, nonfinite="explode")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ema"):
        eqtrain.train_step(mse_loss, opt, ema=1.5)
    with pytest.raises(ConfigError, match="precision"):
        eqtrain.train_step(mse_loss, opt, precision="int8")


def test_ema_needs_state_with_ema(model, batches):
    opt = optax.sgd(0.1)
    step = eqtrain.train_step(mse_loss, opt, ema=0.9)
    with pytest.raises(ConfigError, match="ema=True"):
        step(TrainState.create(model, opt, key=0), batches[0])


def test_bf16_policy_close_to_f32(batches):
    opt = optax.sgd(0.05)
    model = Regressor(jr.key(2))
    # Each state gets its own buffers: a donating step consumes its input's arrays.
    s32 = TrainState.create(_copy(model), opt, key=0)
    s16 = TrainState.create(_copy(model), opt, key=0)
    step32 = eqtrain.jit(eqtrain.train_step(mse_loss, opt))
    step16 = eqtrain.jit(eqtrain.train_step(mse_loss, opt, precision="bf16"))
    for b in batches[:5]:
        s32, m32 = step32(s32, b)
        s16, m16 = step16(s16, b)
        # bf16 has an 8-bit mantissa: ~1e-2 relative agreement is what it can give.
        np.testing.assert_allclose(m16["loss"], m32["loss"], rtol=2e-2)
    # parameters, gradients and optimizer state stay f32 under the policy
    assert all(
        x.dtype == jnp.float32
        for x in jtu.tree_leaves(eqx.filter(s16.model, eqx.is_inexact_array))
    )
    assert m16["loss"].dtype == jnp.float32
    for a, b in zip(_arrays(s16.model), _arrays(s32.model), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)


def test_bf16_policy_computes_in_bf16(model, batches):
    seen = {}

    def spy_loss(model, batch, key):
        seen["w"] = model.mlp.layers[0].weight.dtype
        seen["x"] = batch["x"].dtype
        return mse_loss(model, batch, key)

    opt = optax.sgd(0.1)
    eqtrain.train_step(spy_loss, opt, precision="bf16")(
        TrainState.create(model, opt, key=0), batches[0]
    )
    assert seen == {"w": jnp.bfloat16, "x": jnp.bfloat16}


def test_frozen_leaves_bit_identical_and_without_gradients(batches):
    state, step = _case_frozen()
    scale0 = np.asarray(state.model.scale).copy()
    w0 = np.asarray(state.model.mlp.layers[0].weight).copy()
    compiled = eqtrain.jit(step)
    for b in batches[:4]:
        state, _ = compiled(state, b)
    assert np.array_equal(np.asarray(state.model.scale), scale0)
    assert not np.array_equal(np.asarray(state.model.mlp.layers[0].weight), w0)
    assert state.opt_state[0].mu.scale is None


def _nan_batch(batch):
    bad = dict(batch)
    bad["y"] = np.full_like(batch["y"], np.nan)
    return bad


def test_nonfinite_skip_keeps_model_and_counts(batches):
    opt = optax.adam(1e-2)
    state = TrainState.create(Regressor(jr.key(0)), opt, key=0)
    step = eqtrain.train_step(mse_loss, opt, nonfinite="skip")
    state, _ = step(state, batches[0])
    skipped_state, m = step(state, _nan_batch(batches[1]))
    assert int(m["skipped"]) == 1 and int(skipped_state.step) == 2
    assert eqx.tree_equal(skipped_state.model, state.model)
    assert eqx.tree_equal(skipped_state.opt_state, state.opt_state)
    after, m = step(skipped_state, batches[2])
    assert int(m["skipped"]) == 1 and np.isfinite(float(m["loss"]))
    assert not eqx.tree_equal(after.model, state.model)


def test_nonfinite_stop_freezes_whole_state(batches):
    opt = optax.adam(1e-2)
    state = TrainState.create(Regressor(jr.key(0)), opt, key=0)
    step = eqtrain.train_step(mse_loss, opt, nonfinite="stop")
    good, _ = step(state, batches[0])
    bad, m = step(good, _nan_batch(batches[1]))
    assert int(m["skipped"]) == 1
    assert eqx.tree_equal(
        eqx.filter(bad, eqx.is_array),
        eqx.filter(dataclasses.replace(good, skipped=bad.skipped), eqx.is_array),
    )
    # latched: a later finite batch does not move it either
    later, m = step(bad, batches[2])
    assert int(m["skipped"]) == 1 and int(later.step) == int(good.step)
    assert eqx.tree_equal(later.model, good.model)


def test_nonfinite_ignore_applies_update(batches):
    opt = optax.sgd(0.1)
    state = TrainState.create(Regressor(jr.key(0)), opt, key=0)
    new, m = eqtrain.train_step(mse_loss, opt, nonfinite="ignore")(
        state, _nan_batch(batches[0])
    )
    assert int(m["skipped"]) == 0
    assert np.isnan(np.asarray(new.model.mlp.layers[0].weight)).all()


def test_ema_tracks_weights(batches):
    state, step = _case_ema()
    w0 = state.model.mlp.layers[0].weight
    new, _ = step(state, batches[0])
    w1 = new.model.mlp.layers[0].weight
    np.testing.assert_allclose(
        new.ema.mlp.layers[0].weight, 0.9 * w0 + 0.1 * w1, rtol=1e-6, atol=1e-7
    )


def test_stateful_model_updates_state(batches):
    state, step = _case_stateful()
    new, _ = step(state, batches[0])
    assert not eqx.tree_equal(new.model_state, state.model_state)


def test_key_advances_each_step(batches):
    state, step = _case_plain()
    new, _ = step(state, batches[0])
    assert not np.array_equal(jr.key_data(new.key), jr.key_data(state.key))


def test_eval_step_metrics_and_inference_mode(model, batches):
    seen = {}

    def dropout_loss(model, batch, key):
        seen["inference"] = model.drop.inference
        return mse_loss(model.inner, batch, key)

    class WithDropout(eqx.Module):
        inner: Regressor
        drop: eqx.nn.Dropout

    wrapped = WithDropout(model, eqx.nn.Dropout(0.5))
    opt = optax.sgd(0.1)
    state = TrainState.create(wrapped, opt, key=0)
    m = eqtrain.eval_step(dropout_loss)(state, batches[0])
    assert seen["inference"] is True
    assert set(m) == {"loss", "mae", "weight"} and float(m["weight"]) == 8.0
    direct, _ = mse_loss(model, batches[0], None)
    np.testing.assert_allclose(m["loss"], direct, rtol=1e-6)


def test_eval_step_ema_and_stateful(batches):
    state, step = _case_ema()
    state, _ = step(state, batches[0])
    m_live = eqtrain.eval_step(mse_loss)(state, batches[1])
    m_ema = eqtrain.eval_step(mse_loss, use_ema=True)(state, batches[1])
    assert float(m_live["loss"]) != float(m_ema["loss"])
    s2, _ = _case_stateful()

    def bn_eval(model, batch, key, *, model_state):
        return bn_loss(model, batch, key, model_state=model_state)

    assert "loss" in eqtrain.eval_step(bn_eval)(s2, batches[0])
