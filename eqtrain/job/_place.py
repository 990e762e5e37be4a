"""Where a run's arrays live: the mesh from the `[mesh]` section, the state's
shardings from the partition rules, and the batch sharding."""

import dataclasses
from typing import Any

from .. import models, sharding
from .._errors import ConfigError
from ..config import eval_source
from . import _build


@dataclasses.dataclass(frozen=True)
class Placement:
    """The mesh of a run and the shardings of its state and batches."""

    mesh: Any
    state_shardings: Any
    batch_sharding: Any

    def place(self, state: Any) -> Any:
        """`state` copied onto its shardings."""
        return sharding.shard(state, self.state_shardings)


def check_sequence(job: _build.Job) -> None:
    """Refuse a sequence-parallel setup that cannot split (`ConfigError` naming
    the fields): rows, heads, or a task whose rows are not LM rows."""
    c = job.config
    if c.task.kind not in ("lm", "sft"):
        _check_lm_rows_only(c)
    models.check_sequence(
        seq_len=c.data.seq_len,
        ways=c.mesh.sequence,
        scheme=c.model.sequence_parallel,
        layout=c.model.sequence_layout,
        heads=_heads(job.model_config),
        tensor=c.mesh.tensor if c.mesh.tensor > 0 else 1,
    )


def _check_lm_rows_only(c: Any) -> None:
    """Sequence parallelism and its zigzag layout split LM rows only."""
    rows = {
        "grpo": "prompts whose completions are sampled in the step",
        "distill": "completions that are sampled in the step (task.lmbda) and a "
        "teacher's logits beside the student's",
    }.get(c.task.kind, "preference pairs")
    if c.mesh.sequence > 1:
        raise ConfigError(
            f"mesh.sequence = {c.mesh.sequence} splits LM rows; task.kind = "
            f"{c.task.kind!r} has {rows}, which sequence parallelism "
            "does not split yet. Use mesh.sequence = 1 for this task."
        )
    if c.model.sequence_layout == "zigzag":
        raise ConfigError(
            f"model.sequence_layout = 'zigzag' permutes LM rows; task.kind = "
            f"{c.task.kind!r} has {rows}. Use 'contiguous'."
        )


def _heads(model_config: Any) -> int | None:
    return getattr(model_config, "num_attention_heads", None) or getattr(
        model_config, "n_head", None
    )


def check_eval_batch(config: Any, parallel: int) -> None:
    """An eval batch (`data.batch_size` rows, or `data.eval_rows` when fewer) must
    split over the data axes too; said before any data is read."""
    rows = min(config.data.batch_size, config.data.eval_rows)
    if eval_source(config) != "none" and rows % parallel:
        raise ConfigError(
            f"an eval batch ({rows} rows: the smaller of data.batch_size and "
            f"data.eval_rows) must split evenly over the {parallel} devices of "
            "mesh.data x mesh.fsdp x mesh.expert; raise data.eval_rows to a "
            "multiple of "
            f'{parallel}, or set data.eval = "none".'
        )


def check_experts(ways: int, model_config: Any) -> None:
    """`mesh.expert` must split a mixture-of-experts model's experts evenly."""
    experts = getattr(model_config, "num_experts", 0)
    if ways > 1 and not experts:
        raise ConfigError(
            f"mesh.expert = {ways} splits a mixture-of-experts model's experts, and "
            "this model has none (model.num_experts = 0); use mesh.data for data "
            "parallelism instead."
        )
    if ways > 1 and experts % ways:
        raise ConfigError(
            f"mesh.expert = {ways} must divide the model's {experts} experts; use a "
            f"divisor of {experts}."
        )


def placement(job: _build.Job) -> Placement:
    """The `Placement` of `job`: checks the mesh against the devices, the batch
    against the data axes and every parameter against its rule."""
    m = job.config.mesh
    sizes = {"data": m.data, "fsdp": m.fsdp, "tensor": m.tensor}
    mesh = sharding.make_mesh(sizes | {"sequence": m.sequence, "expert": m.expert})
    parallel = sharding.batch_divisor(mesh)
    check_micro_batch(job.config, parallel)
    check_eval_batch(job.config, parallel)
    check_experts(m.expert, job.model_config)
    abstract = job.abstract
    rules = sharding.rules_for(abstract.model, mesh)
    state_sh = sharding.state_shardings(abstract, mesh, rules, optimizer=job.optimizer)
    batch_sh = sharding.batch_sharding(mesh, sequence=m.sequence > 1)
    return Placement(mesh, state_sh, batch_sh)


def check_micro_batch(config: Any, parallel: int) -> None:
    """A micro-batch must split evenly over the data axes' `parallel` devices."""
    batch = config.data.batch_size // config.optim.accumulate
    if batch % parallel:
        raise ConfigError(
            f"each micro-batch ({batch} rows: data.batch_size / optim.accumulate) "
            f"must split evenly over the {parallel} devices of mesh.data x "
            "mesh.fsdp x mesh.expert; change data.batch_size, optim.accumulate or "
            "the mesh."
        )
