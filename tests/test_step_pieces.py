"""The public step pieces (`eqtrain.step`): the recipes built from them give the same
states, bit for bit, as the step implementation they replaced (kept frozen in
`tests/legacy_step.py`), and the pieces compose into custom steps."""

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
from eqtrain import ConfigError, TrainState, sharding, step as S

from . import legacy_step
from .conftest import Regressor, make_batches, mse_loss
from .test_step import BNModel, bn_loss


def _nan_batches(n, at, **kw):
    batches = make_batches(n, **kw)
    batches[at] = {**batches[at], "y": np.full_like(batches[at]["y"], np.nan)}
    return batches


def _state(opt, *, ema=False, stateful=False, dtype=jnp.float32, frozen=False):
    if stateful:
        model, mstate = eqx.nn.make_with_state(BNModel)(jr.key(0))
        return TrainState.create(model, opt, key=0, model_state=mstate)
    model = Regressor(jr.key(0), dtype=dtype)
    spec = True
    if frozen:
        spec = eqx.tree_at(
            lambda m: m.scale, jtu.tree_map(lambda _: True, model), False
        )
    return TrainState.create(model, opt, key=0, ema=ema, trainable=spec)


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)

# name: (optimizer, state options, train_step options, loss, batches)
CASES = {
    "plain": (optax.adam(1e-2), {}, {}, mse_loss, make_batches(5)),
    "accumulate_masked": (
        optax.adamw(1e-2),
        {},
        {"accumulate": 4},
        mse_loss,
        make_batches(5, mask=True),
    ),
    "bf16_policy": (optax.adamw(1e-2), {}, {"precision": "bf16"}, mse_loss,
                    make_batches(5)),
    "bf16_params": (optax.adam(1e-2), {"dtype": jnp.bfloat16}, {}, mse_loss,
                    make_batches(5)),
    "ema": (optax.adam(1e-2), {"ema": True}, {"ema": 0.9}, mse_loss, make_batches(5)),
    "frozen": (optax.adam(1e-2), {"frozen": True}, {}, mse_loss, make_batches(5)),
    "stateful": (optax.adam(1e-2), {"stateful": True}, {"accumulate": 2}, bn_loss,
                 make_batches(5)),
    "skip_nan_ema": (optax.adam(1e-2), {"ema": True}, {"ema": 0.5}, mse_loss,
                     _nan_batches(6, at=2)),
    "stop_nan_schedule": (
        optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE),
        {},
        {"nonfinite": "stop"},
        mse_loss,
        _nan_batches(6, at=3),
    ),
    "skip_nan_inject": (
        optax.inject_hyperparams(optax.adam)(learning_rate=SCHEDULE),
        {},
        {},
        mse_loss,
        _nan_batches(6, at=1),
    ),
    "ignore_chain_clip": (
        optax.chain(optax.clip_by_global_norm(0.5), optax.lion(1e-3)),
        {},
        {"nonfinite": "ignore", "schedule": optax.constant_schedule(1e-3)},
        mse_loss,
        make_batches(5),
    ),
}  # fmt: skip


def _run(builder, state, batches, *, compiled=True):
    step = eqtrain.jit(builder) if compiled else builder
    history = []
    for batch in batches:
        state, metrics = step(state, batch)
        history.append(jax.device_get(dict(metrics)))
    return state, history


def _assert_bit_identical(a, b):
    la, lb = jtu.tree_leaves(a), jtu.tree_leaves(b)
    assert jtu.tree_structure(a) == jtu.tree_structure(b)
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jr.key_data(x), jr.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _compare(name, *, compiled):
    opt, state_kw, step_kw, loss, batches = CASES[name]
    runs = []
    for builder in (eqtrain.train_step, legacy_step.train_step):
        step = builder(loss, opt, **step_kw)
        runs.append(_run(step, _state(opt, **state_kw), batches, compiled=compiled))
    (new_state, new_hist), (old_state, old_hist) = runs
    if compiled and step_kw.get("nonfinite", "skip") != "ignore":
        # The guard now holds the update inside one `lax.cond`; XLA fuses the
        # branch on its own, so roundings may differ by an ulp or so (the
        # op-by-op run below is the exact comparison).
        rtol = 2e-2 if step_kw.get("precision") or state_kw.get("dtype") else 1e-5
        for a, b in zip(
            jtu.tree_leaves(new_state), jtu.tree_leaves(old_state), strict=True
        ):
            if eqx.is_inexact_array(a):
                np.testing.assert_allclose(
                    np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-6
                )
        return
    _assert_bit_identical(new_state, old_state)
    for new, old in zip(new_hist, old_hist, strict=True):
        assert set(new) == set(old)
        for key in old:
            if key == "grad_norm":  # now summed with fewer kernels (global_norm)
                rtol = 1e-2 if state_kw.get("dtype") else 1e-6  # was in bf16
                np.testing.assert_allclose(new[key], old[key], rtol=rtol)
            else:
                np.testing.assert_array_equal(new[key], old[key], err_msg=key)


