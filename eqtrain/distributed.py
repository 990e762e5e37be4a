"""Multi-process runs: `initialize()` starts JAX's distributed runtime from
arguments, from `EQTRAIN_COORDINATOR` / `EQTRAIN_NUM_PROCESSES` /
`EQTRAIN_PROCESS_ID`, or from SLURM's variables; `agree` makes every process take
the same decision (used by `fit` so all processes stop at the same step).

    eqtrain.distributed.initialize()          # before anything touches a device
"""

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._errors import ConfigError


DEFAULT_PORT = 62357


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process stands: the coordinator, the process count and its id."""

    coordinator: str | None
    num_processes: int
    process_id: int
    source: str  # "arguments", "environment", "slurm" or "single"


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name} must be an integer; got {value!r}.") from None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: `"node[03-05,9],gpu1"` -> `"node03"`.

    >>> first_host("node[03-05,9],gpu1")
    'node03'
    """
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise ConfigError(f"cannot read the SLURM node list {nodelist!r}.")
    prefix, ranges = match.group(1), match.group(3)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def discover(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> Cluster:
    """Resolve the cluster from arguments, then `EQTRAIN_*` variables, then SLURM
    (`SLURM_NTASKS`, `SLURM_PROCID`, and the first host of `SLURM_STEP_NODELIST`
    or `SLURM_JOB_NODELIST` with `EQTRAIN_COORDINATOR_PORT`, default 62357)."""
    env = os.environ if env is None else env
    if coordinator is not None or num_processes is not None or process_id is not None:
        return _checked(coordinator, num_processes, process_id, "arguments")
    if "EQTRAIN_COORDINATOR" in env or "EQTRAIN_NUM_PROCESSES" in env:
        return _checked(*_from_eqtrain_env(env), "environment")
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
        return _checked(*_from_slurm(env), "slurm")
    return Cluster(None, 1, 0, "single")


_Settings = tuple[str | None, int | None, int | None]  # coordinator, count, id


def _from_eqtrain_env(env: Mapping[str, str]) -> _Settings:
    """The run as `EQTRAIN_*` variables describe it (unset: None)."""
    coordinator = env.get("EQTRAIN_COORDINATOR")
    num = _int_var(env, "EQTRAIN_NUM_PROCESSES")
    return coordinator, num, _int_var(env, "EQTRAIN_PROCESS_ID")


def _int_var(env: Mapping[str, str], name: str) -> int | None:
    return _int(env[name], name) if name in env else None


def _from_slurm(env: Mapping[str, str]) -> _Settings:
    """The run as SLURM's variables describe it; the coordinator is the first
    host of the step's (or job's) node list."""
    num = _int(env["SLURM_NTASKS"], "SLURM_NTASKS")
    pid = _int(env["SLURM_PROCID"], "SLURM_PROCID")
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if nodes is None:
        raise ConfigError("SLURM_NTASKS is set but no SLURM node list is.")
    port = env.get("EQTRAIN_COORDINATOR_PORT", str(DEFAULT_PORT))
    return f"{first_host(nodes)}:{_int(port, 'EQTRAIN_COORDINATOR_PORT')}", num, pid


# Where each source's settings come from, for the messages.
_WHERE = {
    "arguments": "initialize()'s arguments",
    "environment": "EQTRAIN_COORDINATOR / EQTRAIN_NUM_PROCESSES / EQTRAIN_PROCESS_ID",
    "slurm": "SLURM's variables",
}


def _checked(
    coordinator: str | None, num: int | None, pid: int | None, source: str
) -> Cluster:
    """The `Cluster` of a multi-process source, checked to be complete."""
    where = _WHERE[source]
    _check_ids(num, pid, where)
    if num > 1 and (coordinator is None or ":" not in coordinator):
        raise ConfigError(
            f"a multi-process run needs the coordinator's `host:port` (process 0's "
            f"address); {where} give {coordinator!r}."
        )
    return Cluster(coordinator, num, pid, source)


def _check_ids(num: int | None, pid: int | None, where: str) -> None:
    """A process count and an id in range."""
    if num is None or pid is None:
        raise ConfigError(
            f"a multi-process run needs the process count and this process's id; "
            f"{where} give num_processes={num}, process_id={pid}."
        )
    if num < 1 or not 0 <= pid < num:
        raise ConfigError(
            f"process_id must be in [0, num_processes); {where} give "
            f"process_id={pid}, num_processes={num}."
        )


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: list[int] | None = None,
    timeout_seconds: int = 300,
) -> Cluster:
    """Join this process to a multi-process run (call it before any JAX work).

    The coordinator (process 0) listens on exactly the given `host:port`, not on
    every interface. A single-process run (nothing configured, or one process)
    does nothing.

    Args:
        coordinator: `host:port` of process 0.
        num_processes, process_id: the process count and this process's id.
        local_device_ids: restrict this process to these local devices.
        timeout_seconds: how long to wait for all processes to join.

    Returns:
        The resolved `Cluster`.
    """
    cluster = discover(coordinator, num_processes, process_id)
    if cluster.num_processes == 1:
        return cluster
    import jax

    jax.distributed.initialize(
        coordinator_address=cluster.coordinator,
        coordinator_bind_address=cluster.coordinator,
        num_processes=cluster.num_processes,
        process_id=cluster.process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=timeout_seconds,
    )
    return cluster


def agree(codes: Any) -> np.ndarray:
    """Each process's small int vector `codes` -> the element-wise maximum over all
    processes (identical on every process). A collective: every process must call
    it at the same point. Single-process: `codes` itself."""
    import jax

    local = np.asarray(codes, np.int32)
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(local)
    return np.asarray(gathered).reshape(jax.process_count(), -1).max(axis=0)
