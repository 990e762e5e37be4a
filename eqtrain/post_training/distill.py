"""Knowledge distillation: a student learns a frozen teacher's next-token
distributions on the completion tokens, as Generalized Knowledge Distillation
(Agarwal et al. 2024, arXiv:2306.13649; TRL's `GKDTrainer`) defines it.

The loss is the generalised Jensen-Shannon divergence of the student `S` and
the teacher `T` (both `log_softmax(logits / temperature)`), summed over the
vocabulary at each completion token and averaged over those tokens:

    beta = 0:   KL(T || S)  (forward KL: the student covers the teacher)
    beta = 1:   KL(S || T)  (reverse KL: the student seeks the teacher's modes)
    otherwise:  beta * KL(T || M) + (1 - beta) * KL(S || M),
                M = beta * T + (1 - beta) * S

which is TRL's `GKDTrainer.generalized_jsd_loss` (reduction "batchmean": the
sum over the masked tokens divided by their number, at least 1), to float
rounding (the tests compare them). The teacher is frozen: no gradient reaches it.

The student and its teacher travel as one model pytree (`WithTeacher`), the
teacher in the state and never closed over inside `jit`; `teacher_trainable`
leaves it out of the gradients and the optimizer state. With `chunk`, both
models' logits are formed `chunk` tokens at a time from their final hidden
states (never a `[tokens, vocab]` array of either); the backward recomputes each
chunk's logits (`jax.checkpoint`), so the memory stays that of one chunk.

On-policy data (`OnPolicy`, `distill_step`): each step draws, from the state's
key, whether its completions are the data's, sampled from the student (with
probability `lmbda`) or, with `seq_kd`, sampled from the teacher (TRL's rule).

    model = distill.with_teacher(student, teacher)
    state = eqtrain.TrainState.create(
        model, optimizer, trainable=distill.teacher_trainable(model))
    loss_fn = distill.distill_loss_fn(beta=0.5, chunk=256)
    step = distill.distill_step(eqtrain.train_step(loss_fn, optimizer),
                                distill.OnPolicy(lmbda=0.5, max_new_tokens=64))
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._chunked import _check_chunk, _chunks, _logits, _transforms
from .._errors import ConfigError
from .._state import trainable_mask
from ..generate import Sampling, generate
from ..losses import (
    _batch_features,
    _lm_inputs,
    _lm_logits,
    _logit_options,
    _row_extras,
    _with_router,
)


Metrics = dict[str, Float[Array, ""]]


# -- the divergence -------------------------------------------------------------------
def _check_beta(beta: float) -> float:
    if isinstance(beta, bool) or not 0.0 <= beta <= 1.0:
        raise ConfigError(
            f"`beta` must be in [0, 1] (0: forward KL, 1: reverse KL, between: "
            f"the generalised JSD); got {beta!r}."
        )
    return float(beta)


def _check_temperature(temperature: float) -> float:
    if not temperature > 0:
        raise ConfigError(f"`temperature` must be > 0; got {temperature!r}.")
    return float(temperature)


def token_divergence(
    student_logits: Float[Array, "*rows vocab"],
    teacher_logits: Float[Array, "*rows vocab"],
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> Float[Array, "*rows"]:
    """The generalised JSD of each position (see the module docstring), summed
    over the vocabulary, in f32. Differentiable in both arguments (stop the
    teacher's gradient outside)."""
    beta, temperature = _check_beta(beta), _check_temperature(temperature)
    s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, -1)
    t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, -1)
    if beta == 0.0:
        return jnp.sum(jnp.exp(t) * (t - s), axis=-1)
    if beta == 1.0:
        return jnp.sum(jnp.exp(s) * (s - t), axis=-1)
    m = jnp.logaddexp(s + jnp.log1p(-beta), t + jnp.log(beta))
    kl_t = jnp.sum(jnp.exp(t) * (t - m), axis=-1)
    kl_s = jnp.sum(jnp.exp(s) * (s - m), axis=-1)
    return beta * kl_t + (1.0 - beta) * kl_s


