"""A run's model and state, made from its `Job`'s pieces: the base
(`model.init_from`'s weights or a random init), the LoRA adapters, the frozen
reference copy, the trainable filter and the `TrainState`. `_build` traces them
without arrays (the job's `abstract`); the start allocates them (`new_state`)
and names the frozen base a LoRA run's checkpoints point at (`base_reference`);
`exported` is what an export writes of a state's model (the `Job` holds it).

`_build` traces the state here, so this module sits below it: a `job` is typed
`Any` (a `Job`)."""

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.random as jr
import numpy as np

from .. import hf, lora as lora_lib, models, quantize as quantize_lib, sharding
from .._errors import ConfigError
from .._state import TrainState
from ..post_training import distill, preference
from . import _distill


ADAPTER_SEED = 0x10A  # folded into the run's seed for the adapters' initial values


def base_model(job: Any, mesh: Any = None) -> Any:
    """The base model: `model.init_from`'s weights, or a random init (with a
    padded vocabulary, initialised at the real size and zero-padded, so the run
    starts where an unpadded one would). With `mesh`, `init_from`'s tensors are
    read straight into their shardings on it, one device block at a time (host
    memory: about one tensor, not the model)."""
    if job.config.model.init_from is not None:
        model = _loaded_base(job, mesh)
    else:
        config = job.model_config
        if job.vocab_size is not None:  # initialised at the real vocabulary
            config = dataclasses.replace(config, vocab_size=job.vocab_size)
        model = models.family(job.model_type).model(config, jr.key(job.config.seed))
        if job.quantize is not None:
            model = quantize_lib.apply(model, job.quantize)
    return models.resize_vocab(model, job.model_config.vocab_size)


def _loaded_base(job: Any, mesh: Any) -> Any:
    """`model.init_from`'s weights, with the `[model]` runtime options."""
    m = job.config.model
    shardings = None
    if mesh is not None and job.vocab_size is None:
        shardings = _model_shardings(mesh)
    model, _ = hf.load(
        m.init_from, dtype=m.param_dtype, shardings=shardings, quantize=job.quantize
    )
    options = models.runtime_options(m)
    return model.with_options(**options, **models.moe_options(m, model.config))


def _model_shardings(mesh: Any) -> Callable[[Any], Any]:
    """The shardings of a plain model's arrays on `mesh` (its partition rules),
    as `hf.load(shardings=)` takes them: a function of the abstract model."""

    def shardings(model: Any) -> Any:
        return sharding.state_shardings(model, mesh, sharding.rules_for(model, mesh))

    return shardings


def with_adapters(job: Any, model: Any) -> Any:
    """`model` with the run's LoRA adapters (`model.adapter_from`'s values, or
    new ones: `lora_b` zero); unchanged without LoRA."""
    if job.lora is None:
        return model
    adapter = job.config.model.adapter_from
    if adapter is not None:
        return hf.load_adapter(model, adapter, model_type=job.model_type)
    key = jr.fold_in(jr.key(job.config.seed), ADAPTER_SEED)
    return lora_lib.apply(model, job.lora, key=key)


def new_model(job: Any, mesh: Any = None) -> Any:
    """The initial model: the base model with the run's adapters, if any (and
    with `task.reference = "copy"`, a frozen copy of it beside; with
    `task.kind = "distill"`, the frozen teacher beside)."""
    model = _with_reference(job, with_adapters(job, base_model(job, mesh)))
    if job.teacher is None:
        return model
    shardings = _model_shardings(mesh) if mesh is not None else None
    if job.vocab_size is not None:  # padded: read whole, then padded
        shardings = None
    teacher = _distill.model(job.teacher, job.config, shardings)
    return distill.with_teacher(model, teacher)


def _with_reference(job: Any, model: Any) -> Any:
    if job.reference == "copy":
        return preference.with_reference(model)
    return model


def trainable(job: Any, model: Any) -> Any:
    """The trainable filter: everything, or with LoRA the adapters (and
    `lora.train_also`); a reference copy never trains."""
    if isinstance(model, preference.WithReference):
        return preference.reference_trainable(model, trainable(job, model.policy))
    if isinstance(model, distill.WithTeacher):
        return distill.teacher_trainable(model, trainable(job, model.student))
    if job.lora is None:
        return True
    return lora_lib.trainable(model, also=job.config.lora.train_also)


