"""Ready-made loss functions with eqtrain's contract `loss_fn(model, batch, key) ->
(loss, aux)`, for `eqtrain.train_step` and `eqtrain.eval_step`.

Each reports `aux["weight"]`, the number of target tokens (or examples) its mean
ran over, which `train_step` uses to weight micro-batches (see `batch_weight`).
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from ._chunked import (
    ChunkedCE as ChunkedCE,
    chunked_cross_entropy as chunked_cross_entropy,
    chunked_token_logprobs as chunked_token_logprobs,
)
from ._errors import ConfigError
from ._reduce import row_max, row_sum
from ._rows import vmap_rows


Aux = dict[str, Float[Array, ""]]

CAUSAL_LM_AUX = ("accuracy", "weight")
"""The aux names `causal_lm_loss` reports (plus `"z_loss"` when it is on)."""


def _row_keys(key: PRNGKeyArray | None, rows: int) -> Array | None:
    """One key per row (`None` stays `None`: the model runs without randomness)."""
    return None if key is None else jr.split(key, rows)


@jax.named_scope("loss")
def _token_cross_entropy(
    logits: Float[Array, "*rows classes"], targets: Int[Array, "*rows"]
) -> tuple[Float[Array, "*rows"], Float[Array, "*rows"], Float[Array, "*rows"]]:
    """Per-position negative log-likelihood, log-partition and correctness, in f32.

    One max serves both the stable log-sum-exp and the accuracy: "correct" is
    `target logit == max logit` held by no other class. A tie for the max is not
    correct: a collapsed model with uniform logits must not report accuracy 1.
    An `argmax` instead would be one more pass over the logits.
    """
    logits = logits.astype(jnp.float32)
    top = lax.stop_gradient(row_max(logits))
    log_z = (jnp.log(row_sum(jnp.exp(logits - top))) + top)[..., 0]
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    at_top = row_sum((logits >= top).astype(jnp.float32))[..., 0]  # exact counts
    top = top[..., 0]
    correct = ((target_logit >= top) & (at_top == 1)).astype(jnp.float32)
    return log_z - target_logit, log_z, correct


def _weighted_mean(values: Array, weights: Array, total: Array) -> Array:
    return jnp.sum(values * weights) / jnp.where(total > 0, total, 1.0)


def vocab_mask(
    logits: Float[Array, "*rows vocab"], vocab_size: int | None
) -> Float[Array, "*rows vocab"]:
    """`logits` with the entries of ids >= `vocab_size` (a padded vocabulary's
    extra rows, see `eqtrain.models.resize_vocab`) set to -inf, so that softmax,
    log-probs and argmax ignore them; unchanged for None or an unpadded
    vocabulary."""
    if vocab_size is None or vocab_size >= logits.shape[-1]:
        return logits
    ids = jnp.arange(logits.shape[-1])
    return jnp.where(ids < vocab_size, logits, -jnp.inf)


def _check_z_loss(z_loss: float | int) -> None:
    if z_loss < 0:
        raise ConfigError(f"`z_loss` must be >= 0 (e.g. 1e-4); got {z_loss!r}.")


def causal_lm_loss_fn(
    *, z_loss: float | int = 0.0, vocab_size: int | None = None
) -> Callable[..., tuple[Float[Array, ""], Aux]]:
    """A causal-LM cross-entropy `loss_fn(model, batch, key) -> (loss, aux)`.

    Args:
        z_loss: coefficient of the auxiliary `log(Z)**2` penalty on the softmax
            normaliser (PaLM uses 1e-4); 0 disables it. When on, it is added to the
            loss and reported as `aux["z_loss"]` (unscaled mean of `log(Z)**2`).
        vocab_size: the real vocabulary of a model whose embedding and head are
            padded (`models.resize_vocab`): the logits of the padded ids are
            masked out of the softmax (`vocab_mask`). None: no mask.

    Returns:
        The loss function; see `causal_lm_loss` for the batch format.
    """
    _check_z_loss(z_loss)

    def loss_fn(
        model: Callable[..., Any],
        batch: Mapping[str, ArrayLike],
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, ""], Aux]:
        tokens, targets, mask = _lm_inputs(batch)
        logits, router = _lm_logits(model, tokens, _row_extras(batch), key)
        logits = vocab_mask(logits, vocab_size)
        # Masked targets may hold anything (e.g. -100): point them at a valid id.
        targets = jnp.where(mask > 0, targets, 0)
        nll, log_z, correct = _token_cross_entropy(logits, targets)
        loss, aux = _masked_means(nll, correct, log_z, mask, z_loss)
        return _with_router(model, router, loss, aux)

    return loss_fn


def _lm_logits(
    model: Any, tokens: Array, extras: dict[str, Array], key: PRNGKeyArray | None
) -> tuple[Array, dict[str, Array]]:
    """`(logits, router statistics)` of an LM on a batch: row by row (`jax.vmap`,
    the key split per row, no statistics), or for a model with experts
    (`routes_batch`) `model.batch_features` over the whole batch, then its head."""
    if getattr(model, "routes_batch", False):
        hidden, router = model.batch_features(tokens, key=key, **extras)
        return _head(model, hidden, key), router
    call = lambda t, rows, k: model(t, key=k, **rows)
    return vmap_rows(call)(tokens, extras, _row_keys(key, tokens.shape[0])), {}


def _masked_means(
    nll: Array, correct: Array, log_z: Array, mask: Array, z_loss: float | int
) -> tuple[Array, Aux]:
    """`(loss, aux)` of `causal_lm_loss_fn`: the means over the masked positions,
    the z-loss added when on."""
    count = jnp.sum(mask)
    loss = _weighted_mean(nll, mask, count)
    aux = {"accuracy": _weighted_mean(correct, mask, count), "weight": count}
    if z_loss:
        z = _weighted_mean(jnp.square(log_z), mask, count)
        loss = loss + z_loss * z
        aux["z_loss"] = z
    return loss, aux


def _head(model: Any, hidden: Array, key: PRNGKeyArray | None) -> Array:
    """A model's logits from its final hidden states (`head_weight` and
    `logit_options`), as its `__call__` computes them."""
    from .models.decoder import transform_logits

    weight = model.head_weight(key=key)
    logits = lax.dot_general(hidden, weight, (((hidden.ndim - 1,), (1,)), ((), ())))
    return transform_logits(logits, **_logit_options(model))


def _with_router(
    model: Any, router: dict[str, Array], loss: Array, aux: Aux
) -> tuple[Array, Aux]:
    """The loss with a mixture-of-experts model's router penalty added and its
    metrics (`eqtrain.models.router_terms`) in `aux`; unchanged without."""
    if not router:
        return loss, aux
    penalty, metrics = model.router_terms(router)
    return loss + penalty, {**aux, **metrics}


def _lm_inputs(batch: Mapping[str, ArrayLike]) -> tuple[Array, Array, Array]:
    """`(tokens, targets, f32 mask)` of an LM batch (the mask all ones without a
    `loss_mask`)."""
    tokens = jnp.asarray(batch["tokens"])
    targets = jnp.asarray(batch["targets"])
    if "loss_mask" not in batch:
        return tokens, targets, jnp.ones(targets.shape, jnp.float32)
    # f32 before any sum: a bf16-cast mask sums inexactly past 256 tokens.
    return tokens, targets, jnp.asarray(batch["loss_mask"]).astype(jnp.float32)


def _row_extras(batch: Mapping[str, ArrayLike]) -> dict[str, Array]:
    """The per-row keyword arguments of an LM model in `batch`: `segment_ids` and
    `positions` (global positions, e.g. of a sequence-parallel layout)."""
    names = ("segment_ids", "positions")
    return {n: jnp.asarray(batch[n]) for n in names if n in batch}


def _batch_features(
    model: Any, tokens: Array, extras: dict[str, Array], key: PRNGKeyArray | None
) -> tuple[Array, dict[str, Array]]:
    """`(model.features per row, router statistics)`: row by row (`jax.vmap`, keys
    split as `causal_lm_loss` does, no statistics), or for a model with experts
    (`routes_batch`) `model.batch_features` over the whole batch. `extras`: the
    rows' `segment_ids` and `positions` (`_row_extras`)."""
    if getattr(model, "routes_batch", False):
        return model.batch_features(tokens, key=key, **extras)
    keys = _row_keys(key, tokens.shape[0])
    call = lambda t, rows, k: model.features(t, key=k, **rows)
    return vmap_rows(call)(tokens, extras, keys), {}


