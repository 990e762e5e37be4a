"""A run planned: its job built, its data read and tokenized, its arrays placed
on the mesh and its `[log] samples` prompts read, every check that can fail
done before the run touches its directory or compiles anything."""

import dataclasses
from pathlib import Path
from typing import Any

from ..config import Config
from . import _build, _grpo, _place, _rows, _samples


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything a run needs before it touches its directory or a device:
    the built job, its rows, where its arrays go and its samples' prompts."""

    job: _build.Job
    rows: Any  # a dict of arrays, or a row source (LM stores)
    eval_rows: _rows.Rows | None
    placement: _place.Placement
    samples: _samples.Prompts | None = None


def plan(config: Config, *, recorded: Path | None = None) -> Plan:
    """Build `config`'s job (with `recorded`, the run's record of
    `model.init_from`, see `_build.build`), read and tokenize its data, and place
    it on the mesh: every check that can fail does so here, before any
    compilation."""
    job = _build.build(config, recorded=recorded)
    if job.grpo is not None:  # task.rewards' functions imported: they must be
        job.grpo.rewards = _grpo.rewards_of(config)
    _place.check_sequence(job)
    placed = _place.placement(job)  # the mesh and the batch split: before any data
    samples = _samples.prompts_of(job)  # log.samples: read and tokenized
    rows, eval_rows = _rows.planned(job)  # every source checked, then read
    return Plan(job, rows, eval_rows, placed, samples)
