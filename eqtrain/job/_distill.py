"""`task.kind = "distill"` in a job: the frozen teacher (`task.teacher`, a
Hugging Face directory or an eqtrain run directory with its export), the loss
(`eqtrain.post_training.distill.distill_loss_fn`) and the on-policy sampling
(`distill.OnPolicy`) of the training step. The rows are SFT rows (`_rows`).

The teacher lives in the state beside the student (`distill.WithTeacher`),
placed on the same mesh by the same partition rules, out of the optimizer
state; the checkpoints do not store it (they store the trained part and a
reference to the frozen weights, as a LoRA run's do: `_model.base_reference`),
and the run's identity holds its content hash (`identity`), so a resume with
another teacher is refused."""

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

from .. import hf, models
from .._errors import ConfigError
from ..config import Config
from ..generate import Sampling
from ..post_training import distill
from . import _grpo


BETA = 0.5  # unset task.beta: TRL's GKDConfig default


@dataclasses.dataclass(frozen=True)
class Teacher:
    """What a job knows of its teacher before any weight is read.

    Attributes:
        directory: the Hugging Face directory its weights are read from.
        model_config: its eqtrain model config (the `[model]` runtime options
            applied; vocabulary padded as the student's).
        model_type: its Hugging Face `model_type`.
    """

    directory: str
    model_config: Any
    model_type: str


def directory(config: Config) -> str:
    """`task.teacher` resolved to a Hugging Face directory: itself when it holds
    a config.json, else an eqtrain run directory's export (`<run>/hf`)."""
    given = config.task.teacher
    if given is None:
        raise ConfigError(
            "task.kind = 'distill' needs a teacher: set task.teacher to a Hugging "
            "Face directory or an eqtrain run directory (with its export in hf/)."
        )
    path = Path(given)
    for candidate in (path, path / "hf"):
        if (candidate / "config.json").is_file():
            return str(candidate)
    if (path / "checkpoints").is_dir():
        raise ConfigError(
            f"task.teacher = {given!r} is an eqtrain run directory without an "
            f"export: run `eqtrain export {given}` first (it writes {path / 'hf'}), "
            "or point task.teacher at a Hugging Face directory."
        )
    raise ConfigError(
        f"task.teacher = {given!r} holds no config.json (nor hf/config.json): "
        "point it at a Hugging Face directory (config.json and safetensors) or "
        "an eqtrain run directory whose model was exported."
    )


def teacher(config: Config, student_vocab: int, padded: int) -> Teacher:
    """The teacher of `config` (its config.json read, no tensor), checked
    against the student's vocabulary (`student_vocab` ids, its head `padded`
    to that many)."""
    where = directory(config)
    try:
        model_config, hf_type = hf.load_config(where, dtype=config.model.param_dtype)
    except (hf.HFFileNotFoundError, hf.HFFormatError) as e:
        raise ConfigError(f"task.teacher ({where}): {e}") from None
    if model_config.vocab_size != student_vocab:
        raise ConfigError(
            f"task.teacher ({where}) has a vocabulary of {model_config.vocab_size} "
            f"tokens, the student's has {student_vocab}: distillation compares "
            "their distributions token by token, so both must share one tokenizer "
            "and vocabulary. Use a teacher of the student's tokenizer."
        )
    model_config = dataclasses.replace(
        model_config, **models.runtime_options(config.model), vocab_size=padded
    )
    model_type = hf.infer_model_type(model_config, hf_type)
    return Teacher(where, model_config, model_type)


def abstract_model(t: Teacher) -> Any:
    """A model of the teacher's structure (under `eqx.filter_eval_shape`, no
    array is made)."""
    import jax.random as jr

    return models.family(t.model_type).model(t.model_config, jr.key(0))


def model(t: Teacher, config: Config, shardings: Any = None) -> Any:
    """The teacher's weights, read into `shardings` (a function of the
    abstract model, as `hf.load` takes it) when given."""
    loaded, _ = hf.load(
        t.directory, dtype=config.model.param_dtype, shardings=shardings
    )
    options = models.runtime_options(config.model)
    loaded = loaded.with_options(**options)
    return models.resize_vocab(loaded, t.model_config.vocab_size)


@functools.lru_cache(maxsize=8)
def _hash(path: str, stamp: tuple[Any, ...]) -> dict[str, Any]:
    del stamp  # part of the cache key: a rewritten file is read again
    return hf.content_hash(path)


def content_hash(config: Config) -> dict[str, Any]:
    """`hf.content_hash` of the teacher's directory (read once per content)."""
    where = directory(config)
    stamp = tuple(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns)
        for f in sorted(Path(where).glob("*.safetensors"))
    )
    return _hash(os.path.abspath(where), stamp)


def identity(config: Config) -> dict[str, Any]:
    """The run identity's entry of the teacher (`{"task.teacher": "sha256:..."}`),
    empty for other tasks."""
    if config.task.kind != "distill":
        return {}
    return {"task.teacher": f"sha256:{content_hash(config)['sha256']}"}


def beta(config: Config) -> float:
    """`task.beta` resolved for distillation (unset: 0.5)."""
    return BETA if config.task.beta is None else config.task.beta


def loss(config: Config, *, vocab_size: int | None, chunk: int) -> Any:
    """`distill.distill_loss_fn` of `[task]` (temperature 1 in the loss, as
    TRL's trainer: task.temperature is the sampling one)."""
    try:
        return distill.distill_loss_fn(
            beta=beta(config), vocab_size=vocab_size, chunk=chunk or None
        )
    except ConfigError as e:
        raise ConfigError(f"[task]: {e}") from None


def on_policy(job: Any) -> distill.OnPolicy:
    """The run's `OnPolicy` (task.lmbda, task.seq_kd, the sampling keys)."""
    t = job.config.task
    return distill.OnPolicy(
        lmbda=t.lmbda,
        seq_kd=t.seq_kd,
        max_new_tokens=t.max_completion_len,
        sampling=Sampling(
            temperature=t.temperature, top_k=t.top_k, top_p=t.top_p, min_p=t.min_p
        ),
        stop_ids=_grpo.stop_ids(job),
        pad_id=_grpo.pad_id(job.tokenizer),
        vocab_size=job.vocab_size,
    )


def resolved(config: Config) -> Config:
    """`config` with distillation's rows unpacked (`data.pack = false`: a step
    may sample a new completion after each row's one prompt); other tasks'
    unchanged."""
    if config.task.kind != "distill" or not config.data.pack:
        return config
    return dataclasses.replace(
        config, data=dataclasses.replace(config.data, pack=False)
    )
