"""Preference optimisation, the formulas: per-sequence log-probabilities of a
completion, and the DPO, IPO, ORPO and SimPO losses on them, with the metrics
TRL reports under the same names (`rewards/chosen`, `rewards/rejected`,
`rewards/margins`, `rewards/accuracies`, `logps/chosen`, `logps/rejected`).

Every loss takes per-pair log-probabilities (arrays of shape `[pairs]`) and
returns `(per-pair loss, metrics)`; the mean over pairs (weighted by pairs, not
tokens) is the caller's, as is where the reference log-probabilities come from
(a frozen copy, the same model with its LoRA adapters off via
`eqtrain.lora.disable`, or values precomputed into the batch).

    logp, count = sequence_logprobs(logits, targets, completion_mask)
    losses, metrics = dpo(policy_chosen, policy_rejected, ref_chosen, ref_rejected,
                          beta=0.1)
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from ._errors import ConfigError


Metrics = dict[str, Float[Array, ""]]


def sequence_logprobs(
    logits: Float[Array, "*batch seq vocab"],
    targets: Int[Array, "*batch seq"],
    mask: ArrayLike,
) -> tuple[Float[Array, "*batch"], Float[Array, "*batch"]]:
    """`(sum over masked positions of log p(target), number of masked positions)`
    per sequence, in float32.

    Args:
        logits: next-token logits (any float dtype).
        targets: the token each position should predict.
        mask: which positions count (the completion's tokens), bool or 0/1.
    """
    logits = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    weight = jnp.asarray(mask).astype(jnp.float32)
    return jnp.sum((picked - log_z) * weight, axis=-1), jnp.sum(weight, axis=-1)


def _check(name: str, value: float, *, low: float, high: float | None = None) -> None:
    if not value >= low or (high is not None and not value <= high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ConfigError(f"`{name}` must be {bound}; got {value!r}.")


def _reward_metrics(
    chosen_rewards: Array,
    rejected_rewards: Array,
    policy_chosen: Array,
    policy_rejected: Array,
) -> Metrics:
    return {
        "rewards/chosen": jnp.mean(chosen_rewards),
        "rewards/rejected": jnp.mean(rejected_rewards),
        "rewards/margins": jnp.mean(chosen_rewards - rejected_rewards),
        "rewards/accuracies": jnp.mean(
            (chosen_rewards > rejected_rewards).astype(jnp.float32)
        ),
        "logps/chosen": jnp.mean(policy_chosen),
        "logps/rejected": jnp.mean(policy_rejected),
    }


def dpo(
    policy_chosen: Float[Array, " pairs"],
    policy_rejected: Float[Array, " pairs"],
    reference_chosen: Float[Array, " pairs"],
    reference_rejected: Float[Array, " pairs"],
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[Float[Array, " pairs"], Metrics]:
    """Direct Preference Optimization (Rafailov et al. 2023, arXiv:2305.18290),
    with label smoothing (the conservative / robust variant: Mitchell 2023,
    "A note on DPO with noisy preferences"; Chowdhury et al. 2024,
    arXiv:2403.00409 use the same form).

    With `h = (pc - rc) - (pr - rr)` (sequence log-probs of the policy `p` and
    the reference `r` on the chosen `c` and rejected `r` completions):

        loss = -(1 - eps) * log sigmoid(beta * h) - eps * log sigmoid(-beta * h)

    Rewards are `beta * (p - r)` per completion. With the reference equal to the
    policy, every pair's loss is `log 2` and every margin 0.
    """
    _check("beta", beta, low=0.0)
    _check("label_smoothing", label_smoothing, low=0.0, high=0.5)
    chosen = beta * (policy_chosen - reference_chosen)
    rejected = beta * (policy_rejected - reference_rejected)
    logits = chosen - rejected
    losses = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(
        logits
    ) - label_smoothing * jax.nn.log_sigmoid(-logits)
    return losses, _reward_metrics(chosen, rejected, policy_chosen, policy_rejected)


def ipo(
    policy_chosen: Float[Array, " pairs"],
    policy_rejected: Float[Array, " pairs"],
    reference_chosen: Float[Array, " pairs"],
    reference_rejected: Float[Array, " pairs"],
    *,
    beta: float = 0.1,
) -> tuple[Float[Array, " pairs"], Metrics]:
    """Identity Preference Optimisation (Azar et al. 2023, arXiv:2310.12036):
    `loss = (h - 1 / (2 * beta))**2` with `h` as in `dpo`. Pass length-averaged
    log-probabilities (sums divided by token counts), as TRL's `ipo` does."""
    _check("beta", beta, low=1e-12)
    chosen = policy_chosen - reference_chosen
    rejected = policy_rejected - reference_rejected
    losses = (chosen - rejected - 1.0 / (2.0 * beta)) ** 2
    metrics = _reward_metrics(
        beta * chosen, beta * rejected, policy_chosen, policy_rejected
    )
    return losses, metrics


def orpo(
    policy_chosen: Float[Array, " pairs"],
    policy_rejected: Float[Array, " pairs"],
    chosen_nll: Float[Array, " pairs"],
    *,
    orpo_lambda: float = 0.1,
) -> tuple[Float[Array, " pairs"], Metrics]:
    """Odds Ratio Preference Optimization (Hong et al. 2024, arXiv:2403.07691);
    no reference model.

    With length-averaged log-probs `lc`, `lr` and `log odds(y) = l - log(1 -
    exp(l))`:

        loss = chosen_nll - lambda * log sigmoid(log odds(c) - log odds(r))

    `chosen_nll` is the SFT loss on the chosen completion (its mean token NLL).
    Rewards are reported as `lambda * l` (TRL's convention).
    """
    _check("orpo_lambda", orpo_lambda, low=0.0)
    log_odds = (policy_chosen - policy_rejected) - (
        jnp.log1p(-jnp.exp(policy_chosen)) - jnp.log1p(-jnp.exp(policy_rejected))
    )
    ratio = jax.nn.log_sigmoid(log_odds)
    losses = chosen_nll - orpo_lambda * ratio
    metrics = _reward_metrics(
        orpo_lambda * policy_chosen,
        orpo_lambda * policy_rejected,
        policy_chosen,
        policy_rejected,
    )
    metrics["log_odds_ratio"] = jnp.mean(ratio)
    return losses, metrics


def simpo(
    policy_chosen: Float[Array, " pairs"],
    policy_rejected: Float[Array, " pairs"],
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> tuple[Float[Array, " pairs"], Metrics]:
    """Simple Preference Optimization (Meng et al. 2024, arXiv:2405.14734); no
    reference model. With length-averaged log-probs `lc`, `lr`:

        loss = -(1 - eps) * log sigmoid(beta * (lc - lr) - gamma)
               - eps * log sigmoid(-(beta * (lc - lr) - gamma))

    `gamma` is the target reward margin (TRL's `gamma_beta_ratio` is
    `gamma / beta`). Rewards are `beta * l`.
    """
    _check("beta", beta, low=0.0)
    _check("label_smoothing", label_smoothing, low=0.0, high=0.5)
    chosen, rejected = beta * policy_chosen, beta * policy_rejected
    logits = chosen - rejected - gamma
    losses = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(
        logits
    ) - label_smoothing * jax.nn.log_sigmoid(-logits)
    return losses, _reward_metrics(chosen, rejected, policy_chosen, policy_rejected)
