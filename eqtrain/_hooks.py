"""Hooks are plain callables `hook(info: StepInfo) -> None`. This module holds what
they receive (`StepInfo`), why a run stopped (`StopReason`), and the schedules that say
when a hook runs (`every`, `at`, `every_seconds`, `at_end`).
"""

import dataclasses
import enum
import time
from collections.abc import Callable, Iterable
from typing import Any

from ._errors import ConfigError, EqtrainError


class StopKind(enum.StrEnum):
    """Why `fit` stopped. A `str` enum: `kind == "max_steps"` works."""

    MAX_STEPS = "max_steps"
    TIME_LIMIT = "time_limit"
    KILL_SWITCH = "kill_switch"
    SIGNAL = "signal"
    NONFINITE = "nonfinite"
    HOOK = "hook"
    DATA_EXHAUSTED = "data_exhausted"
    ERROR = "error"
    """An exception ended the run. Only in the checkpoint `fit` saves on the way
    out; `fit` then re-raises the exception, so no `FitResult` carries it."""


@dataclasses.dataclass(frozen=True)
class StopReason:
    """Why and when `fit` stopped.

    Attributes:
        kind: one of `StopKind` (`"max_steps"`, `"time_limit"`, `"kill_switch"`,
            `"signal"`, `"nonfinite"`, `"hook"`, `"data_exhausted"`; `"error"`
            only in a checkpoint saved while an exception ended the run).
        step: the completed step at which the decision was taken.
        message: a human-readable detail (which signal, which file, the hook's
            message).
    """

    kind: StopKind
    step: int
    message: str = ""

    def __str__(self) -> str:
        detail = f": {self.message}" if self.message else ""
        return f"{self.kind.value} at step {self.step}{detail}"


