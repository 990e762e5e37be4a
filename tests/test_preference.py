"""The preference formulas against the same formulas computed independently in
NumPy (float64) from the same log-probabilities."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqtrain import ConfigError, preference


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
