"""`fit`: the one impure loop. It feeds batches to a compiled step, keeps the host one
step ahead of the device, reads metrics in batches, runs hooks, evaluations and
checkpoints, and ends on a `StopReason` (see `_stops.py` for every way a run ends).
Its neighbours: `_reading` (metrics off the device), `_evaluation`, `_checkpointer`
and `_failures` (an exception on the way out), `_fit_keywords` (the old flat keywords).
"""

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

from .._errors import ConfigError, StopTraining
from .._hooks import Hook, Scheduled, StepInfo, StopKind, StopReason, as_scheduled, now
from .._jit import Jitted, check_live, jit
from .._state import TrainState
from .._types import Batch
from . import _hook_states
from ._checkpointer import (
    CheckpointerProtocol as CheckpointerProtocol,
    CheckpointFailed,
    GuardedCheckpointer,
    close_checkpointer,
)
from ._evaluation import (
    Evaluation as Evaluation,
    compiled_eval,
    evaluate as evaluate,
)
from ._failures import FailedAt, failed_at as failed_at, first_line, say, say_ended
from ._fit_keywords import regroup
from ._reading import Pending, Reading, Throughput, count_tokens, to_host as _to_host
from ._stops import StopConditions, Stopper


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What `fit` returns.

    Attributes:
        state: the final `TrainState`.
        stop_reason: why the loop stopped.
        history: one dict per completed step: `{"step": k, **metrics}`, with
            `eval/...` entries on evaluation steps (oldest dropped beyond
            `Reading(history=N)`).
    """

    state: TrainState
    stop_reason: StopReason
    history: list[dict[str, Any]]

    @property
    def metrics(self) -> dict[str, Any]:
        """The last completed step's metrics (empty if no step ran)."""
        return self.history[-1] if self.history else {}


_END = object()


