"""`eqtrain.ray.fit` and `prepare_data`: connect to Ray, then hand the run to the
supervisor (or the data preparation to Ray tasks)."""

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

from .. import cpu as _cpu, job
from ..config import Config
from ._connect import connected, import_ray
from ._plan import absolute, plan as make_plan
from ._result import LaunchResult
from ._signals import Signals
from ._supervisor import Supervisor


def fit(
    config: Config,
    *,
    resume: str | None = None,
    overwrite: bool = False,
    echo: Callable[[str], None] | None = None,
    env: Mapping[str, str] | None = None,
) -> LaunchResult:
    """Train as `config` says, as `distributed.processes` processes placed by Ray:
    the Python form of `eqtrain fit CONFIG --launcher ray`.

    Uses the Ray connection of this process if there is one, else joins
    `distributed.ray_address`, else starts a local Ray on 127.0.0.1 (and shuts it
    down at the end). When a worker fails, all are stopped and the whole group
    starts again with `--resume auto`, up to `distributed.max_restarts` times.
    SIGINT/SIGTERM are passed on to every worker (a clean, agreed stop); a second
    one aborts them.

    Args:
        config: a validated `Config` (`eqtrain.config.load(...)`).
        resume: the first attempt's `--resume` (`"auto"`, `"never"` or a path);
            restarts always resume `"auto"`.
        overwrite: the first attempt's `--overwrite`.
        echo: where the workers' prefixed lines and the launcher's notes go
            (default: standard error).
        env: variables set for every worker process (e.g. `XLA_FLAGS`). The
            workers also get this process's CPU setting (`tune_cpu`'s choice,
            as `EQTRAIN_CPU_TUNING`), unless `env` sets that variable: they
            apply it without measuring, and all compute alike.

    Returns:
        A `LaunchResult`.

    Raises:
        ConfigError: a config a launched run cannot run, Ray missing, an
            unreachable `ray_address`, or resources the local Ray lacks.
        LaunchError: the workers kept failing (names the worker and its last
            line), or a second signal aborted them.
    """
    the_plan = make_plan(config)
    ray = import_ray()
    config = dataclasses.replace(config, run_dir=absolute(config.run_dir))
    say = echo or _stderr
    with connected(ray, the_plan, say), Signals(say) as signals:
        if config.task.kind == "lm":  # the stores, as Ray tasks, before any worker
            job.prepare_data(config, executor="ray", verify=False, say=say)
        # one CPU setting for every worker: this process's (`tune_cpu`'s)
        env = {**_cpu.shared_setting(), **(env or {})}
        supervisor = Supervisor(ray, the_plan, config, say, env, signals)
        return supervisor.run(resume=resume, overwrite=overwrite)


def prepare_data(
    config: Config,
    *,
    verify: bool = True,
    echo: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """`eqtrain data prepare CONFIG --launcher ray`: the stores of `config`'s text
    sources, their parts built as Ray tasks on the cluster's CPUs (the same parts
    and ledger as a local prepare, so the same bytes). Connects as `fit` does;
    the sources and `data.cache` must be on a filesystem every node sees."""
    the_plan = make_plan(config)
    ray = import_ray()
    say = echo or _stderr
    with connected(ray, the_plan, say):
        return job.prepare_data(config, executor="ray", verify=verify, say=say)


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