# Op by op is slow (~8-12 s a case): the default suite runs the cases that cover
# EMA, both guards and a schedule; `nox -s slow` runs all, accumulation and
# masking included (every case also runs compiled below).
# "plain" is the first step of the two others (and runs compiled below): slow only
OP_BY_OP_DEFAULT = {"skip_nan_ema", "stop_nan_schedule"}


@pytest.mark.parametrize(
    "name",
    [
        n if n in OP_BY_OP_DEFAULT else pytest.param(n, marks=pytest.mark.slow)
        for n in sorted(CASES)
    ],
)
def test_recipe_is_bit_identical_to_the_previous_step_op_by_op(name):
    """Op by op (no compilation, so no fusion), every state and metric is equal to
    the last bit: the recipe computes exactly what the previous step computed."""
    with jax.disable_jit():
        _compare(name, compiled=False)


@pytest.mark.parametrize("name", sorted(CASES))
def test_recipe_matches_the_previous_step_compiled(name):
    _compare(name, compiled=True)


@pytest.mark.parametrize("nonfinite", ["skip", "stop"])
def test_data_parallel_recipe_matches_the_previous_one(nonfinite, compiled=True):
    """Compiled only: op by op, shard_map runs for minutes on 8 simulated devices.
    The pieces it shares with `train_step` are compared op by op above."""
    mesh = sharding.make_mesh({"data": 2, "fsdp": 4})
    rep, batch_sh = sharding.replicated(mesh), sharding.batch_sharding(mesh)
    opt = optax.adamw(1e-2)
    batches = _nan_batches(4, at=2, batch_size=16, mask=True)

    def run(builder):
        state = sharding.shard(_state(opt, ema=True), rep)
        step = eqtrain.jit(builder, shardings=(rep, batch_sh)) if compiled else builder
        out = []
        for b in batches:
            state, metrics = step(state, jax.device_put(b, batch_sh))
            out.append(jax.device_get(dict(metrics)))
        return state, out

    kw = dict(accumulate=2, nonfinite=nonfinite, ema=0.9)
    new_state, new = run(sharding.data_parallel_step(mse_loss, opt, mesh, **kw))
    old_state, old = run(
        legacy_step.legacy_data_parallel_step(mse_loss, opt, mesh, **kw)
    )
    # The update now runs outside shard_map, under one lax.cond: XLA fuses it
    # differently, so roundings may differ by an ulp or so.
    for a, b in zip(
        jtu.tree_leaves(new_state), jtu.tree_leaves(old_state), strict=True
    ):
        if eqx.is_inexact_array(a):
            np.testing.assert_allclose(
                np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6
            )
        elif eqx.is_array(a) and not jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(new, old, strict=True):
        assert set(a) == set(b)
        np.testing.assert_array_equal(a["skipped"], b["skipped"])
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-6)


def test_recipe_equals_its_spelled_out_composition():
    opt = optax.adam(1e-2)
    batches = _nan_batches(4, at=1, mask=True)
    grads = S.microbatched(S.value_and_grad(mse_loss), 2)
    composed = S.skip_nonfinite(S.with_ema(S.gradient_step(grads, opt), 0.9))
    recipe = eqtrain.train_step(mse_loss, opt, accumulate=2, ema=0.9)
    a, _ = _run(composed, _state(opt, ema=True), batches)
    b, _ = _run(recipe, _state(opt, ema=True), batches)
    _assert_bit_identical(a, b)
    assert int(a.skipped) == 1


