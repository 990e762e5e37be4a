"""Group Relative Policy Optimization, the formulas: group-relative advantages of
sampled completions, a model's per-token log-probs (and entropy), and the clipped
surrogate loss with the aggregations of GRPO, DAPO, Dr. GRPO and BNPO, reporting
the metrics TRL's `GRPOTrainer` reports under the same names.

Sampling completions, scoring them (`eqtrain.post_training.rewards`) and the
loop are the caller's; this module builds on `eqtrain.losses` (per-token
log-probs, chunked or not) and `eqtrain.post_training.preference` (the reference model).
One step, `G` completions
per prompt, rows grouped consecutively:

    total, _ = rewards.score(funcs, prompts, completions, columns)
    advantages, metrics = grpo.group_advantages(total, group_size=G)
    old_logps = grpo.token_logprobs(model, tokens, targets)  # the sampling policy
    batch = {"tokens": tokens, "targets": targets, "completion_mask": mask,
             "old_logps": old_logps, "advantages": advantages}
    loss_fn = grpo.grpo_loss_fn(loss_type="dapo", beta=0.0)
    step = eqtrain.jit(eqtrain.train_step(loss_fn, optimizer))
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, PRNGKeyArray, Shaped

from .. import lora
from .._errors import ConfigError
from ..losses import _row_extras, _with_router
from ._logprobs import (
    _check_head,
    _forward,
    _Head,
    token_logprobs as token_logprobs,
    token_logprobs_and_entropy as token_logprobs_and_entropy,
)
from .preference import WithReference, _check_reference


Metrics = dict[str, Float[Array, ""]]

SCALES = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
LEVELS = ("token", "sequence")
REFERENCES = ("copy", "adapters_off", "precomputed")
STD_EPS = 1e-4
"""Added to the standard deviation that scales advantages (TRL's constant)."""


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"`{name}` must be one of {choices}; got {value!r}.")


# -- advantages ---------------------------------------------------------------------
def _nanstd(x: Array, axis: int | None = None) -> Array:
    """Standard deviation with Bessel's correction over the non-NaN values; NaN
    where fewer than two (TRL's `nanstd`)."""
    mean = jnp.nanmean(x, axis=axis, keepdims=True)
    var = jnp.nanmean(jnp.square(x - mean), axis=axis)
    n = jnp.sum(~jnp.isnan(x), axis=axis)
    return jnp.sqrt(jnp.where(n > 1, var * n / jnp.maximum(n - 1, 1), jnp.nan))


def group_advantages(
    rewards: Float[ArrayLike, " rows"],
    group_size: int,
    *,
    scale: str = "group",
) -> tuple[Float[Array, " rows"], Metrics]:
    """Each completion's reward minus its group's mean, scaled (Shao et al. 2024,
    arXiv:2402.03300; TRL's `scale_rewards`).

    Rows are grouped consecutively: group `g` is rows `g*G .. g*G+G-1`. With
    `std` the standard deviation (Bessel-corrected) and `eps = 1e-4`:

        scale="group": A = (r - group mean) / (group std + eps)
        scale="batch": A = (r - group mean) / (batch std + eps)   (PPO Lite)
        scale="none":  A =  r - group mean                        (Dr. GRPO)

    A NaN reward (a row no reward function could score: `rewards.score`) is left
    out of its group's mean and std, and gets advantage 0, as in TRL.

    Returns:
        `(advantages, metrics)`: `reward` (mean reward), `reward_std` (the std of
        all the batch's rewards, TRL 1.16's definition) and
        `frac_reward_zero_std` (the fraction of rows whose group's rewards are all
        equal: no learning signal; TRL reports the batch std's instead under
        `scale="batch"`).
    """
    _choice("scale", scale, SCALES)
    r = jnp.asarray(rewards, jnp.float32)
    _check_group_size(group_size, r.shape[0])
    mean = jnp.repeat(jnp.nanmean(r.reshape(-1, group_size), axis=1), group_size)
    group_std = _group_std(r, group_size)
    std = _batch_std(r) if scale == "batch" else group_std
    advantages = r - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPS)
    advantages = jnp.where(jnp.isnan(advantages), 0.0, advantages)
    return advantages, {
        "reward": jnp.nanmean(r),
        "reward_std": _nanstd(r),
        "frac_reward_zero_std": jnp.mean(jnp.isclose(group_std, 0.0)),
    }


