"""The supervisor: place the workers, run their `eqtrain fit` processes as one JAX
group, stream their output, and restart the whole group from the last complete
checkpoint when one of them fails (`_plan.decide` says when)."""

import contextlib
import dataclasses
import os
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .. import job
from ..config import Config, to_toml
from ._connect import resources
from ._plan import (
    EXIT_USAGE,
    Exit,
    Plan,
    decide,
    export_argv,
    restart_delay,
    worker_args,
    worker_env,
)
from ._result import LaunchError, LaunchResult, launch_result
from ._signals import Signals
from ._worker import Worker


ANSWER_SECONDS = 60.0  # a live actor answers a poll at once; this long: it is gone
PLACING_NOTE_SECONDS = 30.0  # how often to say what placing the workers waits for


@dataclasses.dataclass
class Group:
    """The placement group and its actors (one per worker), and the current
    attempt's worker PIDs and coordinator address."""

    placement_group: Any
    actors: list[Any]
    pids: list[int] = dataclasses.field(default_factory=list)
    coordinator: str = ""


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


def _first_failed(exits: list[Exit]) -> Exit | None:
    return next((e for e in exits if not e.clean), None)


class Supervisor:
    """Runs attempts of the whole group until one ends cleanly, a signal stops
    it, or a failure cannot (or may no more) be mended by a restart."""

    def __init__(
        self,
        ray: Any,
        plan: Plan,
        config: Config,
        say: Callable[[str], None],
        env: dict[str, str],
        signals: Signals,
    ):
        self.ray, self.plan, self.config, self.say = ray, plan, config, say
        self.env, self.signals = env, signals
        self.config_text = to_toml(config)
        self.cwd = os.getcwd()
        self.ports: list[int] = []
        self.last_lines: dict[int, str] = {}
        self.results: dict[int, dict[str, Any]] = {}

    def run(self, *, resume: str | None, overwrite: bool) -> LaunchResult:
        """Place the group and run attempts: the first with the caller's
        `--resume`/`--overwrite`, restarts with `--resume auto`."""
        restarts, group = 0, None
        try:
            while True:
                restart = restarts > 0
                args = worker_args(resume=resume, overwrite=overwrite, restart=restart)
                group = group or self._place()
                exits = self._attempt(group, args)
                if self._outcome(exits, restarts) == "done":
                    return launch_result(self.config, self.results, restarts)
                group = self._regroup(group, exits)
                restarts += 1
                self._before_restart(restarts, exits)
        finally:
            if group is not None:
                self._stop(group)

    # -- after an attempt ------------------------------------------------------
    def _outcome(self, exits: list[Exit], restarts: int) -> str:
        """`decide`'s verdict: `"done"` or `"restart"`; else a `LaunchError`."""
        outcome = decide(
            exits,
            stopping=self.signals.stopping,
            restarts=restarts,
            limit=self.plan.max_restarts,
        )
        failed = _first_failed(exits)
        if outcome == "stopped":
            raise self._stopped(failed)
        if outcome == "fail":
            assert failed is not None
            raise self._failed(failed, restarts)
        return outcome

    def _regroup(self, group: Group, exits: list[Exit]) -> Group | None:
        """The group to run again; None (placed anew) if an actor or node died."""
        if any(e.code is None for e in exits):
            self._stop(group)
            return None
        return group

    def _before_restart(self, restarts: int, exits: list[Exit]) -> None:
        """Say why, and wait before restart number `restarts` (unless a signal
        comes: then the run is stopped)."""
        failed = _first_failed(exits)
        assert failed is not None
        delay = restart_delay(restarts, self.plan.restart_delay)
        self.say(
            f"[ray] {failed.describe()}. Restarting the whole group from "
            f"the last complete checkpoint in {delay:g} s (restart "
            f"{restarts} of at most {self.plan.max_restarts})."
        )
        if not self._wait(delay):
            raise self._stopped(failed)

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

    def _wait(self, seconds: float) -> bool:
        """Sleep `seconds` unless a signal comes; False if one did."""
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.signals.stopping:
                return False
            time.sleep(min(0.2, max(end - time.monotonic(), 0)))
        return not self.signals.stopping

    # -- one attempt -----------------------------------------------------------
    def _attempt(self, group: Group, args: list[str]) -> list[Exit]:
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

    def _place(self) -> Group:
        """A placement group and one actor per worker in it."""
        from ray.util.placement_group import placement_group

        pg = placement_group(self.plan.bundles, strategy=self.plan.strategy)
        group = Group(pg, [])
        try:
            self._wait_placed(pg)
            group.actors.extend(self._actors(pg))
        except BaseException:
            self._stop(group)
            raise
        return group

    def _actors(self, pg: Any) -> list[Any]:
        """One `Worker` actor in each bundle of the placement group `pg`."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote = self.ray.remote(Worker)
        options = _actor_options(self.plan.bundle)
        actors = []
        for index in range(self.plan.processes):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index
            )
            actor = remote.options(scheduling_strategy=strategy, **options)
            actors.append(actor.remote(index))
        return actors

    def _wait_placed(self, pg: Any) -> None:
        started = noted = time.monotonic()
        while not self.ray.wait([pg.ready()], timeout=1.0)[0]:
            if self.signals.stopping:
                raise LaunchError(
                    "stopped by a signal while waiting for the cluster to place "
                    "the workers; nothing was started."
                )
            if time.monotonic() - noted > PLACING_NOTE_SECONDS:
                noted = time.monotonic()
                self.say(self._placing_note(noted - started))

    def _placing_note(self, waited: float) -> str:
        plan = self.plan
        return (
            f"[ray] waiting {waited:.0f} s for the cluster to place "
            f"{plan.processes} workers with {resources(plan.bundle)} each "
            f"({plan.strategy}); available now: "
            f"{resources(self.ray.available_resources())}"
        )

    def _start(self, group: Group, args: list[str]) -> None:
        """Each worker's `eqtrain fit`, joined at a new coordinator port."""
        group.coordinator = self._get(group.actors[0].address.remote(self.ports))
        self.ports.append(int(group.coordinator.rpartition(":")[2]))
        group.pids = []
        for index, actor in enumerate(group.actors):
            env = self._worker_env(actor, index, group.coordinator)
            start = actor.start_fit.remote(self.config_text, args, env, self.cwd)
            group.pids.append(self._get(start))
        processes = self.plan.processes
        where = f" (coordinator {group.coordinator})" if processes > 1 else ""
        pids = ", ".join(f"worker {i}: pid {p}" for i, p in enumerate(group.pids))
        self.say(f"[ray] started {processes} worker(s){where}: {pids}")

    def _worker_env(
        self, actor: Any, index: int, coordinator: str = ""
    ) -> dict[str, str]:
        """Worker `index`'s environment: its actor's, the caller's, `EQTRAIN_*`
        (none without a `coordinator`: the final export runs alone)."""
        processes = self.plan.processes if coordinator else 1
        return worker_env(
            self._get(actor.environ.remote()),
            self.env,
            coordinator=coordinator,
            processes=processes,
            index=index,
        )

    def _get(self, ref: Any) -> Any:
        return self.ray.get(ref, timeout=ANSWER_SECONDS)

    # -- watching --------------------------------------------------------------
    def _watch(self, group: Group) -> list[Exit]:
        """Stream every worker's output until all have ended, or until one fails
        (then the others are killed: a JAX group cannot lose a member)."""
        exits: dict[int, Exit] = {}
        while len(exits) < len(group.actors):
            self._forward_signals(group, exits)
            self._poll_all(group, exits)
            failed = [e for e in exits.values() if not e.clean]
            if failed:
                self._kill_others(group, exits)
                return [*failed, *(e for e in exits.values() if e.clean)]
            time.sleep(0.2)
        return list(exits.values())

    def _running(self, group: Group, exits: dict[int, Exit]) -> list[tuple[int, Any]]:
        return [(i, a) for i, a in enumerate(group.actors) if i not in exits]

    def _forward_signals(self, group: Group, exits: dict[int, Exit]) -> None:
        """Pass the driver's signals on to the workers still running."""
        for _ in self.signals.pending():
            for _, actor in self._running(group, exits):
                if self.signals.aborting:  # a second SIGTERM could merge with
                    actor.kill.remote()  # the first in a busy process: kill
                else:  # `eqtrain fit` saves and stops on it, agreed by all
                    actor.send.remote(int(signal.SIGTERM))

    def _poll_all(self, group: Group, exits: dict[int, Exit]) -> None:
        for index, actor in self._running(group, exits):
            ended = self._poll(index, actor)
            if ended is not None:
                exits[index] = ended

    def _poll(self, index: int, actor: Any) -> Exit | None:
        """Say worker `index`'s new lines; its `Exit` once it has ended."""
        errors = self.ray.exceptions
        try:
            lines, code, result = self._get(actor.poll.remote())
        except errors.GetTimeoutError:
            why = f"its Ray actor did not answer for {ANSWER_SECONDS:g} s"
            return self._lost(index, why)
        except errors.RayError as e:
            return self._lost(index, f"its Ray actor or node died ({_first_line(e)})")
        self._echo(index, lines)
        if code is None:
            return None
        if result is not None:
            self.results[index] = result
        last = self.last_lines.get(index, "")
        return Exit(index, code, reported=result is not None, last_line=last)

    def _lost(self, index: int, detail: str) -> Exit:
        """Worker `index`'s actor is gone (`detail` says how)."""
        last = self.last_lines.get(index, "")
        return Exit(index, None, last_line=last, detail=detail)

    def _echo(self, index: int, lines: list[str]) -> None:
        for line in lines:
            self.say(f"[w{index}] {line}")
            if line.strip():
                self.last_lines[index] = line.strip()

    def _kill_others(self, group: Group, exits: dict[int, Exit]) -> None:
        for _, actor in self._running(group, exits):
            with contextlib.suppress(Exception):
                self._get(actor.kill.remote())

    def _stop(self, group: Group) -> None:
        from ray.util.placement_group import remove_placement_group

        for actor in group.actors:
            with contextlib.suppress(Exception):
                self.ray.get(actor.close.remote(), timeout=10)
            with contextlib.suppress(Exception):
                self.ray.kill(actor)
        with contextlib.suppress(Exception):
            remove_placement_group(group.placement_group)

    # -- the end ---------------------------------------------------------------
    def _exports_due(self) -> dict[str, Path]:
        """export.hf's targets, unless nothing was trained and all exist."""
        targets = job.export_targets(self.config, Path(self.config.run_dir))
        trained = any(r.get("trained") for r in self.results.values())
        if not trained and all(t.exists() for t in targets.values()):
            return {}
        return targets

    def _export(self, group: Group) -> None:
        """Write export.hf from the last checkpoint, as a single-process `eqtrain
        fit` does at its end (on worker 0's node, where the run directory is)."""
        targets = self._exports_due()
        if not targets:
            return
        actor = group.actors[0]
        env = self._worker_env(actor, 0)
        for form, target in targets.items():
            argv = export_argv(
                str(Path(self.config.run_dir)),
                str(target),
                dtype=self.config.export.dtype,
                ema=self.config.export.ema,
                merged=form == "merged",
            )
            self._get(actor.start.remote(argv, env, self.cwd))
            self._check_exported(self._run_to_end(actor), target)

    def _run_to_end(self, actor: Any) -> Exit:
        ended = None
        while ended is None:
            ended = self._poll(0, actor)
            time.sleep(0.2)
        return ended

    def _check_exported(self, ended: Exit, target: Path) -> None:
        if ended.code != 0:
            run_dir = Path(self.config.run_dir)
            raise LaunchError(
                f"the run ended, but its export to {target} failed: "
                f"{ended.describe()}. Write it with `eqtrain export {run_dir} "
                f"{target} --overwrite`."
            )
