"""A model's per-token log-probabilities (and entropy) of given targets, for GRPO:
through its logits, or chunked from its final hidden states and head matrix
(`losses.chunked_token_logprobs`), never holding the full logits.
`eqtrain.post_training.grpo` re-exports `token_logprobs` and
`token_logprobs_and_entropy`.
"""

from typing import Any, NamedTuple

import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._chunked import _chunks, _logits
from .._errors import ConfigError
from ..losses import (
    _batch_features,
    _lm_logits,
    _logit_options,
    chunked_token_logprobs,
    vocab_mask,
)


class _Head(NamedTuple):
    """How log-probs are taken from a model's output head."""

    vocab_size: int | None
    chunk: int | None
    temperature: float


def _entropy(z: Array) -> Array:
    """Entropy of the softmax of f32 logits `[..., vocab]` (-inf logits allowed)."""
    p = jax.nn.softmax(z, axis=-1)
    plogp = jnp.where(p > 0, p * jax.nn.log_softmax(z, axis=-1), 0.0)
    return -jnp.sum(plogp, axis=-1)


def _from_logits(
    logits: Array, targets: Array, head: _Head, entropy: bool
) -> tuple[Array, Array | None]:
    z = vocab_mask(logits, head.vocab_size).astype(jnp.float32) / head.temperature
    picked = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    logp = picked - jax.nn.logsumexp(z, axis=-1)
    return logp, _entropy(lax.stop_gradient(z)) if entropy else None


def _chunk_options(model: Any, temperature: float) -> dict[str, Any]:
    """The model's logit transforms, with the temperature folded into the scale
    (a soft-cap comes after the scale, so the two cannot be combined)."""
    options = _logit_options(model)
    if temperature == 1.0:
        return options
    if options.get("softcap") is not None:
        raise ConfigError(
            f"`temperature`={temperature} with `chunk` needs a model without a "
            "final logit soft-cap (the temperature divides the capped logits); "
            "use chunk=None for this model."
        )
    return {**options, "logit_scale": options.get("logit_scale", 1.0) / temperature}


def _chunked_entropy(
    hidden: Array, weight: Array, head: _Head, options: dict[str, Any]
) -> Array:
    """Per-token entropy from hidden states and the head, `chunk` tokens at a
    time (no gradient)."""
    hidden, weight = lax.stop_gradient(hidden), lax.stop_gradient(weight)
    chunk = min(head.chunk or 1, max(hidden.shape[0], 1))
    (chunks,) = _chunks(chunk, hidden)
    scale, cap = options.get("logit_scale", 1.0), options.get("softcap")
    call = lambda h: _entropy(_logits(h, weight, head.vocab_size, scale, cap))
    return lax.map(call, chunks).reshape(-1)[: hidden.shape[0]]


def _from_features(
    model: Any,
    hidden: Array,
    targets: Array,
    key: PRNGKeyArray | None,
    head: _Head,
    entropy: bool,
) -> tuple[Array, Array | None]:
    """`(log-probs, entropy or None)` from the final hidden states and the head
    matrix, `head.chunk` tokens at a time."""
    options = _chunk_options(model, head.temperature)
    flat = hidden.reshape(-1, hidden.shape[-1])
    weight = model.head_weight(key=key)
    logp = chunked_token_logprobs(
        flat,
        weight,
        targets.reshape(-1),
        chunk=head.chunk,
        vocab_size=head.vocab_size,
        **options,
    ).reshape(targets.shape)
    if not entropy:
        return logp, None
    return logp, _chunked_entropy(flat, weight, head, options).reshape(targets.shape)


def _forward(
    model: Any,
    tokens: Array,
    targets: Array,
    extras: dict[str, Array],
    key: PRNGKeyArray | None,
    head: _Head,
    entropy: bool,
) -> tuple[Array, Array | None, dict[str, Array]]:
    """`(log-probs, entropy or None, router statistics)` of `model` on a batch."""
    targets = jnp.where(targets >= 0, targets, 0)  # e.g. -100 on masked positions
    if head.chunk is None:
        logits, router = _lm_logits(model, tokens, extras, key)
        return *_from_logits(logits, targets, head, entropy), router
    hidden, router = _batch_features(model, tokens, extras, key)
    return *_from_features(model, hidden, targets, key, head, entropy), router


