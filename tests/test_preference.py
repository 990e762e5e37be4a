"""The preference formulas against the same formulas computed independently in
NumPy (float64) from the same log-probabilities."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqtrain import ConfigError
from eqtrain.post_training import preference


RNG = np.random.default_rng(0)
PAIRS = 6
# Sequence log-probs (sums) and length-averaged ones (negative, as log-probs are).
PC, PR, RC, RR = (-RNG.uniform(5, 40, PAIRS) for _ in range(4))
AC, AR = -RNG.uniform(0.2, 3.0, PAIRS), -RNG.uniform(0.2, 3.0, PAIRS)
NLL = RNG.uniform(0.5, 3.0, PAIRS)


def log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


def close(ours, theirs):
    np.testing.assert_allclose(
        np.asarray(ours, np.float64), theirs, rtol=2e-6, atol=2e-6
    )


def f32(*xs):
    return [jnp.asarray(x, jnp.float32) for x in xs]


def test_sequence_logprobs_sum_the_masked_targets():
    logits = RNG.normal(size=(2, 5, 7)).astype(np.float32)
    targets = RNG.integers(0, 7, (2, 5)).astype(np.int32)
    mask = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], bool)
    logp, count = preference.sequence_logprobs(*f32(logits), jnp.asarray(targets), mask)
    shifted = logits - logits.max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    picked = np.take_along_axis(log_softmax, targets[..., None], -1)[..., 0]
    close(logp, (picked * mask).sum(-1))
    np.testing.assert_array_equal(np.asarray(count), [3, 2])
    # bf16 logits are read in float32
    bf = preference.sequence_logprobs(
        jnp.asarray(logits, jnp.bfloat16), jnp.asarray(targets), mask
    )[0]
    assert bf.dtype == jnp.float32


@pytest.mark.parametrize("eps", [0.0, 0.2])
def test_dpo(eps):
    beta = 0.3
    losses, m = preference.dpo(*f32(PC, PR, RC, RR), beta=beta, label_smoothing=eps)
    h = beta * ((PC - RC) - (PR - RR))
    close(losses, -(1 - eps) * log_sigmoid(h) - eps * log_sigmoid(-h))
    close(m["rewards/chosen"], np.mean(beta * (PC - RC)))
    close(m["rewards/rejected"], np.mean(beta * (PR - RR)))
    close(m["rewards/margins"], np.mean(h))
    close(m["rewards/accuracies"], np.mean(beta * (PC - RC) > beta * (PR - RR)))
    close(m["logps/chosen"], np.mean(PC))
    close(m["logps/rejected"], np.mean(PR))


def test_dpo_with_the_policy_as_reference_is_log_2():
    losses, m = preference.dpo(*f32(PC, PR, PC, PR), beta=0.1)
    np.testing.assert_allclose(np.asarray(losses), np.log(2.0), rtol=1e-7)
    assert float(m["rewards/margins"]) == 0.0
    # the gradient raises the chosen and lowers the rejected log-prob
    g = jax.grad(lambda c, r: preference.dpo(c, r, *f32(PC, PR))[0].sum(), (0, 1))(
        *f32(PC, PR)
    )
    assert np.all(np.asarray(g[0]) < 0) and np.all(np.asarray(g[1]) > 0)


def test_ipo():
    beta = 0.5
    losses, m = preference.ipo(*f32(AC, AR, AC + 0.1, AR - 0.2), beta=beta)
    h = (AC - (AC + 0.1)) - (AR - (AR - 0.2))
    close(losses, (h - 1 / (2 * beta)) ** 2)
    close(m["rewards/margins"], np.mean(beta * h))


def test_orpo():
    lam = 0.25
    losses, m = preference.orpo(*f32(AC, AR, NLL), orpo_lambda=lam)
    odds = lambda l: l - np.log1p(-np.exp(l))  # noqa: E731
    ratio = log_sigmoid(odds(AC) - odds(AR))
    close(losses, NLL - lam * ratio)
    close(m["log_odds_ratio"], np.mean(ratio))
    close(m["rewards/chosen"], np.mean(lam * AC))


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_simpo(eps):
    beta, gamma = 2.0, 0.7
    losses, m = preference.simpo(
        *f32(AC, AR), beta=beta, gamma=gamma, label_smoothing=eps
    )
    x = beta * (AC - AR) - gamma
    close(losses, -(1 - eps) * log_sigmoid(x) - eps * log_sigmoid(-x))
    close(m["rewards/margins"], np.mean(beta * (AC - AR)))


def test_bad_settings_name_the_field():
    with pytest.raises(ConfigError, match="beta"):
        preference.dpo(*f32(PC, PR, RC, RR), beta=-1.0)
    with pytest.raises(ConfigError, match="label_smoothing"):
        preference.dpo(*f32(PC, PR, RC, RR), label_smoothing=0.7)
    with pytest.raises(ConfigError, match="orpo_lambda"):
        preference.orpo(*f32(AC, AR, NLL), orpo_lambda=-0.1)


# -- the loss function in a training step -------------------------------------------
import equinox as eqx  # noqa: E402
import jax.random as jr  # noqa: E402
import optax  # noqa: E402

import eqtrain  # noqa: E402
from eqtrain import lora  # noqa: E402
from eqtrain.models import Llama, LlamaConfig  # noqa: E402


TINY = LlamaConfig(
    vocab_size=16,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)
GOOD, BAD = 3, 5


def toy_pairs(n, seed=0, prompt=4, completion=3):
    """Random prompts; the chosen completion repeats token 3, the rejected 5."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(6, 16, (n, prompt))
    out = {}
    for name, token in (("chosen", GOOD), ("rejected", BAD)):
        rows = np.concatenate([prompts, np.full((n, completion), token)], axis=1)
        out[f"{name}_tokens"] = rows[:, :-1].astype(np.int32)
        out[f"{name}_targets"] = rows[:, 1:].astype(np.int32)
        mask = np.zeros(rows[:, 1:].shape, np.float32)
        mask[:, prompt - 1 :] = 1.0  # the completion's targets only
        out[f"{name}_mask"] = mask
    return out