def _logit_options(model: Any) -> dict[str, Any]:
    """The keyword arguments of the chunked losses that transform a model's logits
    (`logit_scale`, `softcap`), from its `logit_options()`; `{}` (plain logits)
    for a model without one."""
    options = getattr(model, "logit_options", None)
    return {} if options is None else dict(options())


def chunked_causal_lm_loss_fn(
    *, chunk: int = 256, z_loss: float | int = 0.0, vocab_size: int | None = None
) -> Callable[..., tuple[Float[Array, ""], Aux]]:
    """`causal_lm_loss_fn`'s loss without the `[batch, seq, vocab]` logits.

    The model's final hidden states (`model.features`, under `jax.vmap` with the
    same segment ids and per-row keys as `causal_lm_loss`) go through
    `chunked_cross_entropy` against `model.head_weight()` in chunks of `chunk`
    tokens, so at most `[chunk, vocab]` f32 logits exist at a time; the mean is
    taken over the global target count outside the chunks. Loss, gradients and
    aux (`accuracy`, `weight`, `z_loss` when on) equal `causal_lm_loss_fn`'s up
    to float rounding; with bf16 compute the logits are f32 here (the plain loss
    rounds them to bf16 first). `eqtrain fit` uses it for `model.loss_chunk`.
    A model whose head transforms its logits (Gemma 2/3's soft-cap, Granite's
    scale) says how with `logit_options() -> {"logit_scale": ..., "softcap":
    ...}`, passed on to `chunked_cross_entropy`.

    Args:
        chunk: tokens per chunk (of the flattened `batch * seq`); 256 is a good
            start (the temporaries grow with `chunk * vocab`).
        z_loss: as for `causal_lm_loss_fn`.
        vocab_size: as for `causal_lm_loss_fn`.

    Returns:
        `loss_fn(model, batch, key)` for a model with `features` and
        `head_weight` (`models.Llama`, `models.GPT2`).

    Raises:
        ConfigError: `chunk` is not a positive int or `z_loss < 0` (here); a LoRA
            adapter with dropout on the head (at the first call with a key).
    """
    _check_z_loss(z_loss)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ConfigError(f"`chunk` must be a positive int (e.g. 256); got {chunk!r}.")

    def loss_fn(
        model: Any,
        batch: Mapping[str, ArrayLike],
        key: PRNGKeyArray | None = None,
    ) -> tuple[Float[Array, ""], Aux]:
        tokens, targets, mask = _lm_inputs(batch)
        hidden, router = _batch_features(model, tokens, _row_extras(batch), key)
        ce = chunked_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]),
            model.head_weight(key=key),
            targets.reshape(-1),
            mask.reshape(-1),
            chunk=chunk,
            z_loss=z_loss,
            vocab_size=vocab_size,
            **_logit_options(model),
        )
        loss, aux = _chunked_means(ce, mask, z_loss)
        return _with_router(model, router, loss, aux)

    return loss_fn


