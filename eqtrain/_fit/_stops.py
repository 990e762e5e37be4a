"""Every way a run can end, as one `StopReason`: the step count, running out of data,
a wall-clock limit, a kill-switch file, SIGINT/SIGTERM, a non-finite loss and a hook's
request. `Stopper.check(done)` is the one question `fit` asks after every step; in a
multi-process run the answer is agreed by all processes."""

import contextlib
import dataclasses
import os
import signal
import sys
import warnings
from typing import Any

import jax

from .._errors import ConfigError
from .._hooks import StopKind, StopReason, now
from . import _signals


@dataclasses.dataclass(frozen=True)
class StopConditions:
    """When `fit` stops besides reaching `num_steps` or running out of data.

    Attributes:
        time_limit: stop after this many seconds of wall-clock time.
        kill_switch: stop when this file exists (checked after every step).
        handle_signals: make the first SIGINT/SIGTERM a clean stop (the current
            step finishes, the final checkpoint and end hooks run); a second one
            ends the process at once with exit code 128 + the signal's number,
            whatever it was doing (see `eqtrain._signals`: no exception is raised
            into the interrupted code). Previous handlers are restored on exit.
            Only in the main thread.
        agree_every: in a multi-process run, how often (in steps) the processes
            pool their stop requests, so that all stop at the same step and save
            once. Each agreement waits for the current step. Unused with one
            process.
    """

    time_limit: float | int | None = None
    kill_switch: str | os.PathLike[str] | None = None
    handle_signals: bool = True
    agree_every: int = 10

    def __post_init__(self) -> None:
        if self.time_limit is not None and not self.time_limit > 0:
            raise ConfigError(
                f"`time_limit` must be > 0 seconds; got {self.time_limit!r}."
            )
        if not isinstance(self.agree_every, int) or self.agree_every < 1:
            raise ConfigError(
                f"`agree_every` must be an int >= 1; got {self.agree_every!r}."
            )


# Stop kinds pooled across processes, in increasing precedence.
_AGREED = (
    StopKind.HOOK,
    StopKind.KILL_SWITCH,
    StopKind.TIME_LIMIT,
    StopKind.SIGNAL,
    StopKind.NONFINITE,
)