def generalized_jsd(
    student_logits: Float[Array, "*rows vocab"],
    teacher_logits: Float[Array, "*rows vocab"],
    mask: ArrayLike,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> Float[Array, ""]:
    """TRL's `generalized_jsd_loss` with reduction "batchmean": the mean of
    `token_divergence` over the positions `mask` selects (TRL's `labels !=
    -100`), 0 when none is. The teacher's gradient is stopped here."""
    d = token_divergence(
        student_logits,
        lax.stop_gradient(teacher_logits),
        beta=beta,
        temperature=temperature,
    )
    m = jnp.asarray(mask).astype(jnp.float32)
    count = jnp.sum(m)
    return jnp.sum(jnp.where(m != 0, m * d, 0.0)) / jnp.maximum(count, 1.0)


def chunked_divergence(
    student_hidden: Float[Array, "tokens hidden"],
    student_weight: Float[Array, "vocab hidden"],
    teacher_hidden: Float[Array, "tokens teacher_hidden"],
    teacher_weight: Float[Array, "vocab teacher_hidden"],
    mask: ArrayLike,
    *,
    chunk: int,
    beta: float = 0.5,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    student_options: Mapping[str, Any] | None = None,
    teacher_options: Mapping[str, Any] | None = None,
) -> Float[Array, ""]:
    """`sum(mask * token_divergence)` from both models' final hidden states and
    head matrices, `chunk` tokens at a time: at most `[chunk, vocab]` f32 logits
    of each model exist at once, in the forward and (recomputed) in the
    backward. Differentiable w.r.t. the student's hidden states and head; the
    teacher's are constants.

    Args:
        vocab_size: the real vocabulary of padded heads: only the first
            `vocab_size` rows of each head are used.
        student_options, teacher_options: each model's logit transforms
            (`logit_scale`, `softcap`: its `logit_options()`).
    """
    _check_chunk(chunk)
    beta, temperature = _check_beta(beta), _check_temperature(temperature)
    plain = {"logit_scale": 1.0, "softcap": None}
    s_opts = _transforms(**{**plain, **(student_options or {})})
    t_opts = _transforms(**{**plain, **(teacher_options or {})})
    if vocab_size is not None:
        student_weight = student_weight[:vocab_size]
        teacher_weight = teacher_weight[:vocab_size]
    teacher_hidden = lax.stop_gradient(teacher_hidden)
    teacher_weight = lax.stop_gradient(teacher_weight)
    m = jnp.asarray(mask).astype(jnp.float32)
    chunk = min(chunk, max(student_hidden.shape[0], 1))
    hs, ht, ms = _chunks(chunk, student_hidden, teacher_hidden, m)

    @jax.checkpoint
    def body(total: Array, xs: tuple[Array, Array, Array]) -> tuple[Array, None]:
        a, b, mc = xs
        on = mc != 0
        # masked rows zeroed: not even a non-finite one reaches a sum
        a = jnp.where(on[:, None], a, jnp.zeros_like(a))
        b = jnp.where(on[:, None], b, jnp.zeros_like(b))
        zs = _logits(a, student_weight, None, *s_opts)
        zt = _logits(b, teacher_weight, None, *t_opts)
        d = token_divergence(zs, zt, beta=beta, temperature=temperature)
        return total + jnp.sum(jnp.where(on, mc * d, 0.0)), None

    total, _ = lax.scan(body, jnp.zeros((), jnp.float32), (hs, ht, ms))
    return total


# -- the student and its teacher ------------------------------------------------------
class WithTeacher(eqx.Module):
    """A student and its frozen teacher as one model pytree. Calling it calls
    the student."""

    student: Any
    teacher: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.student(*args, **kwargs)


def _vocab(model: Any) -> int | None:
    config = getattr(model, "config", None)
    return getattr(config, "vocab_size", None)


def check_vocab(student: Any, teacher: Any) -> None:
    """Refuse a teacher whose vocabulary is not the student's (their
    distributions would be over different tokens)."""
    s, t = _vocab(student), _vocab(teacher)
    if s is not None and t is not None and s != t:
        raise ConfigError(
            f"the teacher's vocabulary has {t} tokens and the student's {s}: "
            "distillation compares their distributions token by token, so both "
            "must use the same tokenizer and vocabulary size. Use a teacher of "
            "the student's family (same tokenizer), or resize one."
        )


def with_teacher(student: Any, teacher: Any) -> WithTeacher:
    """`student` and `teacher` as one model (`WithTeacher`), after checking that
    their vocabularies match (`check_vocab`)."""
    check_vocab(student, teacher)
    return WithTeacher(student=student, teacher=teacher)


def teacher_trainable(model: WithTeacher, student: Any = True) -> WithTeacher:
    """The trainable filter of a `WithTeacher`: `student` (a filter spec of the
    student, e.g. `lora.trainable(...)`) for the student, nothing of the
    teacher."""
    return WithTeacher(
        student=trainable_mask(model.student, student),
        teacher=trainable_mask(model.teacher, False),
    )


def _parts(model: Any) -> tuple[Any, Any]:
    if not isinstance(model, WithTeacher):
        raise ConfigError(
            "a distillation loss reads the teacher of a `WithTeacher` model; build "
            "the state from `distill.with_teacher(student, teacher)` with "
            "`trainable=distill.teacher_trainable(...)`."
        )
    return model.student, jax.lax.stop_gradient(model.teacher)


# -- the loss function ----------------------------------------------------------------
def distill_loss_fn(
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    chunk: int | None = None,
) -> Callable[..., tuple[Float[Array, ""], Metrics]]:
    """A distillation loss `loss_fn(model, batch, key) -> (loss, aux)` of a
    `WithTeacher` model, for `eqtrain.train_step` and the step pieces.

    The batch is an SFT batch: `tokens`, `targets`, `loss_mask` (`[rows, seq]`;
    the mask selects the completion's targets) and optionally `segment_ids`,
    `positions`. The loss is `generalized_jsd` of the student's and the
    teacher's logits over the masked tokens; `aux["weight"]` is their number
    (accumulation weighs tokens, as TRL's `num_items_in_batch` does). The key
    reaches the student only (dropout); the teacher runs without.

    Args:
        beta: 0 forward KL, 1 reverse KL, between the generalised JSD (TRL's
            default 0.5).
        temperature: both models' logits are divided by it (TRL's trainer
            uses 1 in its loss).
        vocab_size: the real vocabulary of padded heads (the padded ids are
            left out of both distributions).
        chunk: form the logits `chunk` tokens at a time from `model.features`
            and `model.head_weight()` (`chunked_divergence`); None: the full
            logits of both models.
    """
    beta, temperature = _check_beta(beta), _check_temperature(temperature)
    if chunk is not None:
        _check_chunk(chunk)

    def loss_fn(
        model: Any, batch: Mapping[str, ArrayLike], key: PRNGKeyArray | None = None
    ) -> tuple[Float[Array, ""], Metrics]:
        student, teacher = _parts(model)
        tokens, targets, mask = _lm_inputs(batch)
        del targets  # the teacher's distribution is the target
        extras = _row_extras(batch)
        if chunk:
            total, router = _chunked_total(student, teacher, tokens, extras, mask, key)
        else:
            zs, router = _lm_logits(student, tokens, extras, key)
            zt, _ = _lm_logits(teacher, tokens, extras, None)
            if vocab_size is not None:
                zs, zt = zs[..., :vocab_size], zt[..., :vocab_size]
            d = token_divergence(zs, zt, beta=beta, temperature=temperature)
            total = jnp.sum(jnp.where(mask != 0, mask * d, 0.0))
        count = jnp.sum(mask)
        loss = total / jnp.maximum(count, 1.0)
        return _with_router(student, router, loss, {"weight": count})

    def _chunked_total(
        student: Any, teacher: Any, tokens: Array, extras: Any, mask: Array, key: Any
    ) -> tuple[Array, Any]:
        hs, router = _batch_features(student, tokens, extras, key)
        ht, _ = _batch_features(teacher, tokens, extras, None)
        total = chunked_divergence(
            hs.reshape(-1, hs.shape[-1]),
            student.head_weight(key=key),
            ht.reshape(-1, ht.shape[-1]),
            teacher.head_weight(key=None),
            mask.reshape(-1),
            chunk=chunk,
            beta=beta,
            temperature=temperature,
            vocab_size=vocab_size,
            student_options=_logit_options(student),
            teacher_options=_logit_options(teacher),
        )
        return total, router

    return loss_fn


# -- on-policy completions ------------------------------------------------------------
DATA, STUDENT, TEACHER = 0, 1, 2
"""Where a step's completions come from (`distill_batch`'s `source`)."""


@dataclasses.dataclass(frozen=True)
class OnPolicy:
    """How `distill_step` chooses and samples each step's completions.

    Attributes:
        lmbda: the probability that a step's completions are sampled from the
            student (TRL's `lmbda`; 0: always the data's, 1: always sampled).
        seq_kd: otherwise sample them from the teacher (sequence-level KD)
            instead of using the data's.
        max_new_tokens: the longest sampled completion (cut further to the
            row: prompt and completion fit in the data's `seq` tokens).
        sampling: temperature and filters (TRL's GKD samples at 0.9).
        stop_ids: a completion ends after one of these (EOS, end of turn).
        pad_id: fills a row after its completion.
        vocab_size: a padded model's real vocabulary (never sampled beyond).
    """

    lmbda: float = 0.5
    seq_kd: bool = False
    max_new_tokens: int = 128
    sampling: Sampling = Sampling(temperature=0.9)
    stop_ids: tuple[int, ...] = ()
    pad_id: int = 0
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.lmbda, bool) or not 0.0 <= self.lmbda <= 1.0:
            raise ConfigError(f"`lmbda` must be in [0, 1]; got {self.lmbda!r}.")
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"`max_new_tokens` must be an integer >= 1; got {n!r}.")

    @property
    def samples(self) -> bool:
        """Whether any step can sample (else every step trains on the data)."""
        return self.lmbda > 0 or self.seq_kd


