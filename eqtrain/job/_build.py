"""From a `Config` to the pieces of a run, as one frozen `Job`: `_resolve`
resolves each piece from the config (tokenizer, model config, optimizer, chat
template, LoRA spec), `_model` traces the state they make, and the task's loss
is resolved last, here: whether the head carries a LoRA dropout, which a chunked
head cannot apply, is read from the traced model. Everything that can be wrong
with the config or its files fails here, before any compilation; the phases
after the plan read the `Job`'s fields, they do not call back into this module."""

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import lora as lora_lib, models, quantize as quantize_lib
from .._errors import ConfigError
from ..config import (
    AUTO_LOSS_CHUNK,
    LOSS_CHUNK_MIN_VOCAB,
    PREFERENCE_TASKS,
    Config,
    lora_on,
    reference_mode,
)
from ..losses import causal_lm_loss, causal_lm_loss_fn, chunked_causal_lm_loss_fn
from ..post_training import preference
from . import _distill, _grpo, _model, _resolve


@dataclasses.dataclass(frozen=True)
class Job:
    """The pieces of a run, built from its config (no arrays allocated yet):
    what each phase after the plan reads. `_model` makes its model and state.

    Attributes:
        config: the resolved config (architecture fields filled in from
            `model.init_from` when it is set).
        tokenizer: a `ByteTokenizer` or `HFTokenizer`.
        model_config: the model's config (`LlamaConfig`, `GPT2Config`).
        model_type: the Hugging Face `model_type` an export writes.
        optimizer: the optax transformation from the `optim` section.
        loss_fn: the loss the steps differentiate.
        quantize: how the frozen base is quantized (`model.quantize`, QLoRA),
            or None.
        lora: the LoRA adapters the run trains (`[lora]`, or `model.adapter_from`'s
            adapter_config.json), or None: every weight trains.
        reference: a DPO/IPO run's reference model (`copy`, `adapters_off` or
            `precomputed`; `task.reference` resolved), else None.
        template: the chat template of post-training data (None for plain text).
        notes: what the data pipelines skipped, said at the start of the run.
        vocab_size: the real vocabulary when the model's embedding and head are
            padded to split over the tensor-parallel axis (`model_config` has the
            padded size), else None.
        loss_chunk: tokens per chunk of the chunked head + loss
            (`model.loss_chunk` resolved), 0: the plain loss over full logits.
        grpo: task.kind = "grpo": its prompts and rollout, learnt as the run
            reads its rows and builds its step (`_grpo.Online`), else None.
        teacher: task.kind = "distill": the frozen teacher (`_distill.Teacher`,
            its config read, no weights), else None.
        abstract: the state's structure, shapes and dtypes
            (`_model.abstract_state`), traced once by `build`.
        exported: what an export writes of a state's model (or of its trainable
            filter): the policy at its real vocabulary (`_model.exported`).
        flops_per_token: the policy's training FLOPs per token, for MFU (a
            reference forward, where the step runs one, is not counted: MFU
            counts the model being trained).
        tokens_per_row: tokens one training row feeds the model (a preference
            row is a pair; a GRPO prompt samples a group of completions).
    """

    config: Config
    tokenizer: Any
    model_config: Any
    model_type: str
    optimizer: Any
    loss_fn: Callable[..., Any] = causal_lm_loss
    lora: lora_lib.LoRA | None = None
    quantize: quantize_lib.Quantize | None = None
    reference: str | None = None
    template: Any = None
    notes: list[str] = dataclasses.field(default_factory=list)
    vocab_size: int | None = None
    loss_chunk: int = 0
    grpo: _grpo.Online | None = None
    teacher: _distill.Teacher | None = None
    abstract: Any = None
    exported: Callable[[Any], Any] = _model.policy
    flops_per_token: float = 0.0
    tokens_per_row: int = 0

    # the trained model inside a state's model (what the samples writer runs)
    policy = staticmethod(_model.policy)

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)


def build(config: Config, *, recorded: Path | None = None) -> Job:
    """The `Job` of `config`: reads the tokenizer and `model.init_from`'s
    config.json, checks that they agree, builds the optimizer, and checks the
    LoRA settings against the model (abstractly: nothing is allocated).

    `recorded`: a run's copy of `model.init_from`'s config and tokenizer files
    (`<run_dir>/init_from`, see `_rundir.record_init_from`), read instead of the
    directory itself: an existing run's architecture is the one it was trained
    with, and the base directory may be gone (its weights are still needed to
    start a run, and by a LoRA run's frozen base)."""
    return _with_loss(_traced(_pieces(config, recorded)))


def _pieces(config: Config, recorded: Path | None) -> Job:
    """Everything of the job but its state and loss (the plain LM loss stands
    in)."""
    source = _resolve.architecture_source(config, recorded)
    tokenizer = _resolve.make_tokenizer(config, source)
    config, model_config, model_type = _resolve.architecture(config, tokenizer, source)
    config = _distill.resolved(_resolve.optim_defaults(config))
    vocab = model_config.vocab_size
    padded = _resolve.padded_vocab(config, vocab)
    model_config = dataclasses.replace(model_config, vocab_size=padded)
    real = None if padded == vocab else vocab
    kind = config.task.kind
    family = models.family(model_type)
    return Job(
        config,
        tokenizer,
        model_config,
        model_type,
        _resolve.optimizer(config),
        # in the order their errors are said: reference, template, LoRA
        reference=reference_mode(config),
        template=None if kind == "lm" else _resolve.chat_template(config, source),
        lora=_resolve.lora_spec(config) if lora_on(config) else None,
        quantize=_resolve.quantize_spec(config),
        vocab_size=real,
        grpo=_grpo.Online() if kind == "grpo" else None,
        teacher=_distill.teacher(config, vocab, padded) if kind == "distill" else None,
        exported=functools.partial(_model.exported, vocab_size=real),
        flops_per_token=family.flops_per_token(model_config, config.data.seq_len),
        tokens_per_row=_tokens_per_row(config),
    )


