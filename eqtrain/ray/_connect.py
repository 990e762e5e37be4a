"""Connecting to Ray: the caller's connection, a cluster at
`distributed.ray_address`, or a local Ray started for the run (and shut down
after it); a local Ray that cannot place the workers is refused at once."""

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .._errors import ConfigError
from ._plan import Plan


EXTRA = (
    "the Ray launcher needs Ray, which is not installed here: install eqtrain's "
    "`ray` extra (`pip install 'eqtrain[ray]'`)."
)
FIX_ADDRESS = (
    "Check `distributed.ray_address` (`ray status` on the head node prints "
    "it; `auto` joins the cluster this machine belongs to), or leave it unset "
    "to start a local Ray."
)
_BUILTIN = ("CPU", "GPU", "TPU", "memory")


def import_ray() -> Any:
    """The `ray` module; without it, a `ConfigError` naming the extra."""
    # Before Ray is imported: keep a loopback address loopback (else Ray binds the
    # machine's address on every interface) and send no usage statistics.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        import ray
    except ImportError:
        raise ConfigError(EXTRA) from None
    return ray


@contextlib.contextmanager
def connected(ray: Any, plan: Plan, say: Callable[[str], None]) -> Iterator[None]:
    """Within: a Ray connection for `plan` (ours is shut down after)."""
    if ray.is_initialized():  # the caller's connection: theirs to shut down
        yield
        return
    if plan.address is None:
        _start_local(ray, plan)
        say("[ray] started a local Ray on 127.0.0.1")
    else:
        _join(ray, plan.address)
        say(f"[ray] connected to the Ray cluster at {plan.address}")
    try:
        _check_fits(ray, plan, local=plan.address is None)
        yield
    finally:
        ray.shutdown()


def _start_local(ray: Any, plan: Plan) -> None:
    custom = {
        name: amount * plan.processes
        for name, amount in plan.bundle.items()
        if name not in _BUILTIN
    }
    cpus = max(os.cpu_count() or 1, int(plan.bundle.get("CPU", 0) * plan.processes))
    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
        num_cpus=cpus,
        resources=custom or None,
        logging_level=logging.WARNING,  # we say what we started
    )


def _check_reachable(address: str) -> None:
    """A `HOST:PORT` address answers (its form is checked with the config)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ConfigError(
            f"cannot reach the Ray cluster at distributed.ray_address = "
            f"{address!r} ({e.strerror or e}). {FIX_ADDRESS}"
        ) from None


def _join(ray: Any, address: str) -> None:
    if address != "auto":
        _check_reachable(address)
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        text = str(e).strip()
        first = text.splitlines()[0].rstrip(".") if text else type(e).__name__
        raise ConfigError(
            f"cannot join the Ray cluster at distributed.ray_address = "
            f"{address!r} ({first}). {FIX_ADDRESS}"
        ) from None


def resources(values: Mapping[str, float | int]) -> str:
    """`CPU=2,GPU=1`."""
    return ",".join(f"{k}={v:g}" for k, v in values.items())


def _unplaceable(have: Mapping[str, float], plan: Plan) -> str | None:
    """Why a Ray with `have` cannot place `plan`'s workers, or None."""
    short = {
        name: amount * plan.processes
        for name, amount in plan.bundle.items()
        if amount * plan.processes > have.get(name, 0)
    }
    if plan.strategy == "STRICT_SPREAD" and plan.processes > 1:
        return "strict_spread needs one node per worker"
    if short:
        return f"it has {resources({k: have.get(k, 0.0) for k in short})}"
    return None


def _check_fits(ray: Any, plan: Plan, *, local: bool) -> None:
    """On a local Ray, refuse at once what it cannot place (a cluster may still
    grow: there the launcher waits and says what it waits for)."""
    if not local:
        return
    why = _unplaceable(ray.cluster_resources(), plan)
    if why is not None:
        raise ConfigError(
            f"the local Ray cannot place {plan.processes} workers with "
            f"{resources(plan.bundle)} each ({why}). Lower distributed.processes or "
            "distributed.resources_per_worker, use distributed.placement = 'pack', "
            "or set distributed.ray_address to a cluster."
        )