def _check_group_size(group_size: Any, rows: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise ConfigError(f"`group_size` must be an int; got {group_size!r}.")
    if group_size < 1 or rows % group_size:
        raise ConfigError(
            f"`group_size` must be >= 1 and divide the {rows} rewards (the "
            f"completions of each prompt, consecutive); got {group_size}."
        )


def _group_std(r: Array, group_size: int) -> Array:
    """Each row's group's std (0 for groups of one)."""
    if group_size == 1:
        return jnp.zeros_like(r)
    return jnp.repeat(_nanstd(r.reshape(-1, group_size), axis=1), group_size)


def _batch_std(r: Array) -> Array:
    """The std of all the batch's rewards, for every row (0 for one row)."""
    return jnp.broadcast_to(_nanstd(r) if r.shape[0] > 1 else 0.0, r.shape)


# -- the loss ------------------------------------------------------------------------
def _token_mean(x: Array, m: Array) -> Array:
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def _clip_metrics(
    ratio: Array, advantages: Array, m: Array, eps_low: float, eps_high: float
) -> Metrics:
    """How often the clip is active where it changes the gradient: the ratio
    below `1 - eps_low` with a negative advantage, above `1 + eps_high` with a
    positive one (TRL's definitions); token means, or row means for
    sequence-level ratios."""
    low = ((ratio < 1 - eps_low) & (advantages < 0)).astype(jnp.float32)
    high = ((ratio > 1 + eps_high) & (advantages > 0)).astype(jnp.float32)
    mean = (lambda x: _token_mean(x, m)) if ratio.shape == m.shape else jnp.mean
    return {
        "clip_ratio/low_mean": mean(low),
        "clip_ratio/high_mean": mean(high),
        "clip_ratio/region_mean": mean(jnp.maximum(low, high)),
    }


def _ratio(logps: Array, old_logps: Array, m: Array, level: str) -> Array:
    """`exp(logp - old_logp)` per token (`[rows, seq]`), or per row (`[rows, 1]`,
    the exponential of the mean log-ratio over the row's tokens). Masked positions
    are read as log-ratio 0, so that anything they hold stays out, gradients too."""
    log_ratio = jnp.where(m != 0, logps - old_logps, 0.0)
    if level == "sequence":
        count = jnp.maximum(jnp.sum(m, -1, keepdims=True), 1.0)
        log_ratio = jnp.sum(log_ratio * m, -1, keepdims=True) / count
    return jnp.exp(log_ratio)


def _aggregate(
    per_token: Array, m: Array, loss_type: str, max_completion_length: int | None
) -> tuple[Array, Array]:
    """`(loss, weight)`: the per-token losses reduced as `loss_type` says, and
    what a micro-batch's loss weighs in accumulation (see `grpo_token_loss`)."""
    rows = jnp.asarray(m.shape[0], jnp.float32)
    total = jnp.sum(per_token * m)
    if loss_type == "grpo":
        per_row = jnp.sum(per_token * m, axis=-1) / jnp.maximum(jnp.sum(m, -1), 1.0)
        return jnp.mean(per_row), rows
    if loss_type == "dr_grpo":
        assert max_completion_length is not None
        return total / (rows * max_completion_length), rows
    tokens = jnp.sum(m)
    return total / jnp.maximum(tokens, 1.0), tokens


def _surrogate(
    ratio: Array, a: Array, epsilon_low: float, epsilon_high: float
) -> Array:
    """PPO's clipped surrogate, negated: `-min(r * A, clip(r) * A)`."""
    clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    return -jnp.minimum(ratio * a, clipped * a)


def _k3(logps: Array, ref_logps: Array, m: Array) -> Array:
    """Schulman's k3 estimate of KL(policy || reference) per token (0 where
    masked)."""
    diff = jnp.where(m != 0, ref_logps - logps, 0.0)
    return jnp.exp(diff) - diff - 1.0


def _check_loss(
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    beta: float,
    importance_sampling_level: str,
    max_completion_length: int | None,
) -> None:
    _choice("loss_type", loss_type, LOSS_TYPES)
    _choice("importance_sampling_level", importance_sampling_level, LEVELS)
    _at_least_zero("epsilon_low", epsilon_low, "e.g. 0.2")
    _at_least_zero("epsilon_high", epsilon_high, "e.g. 0.2")
    _at_least_zero("beta", beta, "0: no KL term")
    _check_dr_grpo(loss_type, max_completion_length)


def _at_least_zero(name: str, value: float, hint: str) -> None:
    if not value >= 0:
        raise ConfigError(f"`{name}` must be >= 0 ({hint}); got {value!r}.")


def _check_dr_grpo(loss_type: str, max_completion_length: int | None) -> None:
    """Dr. GRPO's denominator needs the sampler's limit on new tokens."""
    if loss_type == "dr_grpo" and not (
        isinstance(max_completion_length, int) and max_completion_length >= 1
    ):
        raise ConfigError(
            "loss_type='dr_grpo' divides by rows * `max_completion_length` (the "
            "sampler's limit on new tokens); set it to that int, got "
            f"{max_completion_length!r}."
        )


def grpo_token_loss(
    logps: Float[ArrayLike, "rows seq"],
    old_logps: Float[ArrayLike, "rows seq"],
    advantages: Float[ArrayLike, " rows"],
    mask: Shaped[ArrayLike, "rows seq"],
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    ref_logps: Float[ArrayLike, "rows seq"] | None = None,
    loss_type: str = "dapo",
    max_completion_length: int | None = None,
    importance_sampling_level: str = "token",
    kl_bias_correction: bool = True,
) -> tuple[Float[Array, ""], Metrics]:
    """The clipped surrogate of PPO with group-relative advantages (GRPO), from
    per-token log-probs of the policy, of the policy that sampled
    (`old_logps`) and optionally of a reference.

    Per completion token, with `r = exp(logp - old_logp)` and `A` the row's
    advantage:

        loss_t = -min(r * A, clip(r, 1 - epsilon_low, 1 + epsilon_high) * A)
                 + beta * (exp(ref - logp) - (ref - logp) - 1)

    (the KL term, Schulman's k3 estimator, only when `beta > 0`). With
    `kl_bias_correction` (the default, as TRL 1.16's `use_bias_correction_kl`,
    DeepSeek-V3.2's form) the KL term is multiplied by the importance ratio `r`
    (unclipped, with its gradient): the samples come from the old policy, and
    the ratio makes the estimate one of KL(policy || reference). With
    `importance_sampling_level="sequence"` (GSPO, arXiv:2507.18071) `r` is one
    ratio per row, `exp(mean over its tokens of (logp - old_logp))`.
    `epsilon_high > epsilon_low` is DAPO's clip-higher. The per-token losses are
    reduced as TRL 1.16 reduces them:

        "grpo":    mean over rows of (sum over the row's tokens / its tokens)
        "dapo":    sum over all tokens / number of tokens  (arXiv:2503.14476)
        "bnpo":    the same as "dapo" here (see below)
        "dr_grpo": sum over all tokens / (rows * max_completion_length)
                   (arXiv:2503.20783)

    `metrics["weight"]` makes gradient accumulation and data parallelism
    (`eqtrain.step`, which weighs each micro-batch's mean by it) equal one big
    batch: the number of rows for "grpo" and "dr_grpo" (means over rows), the
    number of completion tokens for "dapo" and "bnpo" (means over tokens): a
    step's loss is then the sum over all its tokens divided by all its tokens,
    which is DAPO's global-token normaliser. TRL's "bnpo" instead averages the
    micro-batches' token means, so it differs from "dapo" in TRL under
    accumulation; on one batch both agree with this.

    Args:
        logps, old_logps, ref_logps: per-token log-probs, aligned with `mask`;
            only the masked positions are read (others may hold anything).
        advantages: one per row (`group_advantages`).
        mask: 1 on the completion tokens that count (0: prompt, padding).

    Returns:
        `(loss, metrics)`: `clip_ratio/low_mean`, `clip_ratio/high_mean`,
        `clip_ratio/region_mean` (the share of completion tokens where the clip
        is active and changes the gradient: `r < 1 - epsilon_low` with `A < 0`,
        `r > 1 + epsilon_high` with `A > 0`, either; the share of rows with
        sequence-level ratios), `kl` (token mean of the KL term, when
        `beta > 0`) and `weight`. These are means within the batch;
        accumulation averages them by `weight`.
    """
    _check_loss(
        loss_type,
        epsilon_low,
        epsilon_high,
        beta,
        importance_sampling_level,
        max_completion_length,
    )
    if beta > 0 and ref_logps is None:
        raise ConfigError("`beta` > 0 needs `ref_logps`, the reference's log-probs.")
    logps, m = jnp.asarray(logps), jnp.asarray(mask).astype(jnp.float32)
    ratio = _ratio(logps, jnp.asarray(old_logps), m, importance_sampling_level)
    a = jnp.asarray(advantages, jnp.float32)[:, None]
    per_token = _surrogate(ratio, a, epsilon_low, epsilon_high)
    metrics = _clip_metrics(ratio, a, m, epsilon_low, epsilon_high)
    if ref_logps is not None and beta > 0:
        kl = _k3(logps, jnp.asarray(ref_logps), m)
        if kl_bias_correction:
            kl = kl * ratio
        per_token = per_token + beta * kl
        metrics["kl"] = _token_mean(kl, m)
    per_token = jnp.broadcast_to(per_token, m.shape)
    loss, metrics["weight"] = _aggregate(per_token, m, loss_type, max_completion_length)
    return loss, metrics


# -- a loss function for the step builders -------------------------------------------
def _check_keys(
    batch: Mapping[str, ArrayLike], reference: str | None, beta: float
) -> None:
    needed = ["tokens", "targets", "completion_mask", "advantages"]
    if beta > 0 and reference == "precomputed":
        needed.append("ref_logps")
    missing = [k for k in needed if k not in batch]
    if missing:
        raise ConfigError(
            f"a GRPO batch needs the keys {needed}; {missing} missing (it has "
            f"{sorted(batch)})."
        )


def _reference_logps(
    model: Any,
    batch: Mapping[str, ArrayLike],
    reference: str | None,
    inputs: tuple[Array, Array, dict[str, Array]],
    head: _Head,
) -> Array:
    """The reference's per-token log-probs (no gradient): the batch's, or the
    frozen copy's, or the policy's with its adapters off."""
    if reference == "precomputed":
        return jnp.asarray(batch["ref_logps"], jnp.float32)
    ref = model.reference if reference == "copy" else lora.disable(model)
    logps, _, _ = _forward(ref, *inputs, None, head, False)
    return lax.stop_gradient(logps)


def grpo_loss_fn(
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    reference: str | None = None,
    importance_sampling_level: str = "token",
    kl_bias_correction: bool = True,
    max_completion_length: int | None = None,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk: int | None = None,
    entropy: bool = True,
) -> Callable[..., tuple[Float[Array, ""], Metrics]]:
    """A GRPO loss `loss_fn(model, batch, key) -> (loss, aux)` for
    `eqtrain.train_step` and the step pieces (`grpo_token_loss` on the model's
    per-token log-probs).

    The batch holds one completion per row: `tokens`, `targets` (int `[rows,
    seq]`, prompt and completion, targets shifted), `completion_mask` (`[rows,
    seq]`, 1 on the completion's targets), `advantages` (`[rows]`), optionally
    `old_logps` (`[rows, seq]`: the sampling policy's log-probs of the targets,
    e.g. `token_logprobs` before the first update on these samples; absent: the
    current ones without gradient, ratio 1, as on a first pass), with
    `reference="precomputed"` and `beta > 0` `ref_logps` (`[rows, seq]`), and
    optionally `segment_ids`, `positions` for the model (as `causal_lm_loss`).

    Args:
        loss_type, epsilon_low, epsilon_high, beta, importance_sampling_level,
            kl_bias_correction, max_completion_length: as for `grpo_token_loss`.
        reference: where the reference log-probs come from when `beta > 0`:
            `"copy"` (the model is a `preference.WithReference`), `"adapters_off"`
            (`eqtrain.lora.disable`) or `"precomputed"` (`ref_logps` in the
            batch); unused (may be None) with `beta == 0`.
        temperature: the sampling temperature (see `token_logprobs`).
        vocab_size, chunk: as for `token_logprobs`.
        entropy: report `entropy` (the token mean of the policy's next-token
            entropy, no gradient); with `chunk` it costs one more forward pass
            over the head.

    Returns:
        The loss function; its aux holds `grpo_token_loss`'s metrics, `entropy`,
        and a model with experts' router penalty (added to the loss) and metrics.
    """
    options = dict(
        loss_type=loss_type,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        beta=beta,
        max_completion_length=max_completion_length,
        importance_sampling_level=importance_sampling_level,
    )
    _check_loss(**options)
    options["kl_bias_correction"] = bool(kl_bias_correction)
    if beta > 0 and reference not in REFERENCES:
        raise ConfigError(
            f"`beta` > 0 needs a reference model: `reference` must be one of "
            f"{REFERENCES}; got {reference!r}."
        )
    head = _check_head(vocab_size, chunk, temperature)
    return _loss_fn(options, reference, head, entropy)


def _loss_fn(
    options: dict[str, Any], reference: str | None, head: _Head, entropy: bool
) -> Callable[..., tuple[Float[Array, ""], Metrics]]:
    """`grpo_loss_fn`'s loss function, its arguments checked; `options` are
    `grpo_token_loss`'s."""
    beta = options["beta"]

    def loss_fn(
        model: Any, batch: Mapping[str, ArrayLike], key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, ""], Metrics]:
        _check_keys(batch, reference, beta)
        mask = jnp.asarray(batch["completion_mask"]).astype(jnp.float32)
        tokens, targets = jnp.asarray(batch["tokens"]), jnp.asarray(batch["targets"])
        inputs = (tokens, targets, _row_extras(batch))
        policy = _policy(model, reference, beta)
        logps, ent, router = _forward(policy, *inputs, key, head, entropy)
        ref = None
        if beta > 0:
            ref = _reference_logps(model, batch, reference, inputs, head)
        old = batch.get("old_logps")  # absent: the current ones, ratio 1 (a first pass)
        old = lax.stop_gradient(logps) if old is None else jnp.asarray(old)
        advantages = jnp.asarray(batch["advantages"], jnp.float32)
        loss, metrics = grpo_token_loss(
            logps, old, advantages, mask, ref_logps=ref, **options
        )
        if ent is not None:
            metrics["entropy"] = _token_mean(ent, mask)
        return _with_router(policy, router, loss, metrics)

    return loss_fn


def _policy(model: Any, reference: str | None, beta: float) -> Any:
    """The policy of `model` (a `WithReference`'s), after checking that `model`
    carries the reference that `reference` names when the loss reads one."""
    if beta > 0:
        _check_reference(model, reference)
    return model.policy if isinstance(model, WithReference) else model