def _chunked_means(
    ce: ChunkedCE, mask: Array, z_loss: float | int
) -> tuple[Array, Aux]:
    """`(loss, aux)` of `chunked_causal_lm_loss_fn`: the chunks' sums over the
    global target count."""
    count = jnp.sum(mask)
    denom = jnp.where(count > 0, count, 1.0)
    aux = {"accuracy": ce.correct / denom, "weight": count}
    if z_loss:
        aux["z_loss"] = ce.z / denom
    return ce.total / denom, aux


def chunked_sequence_logprobs(
    hidden: Float[Array, "*batch seq hidden"],
    weight: Float[Array, "vocab hidden"],
    targets: Int[Array, "*batch seq"],
    mask: ArrayLike,
    *,
    chunk: int = 256,
    vocab_size: int | None = None,
    logit_scale: float | int = 1.0,
    softcap: float | int | None = None,
) -> tuple[Float[Array, "*batch"], Float[Array, "*batch"]]:
    """`preference.sequence_logprobs` from hidden states and the head matrix
    (`model.features`, `model.head_weight()`), without the full logits.

    Returns `(sum over masked positions of log p(target), number of masked
    positions)` per sequence in f32, differentiable w.r.t. `hidden` and `weight`
    (see `chunked_token_logprobs`). `logit_scale`, `softcap`: the logit
    transforms of `chunked_cross_entropy` (a model's `logit_options()`).
    """
    m = jnp.asarray(mask).astype(jnp.float32)
    t = jnp.where(m != 0, jnp.asarray(targets), 0)
    logp = chunked_token_logprobs(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        t.reshape(-1),
        chunk=chunk,
        vocab_size=vocab_size,
        logit_scale=logit_scale,
        softcap=softcap,
    ).reshape(t.shape)
    return jnp.sum(jnp.where(m != 0, logp * m, 0.0), axis=-1), jnp.sum(m, axis=-1)


