"""Losses: masking, normalisation by target tokens, the `weight` convention, and
exact gradient accumulation through `eqtrain.train_step`."""

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
from eqtrain.losses import causal_lm_loss, causal_lm_loss_fn, classification_loss
from eqtrain.models import Llama, LlamaConfig, MLPClassifier, MLPConfig


CFG = LlamaConfig(
    vocab_size=29,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
)
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, jr.key(0))


def lm_batch(rows=4, seq=8, seed=0, packed=False):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, CFG.vocab_size, (rows, seq + 1)).astype(np.int32)
    mask = (rng.random((rows, seq)) < 0.7).astype(np.float32)
    mask[:, -2:] = 0.0  # trailing padding
    batch = {
        "tokens": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
        "loss_mask": jnp.asarray(mask),
    }
    if packed:
        segs = np.repeat([[1, 1, 1, 2, 2, 2, 0, 0]], rows, 0).astype(np.int32)
        batch["segment_ids"] = jnp.asarray(segs[:, :seq])
    return batch


def _reference_lm_loss(model, batch):
    if "segment_ids" in batch:
        logits = jax.vmap(lambda t, s: model(t, segment_ids=s))(
            batch["tokens"], batch["segment_ids"]
        )
    else:
        logits = jax.vmap(model)(batch["tokens"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"]
    return jnp.sum(nll * mask) / jnp.sum(mask), logits


@pytest.mark.parametrize("packed", [False, True])
def test_lm_loss_is_mean_over_target_tokens(model, packed):
    batch = lm_batch(packed=packed)
    loss, aux = causal_lm_loss(model, batch, jr.key(1))
    expected, logits = _reference_lm_loss(model, batch)
    np.testing.assert_allclose(loss, expected, rtol=RTOL, atol=ATOL)
    mask = batch["loss_mask"]
    assert float(aux["weight"]) == float(jnp.sum(mask))
    correct = jnp.argmax(logits, -1) == batch["targets"]
    np.testing.assert_allclose(
        aux["accuracy"], jnp.sum(correct * mask) / jnp.sum(mask), rtol=RTOL
    )
    assert loss.dtype == jnp.float32 and set(aux) == {"accuracy", "weight"}


def test_masked_positions_affect_neither_loss_nor_gradients(model):
    batch = lm_batch()
    rng = np.random.default_rng(5)
    masked = np.asarray(batch["loss_mask"]) == 0
    junk = rng.integers(0, CFG.vocab_size, masked.shape).astype(np.int32)
    changed = dict(batch)
    changed["targets"] = jnp.where(masked, junk, batch["targets"])
    changed["targets"] = changed["targets"].at[0, -1].set(-100)  # "ignore" ids too
    # Tokens after the last counted target (trailing padding) are never attended to.
    changed["tokens"] = batch["tokens"].at[:, -1].set(junk[:, -1])

    grad_fn = eqx.filter_jit(eqx.filter_value_and_grad(causal_lm_loss, has_aux=True))
    (loss_a, _), grads_a = grad_fn(model, batch, jr.key(1))
    (loss_b, _), grads_b = grad_fn(model, changed, jr.key(1))
    np.testing.assert_allclose(loss_a, loss_b, rtol=RTOL, atol=ATOL)
    for a, b in zip(jtu.tree_leaves(grads_a), jtu.tree_leaves(grads_b), strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
        assert bool(jnp.all(jnp.isfinite(a)))


def test_all_masked_batch_is_zero_not_nan(model):
    batch = dict(lm_batch(), loss_mask=jnp.zeros((4, 8), jnp.float32))
    loss, aux = causal_lm_loss(model, batch, None)
    assert float(loss) == 0.0 and float(aux["weight"]) == 0.0


def test_missing_loss_mask_counts_every_target(model):
    batch = lm_batch()
    del batch["loss_mask"]
    _, aux = causal_lm_loss(model, batch, jr.key(0))
    assert float(aux["weight"]) == 4 * 8


def test_z_loss(model):
    batch = lm_batch()
    plain, _ = causal_lm_loss(model, batch, jr.key(0))
    loss, aux = causal_lm_loss_fn(z_loss=1e-2)(model, batch, jr.key(0))
    assert float(aux["z_loss"]) > 0
    np.testing.assert_allclose(loss, plain + 1e-2 * aux["z_loss"], rtol=RTOL)
    with pytest.raises(ConfigError, match="z_loss"):
        causal_lm_loss_fn(z_loss=-1.0)


def _train(loss_fn, model, batches, accumulate, **kwargs):
    optimizer = optax.sgd(0.1)
    state = TrainState.create(model, optimizer, key=0)
    step = eqtrain.train_step(loss_fn, optimizer, accumulate=accumulate, **kwargs)
    step = eqtrain.jit(step, donate=False)  # the shared model fixture stays alive
    history = []
    for batch in batches:
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    return state, history


# unpacked in the default suite; test_job's accumulate test weighs tokens end to end
@pytest.mark.parametrize("packed", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_lm_accumulation_equals_full_batch(model, packed):
    batches = [lm_batch(seed=s, packed=packed) for s in range(2)]
    # Micro-batches with very different token counts: exactness needs the weights.
    batches[0]["loss_mask"] = batches[0]["loss_mask"].at[:2].set(0.0).at[:2, 0].set(1)
    full, h1 = _train(causal_lm_loss, model, batches, accumulate=1)
    micro, h2 = _train(causal_lm_loss, model, batches, accumulate=2)
    for a, b in zip(h1, h2, strict=True):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(a["accuracy"], b["accuracy"], rtol=RTOL, atol=ATOL)
        assert a["weight"] == b["weight"]
    assert h1[0]["loss"] > h1[1]["loss"] - 1.0  # it trains (and stays finite)
    leaves = zip(
        jtu.tree_leaves(full.params), jtu.tree_leaves(micro.params), strict=True
    )
    for a, b in leaves:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_lm_training_reduces_loss_and_bf16_weight_is_exact(model):
    batch = lm_batch(rows=2, seq=160)  # 320 positions, > 256 tokens in bf16
    batch["loss_mask"] = jnp.ones((2, 160), jnp.float32)
    _, history = _train(causal_lm_loss, model, [batch] * 4, 1, precision="bf16")
    assert history[0]["weight"] == 320.0  # bf16 sums 320 ones to 320 only by luck
    assert history[-1]["loss"] < history[0]["loss"]


def clf_batch(rows=8, seed=0, weights=False):
    rng = np.random.default_rng(seed)
    batch = {
        "x": jnp.asarray(rng.normal(size=(rows, 5)).astype(np.float32)),
        "label": jnp.asarray(rng.integers(0, 3, rows).astype(np.int32)),
    }
    if weights:
        batch["weights"] = jnp.asarray(rng.random(rows).astype(np.float32))
    return batch


@pytest.mark.parametrize("weights", [False, True])
def test_classification_loss(weights):
    model = MLPClassifier(MLPConfig(5, 3, hidden_sizes=(8,)), jr.key(0))
    batch = clf_batch(weights=weights)
    loss, aux = classification_loss(model, batch, jr.key(1))
    logits = jax.vmap(model)(batch["x"])
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    w = batch.get("weights", jnp.ones(8))
    np.testing.assert_allclose(loss, jnp.sum(nll * w) / jnp.sum(w), rtol=RTOL)
    np.testing.assert_allclose(aux["weight"], jnp.sum(w), rtol=RTOL)
    correct = jnp.argmax(logits, -1) == batch["label"]
    np.testing.assert_allclose(aux["accuracy"], jnp.sum(correct * w) / jnp.sum(w), RTOL)


def test_classification_dropout_uses_per_example_keys():
    model = MLPClassifier(MLPConfig(5, 3, hidden_sizes=(16,), dropout=0.5), jr.key(0))
    batch = clf_batch()
    a, _ = classification_loss(model, batch, jr.key(1))
    b, _ = classification_loss(model, batch, jr.key(2))
    c, _ = classification_loss(model, batch, None)
    assert float(a) != float(b) and float(c) != float(a)
    evaluate = eqtrain.eval_step(classification_loss)
    state = TrainState.create(model, optax.sgd(0.1), key=0)
    np.testing.assert_allclose(evaluate(state, batch)["loss"], c, rtol=RTOL)


def test_classification_accumulation_equals_full_batch():
    model = MLPClassifier(MLPConfig(5, 3, hidden_sizes=(8,)), jr.key(0))
    batches = [clf_batch(seed=s, weights=True) for s in range(3)]
    full, h1 = _train(classification_loss, model, batches, 1)
    micro, h2 = _train(classification_loss, model, batches, 2)
    for a, b in zip(h1, h2, strict=True):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(a["weight"], b["weight"], rtol=RTOL)
    leaves = zip(
        jtu.tree_leaves(full.params), jtu.tree_leaves(micro.params), strict=True
    )
    for a, b in leaves:
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_accuracy_does_not_count_ties_as_correct():
    """A collapsed model (uniform logits) is right nowhere, not everywhere."""

    def uniform(x, key=None):
        return jnp.zeros((4,))

    def tied_with_label(x, key=None):  # classes 0 and 1 tie for the max
        return jnp.array([2.0, 2.0, 0.0, 0.0])

    def unique(x, key=None):
        return jnp.array([3.0, 2.0, 0.0, 0.0])

    batch = {"x": jnp.ones((3, 2)), "label": jnp.array([0, 1, 0])}
    _, aux = classification_loss(uniform, batch)
    assert float(aux["accuracy"]) == 0.0
    _, aux = classification_loss(tied_with_label, batch)
    assert float(aux["accuracy"]) == 0.0
    _, aux = classification_loss(unique, batch)
    np.testing.assert_allclose(aux["accuracy"], 2 / 3, rtol=RTOL)

    def uniform_lm(tokens, key=None):
        return jnp.zeros((tokens.shape[0], CFG.vocab_size))

    _, aux = causal_lm_loss(uniform_lm, lm_batch())
    assert float(aux["accuracy"]) == 0.0
