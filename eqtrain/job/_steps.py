"""A run's compiled steps on its placement: the training step (`[optim]`
accumulation, `[loop]` precision, non-finite guard and EMA; GRPO's rollout;
distillation's on-policy sampling) and
the evaluation step with its loader."""

import dataclasses
from typing import Any

from .. import models
from .._fit import Evaluation
from .._jit import Jitted, jit
from ..config import Config
from ..cpu import step_options
from ..data import Loader
from ..post_training import distill, rollout
from ..step import eval_step, train_step as _train_step
from . import _build, _distill, _grpo, _place
from ._rows import Rows


def steps(
    job: _build.Job, placement: _place.Placement, eval_rows: Rows | None
) -> tuple[Jitted, Evaluation | None]:
    """The run's training step and what `fit` evaluates (`fit_evaluation`)."""
    return train_step(job, placement), fit_evaluation(job, placement, eval_rows)


def _precision(config: Config) -> str | None:
    return "bf16" if config.loop.precision == "bf16" else None


def _shardings(placement: _place.Placement) -> tuple[Any, Any]:
    """`(state, batch)` shardings, as `eqtrain.jit(..., shardings=)` takes."""
    return (placement.state_shardings, placement.batch_sharding)


def train_step(job: _build.Job, placement: _place.Placement) -> Jitted:
    """The run's compiled training step (the `[optim]` accumulation and the
    `[loop]` precision, non-finite guard and EMA), on `placement`, traced under
    its mesh (sequence-parallel attention reads the mesh from context)."""
    config = job.config
    step = _train_step(
        job.loss_fn,
        job.optimizer,
        accumulate=config.optim.accumulate,
        precision=_precision(config),
        nonfinite=config.loop.nonfinite,
        ema=config.loop.ema,
    )
    if config.task.kind == "grpo":  # each device's rows scored where it lives
        scoring = dataclasses.replace(_grpo.make_rollout(job), mesh=placement.mesh)
        step = rollout.grpo_step(step, scoring)
    if config.task.kind == "distill":  # on-policy completions, drawn per step
        step = distill.distill_step(step, _distill.on_policy(job))
    under = models.under_mesh(step, placement.mesh)
    options = step_options()  # the CPU setting's products, checked per step
    return jit(under, shardings=_shardings(placement), compiler_options=options)


def evaluation(
    job: _build.Job, placement: _place.Placement, rows: Rows | None
) -> tuple[Loader | None, Any]:
    """The eval loader over `rows` and the compiled eval step (None, None without
    rows)."""
    if rows is None:
        return None, None
    loader = Loader(
        rows,
        _eval_batch_size(rows, job.config),
        mode="eval",
        sharding=placement.batch_sharding,
    )
    return loader, _eval_step(job, placement)


def _eval_batch_size(rows: Rows, config: Config) -> int:
    """The eval batch: `data.batch_size`, or all rows when there are fewer (eval
    rows are a dict of arrays, or of a preference pair's arrays)."""
    return min(config.data.batch_size, len(next(iter(rows.values()))))


def _eval_step(job: _build.Job, placement: _place.Placement) -> Any:
    """The compiled eval step: the task's loss, without gradients or donation;
    for task.kind = grpo, the held-out prompts completed and scored."""
    if job.config.task.kind == "grpo":
        scoring = dataclasses.replace(_grpo.make_eval_rollout(job), mesh=placement.mesh)
        step = rollout.grpo_eval_step(scoring)
    else:
        step = eval_step(job.loss_fn, precision=_precision(job.config))
    under = models.under_mesh(step, placement.mesh)
    return jit(
        under, donate=False, shardings=_shardings(placement),
        compiler_options=step_options(),
    )  # fmt: skip


def fit_evaluation(
    job: _build.Job, placement: _place.Placement, rows: Rows | None
) -> Evaluation | None:
    """What `fit` evaluates, and when (None without eval rows: the default
    loop.eval_every then has nothing to evaluate; an explicit one with
    data.eval = none is refused by the config's checks, before any data)."""
    loader, evaluator = evaluation(job, placement, rows)
    if loader is None:
        return None
    loop = job.config.loop
    return Evaluation(
        step=evaluator,
        data=loader,
        every=loop.eval_every or None,
        at_end=loop.eval_at_end,
    )
