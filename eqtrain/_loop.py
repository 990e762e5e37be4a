"""`fit`: the one impure loop. It feeds batches to a compiled step, keeps the host one
step ahead of the device, reads metrics in batches, runs hooks, evaluations and
checkpoints, and ends on a `StopReason` (see `_stops.py` for every way a run ends).
"""

import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from ._cpu import hint_cpu_settings
from ._errors import ConfigError, StopTraining
from ._hooks import Hook, Scheduled, StepInfo, StopKind, StopReason, as_scheduled, now
from ._jit import Jitted, check_live, jit
from ._state import TrainState
from ._stops import StopConditions, Stopper
from ._types import Batch


@runtime_checkable
class Checkpointer(Protocol):
    """What `fit(..., checkpointer=...)` needs from a checkpointer.

    `due(step)` is asked after every step (before the next is dispatched);
    `save(info, final=False)` then receives the exact state. When `fit` stops, for
    any `StopReason`, it calls `save(info, final=True)` exactly once with the final
    state, then `close()` (which should wait for asynchronous writes).
    """

    def due(self, step: int) -> bool: ...

    def save(self, info: StepInfo, *, final: bool) -> None: ...

    def close(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What `fit` returns.

    Attributes:
        state: the final `TrainState`.
        stop_reason: why the loop stopped.
        history: one dict per completed step: `{"step": k, **metrics}`, with
            `eval/...` entries on evaluation steps (oldest dropped beyond
            `fit(..., history=N)`).
    """

    state: TrainState
    stop_reason: StopReason
    history: list[dict[str, Any]]

    @property
    def metrics(self) -> dict[str, Any]:
        """The last completed step's metrics (empty if no step ran)."""
        return self.history[-1] if self.history else {}


TOKEN_KEYS = ("tokens", "input_ids")


def count_tokens(batch: Batch) -> int | None:
    """Tokens in a batch: the size of its `tokens`/`input_ids` entry, or the sum
    over its `*_tokens` entries (a preference batch's `chosen_tokens` and
    `rejected_tokens`); shapes only, no device access. `None` when there is none."""
    if isinstance(batch, Mapping):
        for name in TOKEN_KEYS:
            if name in batch:
                return int(math.prod(np.shape(batch[name])))
        sizes = [
            int(math.prod(np.shape(v)))
            for k, v in batch.items()
            if isinstance(k, str) and k.endswith("_tokens")
        ]
        if sizes:
            return sum(sizes)
    return None


def _to_host(metrics: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Fetch several steps' metrics with one transfer, as Python numbers."""
    host = jax.device_get([dict(m) for m in metrics])
    out = []
    for step_metrics in host:
        values = {}
        for name, value in step_metrics.items():
            value = np.asarray(value)
            values[name] = value.item() if value.ndim == 0 else value.tolist()
        out.append(values)
    return out


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What `fit` evaluates on, and when.

    Attributes:
        step: `eval_step(loss_fn)`, plain or compiled with `eqtrain.jit(...,
            donate=False)` (a plain one is compiled by `fit`).
        data: a re-iterable of eval batches (a list, or a loader), read in full at
            every evaluation.
        every: evaluate after every `every` steps (None: only at the end);
            metrics are averaged over `data` weighted by `weight` and reported as
            `eval/<name>`.
        at_end: also evaluate when the run ends by reaching `num_steps` or running
            out of data (if it did not just evaluate).
    """

    step: Callable[..., Any] | Jitted
    data: Iterable[Batch]
    every: int | None = None
    at_end: bool = True

    def __post_init__(self) -> None:
        _check_every(self.every)
        if iter(self.data) is self.data:
            raise ConfigError(
                "`eval_data` must be re-iterable (it is read at every evaluation), "
                "but an iterator was given. Pass a list or a loader object instead."
            )

    def due(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0


def _check_every(every: Any) -> None:
    if every is not None and (not isinstance(every, int) or every < 1):
        raise ConfigError(f"`eval_every` must be an int >= 1; got {every!r}.")


@dataclasses.dataclass
class _Pending:
    """A dispatched step whose metrics have not been read yet."""

    step: int
    metrics: Any
    due: list[Scheduled]
    data_time: float
    tokens: int | None
    dispatched: float


@dataclasses.dataclass(frozen=True)
class FailedAt:
    """Where an exception ended `fit`, as `fit` found out (it attaches this to the
    exception; read it with `failed_at`). The device reports a failed step late
    (when its results are read, or when a later step is dispatched), so `fit`
    reads the results not read yet one by one: the first unreadable one is the
    step that failed.

    Attributes:
        step: the training step that failed (the first step is 1); None when
            every dispatched step ran (the exception came from elsewhere, e.g.
            an evaluation or a hook).
        finished: the last step known to have run.
    """

    step: int | None
    finished: int

    def __str__(self) -> str:
        if self.step is not None:
            return f"at step {self.step}"
        return f"after step {self.finished}, outside the training step"


def failed_at(error: BaseException) -> FailedAt | None:
    """Where `error` ended `fit` (None if it did not come out of `fit`)."""
    return getattr(error, "eqtrain_failed_at", None)


class _Run:
    """One `fit` call's moving parts: the compiled step and the work between steps
    (reading metrics, evaluating, hooks, checkpoints). `loop` is the loop itself."""

    def __init__(
        self,
        step: Jitted,
        *,
        num_steps: int,
        hooks: Sequence[Scheduled],
        evaluation: Evaluation | None,
        checkpointer: "Checkpointer | None",
        stopper: Stopper,
        history: int | None,
        read_every: int,
        read_seconds: float | int,
        throughput: "_Throughput",
    ):
        self.step, self.num_steps, self.stopper = step, num_steps, stopper
        self.loop_hooks = [h for h in hooks if h.when != "end"]
        self.end_hooks = [h for h in hooks if h.when == "end"]
        self.evaluation = evaluation
        self.evaluator = None if evaluation is None else _compiled_eval(evaluation.step)
        self.checkpointer = checkpointer
        self.history: list[dict[str, Any]] = []
        self.history_limit = history
        self.read_every, self.read_seconds = read_every, read_seconds
        self.throughput = throughput
        self.last_eval_step: int | None = None
        self.arrays: list[Any] = []  # the latest dispatched state's arrays
        self.done = 0  # steps dispatched (the latest state's step)
        self.finished = 0  # the last step whose results were read (so it ran)
        self.unread: list[_Pending] = []  # dispatched steps not read yet
        self.dispatching: int | None = None  # the step being dispatched
        self.saved: int | None = None  # the last step handed to the checkpointer

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
            dispatched = now()
            self.dispatching = self.done + 1
            self.arrays, metrics = self.step.call_flat(self.arrays, batch)
            self.done, self.dispatching = self.done + 1, None
            due = [h for h in self.loop_hooks if h.due(self.done, dispatched)]
            unread = self.unread
            unread.append(
                _Pending(self.done, metrics, due, dispatched - waited,
                         count_tokens(batch), dispatched)
            )  # fmt: skip
            if self.needs_state(unread[-1]):  # wait for this step: its state is used
                self.read(unread, layout.rebuild(self.arrays))
                self.unread = []
            elif len(unread) > 1 and self.read_due(unread[:-1]):  # while it runs
                self.read(unread[:-1], None)
                self.unread = unread[-1:]
        if self.unread:
            self.read(self.unread, layout.rebuild(self.arrays))
            self.unread = []
        return self.stopper.final(reason, self.done)

    # -- between steps ----------------------------------------------------------
    def needs_state(self, pending: _Pending) -> bool:
        step = pending.step
        return (
            any(h.uses_state for h in pending.due)
            or (self.evaluation is not None and self.evaluation.due(step))
            or (self.checkpointer is not None and self.checkpointer.due(step))
        )

    def read_due(self, unread: list[_Pending]) -> bool:
        """Read metrics that are `read_every` steps or `read_seconds` old."""
        return len(unread) >= self.read_every or (
            now() - unread[0].dispatched >= self.read_seconds
        )

    def read(self, pendings: list[_Pending], state: TrainState | None) -> None:
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
        pending: _Pending,
        metrics: dict[str, Any],
        step_time: float,
        state: TrainState | None,
    ) -> None:
        self.stopper.saw_metrics(pending.step, metrics)
        if state is not None and self.evaluation and self.evaluation.due(pending.step):
            metrics.update(self.evaluate(state))
            self.last_eval_step = pending.step
        info = self.throughput.info(pending, metrics, step_time, state, self.num_steps)
        self.record(info)
        self.run_hooks(pending.due, info)
        ckpt = self.checkpointer
        if state is not None and ckpt is not None and not self.stopper.frozen:
            if ckpt.due(pending.step):
                ckpt.save(info, final=False)
                self.saved = pending.step

    def record(self, info: StepInfo) -> None:
        self.history.append({"step": info.step, **info.metrics})
        if self.history_limit is not None and len(self.history) > self.history_limit:
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
            self.checkpointer.save(info, final=True)
            self.saved = info.step
        self.run_hooks(self.end_hooks, info)
        return info

    def final_info(self, state: TrainState, reason: StopReason) -> StepInfo:
        done = int(jax.device_get(state.step))
        # the metrics of the step the state is at: after a non-finite stop, the
        # later (halted) steps' metrics describe no state that exists
        last = self.history[-1] if self.history else None
        if last is not None and last["step"] != done:
            last = None
        metrics = {k: v for k, v in last.items() if k != "step"} if last else {}
        natural = reason.kind in (StopKind.MAX_STEPS, StopKind.DATA_EXHAUSTED)
        ev = self.evaluation
        if ev is not None and ev.at_end and natural and self.last_eval_step != done:
            evaluated = self.evaluate(state)
            self.last_eval_step = done
            metrics.update(evaluated)
            if last is not None and last["step"] == done:
                last.update(evaluated)
        return self.throughput.final_info(state, done, metrics, reason, self.num_steps)

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
        self, layout: Any, first: int, error: Exception, where: FailedAt
    ) -> None:
        """An exception is ending the run: save the latest state if it is intact
        and newer than the start, so that no finished step is lost; then `fit`
        re-raises. Failing to save only adds a note."""
        ckpt = self.checkpointer
        if ckpt is None or self.done <= first or self.stopper.frozen:
            return
        if self.saved == self.done:
            return  # already saved (e.g. the final save, before an end hook failed)
        if isinstance(error, _CheckpointFailed):
            return  # the checkpointer itself failed: saving again would too
        if where.step is not None and where.step <= self.done:
            print(
                f"[eqtrain] {type(error).__name__} ended the run {where}; the "
                "states from that step on carry the error, so none was saved.",
                file=sys.stderr,
                flush=True,
            )
            return
        try:
            state = layout.rebuild(self.arrays)
            check_live(state, "the save after an error")
            jax.block_until_ready(state)  # raises if the step itself failed
            reason = StopReason(
                StopKind.ERROR, self.done, f"{type(error).__name__}: {error}"[:500]
            )
            info = self.throughput.final_info(
                state, self.done, {}, reason, self.num_steps
            )
            ckpt.save(info, final=True)
        except Exception as failure:  # the original error matters more
            print(
                f"[eqtrain] {type(error).__name__} ended the run {where}; the "
                f"state of step {self.done} could not be saved "
                f"({type(failure).__name__}: {_first_line(failure)}).",
                file=sys.stderr,
                flush=True,
            )
            return
        print(
            f"[eqtrain] {type(error).__name__} ended the run {where}; the state "
            f"of step {self.done} was saved first.",
            file=sys.stderr,
            flush=True,
        )


_END = object()


class _CheckpointFailed(Exception):
    """Marks an exception raised by the checkpointer itself (see `fit`)."""


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else ""


class _Throughput:
    """Step times, tokens and MFU, and the `StepInfo` built from them."""

    def __init__(
        self,
        flops_per_token: float | int | None,
        peak_flops: float | int | None,
        tokens_seen: int,
    ):
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.tokens_seen = tokens_seen
        self.start = self.last_done = now()

    def restart(self) -> None:
        self.last_done = now()

    def tick(self, steps: int) -> float:
        """The mean time of the `steps` steps completed since the last tick."""
        done = now()
        step_time = (done - self.last_done) / steps
        self.last_done = done
        return step_time

    def info(
        self,
        pending: _Pending,
        metrics: dict[str, Any],
        step_time: float,
        state: TrainState | None,
        num_steps: int,
    ) -> StepInfo:
        tokens = pending.tokens
        rate = None if tokens is None or step_time <= 0 else tokens / step_time
        if tokens is not None:
            self.tokens_seen += tokens
        mfu = None
        if None not in (rate, self.flops_per_token, self.peak_flops):
            mfu = rate * self.flops_per_token / self.peak_flops
        return StepInfo(
            step=pending.step,
            metrics=metrics,
            num_steps=num_steps,
            step_time=step_time,
            data_time=pending.data_time,
            tokens=tokens,
            tokens_per_second=rate,
            tokens_seen=self.tokens_seen if tokens is not None else None,
            mfu=mfu,
            elapsed=self.last_done - self.start,
            _state=state,
        )

    def final_info(
        self,
        state: TrainState,
        step: int,
        metrics: dict[str, Any],
        reason: StopReason,
        num_steps: int,
    ) -> StepInfo:
        return StepInfo(
            step=step,
            metrics=metrics,
            num_steps=num_steps,
            tokens_seen=self.tokens_seen or None,
            elapsed=now() - self.start,
            stop_reason=reason,
            _state=state,
        )


def _compiled_eval(eval_step: Callable[..., Any] | Jitted) -> Jitted:
    if isinstance(eval_step, Jitted):
        return eval_step
    return jit(eval_step, donate=False)


class _GuardedCheckpointer:
    """Marks the checkpointer's own failures, so `fit` does not retry a save that
    just failed when it saves on the way out of an error."""

    def __init__(self, inner: "Checkpointer"):
        self.inner = inner

    def due(self, step: int) -> bool:
        return self.inner.due(step)

    def save(self, info: StepInfo, *, final: bool) -> None:
        try:
            self.inner.save(info, final=final)
        except Exception as e:
            raise _CheckpointFailed(e) from e

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if callable(close):
            try:
                close()
            except Exception as e:
                raise _CheckpointFailed(e) from e


def evaluate(
    state: TrainState,
    eval_step: Callable[..., Any] | Jitted,
    data: Iterable[Batch],
    *,
    prefix: str = "eval/",
) -> dict[str, float]:
    """Evaluate `state` on every batch of `data`; average weighted by `weight`.

    This is what `fit` does at each evaluation, available on its own (e.g. to
    evaluate a restored state).

    Args:
        state: the state to evaluate (not consumed).
        eval_step: from `eval_step(loss_fn)`, plain or compiled with
            `eqtrain.jit(..., donate=False)` (plain ones are compiled here).
        data: an iterable of batches (read once, in full).
        prefix: put before every metric name.

    Returns:
        `{prefix + name: mean}` for each metric, the mean weighted by each batch's
        `weight` (tokens or examples), and `prefix + "weight"`: the total weight.
    """
    compiled = _compiled_eval(eval_step)
    if compiled.donate:
        raise ConfigError(
            "`evaluate` needs an evaluation step compiled with donate=False: a "
            "donating one would consume the state."
        )
    arrays, _ = compiled.prepare(state)
    outputs = [compiled.call_flat(arrays, batch) for batch in data]
    if not outputs:
        raise ConfigError("the eval data yielded no batches; evaluation needs one.")
    host = _to_host(outputs)
    weights = np.array([m.get("weight", 1.0) for m in host], np.float64)
    total = float(weights.sum())
    scale = weights / total if total > 0 else np.full(len(host), 1.0 / len(host))
    averaged = {
        f"{prefix}{name}": float(
            sum(s * m[name] for s, m in zip(scale, host, strict=True))
        )
        for name in host[0]
        if name != "weight"
    }
    averaged[f"{prefix}weight"] = total
    return averaged


def fit(
    state: TrainState,
    step: Callable[..., Any] | Jitted,
    data: Iterable[Batch],
    *,
    num_steps: int,
    hooks: Sequence[Hook | Scheduled] = (),
    evaluation: Evaluation | None = None,
    stop: StopConditions | None = None,
    checkpointer: Checkpointer | None = None,
    history: int | None = None,
    read_every: int = 10,
    read_seconds: float | int = 0.5,
    flops_per_token: float | int | None = None,
    peak_flops: float | int | None = None,
    tokens_seen: int = 0,
    eval_step: Callable[..., Any] | Jitted | None = None,
    eval_data: Iterable[Batch] | None = None,
    eval_every: int | None = None,
    eval_at_end: bool = True,
    time_limit: float | int | None = None,
    kill_switch: str | os.PathLike[str] | None = None,
    handle_signals: bool = True,
    agree_every: int = 10,
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
    ends it instead (a hook, the data or the step raised), `fit` first saves the
    latest intact state with the checkpointer, then re-raises.

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
        evaluation: an `Evaluation` (eval step, data, period, at the end); or the
            same as `eval_step`, `eval_data`, `eval_every`, `eval_at_end`.
        stop: `StopConditions` (time limit, kill switch, signals, multi-process
            agreement); or the same as `time_limit`, `kill_switch`,
            `handle_signals`, `agree_every`.
        checkpointer: see `Checkpointer`; saved when due, and once at any stop.
        history: keep at most this many entries in `FitResult.history`
            (default: all).
        read_every: metrics that no state-using work needs are read from the
            device in batches, one transfer for up to `read_every` steps...
        read_seconds: ...or for the steps dispatched over `read_seconds`,
            whichever comes first. `read_every=1` reads each step's metrics as
            soon as the next step is dispatched.
        flops_per_token: training FLOPs per token (forward and backward, e.g.
            `eqtrain.models.family(config).flops_per_token(config, seq_len)`);
            with `peak_flops` it gives `StepInfo.mfu`.
        peak_flops: the peak FLOP/s of all devices the step runs on together
            (see `eqtrain.hooks.peak_flops` for known devices).
        tokens_seen: tokens already trained on before this call (a resumed run
            passes its count), the start of `StepInfo.tokens_seen`.
        eval_step, eval_data, eval_every, eval_at_end: the fields of
            `Evaluation` (`step`, `data`, `every`, `at_end`), as keywords.
        time_limit, kill_switch, handle_signals, agree_every: the fields of
            `StopConditions`, as keywords.

    Returns:
        A `FitResult` with the final state, the `StopReason` and the history.
    """
    evaluation = _evaluation(evaluation, eval_step, eval_data, eval_every, eval_at_end)
    stop = _stop_conditions(stop, time_limit, kill_switch, handle_signals, agree_every)
    _check_args(num_steps, read_every, read_seconds)
    compiled = step if isinstance(step, Jitted) else jit(step)
    hint_cpu_settings()
    scheduled = [as_scheduled(h) for h in hooks]
    check_live(state, "`fit`")
    first = int(jax.device_get(state.step))
    arrays, layout = compiled.prepare(state)
    guarded = None if checkpointer is None else _GuardedCheckpointer(checkpointer)
    with Stopper(stop, num_steps) as stopper:
        run = _Run(
            compiled,
            num_steps=num_steps,
            hooks=scheduled,
            evaluation=evaluation,
            checkpointer=guarded,
            stopper=stopper,
            history=history,
            read_every=read_every,
            read_seconds=read_seconds,
            throughput=_Throughput(flops_per_token, peak_flops, tokens_seen),
        )
        run.done = run.finished = first
        for hook in scheduled:
            hook.start(stopper.start)
        failed = True  # until the run got through `finish`
        try:
            reason = run.loop(arrays, layout, data)
            final = layout.rebuild(run.arrays)
            run.finish(final, reason)
            failed = False
        except Exception as error:
            where = run.locate_failure()
            with contextlib.suppress(AttributeError, TypeError):  # a frozen type
                error.eqtrain_failed_at = where  # type: ignore[attr-defined]
            run.save_after_error(layout, first, error, where)
            if isinstance(error, _CheckpointFailed):
                raise error.__cause__ from None  # type: ignore[misc]
            raise
        finally:
            for hook in scheduled:
                hook.close()
            if guarded is not None:
                _close(guarded, quietly=failed)
    return FitResult(state=final, stop_reason=reason, history=run.history)


def _close(checkpointer: _GuardedCheckpointer, *, quietly: bool) -> None:
    """Close the checkpointer (waiting for its writes). While an exception is
    already propagating (`quietly`), a failure here must not replace it."""
    if not quietly:
        try:
            checkpointer.close()
        except _CheckpointFailed as failed:
            raise failed.__cause__ from None  # type: ignore[misc]
        return
    try:
        checkpointer.close()
    except Exception as e:
        print(
            f"[eqtrain] closing the checkpointer failed too: {_first_line(e)}",
            file=sys.stderr,
            flush=True,
        )


def _evaluation(
    evaluation: Evaluation | None,
    eval_step: Any,
    eval_data: Any,
    eval_every: int | None,
    eval_at_end: bool,
) -> Evaluation | None:
    if evaluation is not None:
        if eval_step is not None or eval_data is not None or eval_every is not None:
            raise ConfigError(
                "give `evaluation=Evaluation(...)` or the `eval_*` keywords, not both."
            )
        return evaluation
    _check_every(eval_every)
    if eval_every is not None and (eval_step is None or eval_data is None):
        raise ConfigError(
            "`eval_every` needs both `eval_step=` and `eval_data=` (a re-iterable "
            "of batches, e.g. a list or a loader)."
        )
    if (eval_step is None) != (eval_data is None):
        raise ConfigError(
            "evaluation needs both `eval_step=` and `eval_data=`; got only "
            f"`{'eval_step' if eval_data is None else 'eval_data'}`."
        )
    if eval_step is None:
        return None
    return Evaluation(eval_step, eval_data, eval_every, eval_at_end)


def _stop_conditions(
    stop: StopConditions | None,
    time_limit: float | int | None,
    kill_switch: Any,
    handle_signals: bool,
    agree_every: int,
) -> StopConditions:
    flat = StopConditions(time_limit, kill_switch, handle_signals, agree_every)
    if stop is None:
        return flat
    if flat != StopConditions():
        raise ConfigError(
            "give `stop=StopConditions(...)` or the `time_limit`, `kill_switch`, "
            "`handle_signals`, `agree_every` keywords, not both."
        )
    return stop


def _check_args(num_steps: Any, read_every: Any, read_seconds: Any) -> None:
    if not isinstance(num_steps, int) or num_steps < 0:
        raise ConfigError(f"`num_steps` must be an int >= 0; got {num_steps!r}.")
    if not isinstance(read_every, int) or read_every < 1:
        raise ConfigError(f"`read_every` must be an int >= 1; got {read_every!r}.")
    if not read_seconds >= 0:
        raise ConfigError(f"`read_seconds` must be >= 0; got {read_seconds!r}.")