def _check_chunk(chunk: Any) -> None:
    if chunk is not None and (
        isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1
    ):
        raise ConfigError(f"`chunk` must be None or an int >= 1; got {chunk!r}.")


def _check_head(vocab_size: Any, chunk: Any, temperature: Any) -> _Head:
    _check_chunk(chunk)
    if not temperature > 0:
        raise ConfigError(
            f"`temperature` must be > 0 (the sampling temperature); got "
            f"{temperature!r}."
        )
    return _Head(vocab_size, chunk, float(temperature))


def _model_inputs(
    tokens: ArrayLike,
    targets: ArrayLike,
    segment_ids: ArrayLike | None,
    positions: ArrayLike | None,
) -> tuple[Array, Array, dict[str, Array]]:
    extras = {"segment_ids": segment_ids, "positions": positions}
    extras = {k: jnp.asarray(v) for k, v in extras.items() if v is not None}
    return jnp.asarray(tokens), jnp.asarray(targets), extras


def token_logprobs_and_entropy(
    model: Any,
    tokens: Int[ArrayLike, "rows seq"],
    targets: Int[ArrayLike, "rows seq"],
    *,
    key: PRNGKeyArray | None = None,
    vocab_size: int | None = None,
    chunk: int | None = None,
    temperature: float = 1.0,
    segment_ids: Int[ArrayLike, "rows seq"] | None = None,
    positions: Int[ArrayLike, "rows seq"] | None = None,
) -> tuple[Float[Array, "rows seq"], Float[Array, "rows seq"]]:
    """`token_logprobs` and the entropy of the model's next-token distribution at
    every position (f32, no gradient; with `chunk`, one more pass over the head,
    forward only)."""
    head = _check_head(vocab_size, chunk, temperature)
    tokens, targets, extras = _model_inputs(tokens, targets, segment_ids, positions)
    logp, ent, _ = _forward(model, tokens, targets, extras, key, head, True)
    assert ent is not None
    return logp, ent


def token_logprobs(
    model: Any,
    tokens: Int[ArrayLike, "rows seq"],
    targets: Int[ArrayLike, "rows seq"],
    *,
    key: PRNGKeyArray | None = None,
    vocab_size: int | None = None,
    chunk: int | None = None,
    temperature: float = 1.0,
    segment_ids: Int[ArrayLike, "rows seq"] | None = None,
    positions: Int[ArrayLike, "rows seq"] | None = None,
) -> Float[Array, "rows seq"]:
    """`log p(target)` at every position of a batch, in f32, differentiable.

    Args:
        model: a per-row model `model(tokens [seq], key=...) -> logits [seq,
            vocab]` (run under `jax.vmap`, the key split per row), or one with
            `routes_batch` (experts: `model.batch_features` over the batch, then
            its head).
        tokens: the inputs (prompt and completion).
        targets: the next token of every position; negative ids (e.g. -100 on
            masked positions) are read as 0, so their log-prob is meaningless.
        key: for dropout (LoRA adapters); None: none.
        vocab_size: the real vocabulary of a padded model (`losses.vocab_mask`).
        chunk: take the log-probs from `model.features` and
            `model.head_weight()` this many tokens at a time
            (`losses.chunked_token_logprobs`), never holding the full logits.
        temperature: the sampling temperature: the logits are divided by it, as
            the sampler did (TRL does the same).
        segment_ids, positions: passed to the model as `causal_lm_loss` does
            (e.g. left-padded prompts: pad tokens in segment 0).
    """
    head = _check_head(vocab_size, chunk, temperature)
    tokens, targets, extras = _model_inputs(tokens, targets, segment_ids, positions)
    return _forward(model, tokens, targets, extras, key, head, False)[0]
