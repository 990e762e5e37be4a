"""The supervisor: connect to Ray, place the workers, run their `eqtrain fit`
processes as one JAX group, stream their output, and restart the whole group from
the last complete checkpoint when one of them fails."""

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .. import job
from .._errors import ConfigError, EqtrainError
from .._hooks import StopKind, StopReason
from ..config import Config, to_toml
from ._plan import (
    EXIT_USAGE,
    Exit,
    Plan,
    absolute,
    decide,
    export_argv,
    plan as make_plan,
    restart_delay,
    worker_args,
    worker_env,
)
from ._worker import Worker


ANSWER_SECONDS = 60.0  # a live actor answers a poll at once; this long: it is gone
EXTRA = (
    "the Ray launcher needs Ray, which is not installed here: install eqtrain's "
    "`ray` extra (`pip install 'eqtrain[ray]'`)."
)


class LaunchError(EqtrainError, RuntimeError):
    """The launched run failed: a worker failed more often than
    `distributed.max_restarts` allows, or failed in a way a restart cannot mend."""


@dataclasses.dataclass
class LaunchResult:
    """What `eqtrain.ray.fit` did (and `eqtrain fit --launcher ray` prints).

    Attributes:
        stop_reason: why the run stopped (agreed by all workers), and at which
            step (`step`).
        metrics: the last step's metrics, as process 0 reported them.
        run_dir: the run directory.
        export_dir: the final Hugging Face export, or None.
        config: the resolved config.
        restarts: how many times the whole group was restarted.
        resumed_from: the checkpoint step the last attempt continued from.
    """

    stop_reason: StopReason
    metrics: dict[str, Any]
    run_dir: Path
    export_dir: Path | None
    config: Config
    restarts: int = 0
    resumed_from: int | None = None

    @property
    def step(self) -> int:
        """The last completed step."""
        return self.stop_reason.step


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
        env: variables set for every worker process (e.g. `XLA_FLAGS`).

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
    with _connected(ray, the_plan, say), _Signals(say) as signals:
        if config.task.kind == "lm":  # the stores, as Ray tasks, before any worker
            job.prepare_data(config, executor="ray", verify=False, say=say)
        supervisor = _Supervisor(ray, the_plan, config, say, dict(env or {}), signals)
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
    with _connected(ray, the_plan, say):
        return job.prepare_data(config, executor="ray", verify=verify, say=say)


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- connecting -------------------------------------------------------------------
@contextlib.contextmanager
def _connected(ray: Any, plan: Plan, say: Callable[[str], None]) -> Iterator[None]:
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
    builtin = ("CPU", "GPU", "TPU", "memory")
    custom = {
        name: amount * plan.processes
        for name, amount in plan.bundle.items()
        if name not in builtin
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


def _join(ray: Any, address: str) -> None:
    fix = (
        "Check `distributed.ray_address` (`ray status` on the head node prints "
        "it; `auto` joins the cluster this machine belongs to), or leave it unset "
        "to start a local Ray."
    )
    if address != "auto":  # its form is checked with the config
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
        except OSError as e:
            raise ConfigError(
                f"cannot reach the Ray cluster at distributed.ray_address = "
                f"{address!r} ({e.strerror or e}). {fix}"
            ) from None
    try:
        ray.init(address=address, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        text = str(e).strip()
        first = text.splitlines()[0].rstrip(".") if text else type(e).__name__
        raise ConfigError(
            f"cannot join the Ray cluster at distributed.ray_address = "
            f"{address!r} ({first}). {fix}"
        ) from None


def _check_fits(ray: Any, plan: Plan, *, local: bool) -> None:
    """On a local Ray, refuse at once what it cannot place (a cluster may still
    grow: there the launcher waits and says what it waits for)."""
    if not local:
        return
    have = ray.cluster_resources()
    short = {
        name: amount * plan.processes
        for name, amount in plan.bundle.items()
        if amount * plan.processes > have.get(name, 0)
    }
    spread = plan.strategy == "STRICT_SPREAD" and plan.processes > 1
    if short or spread:
        want = _resources(plan.bundle)
        why = (
            "strict_spread needs one node per worker"
            if spread
            else f"it has {_resources({k: have.get(k, 0.0) for k in short})}"
        )
        raise ConfigError(
            f"the local Ray cannot place {plan.processes} workers with {want} each "
            f"({why}). Lower distributed.processes or "
            "distributed.resources_per_worker, use distributed.placement = 'pack', "
            "or set distributed.ray_address to a cluster."
        )


def _resources(values: Mapping[str, float | int]) -> str:
    return ",".join(f"{k}={v:g}" for k, v in values.items())


# -- signals ------------------------------------------------------------------------
class _Signals:
    """SIGINT/SIGTERM received by the driver, for the supervisor to pass on. The
    first is a stop request; the second also aborts."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.received: list[int] = []
        self.forwarded = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_Signals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append(signum)  # only this: printing here could re-enter

    @property
    def stopping(self) -> bool:
        return bool(self.received)

    @property
    def aborting(self) -> bool:
        return len(self.received) > 1

    def pending(self) -> list[int]:
        """The next signal not yet passed on to the workers (one per call: two
        sent at once could reach a worker as one)."""
        if self.forwarded >= len(self.received):
            return []
        self.forwarded += 1
        signum = self.received[self.forwarded - 1]
        name = signal.Signals(signum).name
        if self.forwarded == 1:
            self.say(
                f"[ray] {name} received: asking every worker to save and stop "
                "(send it again to abort them without saving)."
            )
        else:
            self.say(f"[ray] {name} received again: aborting the workers.")
        return [signum]


# -- the group ------------------------------------------------------------------
@dataclasses.dataclass
class _Group:
    placement_group: Any
    actors: list[Any]
    pids: list[int] = dataclasses.field(default_factory=list)
    coordinator: str = ""


class _Supervisor:
    def __init__(
        self,
        ray: Any,
        plan: Plan,
        config: Config,
        say: Callable[[str], None],
        env: dict[str, str],
        signals: _Signals,
    ):
        self.ray, self.plan, self.config, self.say = ray, plan, config, say
        self.env, self.signals = env, signals
        self.config_text = to_toml(config)
        self.cwd = os.getcwd()
        self.ports: list[int] = []
        self.last_lines: dict[int, str] = {}
        self.results: dict[int, dict[str, Any]] = {}

    def run(self, *, resume: str | None, overwrite: bool) -> LaunchResult:
        restarts, group = 0, None
        try:
            while True:
                args = worker_args(
                    resume=resume, overwrite=overwrite, restart=restarts > 0
                )
                group = group or self._place()
                exits = self._attempt(group, args)
                outcome = decide(
                    exits,
                    stopping=self.signals.stopping,
                    restarts=restarts,
                    limit=self.plan.max_restarts,
                )
                if outcome == "done":
                    return self._result(restarts)
                failed = next((e for e in exits if not e.clean), None)
                if outcome == "stopped":
                    raise self._stopped(failed)
                assert failed is not None
                if outcome == "fail":
                    raise self._failed(failed, restarts)
                if any(e.code is None for e in exits):  # an actor or node died:
                    self._stop(group)  # place the whole group anew
                    group = None
                restarts += 1
                delay = restart_delay(restarts, self.plan.restart_delay)
                self.say(
                    f"[ray] {failed.describe()}. Restarting the whole group from "
                    f"the last complete checkpoint in {delay:g} s (restart "
                    f"{restarts} of at most {self.plan.max_restarts})."
                )
                if not self._wait(delay):
                    raise self._stopped(failed)
        finally:
            if group is not None:
                self._stop(group)

    def _attempt(self, group: _Group, args: list[str]) -> list[Exit]:
        """Start every worker's `eqtrain fit`, watch them to the end, and export
        if all ended cleanly. Whatever happens, no worker process outlives it."""
        self.results, self.last_lines = {}, {}
        try:
            try:
                self._start(group, args)
            except self.ray.exceptions.RayError as e:  # an actor died meanwhile
                return [Exit(0, None, detail=f"a Ray actor died ({_first_line(e)})")]
            exits = self._watch(group)
            if all(e.clean for e in exits) and not self.signals.aborting:
                self._export(group)
            return exits
        finally:
            for actor in group.actors:
                with contextlib.suppress(Exception):
                    self._get(actor.kill.remote())

    def _place(self) -> _Group:
        """A placement group and one actor per worker in it."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        plan = self.plan
        pg = placement_group(plan.bundles, strategy=plan.strategy)
        group = _Group(pg, [])
        try:
            self._wait_placed(pg)
            remote = self.ray.remote(Worker)
            for index in range(plan.processes):
                strategy = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index
                )
                options = _actor_options(plan.bundle)
                actor = remote.options(scheduling_strategy=strategy, **options)
                group.actors.append(actor.remote(index))
        except BaseException:
            self._stop(group)
            raise
        return group

    def _start(self, group: _Group, args: list[str]) -> None:
        """Each worker's `eqtrain fit`, joined at a new coordinator port."""
        plan = self.plan
        group.coordinator = self._get(group.actors[0].address.remote(self.ports))
        self.ports.append(int(group.coordinator.rpartition(":")[2]))
        group.pids = []
        for index, actor in enumerate(group.actors):
            env = worker_env(
                self._actor_env(actor),
                self.env,
                coordinator=group.coordinator,
                processes=plan.processes,
                index=index,
            )
            start = actor.start_fit.remote(self.config_text, args, env, self.cwd)
            group.pids.append(self._get(start))
        where = f" (coordinator {group.coordinator})" if plan.processes > 1 else ""
        pids = ", ".join(f"worker {i}: pid {p}" for i, p in enumerate(group.pids))
        self.say(f"[ray] started {plan.processes} worker(s){where}: {pids}")

    def _actor_env(self, actor: Any) -> dict[str, str]:
        return self._get(actor.environ.remote())

    def _wait_placed(self, pg: Any) -> None:
        started = time.monotonic()
        noted = started
        while True:
            ready, _ = self.ray.wait([pg.ready()], timeout=1.0)
            if ready:
                return
            if self.signals.stopping:
                raise LaunchError(
                    "stopped by a signal while waiting for the cluster to place "
                    "the workers; nothing was started."
                )
            if time.monotonic() - noted > 30:
                noted = time.monotonic()
                self.say(
                    f"[ray] waiting {noted - started:.0f} s for the cluster to place "
                    f"{self.plan.processes} workers with "
                    f"{_resources(self.plan.bundle)} each "
                    f"({self.plan.strategy}); available now: "
                    f"{_resources(self.ray.available_resources())}"
                )

    def _get(self, ref: Any) -> Any:
        return self.ray.get(ref, timeout=ANSWER_SECONDS)

    def _watch(self, group: _Group) -> list[Exit]:
        """Stream every worker's output until all have ended, or until one fails
        (then the others are killed: a JAX group cannot lose a member)."""
        exits: dict[int, Exit] = {}
        while len(exits) < len(group.actors):
            for _ in self.signals.pending():
                for index, actor in enumerate(group.actors):
                    if index in exits:
                        continue
                    if self.signals.aborting:  # a second SIGTERM could merge with
                        actor.kill.remote()  # the first in a busy process: kill
                    else:  # `eqtrain fit` saves and stops on it, agreed by all
                        actor.send.remote(int(signal.SIGTERM))
            for index, actor in enumerate(group.actors):
                if index not in exits:
                    ended = self._poll(index, actor)
                    if ended is not None:
                        exits[index] = ended
            failed = [e for e in exits.values() if not e.clean]
            if failed:
                self._kill_others(group, exits)
                return [*failed, *(e for e in exits.values() if e.clean)]
            time.sleep(0.2)
        return list(exits.values())

    def _poll(self, index: int, actor: Any) -> Exit | None:
        ray = self.ray
        try:
            lines, code, result = self._get(actor.poll.remote())
        except ray.exceptions.GetTimeoutError:
            return Exit(
                index,
                None,
                last_line=self.last_lines.get(index, ""),
                detail=f"its Ray actor did not answer for {ANSWER_SECONDS:g} s",
            )
        except ray.exceptions.RayError as e:
            return Exit(
                index,
                None,
                last_line=self.last_lines.get(index, ""),
                detail=f"its Ray actor or node died ({_first_line(e)})",
            )
        for line in lines:
            self.say(f"[w{index}] {line}")
            if line.strip():
                self.last_lines[index] = line.strip()
        if code is None:
            return None
        if result is not None:
            self.results[index] = result
        return Exit(
            index,
            code,
            reported=result is not None,
            last_line=self.last_lines.get(index, ""),
        )

    def _kill_others(self, group: _Group, exits: dict[int, Exit]) -> None:
        for index, actor in enumerate(group.actors):
            if index not in exits:
                with contextlib.suppress(Exception):
                    self._get(actor.kill.remote())

    def _stop(self, group: _Group) -> None:
        from ray.util.placement_group import remove_placement_group

        for actor in group.actors:
            with contextlib.suppress(Exception):
                self.ray.get(actor.close.remote(), timeout=10)
            with contextlib.suppress(Exception):
                self.ray.kill(actor)
        with contextlib.suppress(Exception):
            remove_placement_group(group.placement_group)

    def _wait(self, seconds: float) -> bool:
        """Sleep `seconds` unless a signal comes; False if one did."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.signals.stopping:
                return False
            time.sleep(min(0.2, max(end - time.monotonic(), 0)))
        return not self.signals.stopping

    # the end
    def _export(self, group: _Group) -> None:
        """Write export.hf from the last checkpoint, as a single-process `eqtrain
        fit` does at its end (on worker 0's node, where the run directory is)."""
        config = self.config
        run_dir = Path(config.run_dir)
        targets = job.export_targets(config, run_dir)
        trained = any(r.get("trained") for r in self.results.values())
        if not targets or (not trained and all(t.exists() for t in targets.values())):
            return
        actor = group.actors[0]
        env = worker_env(
            self._actor_env(actor), self.env, coordinator="", processes=1, index=0
        )
        for form, target in targets.items():
            argv = export_argv(
                str(run_dir),
                str(target),
                dtype=config.export.dtype,
                ema=config.export.ema,
                merged=form == "merged",
            )
            self._get(actor.start.remote(argv, env, self.cwd))
            ended = None
            while ended is None:
                ended = self._poll(0, actor)
                time.sleep(0.2)
            if ended.code != 0:
                raise LaunchError(
                    f"the run ended, but its export to {target} failed: "
                    f"{ended.describe()}. Write it with `eqtrain export {run_dir} "
                    f"{target} --overwrite`."
                )

    def _result(self, restarts: int) -> LaunchResult:
        report = self.results.get(0) or next(iter(self.results.values()), {})
        stop = report.get("stop_reason") or {}
        reason = StopReason(
            StopKind(stop.get("kind", "max_steps")),
            int(stop.get("step", 0)),
            stop.get("message", ""),
        )
        config, run_dir = self.config, Path(self.config.run_dir)
        export_dir = None
        if config.export.hf is not None and (run_dir / config.export.hf).exists():
            export_dir = run_dir / config.export.hf
        return LaunchResult(
            stop_reason=reason,
            metrics=dict(report.get("metrics") or {}),
            run_dir=run_dir,
            export_dir=export_dir,
            config=config,
            restarts=restarts,
            resumed_from=report.get("resumed_from"),
        )

    def _failed(self, failed: Exit, restarts: int) -> LaunchError:
        note = job.last_checkpoint_note(self.config.run_dir)
        if failed.code == EXIT_USAGE:
            why = "a config or file error, which a restart would repeat"
        else:
            why = f"after {restarts} restart(s) (distributed.max_restarts = "
            why += f"{self.plan.max_restarts})"
        return LaunchError(f"the run failed: {failed.describe()}; {why}. {note}")

    def _stopped(self, failed: Exit | None) -> LaunchError:
        note = job.last_checkpoint_note(self.config.run_dir)
        if self.signals.aborting:
            what = "aborted by a second signal while the workers were stopping"
        elif failed is not None:
            what = f"stopped by a signal, but {failed.describe()}"
        else:
            what = "stopped by a signal"
        return LaunchError(f"the run was {what}. {note}")


def _actor_options(bundle: Mapping[str, float]) -> dict[str, Any]:
    """Ray's actor options that hold `bundle` (CPU, GPU and custom resources)."""
    options: dict[str, Any] = {
        "num_cpus": bundle.get("CPU", 0),
        "num_gpus": bundle.get("GPU", 0),
    }
    rest = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
    if "memory" in rest:
        options["memory"] = rest.pop("memory")
    if rest:
        options["resources"] = rest
    return options


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:200]
