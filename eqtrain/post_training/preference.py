"""Preference optimisation, the formulas: per-sequence log-probabilities of a
completion, and the DPO, IPO, ORPO and SimPO losses on them, with the metrics
TRL reports under the same names (`rewards/chosen`, `rewards/rejected`,
`rewards/margins`, `rewards/accuracies`, `logps/chosen`, `logps/rejected`).

Every loss takes per-pair log-probabilities (arrays of shape `[pairs]`) and
returns `(per-pair loss, metrics)`; the mean over pairs (weighted by pairs, not
tokens) is the caller's, as is where the reference log-probabilities come from
(a frozen copy, the same model with its LoRA adapters off via
`eqtrain.lora.disable`, or values precomputed into the batch with
`pair_logprobs`).

    logp, count = sequence_logprobs(logits, targets, completion_mask)
    losses, metrics = dpo(policy_chosen, policy_rejected, ref_chosen, ref_rejected,
                          beta=0.1)
"""

import functools
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .. import lora
from .._errors import ConfigError
from .._rows import vmap_rows
from .._state import trainable_mask
from ..losses import (
    _logit_options,
    _row_keys,
    chunked_sequence_logprobs,
    vocab_mask,
)


Metrics = dict[str, Float[Array, ""]]
_Pair = tuple[Array, Array]  # chosen and rejected values, one per pair each


def sequence_logprobs(
    logits: Float[Array, "*batch seq vocab"],
    targets: Int[Array, "*batch seq"],
    mask: ArrayLike,
    *,
    vocab_size: int | None = None,
) -> tuple[Float[Array, "*batch"], Float[Array, "*batch"]]:
    """`(sum over masked positions of log p(target), number of masked positions)`
    per sequence, in float32.

    Args:
        logits: next-token logits (any float dtype).
        targets: the token each position should predict.
        mask: which positions count (the completion's tokens), bool or 0/1.
        vocab_size: the real vocabulary of a padded model (`losses.vocab_mask`).
    """
    logits = vocab_mask(logits, vocab_size).astype(jnp.float32)
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


def _smoothed_sigmoid_loss(logits: Array, label_smoothing: float) -> Array:
    """`-(1 - eps) * log sigmoid(logits) - eps * log sigmoid(-logits)`, DPO's and
    SimPO's loss on their margins."""
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(
        logits
    ) - label_smoothing * jax.nn.log_sigmoid(-logits)


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
    losses = _smoothed_sigmoid_loss(chosen - rejected, label_smoothing)
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


def _log_odds_ratio(chosen: Array, rejected: Array) -> Array:
    """`log odds(c) - log odds(r)` of length-averaged log-probs, with
    `log odds(y) = l - log(1 - exp(l))`."""
    return (chosen - rejected) - (
        jnp.log1p(-jnp.exp(chosen)) - jnp.log1p(-jnp.exp(rejected))
    )


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
    ratio = jax.nn.log_sigmoid(_log_odds_ratio(policy_chosen, policy_rejected))
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
    losses = _smoothed_sigmoid_loss(chosen - rejected - gamma, label_smoothing)
    return losses, _reward_metrics(chosen, rejected, policy_chosen, policy_rejected)


# -- a loss function for the step builders ------------------------------------------
KINDS = ("dpo", "ipo", "orpo", "simpo")
REFERENCES = ("copy", "adapters_off", "precomputed")
_NEEDS_REFERENCE = ("dpo", "ipo")


class WithReference(eqx.Module):
    """A policy and a frozen copy of it as one model pytree: the reference lives
    in the state (never closed over as a constant inside `jit`), and
    `reference_trainable` leaves it out of the gradients and optimizer state.
    Calling it calls the policy."""

    policy: Any
    reference: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.policy(*args, **kwargs)


def with_reference(model: Any) -> WithReference:
    """`model` as the policy, and a copy of its arrays as the reference (a copy,
    so donating the state never frees the reference's arrays under it)."""
    copied = jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, model)
    return WithReference(policy=model, reference=copied)


def reference_trainable(model: WithReference, policy: Any = True) -> Any:
    """The trainable filter of a `WithReference`: `policy` (a filter spec of the
    policy, e.g. `lora.trainable(...)`) for the policy, nothing of the reference."""
    return WithReference(
        policy=trainable_mask(model.policy, policy),
        reference=trainable_mask(model.reference, False),
    )


def _check_reference(model: Any, reference: str | None) -> None:
    if reference == "copy" and not isinstance(model, WithReference):
        raise ConfigError(
            "reference='copy' reads the frozen copy of a `WithReference` model; "
            "build the state from `preference.with_reference(model)` with "
            "`trainable=preference.reference_trainable(...)`."
        )
    if reference == "adapters_off" and not lora.adapter_paths(model):
        raise ConfigError(
            "reference='adapters_off' is the policy with its LoRA adapters off, "
            "but this model has no adapters (it would be its own reference and "
            "never learn); wrap it with `lora.apply`, or use reference='copy'."
        )