class _Run:
    """One `fit` call's moving parts: the compiled step and the work between steps
    (reading metrics, evaluating, hooks, checkpoints). `loop` is the loop itself."""

    def __init__(
        self,
        step: Jitted,
        hooks: Sequence[Scheduled],
        evaluation: Evaluation | None,
        checkpointer: GuardedCheckpointer | None,
        stopper: Stopper,
        reading: Reading,
        throughput: Throughput,
        stateful: dict[str, Any],
    ):
        self.step, self.stopper, self.throughput = step, stopper, throughput
        self.stateful = stateful  # the hooks that keep state, by key
        self.hooks, self.reading, self.checkpointer = hooks, reading, checkpointer
        self.loop_hooks = [h for h in hooks if h.when != "end"]
        self.end_hooks = [h for h in hooks if h.when == "end"]
        self.evaluation = evaluation
        self.evaluator = None if evaluation is None else compiled_eval(evaluation.step)
        self.history: list[dict[str, Any]] = []
        self.last_eval_step: int | None = None
        self.arrays: list[Any] = []  # the latest dispatched state's arrays
        self.first = 0  # the step the run started at
        self.done = 0  # steps dispatched (the latest state's step)
        self.finished = 0  # the last step whose results were read (so it ran)
        self.unread: list[Pending] = []  # dispatched steps not read yet
        self.dispatching: int | None = None  # the step being dispatched
        self.saved: int | None = None  # the last step handed to the checkpointer

    def run(
        self, arrays: list[Any], layout: Any, data: Iterable[Batch]
    ) -> tuple[TrainState, StopReason]:
        """The loop, then the end (`finish`); on an exception (a `KeyboardInterrupt`
        too), the latest intact state is saved before it propagates. Hooks and
        checkpointer are closed."""
        for hook in self.hooks:
            hook.start(self.stopper.start)
        failed = True  # until the run got through `finish`
        try:
            self.stop_if_ended()
            reason = self.loop(arrays, layout, data)
            final = layout.rebuild(self.arrays)
            self.finish(final, reason)
            failed = False
        except (Exception, KeyboardInterrupt) as error:
            self.ended_by(error, layout)
            if isinstance(error, CheckpointFailed):
                raise error.__cause__ from None  # type: ignore[misc]
            raise
        finally:
            self.close(quietly=failed)
        return final, reason

    def stop_if_ended(self) -> None:
        """A hook whose restored state says it ended this run (an early stop)
        stops it before the first step: nothing is trained on."""
        found = _hook_states.ended(self.stateful)
        if found is None:
            return
        key, message = found
        say(
            f"[eqtrain] not training: {message} (the hook {key}, from its saved "
            "state). Give `fit` the hook without that state to train on."
        )
        self.stopper.hook_requested(self.first, message)

    def close(self, *, quietly: bool) -> None:
        for hook in self.hooks:
            hook.close()
        if self.checkpointer is not None:
            close_checkpointer(self.checkpointer, quietly=quietly)

    # -- the loop ---------------------------------------------------------------
    def loop(self, arrays: list[Any], layout: Any, data: Iterable[Batch]) -> StopReason:
        """Dispatch steps until a stop reason holds; returns it. `self.arrays`
        holds the latest state's arrays throughout."""
        self.arrays, batches, self.unread = arrays, iter(data), []
        while (reason := self.stopper.check(self.done)) is None:
            waited = now()
            batch = next(batches, _END)
            if batch is _END:
                reason = StopReason(
                    StopKind.DATA_EXHAUSTED, self.done, "the data iterable ran out"
                )
                break
            self.unread.append(self.dispatch(batch, waited))
            self.read_some(layout)
        if self.unread:
            self.read(self.unread, layout.rebuild(self.arrays))
            self.unread = []
        return self.stopper.final(reason, self.done)

    def dispatch(self, batch: Batch, waited: float) -> Pending:
        """Dispatch the next step on `batch`, without waiting for it."""
        dispatched = now()
        self.dispatching = self.done + 1
        self.arrays, metrics = self.step.call_flat(self.arrays, batch)
        self.done, self.dispatching = self.done + 1, None
        due = [h for h in self.loop_hooks if h.due(self.done, dispatched)]
        tokens = count_tokens(batch)
        return Pending(self.done, metrics, due, dispatched - waited, tokens, dispatched)

    def read_some(self, layout: Any) -> None:
        """Read the steps due for reading while the latest one runs; wait for the
        latest one only when its state is needed."""
        unread = self.unread
        if self.needs_state(unread[-1]):  # wait for this step: its state is used
            self.read(unread, layout.rebuild(self.arrays))
            self.unread = []
        elif len(unread) > 1 and self.read_due(unread[:-1]):  # while it runs
            self.read(unread[:-1], None)
            self.unread = unread[-1:]

    # -- between steps ----------------------------------------------------------
    def needs_state(self, pending: Pending) -> bool:
        step = pending.step
        return (
            any(h.uses_state for h in pending.due)
            or (self.evaluation is not None and self.evaluation.due(step))
            or (self.checkpointer is not None and self.checkpointer.due(step))
        )

    def read_due(self, unread: list[Pending]) -> bool:
        """Read metrics that are `Reading.every` steps or `Reading.seconds` old."""
        return len(unread) >= self.reading.every or (
            now() - unread[0].dispatched >= self.reading.seconds
        )

    def read(self, pendings: list[Pending], state: TrainState | None) -> None:
        """Read the metrics of `pendings` in one transfer, then run each step's
        evaluation, hooks and checkpoint in order. `state` is the state after the
        last of them (`None` when it was already donated to a later step)."""
        host = _to_host([p.metrics for p in pendings])
        self.finished = pendings[-1].step
        step_time = self.throughput.tick(len(pendings))
        for i, (pending, metrics) in enumerate(zip(pendings, host, strict=True)):
            last = i == len(pendings) - 1
            self.complete(pending, metrics, step_time, state if last else None)
        if state is not None:  # the device idled for this work: don't bill a step
            self.throughput.restart()

    def complete(
        self,
        pending: Pending,
        metrics: dict[str, Any],
        step_time: float,
        state: TrainState | None,
    ) -> None:
        """One read step's evaluation (if due), history row, hooks and checkpoint."""
        self.stopper.saw_metrics(pending.step, metrics)
        if state is not None and self.evaluation and self.evaluation.due(pending.step):
            metrics.update(self.evaluate(state))
            self.last_eval_step = pending.step
        info = self.throughput.info(pending, metrics, step_time, state)
        self.record(info)
        self.run_hooks(pending.due, info)
        if state is not None:
            self.save_if_due(info)

    def save_if_due(self, info: StepInfo) -> None:
        ckpt = self.checkpointer
        if ckpt is not None and not self.stopper.frozen and ckpt.due(info.step):
            ckpt.save(self.with_hook_states(info), final=False)
            self.saved = info.step

    def with_hook_states(self, info: StepInfo) -> StepInfo:
        """`info` for the checkpointer: with the stateful hooks' states, which
        are as of `info.step` (every hook due up to it has run)."""
        states = _hook_states.collect(self.stateful)
        return dataclasses.replace(info, hook_states=states)

    def record(self, info: StepInfo) -> None:
        self.history.append({"step": info.step, **info.metrics})
        limit = self.reading.history
        if limit is not None and len(self.history) > limit:
            del self.history[0]

    def run_hooks(self, hooks: Iterable[Hook], info: StepInfo) -> None:
        for hook in hooks:
            try:
                hook(info)
            except StopTraining as request:
                self.stopper.hook_requested(info.step, request.message)

    def evaluate(self, state: TrainState) -> dict[str, float]:
        assert self.evaluation is not None and self.evaluator is not None
        return evaluate(state, self.evaluator, self.evaluation.data)

    # -- the end ----------------------------------------------------------------
    def finish(self, state: TrainState, reason: StopReason) -> StepInfo:
        """Evaluate at a natural end, save the final checkpoint, then run the end
        hooks (an export or a log that fails at the end loses no training)."""
        info = self.final_info(state, reason)
        if self.checkpointer is not None:
            self.checkpointer.save(self.with_hook_states(info), final=True)
            self.saved = info.step
        self.run_hooks(self.end_hooks, info)
        return info

    def final_info(self, state: TrainState, reason: StopReason) -> StepInfo:
        done = int(jax.device_get(state.step))
        last = self.row_of(done)
        metrics = {k: v for k, v in last.items() if k != "step"} if last else {}
        if self.evaluates_at_end(reason, done):
            evaluated = self.evaluate(state)
            self.last_eval_step = done
            metrics.update(evaluated)
            if last is not None:
                last.update(evaluated)
        return self.throughput.final_info(state, done, metrics, reason)

    def row_of(self, done: int) -> dict[str, Any] | None:
        """The history row of step `done`, the step the state is at, if it is the
        last one: after a non-finite stop, the later (halted) steps' metrics
        describe no state that exists."""
        last = self.history[-1] if self.history else None
        return last if last is not None and last["step"] == done else None

    def evaluates_at_end(self, reason: StopReason, done: int) -> bool:
        """Whether the run ended naturally and wants an evaluation not yet done."""
        natural = reason.kind in (StopKind.MAX_STEPS, StopKind.DATA_EXHAUSTED)
        ev = self.evaluation
        return ev is not None and ev.at_end and natural and self.last_eval_step != done

    # -- an exception ends the run ----------------------------------------------
    def ended_by(self, error: BaseException, layout: Any) -> None:
        """Attach where `error` came from to it, then save what can be saved."""
        where = self.locate_failure()
        with contextlib.suppress(AttributeError, TypeError):  # a frozen type
            error.eqtrain_failed_at = where  # type: ignore[attr-defined]
        self.save_after_error(layout, error, where)

    def locate_failure(self) -> FailedAt:
        """Where the exception ending the run came from: the first dispatched
        step whose results cannot be read, else the step being dispatched."""
        for pending in self.unread:
            try:
                _to_host([pending.metrics])
            except Exception:  # this step failed: its results carry the error
                return FailedAt(pending.step, self.finished)
            self.finished = pending.step
        return FailedAt(self.dispatching, self.finished)

    def save_after_error(
        self, layout: Any, error: BaseException, where: FailedAt
    ) -> None:
        """An exception (or a `KeyboardInterrupt`) is ending the run: save the
        latest state if it is intact and not saved yet, so that no finished step
        is lost; then `fit` re-raises. A note says what became of that state."""
        if not self.may_save(error):
            return
        outcome = self.not_to_save(where)
        if outcome is None:
            outcome = self.try_to_save(layout, error)
        say_ended(error, where, outcome)

    def may_save(self, error: BaseException) -> bool:
        """Whether steps ran since the start or the last save, and may be saved
        (or a note say why not)."""
        if self.checkpointer is None or self.done <= self.first or self.stopper.frozen:
            return False
        if self.saved == self.done:  # e.g. the final save, before an end hook
            return False
        # the checkpointer itself failed: saving again would too (it said why)
        return not isinstance(error, CheckpointFailed)

    def not_to_save(self, where: FailedAt) -> str | None:
        """Why the latest state is not to be saved now, or None to save it."""
        if where.step is not None and where.step <= self.done:
            return "the states from that step on carry the error, so none was saved."
        assert self.checkpointer is not None
        if self.checkpointer.interrupted is not None:
            return (
                f"it came while step {self.checkpointer.interrupted} was being "
                "saved, and that save was not retried (a save cut short is never "
                "read; the earlier checkpoints are intact)."
            )
        return None

    def try_to_save(self, layout: Any, error: BaseException) -> str:
        """Save the latest state; what became of it. Failing to save, or a second
        Ctrl-C during the save, only changes the note: the original error is the
        one that propagates."""
        try:
            self.save_error_state(layout, error)
        except KeyboardInterrupt:  # a second Ctrl-C: give up on this save
            return (
                f"a second interrupt stopped the save of step {self.done}, which "
                "was not retried (the earlier checkpoints are intact)."
            )
        except Exception as failure:  # the original error matters more
            why = f"{type(failure).__name__}: {first_line(failure)}"
            return f"the state of step {self.done} could not be saved ({why})."
        return f"the state of step {self.done} was saved first."

    def save_error_state(self, layout: Any, error: BaseException) -> None:
        """Save the latest state as the final one, its reason the error."""
        assert self.checkpointer is not None
        state = layout.rebuild(self.arrays)
        check_live(state, "the save after an error")
        jax.block_until_ready(state)  # raises if the step itself failed
        detail = f": {error}" if str(error) else ""
        message = f"{type(error).__name__}{detail}"[:500]
        reason = StopReason(StopKind.ERROR, self.done, message)
        info = self.throughput.final_info(state, self.done, {}, reason)
        self.checkpointer.save(self.with_hook_states(info), final=True)
        self.saved = self.done