class Stopper:
    """The stop decision of one `fit` call (a context manager: it holds the signal
    handlers while the loop runs)."""

    def __init__(self, conditions: StopConditions, num_steps: int, *, first: int = 0):
        self.conditions = conditions
        self.num_steps, self.first = num_steps, first
        self.kill_switch = (
            None
            if conditions.kill_switch is None
            else os.fspath(conditions.kill_switch)
        )
        self.processes = jax.process_count()
        self._guard = contextlib.ExitStack()
        self.signals: _signals.SignalGuard | None = None
        self.announced = False  # the first signal's notice was printed
        self.checked = first  # the steps done at the last `check`
        self.start = now()
        self.hook_stop: StopReason | None = None
        self.warned_late = False
        self.nonfinite_at: int | None = None

    def __enter__(self) -> "Stopper":
        handle = self.conditions.handle_signals
        self.signals = self._guard.enter_context(_signals.guarded(handle))
        if self.signals is not None:
            self.signals.first_note = self._notice
        self.start = now()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.signals is not None:
            self.signals.first_note = None
        self._guard.close()

    # -- what the loop reports --------------------------------------------------
    def hook_requested(self, step: int, message: str) -> None:
        """A hook raised `StopTraining` after `step` (the first request wins)."""
        if self.hook_stop is None:
            self.hook_stop = StopReason(StopKind.HOOK, step, message)

    def saw_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """Steps built with `nonfinite="stop"` report `halted` once the state froze."""
        if metrics.get("halted") and self.nonfinite_at is None:
            self.nonfinite_at = step

    @property
    def frozen(self) -> bool:
        return self.nonfinite_at is not None

    # -- the decision -----------------------------------------------------------
    def check(self, done: int) -> StopReason | None:
        """The reason to stop after `done` steps, agreed by all processes: a local
        reason (a signal, the kill switch, the time limit, a hook, a non-finite
        loss) is pooled every `agree_every` steps, so every process stops at the
        same step (and before the first step); reaching `num_steps` needs no
        agreement."""
        self.checked = done
        reason = self._local(done)
        if self.processes == 1 or (
            reason is not None and reason.kind == StopKind.MAX_STEPS
        ):
            return reason
        if done % self.conditions.agree_every and done != self.first:
            # local reasons persist until the next agreement; the first check
            # agrees too (a hook's restored state may end the run before it trains)
            return None
        from ..distributed import agree

        code = 0 if reason is None else _AGREED.index(reason.kind) + 1
        agreed = int(agree([code])[0])
        if agreed == 0:
            return None
        kind = _AGREED[agreed - 1]
        if reason is not None and reason.kind == kind:
            return reason
        return StopReason(kind, done, f"{kind} on another process")

    def final(self, reason: StopReason, done: int) -> StopReason:
        """The reason the run ended, once the last metrics are read: a non-finite
        step seen only then still explains the end (the state froze there)."""
        frozen = self.check(done)  # every process asks: it may be a collective
        if frozen is not None and frozen.kind == StopKind.NONFINITE:
            return frozen
        return reason

    def _hook_stop(self, done: int) -> StopReason:
        """A hook asked to stop after `hook_stop.step`; a hook that runs late (no
        `uses_state`) asked once later steps were already dispatched."""
        assert self.hook_stop is not None
        asked = self.hook_stop.step
        if done > asked and not self.warned_late:
            self.warned_late = True
            warnings.warn(
                f"a hook raised StopTraining after step {asked}, but ran late (it "
                f"does not declare `uses_state = True`), so the run stops at step "
                f"{done}. Decorate the hook with `@eqtrain.uses_state` (or schedule "
                "it with `uses_state=True`) to stop at the exact step.",
                stacklevel=1,
            )
        return dataclasses.replace(self.hook_stop, step=done)

    def _local(self, done: int) -> StopReason | None:
        """This process's reason to stop, the first of `_LOCAL` that holds."""
        for reason_after in self._LOCAL:
            reason = reason_after(self, done)
            if reason is not None:
                return reason
        return None

    def _nonfinite(self, done: int) -> StopReason | None:
        if self.nonfinite_at is None:
            return None
        return StopReason(
            StopKind.NONFINITE,
            self.nonfinite_at,
            f"non-finite loss or gradients at step {self.nonfinite_at}; the "
            "returned state is the last finite one",
        )

    def _hook(self, done: int) -> StopReason | None:
        return None if self.hook_stop is None else self._hook_stop(done)

    def _signal(self, done: int) -> StopReason | None:
        if self.signals is None or self.signals.received is None:
            return None
        name = signal.Signals(self.signals.received).name
        self._announce(name, done)
        return StopReason(StopKind.SIGNAL, done, name)

    def _notice_text(self, name: str, done: int) -> str:
        when = "after the current step" if done > self.first else "before training"
        return (
            f"[eqtrain] {name} received: stopping {when} (send it again to "
            "abort without saving)."
        )

    def _notice(self, sig: int) -> str | None:
        """The notice, said by the signal guard's watchdog the moment the first
        signal comes (a GRPO step may run for seconds), with `os.write`:
        never Python's stream, which the signal may have interrupted (a second
        Ctrl-C during compilation once crashed a handler that printed)."""
        if self.announced:
            return None
        self.announced = True
        return self._notice_text(signal.Signals(sig).name, self.checked)

    def _announce(self, name: str, done: int) -> None:
        """Say once that the first signal was heard, if the guard's watchdog
        did not (a guard installed elsewhere)."""
        if self.announced:
            return
        self.announced = True
        print("\n" + self._notice_text(name, done), file=sys.stderr, flush=True)

    def _max_steps(self, done: int) -> StopReason | None:
        if done < self.num_steps:
            return None
        return StopReason(StopKind.MAX_STEPS, done, f"reached {self.num_steps} steps")

    def _time_limit(self, done: int) -> StopReason | None:
        limit = self.conditions.time_limit
        if limit is None or now() - self.start < limit:
            return None
        return StopReason(
            StopKind.TIME_LIMIT, done, f"time limit of {limit:g}s reached"
        )

    def _kill_switch(self, done: int) -> StopReason | None:
        if self.kill_switch is None or not os.path.exists(self.kill_switch):
            return None
        return StopReason(StopKind.KILL_SWITCH, done, f"found {self.kill_switch}")

    # the local stop reasons, in order of precedence
    _LOCAL = (_nonfinite, _hook, _signal, _max_steps, _time_limit, _kill_switch)