def test_custom_composition_clip_per_microbatch_and_extra_metric():
    """The example of docs/steps.md: clip each micro-batch's gradients, and log
    the norm of the update, built from public pieces only."""

    def clip_each(grad_fn, max_norm):
        def clipped(params, static, batch, key, model_state):
            g = grad_fn(params, static, batch, key, model_state)
            norm = optax.tree.norm(g.grads)
            scale = jnp.minimum(1.0, max_norm / (norm + 1e-6))
            return g._replace(grads=jtu.tree_map(lambda x: x * scale, g.grads))

        return clipped

    def log_update_norm(step):
        def apply(state, grads, key):
            new, metrics = step.apply(state, grads, key)
            delta = jtu.tree_map(
                jnp.subtract,
                eqx.filter(new.model, new.trainable),
                eqx.filter(state.model, state.trainable),
            )
            return new, {**metrics, "update_norm": optax.tree.norm(delta)}

        return dataclasses.replace(step, apply=apply)

    opt = optax.sgd(1.0)
    grads = S.microbatched(clip_each(S.value_and_grad(mse_loss), 1e-3), 4)
    step = S.skip_nonfinite(log_update_norm(S.gradient_step(grads, opt)))
    state, history = _run(step, _state(opt), make_batches(3, batch_size=16))
    # Each micro-batch's gradient has norm <= 1e-3, so their weighted mean does,
    # and with sgd(1.0) so does the update.
    for metrics in history:
        assert 0 < metrics["update_norm"] <= 1e-3 * (1 + 1e-5)
        assert metrics["grad_norm"] <= 1e-3 * (1 + 1e-5)
    assert int(state.step) == 3


def test_skip_is_one_cond_over_the_update():
    """The guard is structural: the compiled step holds one conditional and no
    per-leaf select between old and new parameters."""
    opt = optax.adam(1e-2)
    state = _state(opt)
    batch = make_batches(1)[0]
    skip = eqx.filter_make_jaxpr(eqtrain.train_step(mse_loss, opt))(state, batch)[0]
    ignore = eqx.filter_make_jaxpr(
        eqtrain.train_step(mse_loss, opt, nonfinite="ignore")
    )(state, batch)[0]

    def count(jaxpr, name):
        return sum(1 for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == name)

    assert count(skip, "cond") == 1
    assert count(ignore, "cond") == 0
    assert count(skip, "select_n") == count(ignore, "select_n")


@pytest.mark.parametrize(
    "build",
    [
        lambda: S.microbatched(S.value_and_grad(mse_loss), 0),
        lambda: S.microbatched(S.value_and_grad(mse_loss), -1),
        lambda: S.with_ema(
            S.gradient_step(S.value_and_grad(mse_loss), optax.sgd(1)), 1.5
        ),
        lambda: S.finish_step(
            S.value_and_grad(mse_loss), optax.sgd(1), nonfinite="skp"
        ),
        lambda: eqtrain.train_step(mse_loss, optax.sgd(1), nonfinite="skp"),
        lambda: eqtrain.train_step(mse_loss, optax.sgd(1), accumulate=True),
        lambda: sharding.data_parallel_step(
            mse_loss, optax.sgd(1), sharding.make_mesh({"data": -1}), nonfinite="skp"
        ),
        lambda: sharding.data_parallel_step(
            mse_loss, optax.sgd(1), sharding.make_mesh({"data": -1}), ema=2.0
        ),
        lambda: sharding.data_parallel_step(
            mse_loss, optax.sgd(1), sharding.make_mesh({"data": -1}), accumulate=0
        ),
    ],
)
def test_every_builder_checks_its_arguments_at_once(build):
    with pytest.raises(ConfigError):
        build()


def test_global_norm_matches_optax():
    tree = {
        "small": jnp.arange(12.0).reshape(3, 4),
        "big": jnp.linspace(-1, 1, S.SMALL_LEAF + 3),
        "bf16": jnp.ones((5,), jnp.bfloat16) * 3,
        "int": jnp.arange(4),  # integer leaves are not gradients, but count in optax
        "none": None,
    }
    floats = {k: v for k, v in tree.items() if k not in ("int", "none")}
    expected = optax.tree.norm(jtu.tree_map(lambda x: x.astype(jnp.float32), floats))
    np.testing.assert_allclose(S.global_norm(floats), expected, rtol=1e-6)
    assert S.global_norm({}) == 0.0
    assert not np.isfinite(S.global_norm({"a": jnp.array([1.0, jnp.inf])}))
    assert np.isnan(S.global_norm({"a": jnp.array([jnp.nan])}))


def test_filter_cond_keeps_non_array_leaves():
    model = Regressor(jr.key(0))  # holds functions (activations) as leaves
    out = S.filter_cond(
        jnp.array(False),
        lambda m: jtu.tree_map(lambda x: x + 1 if eqx.is_array(x) else x, m),
        lambda m: m,
        model,
    )
    assert out.mlp.activation is model.mlp.activation
    _assert_bit_identical(
        eqx.filter(out, eqx.is_array), eqx.filter(model, eqx.is_array)
    )
