"""Tests for `eqtrain.optim`: schedules, decay masks, errors, and equivalence with
the optax chains `build` stands for."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import eqtrain
from eqtrain import ConfigError, TrainState, optim
from eqtrain.models import GPT2, GPT2Config, Llama, LlamaConfig

from .conftest import Regressor, make_batches, mse_loss


def llama():
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
    )
    return Llama(config, jr.key(0))


def gpt2():
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    return GPT2(config, jr.key(0))


def named(tree):
    """`{dotted path: leaf}` for the leaves of `tree`."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {optim.param_path(p): x for p, x in leaves}


def paths(tree):
    return list(named(tree))


def decayed_paths(model, no_decay=optim.DEFAULT_NO_DECAY):
    params = eqx.filter(model, eqx.is_inexact_array)
    return {p for p, m in named(optim.decay_mask(params, no_decay)).items() if m}


def train(opt, model, batches, loss_fn=mse_loss, **create):
    state = TrainState.create(model, opt, key=0, **create)
    step = eqx.filter_jit(eqtrain.train_step(loss_fn, opt))
    history = []
    for batch in batches:
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    return state, history


# --- decay masks -----------------------------------------------------------------


def test_default_no_decay_on_llama():
    assert decayed_paths(llama()) == {
        "layers.self_attn.q_proj.weight",
        "layers.self_attn.k_proj.weight",
        "layers.self_attn.v_proj.weight",
        "layers.self_attn.o_proj.weight",
        "layers.mlp.gate_proj.weight",
        "layers.mlp.up_proj.weight",
        "layers.mlp.down_proj.weight",
        "lm_head.weight",
    }


def test_default_no_decay_on_gpt2():
    assert decayed_paths(gpt2()) == {
        "h.attn.c_attn.weight",
        "h.attn.c_proj.weight",
        "h.mlp.c_fc.weight",
        "h.mlp.c_proj.weight",
    }


def test_empty_no_decay_decays_everything_and_keeps_none_leaves():
    params = {"a": jnp.ones(2), "norm": None, "b": [jnp.ones(1), None]}
    assert optim.decay_mask(params, "") == {"a": True, "norm": None, "b": [True, None]}
    assert optim.decay_mask(params) == {"a": True, "norm": None, "b": [True, None]}


def test_param_path():
    assert "layers.self_attn.q_proj.weight" in paths(llama())
    assert paths({"mlp": [{"bias": 0}], "w": (1,)}) == ["mlp.0.bias", "w.0"]


def zero_loss(model, batch, key):
    return jnp.zeros(()), {}


@pytest.mark.parametrize("name", ["adamw", "lion", "sgd", "adafactor"])
@pytest.mark.parametrize("frozen", [False, True])
def test_weight_decay_shrinks_only_decayed_params(name, frozen):
    """With a zero gradient the update is the decay alone: `p *= 1 - lr * wd` on the
    decayed parameters; excluded and frozen ones stay put."""
    model = llama()
    trainable = True
    if frozen:  # freeze the embedding and the attention: `None` leaves in params
        trainable = jax.tree.map(lambda _: True, model)
        trainable = eqx.tree_at(
            lambda m: (m.embed_tokens, m.layers.self_attn), trainable, (False, False)
        )
    opt = optim.build(name, lr=0.1, weight_decay=0.5)
    batch = {"x": jnp.zeros((1,))}
    state, _ = train(opt, model, [batch], zero_loss, trainable=trainable)
    decayed = decayed_paths(model)
    after = named(state.model)
    for path, old in named(model).items():
        if not eqx.is_inexact_array(old):
            continue
        is_frozen = frozen and ("embed" in path or "self_attn" in path)
        expected = old * 0.95 if path in decayed and not is_frozen else old
        np.testing.assert_allclose(after[path], expected, rtol=1e-6, err_msg=path)


# --- equivalence with hand-written optax chains -------------------------------------


def _mask(params):
    return optim.decay_mask(params)


def _cosine():
    return optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 6, 1e-3)


