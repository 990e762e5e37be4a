"""Where a run's arrays live: the mesh from the `[mesh]` section, the state's
shardings from the partition rules, and the batch sharding."""

import dataclasses
from typing import Any

from .. import sharding
from .._errors import ConfigError
from .._jit import Jitted, jit
from ..step import train_step as _train_step
from . import _build


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
    rows: _build.Rows
    eval_rows: _build.Rows | None
    placement: Placement


def plan(config: Any, *, recorded: Any = None) -> Plan:
    """Build `config`'s job (with `recorded`, the run's record of
    `model.init_from`, see `_build.build`), read and tokenize its data, and place
    it on the mesh: every check that can fail does so here, before any
    compilation."""
    job = _build.build(config, recorded=recorded)
    rows = _build.train_rows(job)
    return Plan(job, rows, _build.eval_rows(job), placement(job))


def placement(job: _build.Job) -> Placement:
    """The `Placement` of `job`: checks the mesh against the devices, the batch
    against the data axes and every parameter against its rule."""
    m = job.config.mesh
    mesh = sharding.make_mesh({"data": m.data, "fsdp": m.fsdp, "tensor": m.tensor})
    batch = job.config.data.batch_size // job.config.optim.accumulate
    parallel = mesh.shape["data"] * mesh.shape["fsdp"]
    if batch % parallel:
        raise ConfigError(
            f"each micro-batch ({batch} rows: data.batch_size / optim.accumulate) "
            f"must split evenly over the {parallel} devices of mesh.data x mesh.fsdp; "
            "change data.batch_size, optim.accumulate or the mesh."
        )
    abstract = job.abstract_state()
    rules = sharding.rules_for(abstract.model, mesh)
    state_sh = sharding.state_shardings(abstract, mesh, rules, optimizer=job.optimizer)
    return Placement(mesh, state_sh, sharding.batch_sharding(mesh))


def train_step(job: _build.Job, placement: Placement) -> Jitted:
    """The run's compiled training step (the `[optim]` accumulation and the
    `[loop]` precision, non-finite guard and EMA), on `placement`."""
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
    return jit(step, shardings=placement.shardings)