def prompts_of(
    tokens: Int[Array, "rows seq"], mask: Float[Array, "rows seq"], pad_id: int = 0
) -> tuple[Int[Array, "rows seq"], Int[Array, " rows"]]:
    """The prompts of SFT rows, right-aligned in `[rows, seq]` as
    `eqtrain.generate` takes them, and their lengths: a row's prompt is its
    tokens up to and including the position of its first masked-in target (a
    row without one is all prompt)."""
    rows, seq = tokens.shape
    on = mask != 0
    first = jnp.where(jnp.any(on, axis=1), jnp.argmax(on, axis=1), seq - 1)
    length = (first + 1).astype(jnp.int32)
    index = jnp.arange(seq)[None, :] - (seq - length)[:, None]
    picked = jnp.take_along_axis(tokens, jnp.clip(index, 0, seq - 1), axis=1)
    return jnp.where(index >= 0, picked, pad_id).astype(jnp.int32), length


def completion_rows(
    prompt: Int[Array, "rows width"],
    prompt_len: Int[Array, " rows"],
    completion: Int[Array, "rows new"],
    length: Int[Array, " rows"],
    seq: int,
    pad_id: int = 0,
) -> dict[str, Array]:
    """SFT rows of `seq` tokens from right-aligned prompts and their sampled
    completions: the prompt from position 0, then the completion (its `length`
    tokens, a final stop token included, cut at the row's end), then `pad_id`;
    `loss_mask` selects the completion's targets, `segment_ids` the real
    tokens (1) from the padding (0), as `eqtrain.data.sft_rows` makes them."""
    width = prompt.shape[1]
    text = jnp.concatenate([prompt, completion], axis=1)
    j = jnp.arange(seq + 1)[None, :]
    index = j + (width - prompt_len)[:, None]
    inside = index < text.shape[1]
    picked = jnp.take_along_axis(text, jnp.clip(index, 0, text.shape[1] - 1), axis=1)
    end = (prompt_len + length)[:, None]  # one past the completion's last token
    text = jnp.where(inside & (j < end), picked, pad_id).astype(jnp.int32)
    at = jnp.arange(seq)[None, :]
    mask = (at >= prompt_len[:, None] - 1) & (at < end - 1)
    return {
        "tokens": text[:, :-1],
        "targets": text[:, 1:],
        "loss_mask": mask.astype(jnp.float32),
        "segment_ids": (at < end).astype(jnp.int32),
    }