EQUIVALENT = {
    "adamw": (
        dict(
            lr=1e-2,
            schedule="cosine",
            total_steps=6,
            warmup_steps=2,
            final_lr=1e-3,
            weight_decay=0.1,
            clip_norm=0.5,
            b1=0.8,
            b2=0.95,
            eps=1e-6,
        ),
        lambda: optax.chain(
            optax.clip_by_global_norm(0.5),
            optax.adamw(_cosine(), 0.8, 0.95, 1e-6, weight_decay=0.1, mask=_mask),
        ),
    ),
    "adam": (
        dict(lr=1e-2, clip_norm=None),
        lambda: optax.adam(1e-2),
    ),
    "lion": (
        dict(
            lr=1e-3,
            schedule="linear",
            total_steps=6,
            weight_decay=0.5,
            no_decay="",
            b2=0.9,
        ),
        lambda: optax.chain(
            optax.clip_by_global_norm(1.0),
            optax.lion(optax.linear_schedule(1e-3, 0.0, 6), b2=0.9, weight_decay=0.5),
        ),
    ),
    "sgd": (
        dict(lr=1e-3, momentum=0.9, nesterov=True, clip_norm=0),
        lambda: optax.sgd(1e-3, momentum=0.9, nesterov=True),
    ),
    # Without momentum, decoupled decay is plain L2 decay added to the gradient.
    "sgd weight_decay": (
        dict(lr=1e-3, weight_decay=0.1, clip_norm=None),
        lambda: optax.chain(optax.add_decayed_weights(0.1, _mask), optax.sgd(1e-3)),
    ),
    "adafactor": (
        dict(lr=1e-2, b1=0.9, clip_norm=2.0),
        lambda: optax.chain(
            optax.clip_by_global_norm(2.0), optax.adafactor(1e-2, momentum=0.9)
        ),
    ),
}