def policy_logps(model, batch):
    logps = []
    for name in ("chosen", "rejected"):
        logits = jax.vmap(model)(jnp.asarray(batch[f"{name}_tokens"]))
        logps.append(
            preference.sequence_logprobs(
                logits, jnp.asarray(batch[f"{name}_targets"]), batch[f"{name}_mask"]
            )[0]
        )
    return logps


def tiny_base():
    return Llama(TINY, jr.key(0))


def state_for(reference, model=None):
    base = model or tiny_base()
    if reference == "copy":
        wrapped = preference.with_reference(base)
        trainable = preference.reference_trainable(wrapped)
        return eqtrain.TrainState.create(
            wrapped, optax.adam(1e-2), key=0, trainable=trainable
        )
    adapted = lora.apply(base, lora.LoRA(rank=4, alpha=8), key=jr.key(1))
    return eqtrain.TrainState.create(
        adapted, optax.adam(1e-2), key=0, trainable=lora.trainable(adapted)
    )


@pytest.mark.parametrize("reference", ["copy", "adapters_off", "precomputed"])
def test_dpo_step_one_is_log_2_in_every_reference_mode(reference):
    batch = toy_pairs(8)
    state = state_for("adapters_off" if reference == "precomputed" else reference)
    if reference == "precomputed":  # from the policy itself
        rc, rr = preference.pair_logprobs(state.model, batch)
        np.testing.assert_array_equal(
            np.asarray(rc), np.asarray(policy_logps(state.model, batch)[0])
        )
        batch = {**batch, "reference_chosen": rc, "reference_rejected": rr}
    loss_fn = preference.preference_loss_fn("dpo", reference=reference, beta=0.1)
    loss, aux = loss_fn(state.model, batch, None)
    assert float(loss) == pytest.approx(np.log(2.0), abs=1e-6)
    assert float(aux["rewards/margins"]) == pytest.approx(0.0, abs=1e-6)
    assert float(aux["weight"]) == 8.0  # pairs, not tokens
    if reference == "adapters_off":  # at step one (lora_b = 0) on and off agree:
        _adapters_off_is_the_base_after_training(loss_fn, state)  # so train them