def _tokens_per_row(config: Config) -> int:
    """Tokens one training row feeds the model (a preference row is a pair)."""
    task = config.task
    if task.kind == "grpo":  # each prompt row samples a group of completions
        return config.data.seq_len * task.group_size
    pair = task.kind in PREFERENCE_TASKS
    return config.data.seq_len * (2 if pair else 1)


def _traced(job: Job) -> Job:
    """`job` with its abstract state traced (where its LoRA targets, rank and
    train_also are checked against the model)."""
    try:
        return dataclasses.replace(job, abstract=_model.abstract_state(job))
    except ConfigError as e:
        if job.lora is None:
            raise
        raise ConfigError(f"[lora]: {e}") from None


def _with_loss(job: Job) -> Job:
    """`job` with the loss of its task, chunked as `model.loss_chunk` says."""
    config, real = job.config, job.vocab_size
    vocab = job.model_config.vocab_size
    chunk = loss_chunk(config, vocab, head_dropout=_head_dropout(job))
    loss_fn = task_loss(config, job.reference, vocab_size=real, chunk=chunk)
    return dataclasses.replace(job, loss_fn=loss_fn, loss_chunk=chunk)


def _head_dropout(job: Job) -> bool:
    """Whether the run's LoRA puts an adapter with dropout on the output head
    (which a chunked head, one matrix, cannot apply)."""
    if job.lora is None or job.lora.dropout <= 0:
        return False
    model = _model.policy(job.abstract.model)
    return isinstance(getattr(model, "lm_head", None), models.LoRALinear)


def loss_chunk(config: Config, vocab: int, *, head_dropout: bool = False) -> int:
    """`model.loss_chunk` resolved for a model with `vocab` output ids: tokens per
    chunk of the chunked head + loss, or 0 for the plain loss. `auto` chunks from
    `LOSS_CHUNK_MIN_VOCAB` ids on (below it the logits are small, and the plain
    loss is faster) on runs without a sequence axis, unless `head_dropout` (a
    LoRA adapter with dropout on the head, which a chunked head cannot apply; an
    explicit chunk is an error)."""
    chunk = config.model.loss_chunk
    if chunk == "auto":
        # A sequence-split row would be gathered to be cut into token chunks.
        if head_dropout or vocab < LOSS_CHUNK_MIN_VOCAB or config.mesh.sequence > 1:
            return 0
        return AUTO_LOSS_CHUNK
    if chunk and head_dropout:
        raise ConfigError(
            f"model.loss_chunk = {chunk} computes the head as one matrix, which "
            f"cannot apply the LoRA dropout (lora.dropout = {config.lora.dropout}) "
            "of an adapter on `lm_head` (lora.targets). Set model.loss_chunk = 0, "
            "lora.dropout = 0, or leave lm_head out of lora.targets."
        )
    return int(chunk)


def task_loss(
    config: Config,
    reference: str | None,
    *,
    vocab_size: int | None = None,
    chunk: int = 0,
) -> Callable[..., Any]:
    """The loss of `task.kind`: next-token cross-entropy for lm and sft (whose
    rows mask out everything but completions), else the preference loss;
    `vocab_size`: a padded model's real vocabulary (its padded logits are
    masked); `chunk`: tokens per chunk of a chunked head + loss (0: the plain
    loss over full logits)."""
    kind = config.task.kind
    if kind == "grpo":
        return _grpo.loss(config, reference, vocab_size=vocab_size, chunk=chunk)
    if kind == "distill":
        return _distill.loss(config, vocab_size=vocab_size, chunk=chunk)
    if kind in ("lm", "sft"):
        return _lm_loss(vocab_size, chunk)
    return _preference_loss(config, reference, vocab_size, chunk)


def _lm_loss(vocab_size: int | None, chunk: int) -> Callable[..., Any]:
    """Next-token cross-entropy: chunked, masked to a real vocabulary, or plain."""
    if chunk:
        return chunked_causal_lm_loss_fn(chunk=chunk, vocab_size=vocab_size)
    if vocab_size is not None:
        return causal_lm_loss_fn(vocab_size=vocab_size)
    return causal_lm_loss


def _preference_loss(
    config: Config, reference: str | None, vocab_size: int | None, chunk: int
) -> Callable[..., Any]:
    t = config.task
    try:
        return preference.preference_loss_fn(
            t.kind,
            reference=reference,
            beta=t.beta,
            label_smoothing=t.label_smoothing,
            orpo_lambda=t.orpo_lambda,
            gamma=t.simpo_gamma,
            vocab_size=vocab_size,
            chunk=chunk or None,
        )
    except ConfigError as e:
        raise ConfigError(f"[task]: {e}") from None