@pytest.mark.parametrize("case", EQUIVALENT)
def test_build_equals_hand_written_chain(case):
    kwargs, reference = EQUIVALENT[case]
    model, batches = Regressor(jr.key(0)), make_batches(5)
    ours, _ = train(optim.build(case.split()[0], **kwargs), model, batches)
    theirs, _ = train(reference(), model, batches)
    assert not eqx.tree_equal(ours.model, model)
    arrays = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))
    for a, b in zip(arrays(ours.model), arrays(theirs.model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# --- training and the logged learning rate --------------------------------------


TRAINS = {
    "adamw": dict(lr=3e-2, weight_decay=0.01),
    "adam": dict(lr=3e-2),
    "lion": dict(lr=1e-2, weight_decay=0.01),
    "sgd": dict(lr=3e-2, momentum=0.9),
    "adafactor": dict(lr=3e-2, weight_decay=0.01),
}


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
def test_each_optimizer_trains(name):
    opt = optim.build(name, **TRAINS[name], schedule="cosine", total_steps=40)
    _, history = train(opt, Regressor(jr.key(0)), make_batches(40))
    losses = [float(m["loss"]) for m in history]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses


SCHEDULED = {
    "constant": dict(warmup_steps=3),
    "linear": dict(warmup_steps=2, final_lr=1e-3),
    "cosine": dict(warmup_steps=2, final_lr=1e-3),
    "wsd": dict(warmup_steps=2, decay_steps=3),
}


@pytest.mark.parametrize("name", SCHEDULED)
def test_logged_learning_rate_is_the_schedule(name):
    kwargs = dict(lr=1e-2, total_steps=8, **SCHEDULED[name])
    opt = optim.build("adamw", schedule=name, **kwargs)
    _, history = train(opt, Regressor(jr.key(0)), make_batches(11))
    logged = [float(m["learning_rate"]) for m in history]
    np.testing.assert_allclose(logged, SCHEDULE_VALUES[name], rtol=1e-6, atol=1e-9)


def _cosine_at(t):  # from 1e-2 to 1e-3 over 6 steps (8 - 2 of warmup)
    return 1e-3 + (1e-2 - 1e-3) * 0.5 * (1 + np.cos(np.pi * min(t, 6) / 6))


# The learning rate used at steps 0..10 (lr 1e-2, 8 steps, SCHEDULED's settings),
# written out from each schedule's definition, not computed by eqtrain.
SCHEDULE_VALUES = {
    "constant": [0.0, 1e-2 / 3, 2e-2 / 3] + [1e-2] * 8,  # warmup 3
    # warmup 2, then 1e-2 to 1e-3 linearly over steps 2..8, then 1e-3
    "linear": [0.0, 5e-3] + [1e-2 - 9e-3 * t / 6 for t in range(7)] + [1e-3] * 2,
    "cosine": [0.0, 5e-3] + [_cosine_at(t) for t in range(9)],
    # warmup 2, stable until step 5, then to 0 over the last 3 steps
    "wsd": [0.0, 5e-3, 1e-2, 1e-2, 1e-2, 1e-2, 1e-2 * 2 / 3, 1e-2 / 3, 0.0, 0.0, 0.0],
}


@pytest.mark.parametrize("name", optim.OPTIMIZERS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_state_types_stable(name, dtype):
    kwargs = {"momentum": 0.9} if name == "sgd" else {}
    wd = 0.0 if name == "adam" else 0.1
    opt = optim.build(name, weight_decay=wd, **kwargs)
    state = TrainState.create(Regressor(jr.key(0), dtype=dtype), opt, key=0)
    step = eqtrain.train_step(mse_loss, opt)
    batch = make_batches(1)[0]
    after = eqx.filter_eval_shape(lambda s: step(s, batch)[0], state)
    assert eqx.tree_equal(eqx.filter_eval_shape(lambda: state), after)


# --- schedules ----------------------------------------------------------------------


@st.composite
def schedule_args(draw):
    name = draw(st.sampled_from(optim.SCHEDULES))
    lr = draw(st.floats(1e-5, 1.0))
    total = draw(st.integers(2, 20_000))
    warmup = draw(st.integers(0, total - 1))
    final = 0.0 if name == "constant" else lr * draw(st.floats(0.0, 1.0))
    decay = None
    if name == "wsd":
        decay = draw(st.none() | st.integers(1, total - warmup))
    return name, dict(
        lr=lr,
        total_steps=total,
        warmup_steps=warmup,
        final_lr=final,
        decay_steps=decay,
    )


@settings(derandomize=True, deadline=None, max_examples=20)
@given(schedule_args())
def test_schedule_shape(args):
    name, kw = args
    lr, total, warmup = kw["lr"], kw["total_steps"], kw["warmup_steps"]
    end = lr if name == "constant" else kw["final_lr"]
    # A fixed number of points, so that each example reuses the compiled ops.
    grid = np.linspace(0, total + 10, 60).astype(np.int32)
    steps = np.sort(np.concatenate([grid, [0, warmup, total, total + 10]]))
    values = optim.schedule(name, **kw)(jnp.asarray(steps))
    values = np.broadcast_to(np.asarray(values, np.float64), steps.shape)  # constant
    at = lambda s: values[np.searchsorted(steps, s)]
    close = dict(rtol=1e-5, atol=1e-6 * lr)
    assert np.all(values >= 0)
    np.testing.assert_allclose(at(0), 0.0 if warmup else lr, **close)
    np.testing.assert_allclose(at(warmup), lr, **close)
    np.testing.assert_allclose(at(total), end, **close)
    np.testing.assert_allclose(at(total + 10), end, **close)
    rising, falling = values[steps <= warmup], values[steps >= warmup]
    assert np.all(np.diff(rising) >= -1e-6 * lr)
    assert np.all(np.diff(falling) <= 1e-6 * lr)


def test_wsd_is_stable_then_decays():
    sched = optim.schedule(
        "wsd", lr=1.0, total_steps=10, warmup_steps=2, decay_steps=4, final_lr=0.2
    )
    values = [round(float(sched(s)), 6) for s in range(12)]
    assert values == [0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2]


@pytest.mark.parametrize("name", optim.SCHEDULES)
def test_lr_zero_is_a_frozen_schedule(name):
    # `optim.lr = 0` is documented (>= 0): a run that trains nothing.
    sched = optim.schedule(name, lr=0, total_steps=10, warmup_steps=2)
    assert [float(sched(s)) for s in range(12)] == [0.0] * 12


def test_wsd_default_decay_is_a_tenth():
    sched = optim.schedule("wsd", lr=1.0, total_steps=100)
    assert float(sched(90)) == 1.0
    assert float(sched(95)) == pytest.approx(0.5)


# --- errors ---------------------------------------------------------------------------


ERRORS = [
    (
        dict(name="adafctor"),
        r"`optim.name` must be one of 'adamw', 'adam', 'lion', 'sgd', 'adafactor'; "
        r"got 'adafctor'. Did you mean 'adafactor'\?",
    ),
    (
        dict(schedule="cosin", total_steps=10),
        r"^`optim.schedule` must be one of 'constant', 'linear', 'cosine', 'wsd'; "
        r"got 'cosin'. Did you mean 'cosine'\?$",
    ),
    (dict(schedule="zzz"), r"got 'zzz'\.$"),
    (dict(lr=-1), r"`optim.lr` must be >= 0; got -1"),
    (dict(weight_decay=-0.1), r"`optim.weight_decay` must be >= 0"),
    (dict(name="adam", weight_decay=0.1), r"Use name 'adamw'"),
    (dict(warmup_steps=10, total_steps=10), r"`optim.warmup_steps` must be smaller"),
    (dict(warmup_steps=-1), r"`optim.warmup_steps` must be >= 0"),
    (dict(schedule="cosine"), r"Pass `total_steps`"),
    (dict(schedule="wsd"), r"Pass `total_steps`"),
    (dict(momentum=0.9), r"`optim.momentum` does not apply to optimizer 'adamw'"),
    (dict(momentum=0.0), r"`optim.momentum` does not apply"),
    (dict(name="adam", nesterov=True), r"`optim.nesterov` does not apply"),
    (dict(schedule="linear", total_steps=0), r"`optim.total_steps` must be >= 1"),
    (dict(name="sgd", nesterov=True), r"needs `optim.momentum`"),
    (dict(name="sgd", b1=0.9), r"`optim.b1` does not apply to optimizer 'sgd'"),
    (dict(name="lion", eps=1e-8), r"`optim.eps` does not apply to optimizer 'lion'"),
    (dict(name="adafactor", b2=0.99), r"`optim.b2` does not apply"),
    (dict(b2=1.0), r"`optim.b2` must be in \[0, 1\)"),
    (dict(eps=-1.0), r"`optim.eps` must be >= 0"),
    (dict(schedule="cosine", total_steps=9, decay_steps=3), r"only to schedule 'wsd'"),
    (dict(schedule="wsd", total_steps=9, warmup_steps=5, decay_steps=5), r"between 1"),
    (dict(schedule="wsd", total_steps=9, decay_steps=0), r"`optim.decay_steps`"),
    (dict(final_lr=1e-4), r"`optim.final_lr` applies to"),
    (dict(schedule="linear", total_steps=9, final_lr=1.0), r"`optim.final_lr` must"),
    (dict(no_decay="(norm"), r"`optim.no_decay` is not a valid regular expression"),
    (dict(clip_norm=-1.0), r"`optim.clip_norm` must be > 0"),
]


@pytest.mark.parametrize("kwargs, match", ERRORS)
def test_build_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        optim.build(**kwargs)


def test_schedule_and_mask_errors():
    with pytest.raises(ConfigError, match=r"Did you mean 'linear'\?"):
        optim.schedule("lineer", lr=1.0, total_steps=10)
    with pytest.raises(ConfigError, match=r"not a valid regular expression"):
        optim.decay_mask({"a": jnp.ones(1)}, "[")


def test_clip_norm_disabled():
    """`clip_norm=None` and `0` both leave the gradients unclipped."""
    for clip_norm in (None, 0):
        opt = optim.build("sgd", lr=1.0, clip_norm=clip_norm)
        updates, _ = opt.update({"w": jnp.full(2, 100.0)}, opt.init({"w": jnp.ones(2)}))
        np.testing.assert_allclose(updates["w"], -100.0)
    opt = optim.build("sgd", lr=1.0)
    updates, _ = opt.update({"w": jnp.full(2, 100.0)}, opt.init({"w": jnp.ones(2)}))
    np.testing.assert_allclose(optax.tree.norm(updates), 1.0, rtol=1e-6)