def _adapters_off_is_the_base_after_training(loss_fn, state):
    """Three steps move the policy (the adapters); the reference stays the base
    model, so the loss is DPO's against the base's log-probs, in NumPy."""
    step = eqtrain.jit(eqtrain.train_step(loss_fn, optax.adam(1e-2)))
    for i in range(3):
        state, _ = step(state, toy_pairs(8, seed=i))
    batch = toy_pairs(8, seed=7)
    logps = eqx.filter_jit(policy_logps)
    pc, pr = (np.asarray(x, np.float64) for x in logps(state.model, batch))
    rc, rr = (np.asarray(x, np.float64) for x in logps(tiny_base(), batch))
    assert np.abs(pc - rc).min() > 1e-3  # the policy is no longer the base
    loss, aux = loss_fn(state.model, batch, None)
    h = 0.1 * ((pc - rc) - (pr - rr))
    close(loss, np.mean(-log_sigmoid(h)))
    close(aux["rewards/chosen"], np.mean(0.1 * (pc - rc)))


def test_dpo_learns_the_toy_preference_and_keeps_the_reference_frozen():
    opt = optax.adam(1e-2)
    state = state_for("copy")
    frozen = jax.device_get(
        jax.tree.leaves(eqx.filter(state.model.reference, eqx.is_array))
    )
    loss_fn = preference.preference_loss_fn("dpo", reference="copy", beta=0.5)
    step = eqtrain.jit(eqtrain.train_step(loss_fn, opt))
    for i in range(25):
        state, metrics = step(state, toy_pairs(8, seed=i))
    assert float(metrics["rewards/accuracies"]) > 0.9
    assert float(metrics["loss"]) < np.log(2.0) - 0.1
    after = jax.tree.leaves(eqx.filter(state.model.reference, eqx.is_array))
    for x, y in zip(frozen, after, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("kind", ["dpo", pytest.param("simpo", marks=pytest.mark.slow)])
def test_accumulation_weighs_pairs(kind):
    """Four micro-batches equal one batch (pairs weighted, not tokens): the
    rejected completions here are longer than the chosen ones in some rows."""
    batch = toy_pairs(8)
    batch["rejected_mask"][:4, -1] = 0.0  # unequal token counts across rows
    opt = optax.sgd(0.1)
    loss_fn = preference.preference_loss_fn(kind, reference="adapters_off")
    results = []
    for accumulate in (1, 4):
        step = eqtrain.jit(eqtrain.train_step(loss_fn, opt, accumulate=accumulate))
        results.append(step(state_for("adapters_off"), batch))
    (s1, m1), (s4, m4) = results
    for name in ("loss", "rewards/accuracies", "logps/chosen"):
        np.testing.assert_allclose(float(m1[name]), float(m4[name]), rtol=1e-5)
    a = jax.tree.leaves(eqx.filter(s1.params, eqx.is_array))
    b = jax.tree.leaves(eqx.filter(s4.params, eqx.is_array))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_loss_fn_refuses_a_reference_it_cannot_have():
    plain = Llama(TINY, jr.key(0))
    with pytest.raises(ConfigError, match="no adapters"):
        preference.preference_loss_fn("dpo")(plain, toy_pairs(2), None)
    with pytest.raises(ConfigError, match="WithReference"):
        preference.preference_loss_fn("dpo", reference="copy")(plain, toy_pairs(2))
    with pytest.raises(ConfigError, match="needs a reference"):
        preference.preference_loss_fn("ipo", reference=None)
    with pytest.raises(ConfigError, match="kind"):
        preference.preference_loss_fn("kto")
    loss, _ = preference.preference_loss_fn("orpo", reference=None)(
        plain, toy_pairs(2), None
    )
    assert np.isfinite(float(loss))


def test_the_reference_copy_is_an_input_of_the_compiled_step_not_a_constant():
    """A new reference under the same compiled step changes the loss with no
    retrace: the reference's arrays are arguments of the jitted step."""
    loss_fn = preference.preference_loss_fn("dpo", reference="copy")
    step = eqtrain.jit(eqtrain.train_step(loss_fn, optax.sgd(0.0)))
    batch = toy_pairs(4)
    _, first = step(state_for("copy"), batch)
    other = state_for("copy")
    moved = jax.tree.map(
        lambda x: x * 1.5 if eqx.is_inexact_array(x) else x, other.model.reference
    )
    other = eqx.tree_at(lambda s: s.model.reference, other, moved)
    _, second = step(other, batch)
    assert float(first["loss"]) == pytest.approx(np.log(2.0), abs=1e-6)
    assert abs(float(second["loss"]) - np.log(2.0)) > 1e-3
    assert step.num_traces == 1