def fit(
    state: TrainState,
    step: Callable[..., Any] | Jitted,
    data: Iterable[Batch],
    *,
    num_steps: int,
    hooks: Sequence[Hook | Scheduled] = (),
    evaluation: Evaluation | None = None,
    stop: StopConditions | None = None,
    checkpointer: CheckpointerProtocol | None = None,
    reading: Reading | None = None,
    flops_per_token: float | int | None = None,
    peak_flops: float | int | None = None,
    tokens_seen: int = 0,
    hook_states: Mapping[str, Mapping[str, Any]] | None = None,
    **deprecated: Any,
) -> FitResult:
    """Train `state` with `step` on `data` until a stop condition holds.

    The host stays one step ahead of the device: it dispatches step k+1 before it
    reads step k's metrics, so the device never waits for Python between steps.
    Metrics are read in batches, and hooks run for every due step, in order, a
    little late. A hook that uses the state (`uses_state = True`), an evaluation
    or a checkpoint due at step k makes the loop wait for step k before
    dispatching k+1, so they see the exact state of step k.

    When the run stops, for any `StopReason`, `fit` evaluates (at a natural end),
    saves the final checkpoint, then runs the `at_end` hooks. When an exception
    ends it instead (a hook, the data or the step raised, or a `KeyboardInterrupt`
    came), `fit` first saves the latest intact state with the checkpointer, says
    so on the standard error, then re-raises.

    Args:
        state: the initial (or restored) state. With a donating step (the default),
            its arrays are consumed: use `FitResult.state` afterwards.
        step: a step from `train_step`, or the same compiled with `eqtrain.jit`
            (a plain function is compiled with `eqtrain.jit(step)`).
        data: an iterable of batches; running out stops the run
            (`"data_exhausted"`).
        num_steps: the step count at which to stop (absolute: a state restored at
            step 400 with `num_steps=1000` runs 600 more steps).
        hooks: callables `hook(info)`; a plain callable runs after every step, or
            wrap it with `every`, `at`, `every_seconds`, `at_end`. Hooks read
            metrics only unless they declare `uses_state = True` (an attribute, or
            `@eqtrain.uses_state`, or `every(n, hook, uses_state=True)`). Raise
            `StopTraining` from a hook to stop: at its step when it declares
            `uses_state`, else at the next step boundary after it ran.
        evaluation: an `Evaluation` (eval step, data, period, at the end).
        stop: `StopConditions` (time limit, kill switch, signals, multi-process
            agreement).
        checkpointer: see `CheckpointerProtocol` (e.g. an
            `eqtrain.checkpoint.Checkpointer`); saved when due, and once at any stop.
        reading: a `Reading`: how often metrics are read from the device, and
            how many history entries are kept (default: `Reading()`).
        flops_per_token: training FLOPs per token (forward and backward, e.g.
            `eqtrain.models.family(config).flops_per_token(config, seq_len)`);
            with `peak_flops` it gives `StepInfo.mfu`.
        peak_flops: the peak FLOP/s of all devices the step runs on together
            (see `eqtrain.hooks.peak_flops` for known devices).
        tokens_seen: tokens already trained on before this call (a resumed run
            passes its count), the start of `StepInfo.tokens_seen`.
        hook_states: the states of the hooks that keep one (`state_dict()` /
            `load_state_dict(state)`, by `state_key`), as saved with a checkpoint:
            `resume_run(...).hook_states`. Each is loaded into its hook before
            the first step; every save hands the current ones to the
            checkpointer (`StepInfo.hook_states`). A hook whose restored state
            says it ended the run (an early stop) makes `fit` stop before
            training, with a `"hook"` stop reason. None: the hooks as they are.
        **deprecated: the flat keywords of the previous release (`eval_step`,
            `eval_data`, `eval_every`, `eval_at_end`, `time_limit`,
            `kill_switch`, `handle_signals`, `agree_every`, `history`,
            `read_every`, `read_seconds`) still work, with a `DeprecationWarning`.

    Returns:
        A `FitResult` with the final state, the `StopReason` and the history.
    """
    evaluation, stop, reading = regroup(deprecated, evaluation, stop, reading)
    if not isinstance(num_steps, int) or num_steps < 0:
        raise ConfigError(f"`num_steps` must be an int >= 0; got {num_steps!r}.")
    compiled = step if isinstance(step, Jitted) else jit(step)
    scheduled = [as_scheduled(h) for h in hooks]
    stateful = _hook_states.stateful(scheduled)
    if hook_states is not None:
        _hook_states.load(stateful, hook_states)
    _hook_states.collect(stateful)  # a state that is not plain JSON fails here
    check_live(state, "`fit`")
    first = int(jax.device_get(state.step))
    arrays, layout = compiled.prepare(state)
    guarded = None if checkpointer is None else GuardedCheckpointer(checkpointer)
    throughput = Throughput(flops_per_token, peak_flops, tokens_seen, num_steps)
    with Stopper(stop, num_steps, first=first) as stopper:
        run = _Run(
            compiled,
            scheduled,
            evaluation,
            guarded,
            stopper,
            reading,
            throughput,
            stateful,
        )
        run.first = run.done = run.finished = first
        final, reason = run.run(arrays, layout, data)
    return FitResult(state=final, stop_reason=reason, history=run.history)