def _data_rows(batch: Mapping[str, Any]) -> dict[str, Array]:
    """The batch's rows in `completion_rows`' keys."""
    tokens, targets, mask = _lm_inputs(batch)
    seg = batch.get("segment_ids")
    seg = jnp.ones(tokens.shape, jnp.int32) if seg is None else jnp.asarray(seg)
    return {
        "tokens": tokens.astype(jnp.int32),
        "targets": targets.astype(jnp.int32),
        "loss_mask": mask,
        "segment_ids": seg.astype(jnp.int32),
    }


def choose(key: PRNGKeyArray, on_policy: OnPolicy) -> Int[Array, ""]:
    """Where a step's completions come from (`DATA`, `STUDENT` or `TEACHER`),
    drawn from `key`: the student's with probability `lmbda` (TRL's rule),
    else the teacher's with `seq_kd`, else the data's."""
    u = jr.uniform(key)
    other = TEACHER if on_policy.seq_kd else DATA
    return jnp.where(u < on_policy.lmbda, STUDENT, other).astype(jnp.int32)


def _sampled(
    model: Any, batch: Mapping[str, Any], key: PRNGKeyArray, on_policy: OnPolicy
) -> dict[str, Array]:
    """Rows of the batch's prompts with completions sampled from `model`."""
    rows = _data_rows(batch)
    prompt, prompt_len = prompts_of(rows["tokens"], rows["loss_mask"], on_policy.pad_id)
    out = generate(
        model,
        prompt,
        prompt_len,
        max_new_tokens=on_policy.max_new_tokens,
        key=key,
        sampling=on_policy.sampling,
        stop_ids=on_policy.stop_ids,
        pad_id=on_policy.pad_id,
        vocab_size=on_policy.vocab_size,
    )
    seq = rows["tokens"].shape[1]
    return completion_rows(
        prompt, prompt_len, out.tokens, out.lengths, seq, on_policy.pad_id
    )