class StateUnavailableError(EqtrainError, AttributeError):
    """A metrics-only hook asked for `info.state` (see `StepInfo.state`)."""


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What a hook receives after a completed step.

    Attributes:
        step: number of completed steps, **1-based**: after the first step of a
            fresh run `step == 1`; it equals `int(info.state.step)` (except after
            a non-finite step under `nonfinite="stop"`, where the state is the
            last finite one and is not advanced).
        metrics: host metrics of that step (Python floats): the step's own
            (`loss`, `grad_norm`, ...) and, on evaluation steps, `eval/...`.
        num_steps: the step count at which `fit` will stop (for ETAs).
        step_time: seconds between the completion of the previous step and this
            one (the first step includes compilation).
        data_time: seconds the loop waited for this step's batch.
        tokens: tokens in this step's batch, or `None` when the batch has no
            `tokens`/`input_ids` entry.
        tokens_per_second: `tokens / step_time`, or `None`.
        tokens_seen: tokens trained on so far (including `fit(tokens_seen=...)`
            from before a resume), or `None` when batches have no tokens.
        mfu: model FLOPs utilisation, `tokens_per_second * flops_per_token /
            peak_flops`, when `fit` was given both; else `None`.
        elapsed: seconds since `fit` started.
        stop_reason: set only for the final call (`at_end` hooks and the
            checkpointer's final save).
        hook_states: set only in what the checkpointer's `save` receives: the
            state (`state_dict()`, plain JSON) of each hook that keeps one, by
            its `state_key`, as of this step (see `fit(hook_states=...)`).
    """

    step: int
    metrics: dict[str, Any]
    num_steps: int
    step_time: float = 0.0
    data_time: float = 0.0
    tokens: int | None = None
    tokens_per_second: float | None = None
    tokens_seen: int | None = None
    mfu: float | None = None
    elapsed: float = 0.0
    stop_reason: StopReason | None = None
    hook_states: dict[str, dict[str, Any]] | None = None
    _state: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def state(self) -> Any:
        """The `TrainState` after this step (device arrays; reading them waits).

        Available to hooks that declare `uses_state = True` (`@eqtrain.uses_state`,
        or `every(n, hook, uses_state=True)`), and at the end. Other hooks run
        late, after later steps were dispatched and this state's buffers donated
        to them, so they cannot see it.
        """
        if self._state is None:
            raise StateUnavailableError(
                f"`info.state` is not available to this hook at step {self.step}: "
                "hooks read metrics only, and run after the next step was "
                "dispatched, unless they declare `uses_state = True`. Decorate it "
                "with `@eqtrain.uses_state`, set `uses_state = True` on its class, "
                "or schedule it with `every(n, hook, uses_state=True)`; it then "
                "runs on the exact state of its step."
            )
        return self._state

    @property
    def has_state(self) -> bool:
        return self._state is not None


Hook = Callable[[StepInfo], Any]


def declares_state(hook: Any) -> bool:
    """Whether `hook` declared that it needs `info.state` (its `uses_state`
    attribute; default False: hooks read metrics only)."""
    return bool(getattr(hook, "uses_state", False))


def uses_state(hook: Hook) -> Hook:
    """Declare that `hook` reads `info.state` or must act at its exact step.

        @eqtrain.uses_state
        def save_samples(info):
            generate(info.state.model)

    The loop then waits for each step the hook is due at before dispatching the
    next one, so the hook sees that step's exact state, and a `StopTraining` it
    raises stops the run at that very step. That wait costs a little on short
    steps (see docs/performance.md); schedule such a hook sparsely
    (`every(n, hook)`). Without the declaration a hook reads metrics only and
    runs late, never making the loop wait.

    Sets `hook.uses_state = True` and returns `hook` (for a callable object,
    define the class attribute `uses_state = True` instead)."""
    hook.uses_state = True  # type: ignore[attr-defined]
    return hook


def metrics_only(hook: Hook) -> Hook:
    """Declare that `hook` reads only `info.metrics` (and the other numbers of
    `StepInfo`), never `info.state`. That is the default for hooks without a
    `uses_state` attribute; this undoes `uses_state` (e.g. on an instance of a
    class that sets it).

    Sets `hook.uses_state = False` and returns `hook`."""
    hook.uses_state = False  # type: ignore[attr-defined]
    return hook


@dataclasses.dataclass
class Scheduled:
    """A hook with a schedule. Build it with `every`, `at`, `every_seconds`, `at_end`.

    `fit` asks `due(step, now)` once per completed step, before dispatching the
    next one; a hook due at a step that uses the state makes the loop wait for that
    step before going on (only then), so the hook sees the exact state.
    """

    hook: Hook
    when: str  # "every" | "at" | "seconds" | "end"
    n: int = 1
    steps: frozenset[int] = frozenset()
    seconds: float = 0.0
    uses_state: bool = True
    _last: float | None = None

    def due(self, step: int, now: float) -> bool:
        if self.when == "every":
            return step % self.n == 0
        if self.when == "at":
            return step in self.steps
        if self.when == "seconds":
            if self._last is None:
                self._last = now
                return False
            if now - self._last >= self.seconds:
                self._last = now
                return True
        return False

    def start(self, now: float) -> None:
        """Reset clocks at the start of `fit`."""
        self._last = now

    def __call__(self, info: StepInfo) -> Any:
        return self.hook(info)

    def close(self) -> None:
        close = getattr(self.hook, "close", None)
        if callable(close):
            close()


def _flag(hook: Hook, given: bool | None) -> bool:
    return declares_state(hook) if given is None else given


def every(n: int, hook: Hook, *, uses_state: bool | None = None) -> Scheduled:
    """Run `hook` after every `n`-th step (steps n, 2n, ...).

    Args:
        n: period in steps, >= 1.
        hook: the callable.
        uses_state: override the hook's own `uses_state` attribute (default
            False: the hook reads metrics, runs late and never makes the loop
            wait). True: the hook gets the exact `info.state`, its
            `StopTraining` stops at its step, and the loop waits for the device
            at its steps (see `uses_state`).
    """
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"`every(n, ...)` needs an int n >= 1; got {n!r}.")
    return Scheduled(hook, "every", n=n, uses_state=_flag(hook, uses_state))


def at(
    steps: Iterable[int], hook: Hook, *, uses_state: bool | None = None
) -> Scheduled:
    """Run `hook` after each of the given (1-based) steps."""
    chosen = frozenset(int(s) for s in steps)
    if any(s < 1 for s in chosen):
        raise ConfigError(f"`at(steps, ...)`: steps are 1-based; got {sorted(chosen)}.")
    return Scheduled(hook, "at", steps=chosen, uses_state=_flag(hook, uses_state))


def every_seconds(
    seconds: float | int, hook: Hook, *, uses_state: bool | None = None
) -> Scheduled:
    """Run `hook` after the first step completed once `seconds` have passed since
    its last run (or since `fit` started)."""
    if not seconds > 0:
        raise ConfigError(f"`every_seconds` needs seconds > 0; got {seconds!r}.")
    return Scheduled(
        hook, "seconds", seconds=float(seconds), uses_state=_flag(hook, uses_state)
    )


def at_end(hook: Hook) -> Scheduled:
    """Run `hook` once when `fit` stops, whatever the reason, with the final state
    and `info.stop_reason` set."""
    return Scheduled(hook, "end", uses_state=True)


def as_scheduled(hook: Hook | Scheduled) -> Scheduled:
    """A plain callable runs after every step."""
    if isinstance(hook, Scheduled):
        return hook
    if not callable(hook):
        raise ConfigError(f"a hook must be callable `hook(info)`; got {hook!r}.")
    return every(1, hook)


def now() -> float:
    return time.perf_counter()