def policy(model: Any) -> Any:
    """The trained model inside a state's model (what is exported): the policy
    of a `preference.WithReference`, the student of a `distill.WithTeacher`,
    else `model` itself."""
    if isinstance(model, preference.WithReference):
        return model.policy
    if isinstance(model, distill.WithTeacher):
        return model.student
    return model


def exported(model: Any, *, vocab_size: int | None) -> Any:
    """What an export writes of a state's model (or its trainable filter): the
    policy, with a padded vocabulary cut back to the real one (`vocab_size`;
    None: not padded)."""
    model = policy(model)
    if vocab_size is None:
        return model
    return models.resize_vocab(model, vocab_size)


def _state(job: Any, model: Any, seed: int) -> TrainState:
    return TrainState.create(
        model,
        job.optimizer,
        key=seed,
        trainable=trainable(job, model),
        ema=job.config.loop.ema is not None,
    )


def new_state(job: Any, mesh: Any = None) -> TrainState:
    """The initial `TrainState` (allocates the model and optimizer state; with
    `mesh`, an HF base is read straight onto it, see `base_model`)."""
    return _state(job, new_model(job, mesh), job.config.seed)


def abstract_state(job: Any) -> TrainState:
    """The state's structure, shapes and dtypes, without reading weights (where
    the LoRA targets, rank and train_also are checked against the model)."""

    def init() -> TrainState:
        base = models.family(job.model_type).model(job.model_config, jr.key(0))
        if job.quantize is not None:
            base = quantize_lib.apply(base, job.quantize, abstract_only=True)
        model = _with_reference(job, with_adapters(job, base))
        if job.teacher is not None:
            model = distill.WithTeacher(model, _distill.abstract_model(job.teacher))
        return _state(job, model, 0)

    return eqx.filter_eval_shape(init)


def base_reference(job: Any) -> dict[str, Any] | None:
    """What a LoRA run's checkpoints record of their frozen base (None without
    LoRA): `hf.content_hash` of `model.init_from` (its path and the sha256 of
    its safetensors, read once), or for a random base its seed and the sha256
    of its arrays. A distillation run's checkpoints leave the teacher out too:
    theirs is `_distilled_reference`."""
    if job.teacher is not None:
        return _distilled_reference(job)
    return _student_base(job)


def _distilled_reference(job: Any) -> dict[str, Any]:
    """The frozen weights a distillation run's checkpoints point at: the
    teacher (`task.teacher`'s content hash) and, with LoRA, the student's base;
    `sha256` over both (what a restore compares)."""
    teacher = _distill.content_hash(job.config)
    student = _student_base(job)
    out = {"path": teacher["path"], "teacher": teacher, "student_base": student}
    combined = teacher["sha256"] + ("" if student is None else student["sha256"])
    return out | {"sha256": hashlib.sha256(combined.encode()).hexdigest()}


def _student_base(job: Any) -> dict[str, Any] | None:
    if job.lora is None:
        return None
    base = _unquantized_base(job)
    if job.quantize is None:
        return base
    q = job.quantize  # the codes are a function of the weights and these
    how = {"kind": q.kind, "skip": q.skip, "double": q.double}
    digest = hashlib.sha256((base["sha256"] + repr(sorted(how.items()))).encode())
    return base | {"quantize": how, "sha256": digest.hexdigest()}


def _unquantized_base(job: Any) -> dict[str, Any]:
    init_from = job.config.model.init_from
    if init_from is None:
        return _random_base_hash(job)
    if not (Path(init_from) / "config.json").is_file():
        raise ConfigError(
            f"this LoRA run's frozen base, model.init_from = {init_from!r}, "
            "is gone (no config.json there): its checkpoints hold only the "
            "adapters. Put the base back there, or pass its new place with "
            "--set model.init_from=PATH (its content is checked)."
        )
    return hf.content_hash(init_from)


def _random_base_hash(job: Any) -> dict[str, Any]:
    """A random base's seed and the sha256 of its arrays."""
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(eqx.filter(base_model(job), eqx.is_array)):
        digest.update(np.asarray(jax.device_get(leaf)).tobytes())
    return {"path": None, "seed": job.config.seed, "sha256": digest.hexdigest()}
