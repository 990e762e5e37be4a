"""Run `eqtrain fit` as several processes placed by Ray, restarting the whole group
from the last complete checkpoint when a worker fails (needs the `ray` extra).

    config = eqtrain.config.load("run.toml", ["distributed.processes=2"])
    result = eqtrain.ray.fit(config)          # or: eqtrain fit run.toml --launcher ray
    print(result.stop_reason, result.restarts)

Ray only places, watches and restarts the workers; JAX's distributed runtime
(`eqtrain.distributed`) joins them into one mesh, as under SLURM.
"""

from ._connect import import_ray as import_ray
from ._launch import fit as fit, prepare_data as prepare_data
from ._plan import (
    Exit as Exit,
    Plan as Plan,
    check_launchable as check_launchable,
    decide as decide,
    plan as plan,
    restart_delay as restart_delay,
    worker_args as worker_args,
    worker_env as worker_env,
)
from ._result import LaunchError as LaunchError, LaunchResult as LaunchResult