def _logps(
    model: Any,
    rows: tuple[Array, Array, Array],
    key: Any,
    vocab_size: int | None = None,
    chunk: int | None = None,
) -> Any:
    """`(log-prob sums, token counts)` of `rows = (tokens, targets, mask)`: through
    the model's logits, or `chunk` tokens at a time from its hidden states."""
    tokens, targets, mask = rows
    keys = _row_keys(key, tokens.shape[0])
    if not chunk:
        logits = vmap_rows(lambda t, k: model(t, key=k))(tokens, keys)
        return sequence_logprobs(logits, targets, mask, vocab_size=vocab_size)
    hidden = vmap_rows(lambda t, k: model.features(t, key=k))(tokens, keys)
    return chunked_sequence_logprobs(
        hidden,
        model.head_weight(key=key),
        targets,
        mask,
        chunk=chunk,
        vocab_size=vocab_size,
        **_logit_options(model),
    )


def _pairs(
    batch: Mapping[str, ArrayLike],
) -> tuple[int, tuple[Array, Array, Array]]:
    """Both completions of every pair as one batch: `(pairs, (tokens, targets,
    mask))`, chosen rows first; masked targets point at id 0."""
    get = lambda name: jnp.asarray(batch[name])  # noqa: E731
    pairs = get("chosen_tokens").shape[0]
    tokens = jnp.concatenate([get("chosen_tokens"), get("rejected_tokens")])
    targets = jnp.concatenate([get("chosen_targets"), get("rejected_targets")])
    mask = jnp.concatenate([get("chosen_mask"), get("rejected_mask")])
    mask = mask.astype(jnp.float32)
    return pairs, (tokens, jnp.where(mask > 0, targets, 0), mask)


def pair_logprobs(
    model: Any,
    batch: Mapping[str, ArrayLike],
    *,
    vocab_size: int | None = None,
    chunk: int | None = None,
) -> tuple[Float[Array, " pairs"], Float[Array, " pairs"]]:
    """`(chosen, rejected)` sequence log-probs (sums over each completion's mask)
    of `model` on a batch of pairs, without dropout: what `reference="precomputed"`
    reads back as `reference_chosen` / `reference_rejected`. Jit it (e.g.
    `eqx.filter_jit`) to precompute a reference over a dataset once. `chunk`: as
    for `preference_loss_fn`."""
    pairs, rows = _pairs(batch)
    logp, _ = _logps(model, rows, None, vocab_size, chunk)
    return _split(logp, pairs)


def _split(x: Array, pairs: int) -> tuple[Array, Array]:
    """The chosen and the rejected rows of `x` (`_pairs`' order)."""
    return x[:pairs], x[pairs:]


def preference_loss_fn(
    kind: str = "dpo",
    *,
    reference: str | None = "adapters_off",
    beta: float | None = None,
    label_smoothing: float = 0.0,
    orpo_lambda: float = 0.1,
    gamma: float = 0.5,
    vocab_size: int | None = None,
    chunk: int | None = None,
) -> Callable[..., tuple[Float[Array, ""], Metrics]]:
    """A preference loss `loss_fn(model, batch, key) -> (loss, aux)` for
    `eqtrain.train_step` and the step pieces.

    The batch holds pairs: `chosen_tokens`, `chosen_targets`, `chosen_mask` and
    the same for `rejected_` (int32/float `[pairs, seq]`; the masks select the
    completion's target tokens; `eqtrain.data.preference_rows` makes them), and
    with `reference="precomputed"` the reference's sequence log-probs
    `reference_chosen`, `reference_rejected` (`[pairs]`, sums over the
    completion, e.g. from `pair_logprobs` over the dataset once). Both completions run
    through the policy in one batch. The loss is the mean over pairs, and
    `aux["weight"]` is the number of pairs, so accumulation weighs pairs (not
    tokens).

    Args:
        kind: `"dpo"`, `"ipo"` (both need a reference), `"orpo"` or `"simpo"`.
        reference: where the reference log-probs come from: `"copy"` (the model
            is a `WithReference`), `"adapters_off"` (the policy with its LoRA
            adapters switched off, `eqtrain.lora.disable`: no second copy of the
            weights) or `"precomputed"` (read from the batch). Ignored (may be
            None) for ORPO and SimPO.
        beta: DPO/IPO's beta (default 0.1) or SimPO's (default 2.0).
        label_smoothing: DPO's and SimPO's (0: off).
        orpo_lambda: ORPO's weight of the odds-ratio term.
        gamma: SimPO's target reward margin.
        vocab_size: the real vocabulary of a model with a padded embedding and
            head (`models.resize_vocab`): padded logits are masked out.
        chunk: compute the log-probs from `model.features` and
            `model.head_weight()` this many tokens at a time
            (`losses.chunked_sequence_logprobs`), never holding the full logits;
            None: through the model's logits.
    """
    _check_kind(kind, reference)
    beta = (2.0 if kind == "simpo" else 0.1) if beta is None else beta
    losses = _kind_losses(kind, beta, label_smoothing, orpo_lambda, gamma)
    logps = functools.partial(_logps, vocab_size=vocab_size, chunk=chunk)
    return _loss_fn(kind in _NEEDS_REFERENCE, reference, losses, logps)