def distill_batch(
    model: WithTeacher,
    batch: Mapping[str, Any],
    key: PRNGKeyArray,
    on_policy: OnPolicy,
) -> tuple[dict[str, Array], Int[Array, ""]]:
    """`(rows, source)`: the rows one `distill_step` trains on, and where their
    completions came from (`choose` with `fold_in(key, 0)`; sampled with
    `fold_in(key, 1)`). Only the branch drawn runs (`lax.switch`)."""
    data = _data_rows(batch)
    if not on_policy.samples:
        return data, jnp.asarray(DATA, jnp.int32)
    source = choose(jr.fold_in(key, 0), on_policy)
    sample_key = jr.fold_in(key, 1)
    student, teacher = (lax.stop_gradient(m) for m in (model.student, model.teacher))
    branches = [
        lambda: data,
        lambda: _sampled(student, batch, sample_key, on_policy),
    ]
    if on_policy.seq_kd:
        branches.append(lambda: _sampled(teacher, batch, sample_key, on_policy))
    if on_policy.lmbda >= 1.0:  # always the student's: no choice compiled
        return branches[STUDENT](), jnp.asarray(STUDENT, jnp.int32)
    return lax.switch(source, branches), source


def distill_step(inner: Any, on_policy: OnPolicy) -> Callable[..., Any]:
    """The step `step(state, batch) -> (state, metrics)` around `inner` (a
    `TrainStep` whose loss is `distill_loss_fn`): each call draws where its
    completions come from off the state's key (so a resumed run draws the
    same), samples them if it must (`distill_batch`), and runs `inner` on the
    rows. Metrics: `inner`'s, and `on_policy` / `teacher_sampled` (1 when the
    step's completions were the student's / the teacher's)."""

    def step(state: Any, batch: Mapping[str, Any]) -> tuple[Any, dict[str, Array]]:
        key, draw = jr.split(state.key)
        state = dataclasses.replace(state, key=key)
        rows, source = distill_batch(state.model, batch, draw, on_policy)
        state, metrics = inner(state, rows)
        metrics = dict(metrics)
        metrics["on_policy"] = (source == STUDENT).astype(jnp.float32)
        metrics["teacher_sampled"] = (source == TEACHER).astype(jnp.float32)
        return state, metrics

    return step
