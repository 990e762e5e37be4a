"""What a Ray launch will do, decided from the config alone (no Ray needed): the
placement group, each worker's command and environment, and the restart policy."""

import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence

from .._errors import ConfigError
from ..config import Config, parse_resources, reference_mode


MAX_DELAY = 300.0  # seconds: the longest wait between restarts
EXIT_USAGE = 2  # `eqtrain fit`'s exit code for a bad config or file: never retried
STRATEGIES = {
    "pack": "PACK",
    "spread": "SPREAD",
    "strict_pack": "STRICT_PACK",
    "strict_spread": "STRICT_SPREAD",
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """A launch from `distributed.*`: `processes` workers, each holding `bundle`
    (Ray resources) in one placement group placed by `strategy`."""

    processes: int
    bundle: dict[str, float]
    strategy: str
    address: str | None
    max_restarts: int
    restart_delay: float

    @property
    def bundles(self) -> list[dict[str, float]]:
        return [dict(self.bundle) for _ in range(self.processes)]


def plan(config: Config) -> Plan:
    """The launch `config` asks for, after checking that it can run as
    `distributed.processes` processes under a launcher."""
    check_launchable(config)
    dist = config.distributed
    return Plan(
        processes=dist.processes,
        bundle=parse_resources(dist.resources_per_worker),
        strategy=STRATEGIES[dist.placement],
        address=dist.ray_address,
        max_restarts=dist.max_restarts,
        restart_delay=dist.restart_delay,
    )


def check_launchable(config: Config) -> None:
    """Refuse, before anything starts, what a launched run cannot do."""
    if config.distributed.processes > 1 and reference_mode(config) == "precomputed":
        raise ConfigError(
            "task.reference = 'precomputed' cannot run as "
            f"distributed.processes = {config.distributed.processes} processes (its "
            "pass runs in one process); use task.reference = 'copy' (or "
            "'adapters_off' with [lora]), or distributed.processes = 1."
        )
    if config.export.every:
        raise ConfigError(
            f"export.every = {config.export.every} is not supported with "
            "`--launcher ray` (the workers write no exports while training); set "
            "export.every = 0: the launcher writes export.hf from the last "
            "checkpoint when the run ends."
        )


def restart_delay(restart: int, base: float) -> float:
    """Seconds to wait before restart number `restart` (1, 2, ...): `base`,
    then twice as long each time, at most `MAX_DELAY`.

    >>> [restart_delay(k, 2.0) for k in (1, 2, 3)]
    [2.0, 4.0, 8.0]
    """
    return min(base * 2 ** (restart - 1), MAX_DELAY) if base > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class Exit:
    """How one worker ended: its exit `code` (negative: killed by that signal;
    None: its actor or node died), whether it reported a result, its last line."""

    worker: int
    code: int | None
    reported: bool = False
    last_line: str = ""
    detail: str = ""

    @property
    def clean(self) -> bool:
        """Ended with a stop reason (max steps, signal, time limit, non-finite
        loss, ...), even where the exit code says non-finite (1)."""
        return self.reported or self.code == 0

    def describe(self) -> str:
        if self.detail:
            how = self.detail
        elif self.code is None:
            how = "its Ray actor died"
        elif self.code < 0:
            how = f"it was killed by signal {_signal_name(-self.code)}"
        else:
            how = f"it exited with code {self.code}"
        last = f"; its last line: {self.last_line!r}" if self.last_line else ""
        return f"worker {self.worker} failed: {how}{last}"


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def decide(exits: Sequence[Exit], *, stopping: bool, restarts: int, limit: int) -> str:
    """After an attempt: `"done"` (every worker ended cleanly), `"stopped"` (a
    signal or the driver stopped it: never restarted), `"restart"` or `"fail"`.
    `exits[0]` is the first worker that ended."""
    if all(e.clean for e in exits):
        return "done"
    if stopping:
        return "stopped"
    first = next(e for e in exits if not e.clean)
    if first.code == EXIT_USAGE:  # a config or file error: the same next time
        return "fail"
    return "restart" if restarts < limit else "fail"


def worker_args(*, resume: str | None, overwrite: bool, restart: bool) -> list[str]:
    """The `eqtrain fit CONFIG` options of every worker: the caller's `--resume`
    and `--overwrite` on the first attempt; a restart continues from the last
    complete checkpoint (`--resume auto`) and never discards checkpoints."""
    if restart:
        return ["--resume", "auto", "--no-export"]
    args = ["--no-export"]
    if resume is not None:
        args += ["--resume", resume]
    if overwrite:
        args.append("--overwrite")
    return args


def worker_env(
    base: Mapping[str, str],
    extra: Mapping[str, str] | None,
    *,
    coordinator: str,
    processes: int,
    index: int,
) -> dict[str, str]:
    """Worker `index`'s environment: `base` (the actor's), the caller's `extra`,
    and the `EQTRAIN_*` variables that make `eqtrain fit` join the group."""
    env = {**base, **(extra or {}), "PYTHONUNBUFFERED": "1"}
    for name in ("EQTRAIN_COORDINATOR", "EQTRAIN_NUM_PROCESSES", "EQTRAIN_PROCESS_ID"):
        env.pop(name, None)
    if processes > 1:
        env["EQTRAIN_COORDINATOR"] = coordinator
        env["EQTRAIN_NUM_PROCESSES"] = str(processes)
        env["EQTRAIN_PROCESS_ID"] = str(index)
    return env


def fit_argv(config_path: str, args: Sequence[str], result_file: str) -> list[str]:
    """The command a worker runs: this Python's `eqtrain fit`."""
    cli = [sys.executable, "-m", "eqtrain.cli", "fit", config_path]
    return [*cli, *args, "--result-file", result_file]


def export_argv(
    run_dir: str, target: str, *, dtype: str | None, ema: bool, merged: bool
) -> list[str]:
    """`eqtrain export RUN_DIR TARGET --overwrite ...`: the run's final export,
    as the single-process `eqtrain fit` writes it at the end."""
    argv = [sys.executable, "-m", "eqtrain.cli", "export", run_dir, target]
    argv.append("--overwrite")
    if dtype is not None:
        argv += ["--dtype", dtype]
    if ema:
        argv.append("--ema")
    if merged:
        argv.append("--merged")
    return argv


def absolute(path: str) -> str:
    """`path` from the driver's working directory (the workers may start
    elsewhere)."""
    return os.path.abspath(os.path.expanduser(path))