def _check_kind(kind: str, reference: str | None) -> None:
    if kind not in KINDS:
        raise ConfigError(f"preference `kind` must be one of {KINDS}; got {kind!r}.")
    if kind in _NEEDS_REFERENCE and reference not in REFERENCES:
        raise ConfigError(
            f"{kind} needs a reference model: `reference` must be one of "
            f"{REFERENCES}; got {reference!r}."
        )


def _loss_fn(
    needs: bool,
    reference: str | None,
    losses: Callable[..., tuple[Array, Metrics]],
    logps: Callable[..., Any],
) -> Callable[..., tuple[Float[Array, ""], Metrics]]:
    """`preference_loss_fn`'s loss function from its parts: whether it `needs`
    the reference, the kind's `losses` (`_kind_losses`) and `logps` (`_logps`)."""

    def loss_fn(
        model: Any, batch: Mapping[str, ArrayLike], key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, ""], Metrics]:
        pairs, rows = _pairs(batch)
        if needs:
            _check_reference(model, reference)
        policy = model.policy if needs and reference == "copy" else model
        logp, count = logps(policy, rows, key)
        count = jnp.maximum(count, 1.0)
        ref = None
        if needs:
            ref = _reference_sums(model, batch, reference, rows, logps, pairs)
        per_pair, metrics = losses(_split(logp, pairs), _split(count, pairs), ref)
        metrics["weight"] = jnp.asarray(pairs, jnp.float32)
        return jnp.mean(per_pair), metrics

    return loss_fn


def _kind_losses(
    kind: str, beta: float, label_smoothing: float, orpo_lambda: float, gamma: float
) -> Callable[[_Pair, _Pair, _Pair | None], tuple[Array, Metrics]]:
    """`losses(policy sums, token counts, reference sums or None) -> (per-pair
    loss, metrics)` for `kind`; the length-averaged kinds divide the sums by the
    counts."""

    def dpo_(p: _Pair, n: _Pair, r: _Pair | None) -> tuple[Array, Metrics]:
        assert r is not None
        return dpo(*p, *r, beta=beta, label_smoothing=label_smoothing)

    def ipo_(p: _Pair, n: _Pair, r: _Pair | None) -> tuple[Array, Metrics]:
        assert r is not None
        return ipo(p[0] / n[0], p[1] / n[1], r[0] / n[0], r[1] / n[1], beta=beta)

    def orpo_(p: _Pair, n: _Pair, r: _Pair | None) -> tuple[Array, Metrics]:
        mean_c, mean_r = p[0] / n[0], p[1] / n[1]
        return orpo(mean_c, mean_r, -mean_c, orpo_lambda=orpo_lambda)

    def simpo_(p: _Pair, n: _Pair, r: _Pair | None) -> tuple[Array, Metrics]:
        mean_c, mean_r = p[0] / n[0], p[1] / n[1]
        return simpo(
            mean_c, mean_r, beta=beta, gamma=gamma, label_smoothing=label_smoothing
        )

    return {"dpo": dpo_, "ipo": ipo_, "orpo": orpo_, "simpo": simpo_}[kind]


def _reference_sums(
    model: Any,
    batch: Mapping[str, ArrayLike],
    reference: str | None,
    rows: tuple[Array, Array, Array],
    logps: Callable[..., Any],
    pairs: int,
) -> _Pair:
    """The reference's sequence log-probs (no gradient): the batch's, or the
    frozen copy's, or the policy's with its adapters off."""
    if reference == "precomputed":
        chosen = jnp.asarray(batch["reference_chosen"])
        return chosen, jnp.asarray(batch["reference_rejected"])
    ref = model.reference if reference == "copy" else lora.disable(model)
    ref_logp, _ = logps(ref, rows, None)
    return _split(jax.lax.stop_gradient(ref_logp), pairs)