_causal_lm_loss = causal_lm_loss_fn()


def causal_lm_loss(
    model: Callable[..., Any],
    batch: Mapping[str, ArrayLike],
    key: PRNGKeyArray | None = None,
) -> tuple[Float[Array, ""], Aux]:
    """Next-token cross-entropy, averaged over target tokens.

    The model is called on one row at a time (`jax.vmap` over the batch) as
    `model(tokens, segment_ids=..., positions=..., key=...)`, with `segment_ids`
    and `positions` only when the batch has them and the key split per row. The
    loss is computed in f32.

    Args:
        model: e.g. `eqtrain.models.Llama`: `tokens [seq] -> logits [seq, vocab]`.
        batch: a mapping with `"tokens"` int32[B, S] (inputs), `"targets"`
            int32[B, S] (the next token for each position, already shifted),
            `"loss_mask"` float32[B, S] (1 where the target counts: 0 for padding,
            prompts, and targets across a packed-segment boundary; all ones if
            absent), and optionally `"segment_ids"` int32[B, S] and `"positions"`
            int32[B, S] (each token's position in its segment; a sequence-parallel
            layout carries them, see `eqtrain.models.sequence_rows`).
        key: split per row and passed to the model (dropout); may be `None`.

    Returns:
        `(loss, {"accuracy", "weight"})`: the mean over the `sum(loss_mask)` target
        tokens, the top-1 accuracy over them, and their number (the weight
        `train_step` uses for token-weighted gradient accumulation). An all-masked
        batch gives loss 0 and weight 0.
    """
    return _causal_lm_loss(model, batch, key)


def classification_loss(
    model: Callable[..., Any],
    batch: Mapping[str, ArrayLike],
    key: PRNGKeyArray | None = None,
) -> tuple[Float[Array, ""], Aux]:
    """Softmax cross-entropy of a classifier, averaged over (weighted) examples.

    Args:
        model: e.g. `eqtrain.models.MLPClassifier`: `x [features] -> logits
            [classes]`, called as `model(x, key=k)` under `jax.vmap`.
        batch: `{"x": float[B, F], "label": int32[B]}`, optionally `"weights"`
            float[B] (per-example weights; 0 drops an example).
        key: split per example and passed to the model (dropout); may be `None`.

    Returns:
        `(loss, {"accuracy", "weight"})`, weight = the number of examples or the
        sum of `weights`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from eqtrain.models import MLPClassifier, MLPConfig
        >>> model = MLPClassifier(MLPConfig(4, 3), jax.random.key(0))
        >>> batch = {"x": jnp.ones((2, 4)), "label": jnp.array([0, 2])}
        >>> loss, aux = classification_loss(model, batch, jax.random.key(1))
        >>> float(aux["weight"])
        2.0
    """
    x, labels = jnp.asarray(batch["x"]), jnp.asarray(batch["label"])
    if "weights" in batch:
        weights = jnp.asarray(batch["weights"]).astype(jnp.float32)
    else:
        weights = jnp.ones(labels.shape, jnp.float32)
    keys = _row_keys(key, x.shape[0])
    logits = jax.vmap(lambda xi, k: model(xi, key=k))(x, keys)
    nll, _, correct = _token_cross_entropy(logits, labels)
    total = jnp.sum(weights)
    loss = _weighted_mean(nll, weights, total)
    return loss, {"accuracy": _weighted_mean(correct, weights, total), "weight": total}
