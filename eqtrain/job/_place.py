"""Where a run's arrays live: the mesh from the `[mesh]` section, the state's
shardings from the partition rules, and the batch sharding."""

import dataclasses
from typing import Any

from .. import data as data_lib, models, rollout, sharding
from .._errors import ConfigError
from .._jit import Jitted, jit
from ..step import train_step as _train_step
from . import _build, _grpo
from ._samples import prompts_of


@dataclasses.dataclass
class Placement:
    """The mesh of a run and the shardings of its state and batches."""

    mesh: Any
    state_shardings: Any
    batch_sharding: Any

    @property
    def shardings(self) -> tuple[Any, Any]:
        """`(state, batch)` shardings, as `eqtrain.jit(..., shardings=)` takes."""
        return (self.state_shardings, self.batch_sharding)

    def place(self, state: Any) -> Any:
        """`state` copied onto its shardings."""
        return sharding.shard(state, self.state_shardings)


@dataclasses.dataclass
class Plan:
    """Everything a run needs before it touches its directory or a device:
    the built job, its rows and where its arrays go."""

    job: _build.Job
    rows: Any  # a dict of arrays, or a row source (LM stores)
    eval_rows: _build.Rows | None
    placement: Placement


def plan(config: Any, *, recorded: Any = None) -> Plan:
    """Build `config`'s job (with `recorded`, the run's record of
    `model.init_from`, see `_build.build`), read and tokenize its data, and place
    it on the mesh: every check that can fail does so here, before any
    compilation."""
    job = _build.build(config, recorded=recorded)
    check_sequence(job)
    placed = placement(job)  # the mesh and the batch split: before any data
    _build.check_sources(job.config)  # every source exists: before reading any
    prompts_of(job)  # log.samples: its prompts read and tokenized
    rows = sequence_rows(job, _build.train_rows(job))
    eval_rows = _build.eval_rows(job)
    if eval_rows is not None:
        eval_rows = sequence_rows(job, eval_rows)
    return Plan(job, rows, eval_rows, placed)


def check_sequence(job: _build.Job) -> None:
    """Refuse a sequence-parallel setup that cannot split (`ConfigError` naming
    the fields): rows, heads, or a task whose rows are not LM rows."""
    c = job.config
    ways = c.mesh.sequence
    if ways > 1 and c.task.kind not in ("lm", "sft"):
        raise ConfigError(
            f"mesh.sequence = {ways} splits LM rows; task.kind = {c.task.kind!r} "
            "has preference pairs, which sequence parallelism does not split yet. "
            "Use mesh.sequence = 1 for this task."
        )
    if c.model.sequence_layout == "zigzag" and c.task.kind not in ("lm", "sft"):
        raise ConfigError(
            f"model.sequence_layout = 'zigzag' permutes LM rows; task.kind = "
            f"{c.task.kind!r} has preference pairs. Use 'contiguous'."
        )
    models.check_sequence(
        seq_len=c.data.seq_len,
        ways=ways,
        scheme=c.model.sequence_parallel,
        layout=c.model.sequence_layout,
        heads=_heads(job.model_config),
        tensor=c.mesh.tensor if c.mesh.tensor > 0 else 1,
    )


def _heads(model_config: Any) -> int | None:
    return getattr(model_config, "num_attention_heads", None) or getattr(
        model_config, "n_head", None
    )


def sequence_rows(job: _build.Job, rows: Any) -> Any:
    """LM rows with the global `positions` a sequence-parallel model reads, in the
    configured layout (`eqtrain.models.sequence_rows`); other rows unchanged."""
    m = job.config.model
    if m.sequence_parallel is None or "tokens" not in _build.first_rows(rows, 1):
        return rows
    ways = job.config.mesh.sequence

    def positioned(rows: _build.Rows) -> _build.Rows:
        return models.sequence_rows(rows, layout=m.sequence_layout, ways=ways)

    if hasattr(rows, "take"):  # a row source: each batch as it is read
        return data_lib.MappedRows(rows, positioned)
    return positioned(rows)


def check_eval_batch(config: Any, parallel: int) -> None:
    """An eval batch (`data.batch_size` rows, or `data.eval_rows` when fewer) must
    split over the data axes too; said before any data is read."""
    data = config.data
    source = data.eval
    if source == "auto":
        lm = config.task.kind == "lm"
        source = "stdlib" if data.train == "stdlib" and lm else "none"
    if source == "none":
        return
    rows = min(data.batch_size, data.eval_rows)
    if rows % parallel:
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
    batch = job.config.data.batch_size // job.config.optim.accumulate
    parallel = sharding.batch_divisor(mesh)
    if batch % parallel:
        raise ConfigError(
            f"each micro-batch ({batch} rows: data.batch_size / optim.accumulate) "
            f"must split evenly over the {parallel} devices of mesh.data x "
            "mesh.fsdp x mesh.expert; change data.batch_size, optim.accumulate or "
            "the mesh."
        )
    check_eval_batch(job.config, parallel)
    check_experts(m.expert, job.model_config)
    abstract = job.abstract_state()
    rules = sharding.rules_for(abstract.model, mesh)
    state_sh = sharding.state_shardings(abstract, mesh, rules, optimizer=job.optimizer)
    batch_sh = sharding.batch_sharding(mesh, sequence=m.sequence > 1)
    return Placement(mesh, state_sh, batch_sh)


def train_step(job: _build.Job, placement: Placement) -> Jitted:
    """The run's compiled training step (the `[optim]` accumulation and the
    `[loop]` precision, non-finite guard and EMA), on `placement`, traced under
    its mesh (sequence-parallel attention reads the mesh from context)."""
    config = job.config
    loop = config.loop
    step = _train_step(
        job.loss_fn,
        job.optimizer,
        accumulate=config.optim.accumulate,
        precision="bf16" if loop.precision == "bf16" else None,
        nonfinite=loop.nonfinite,
        ema=loop.ema,
    )
    if config.task.kind == "grpo":
        step = rollout.grpo_step(step, _grpo.make_rollout(job))
    return jit(models.under_mesh(step, placement.mesh), shardings=placement.shardings)
