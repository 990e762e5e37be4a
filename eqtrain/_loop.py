"""`fit`: the one impure loop. It feeds batches to a compiled step, keeps the host one
step ahead of the device, calls hooks, evaluates, and turns every way a run can end
into a `StopReason`.
"""

import dataclasses
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from ._errors import ConfigError, StopTraining
from ._hooks import (
    Hook,
    Scheduled,
    StepInfo,
    StopKind,
    StopReason,
    as_scheduled,
    now,
)
from ._jit import Jitted, check_live, jit
from ._state import TrainState
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
    """Tokens in a batch: the size of its `tokens`/`input_ids` entry (shape only,
    no device access), or `None` when there is none."""
    if isinstance(batch, Mapping):
        for name in TOKEN_KEYS:
            if name in batch:
                return int(math.prod(np.shape(batch[name])))
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


class _Signals:
    """Turn the first SIGINT/SIGTERM into a stop request; a second one aborts."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_Signals":
        if self.enabled:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.getsignal(sig)
                signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.received = signum
        print(
            f"\n[eqtrain] {signal.Signals(signum).name} received: stopping after the "
            "current step (send it again to abort without saving).",
            file=sys.stderr,
            flush=True,
        )

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclasses.dataclass
class _Pending:
    """A dispatched step whose metrics have not been read yet."""

    step: int
    metrics: Any
    due: list[Scheduled]
    data_time: float
    tokens: int | None
    dispatched: float


def _check_args(
    num_steps: Any, eval_every: Any, eval_data: Any, eval_step: Any
) -> None:
    if not isinstance(num_steps, int) or num_steps < 0:
        raise ConfigError(f"`num_steps` must be an int >= 0; got {num_steps!r}.")
    if eval_every is not None:
        if not isinstance(eval_every, int) or eval_every < 1:
            raise ConfigError(f"`eval_every` must be an int >= 1; got {eval_every!r}.")
        if eval_step is None or eval_data is None:
            raise ConfigError(
                "`eval_every` needs both `eval_step=` and `eval_data=` (a re-iterable "
                "of batches, e.g. a list or a loader)."
            )
    if (eval_step is None) != (eval_data is None):
        raise ConfigError(
            "evaluation needs both `eval_step=` and `eval_data=`; got only "
            f"`{'eval_step' if eval_data is None else 'eval_data'}`."
        )
    if eval_data is not None and iter(eval_data) is eval_data:
        raise ConfigError(
            "`eval_data` must be re-iterable (it is read at every evaluation), but "
            "an iterator was given. Pass a list or a loader object instead."
        )


# Stop kinds pooled across processes, in increasing precedence.
_AGREED = (
    StopKind.HOOK,
    StopKind.KILL_SWITCH,
    StopKind.TIME_LIMIT,
    StopKind.SIGNAL,
    StopKind.NONFINITE,
)


class _Loop:
    """The state of one `fit` call; kept out of `fit` to give its parts names."""

    def __init__(
        self,
        step: Jitted,
        *,
        num_steps: int,
        hooks: Sequence[Scheduled],
        evaluator: Jitted | None,
        eval_data: Iterable[Batch] | None,
        eval_every: int | None,
        checkpointer: Checkpointer | None,
        time_limit: float | int | None,
        kill_switch: str | os.PathLike[str] | None,
        history: int | None,
        signals: _Signals,
        eval_at_end: bool = True,
        read_every: int = 1,
        read_seconds: float | int = 0.0,
        flops_per_token: float | int | None = None,
        peak_flops: float | int | None = None,
        tokens_seen: int = 0,
        agree_every: int = 10,
    ):
        self.step = step
        self.processes = jax.process_count()
        self.agree_every = agree_every
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.tokens_seen = tokens_seen
        self.num_steps = num_steps
        self.loop_hooks = [h for h in hooks if h.when != "end"]
        self.end_hooks = [h for h in hooks if h.when == "end"]
        self.evaluator = evaluator
        self.eval_data = eval_data
        self.eval_every = eval_every
        self.eval_at_end = eval_at_end
        self.read_every = read_every
        self.read_seconds = read_seconds
        self.checkpointer = checkpointer
        self.time_limit = time_limit
        self.kill_switch = None if kill_switch is None else os.fspath(kill_switch)
        self.history: list[dict[str, Any]] = []
        self.history_limit = history
        self.signals = signals
        self.hook_stop: StopReason | None = None
        self.nonfinite_at: int | None = None
        self.last_eval_step: int | None = None
        self.start = now()
        self.last_done = self.start

    # -- stop conditions --------------------------------------------------------
    def stop_reason(self, done: int) -> StopReason | None:
        """The reason to stop after `done` steps, agreed by all processes: a
        local reason (a signal, the kill switch, the time limit, a hook, a
        non-finite loss) is pooled every `agree_every` steps, so every process
        stops at the same step; reaching `num_steps` needs no agreement."""
        reason = self.local_stop_reason(done)
        if self.processes == 1 or (
            reason is not None and reason.kind == StopKind.MAX_STEPS
        ):
            return reason
        if done % self.agree_every:
            return None  # local reasons persist until the next agreement
        from .distributed import agree

        code = 0 if reason is None else _AGREED.index(reason.kind) + 1
        agreed = int(agree([code])[0])
        if agreed == 0:
            return None
        kind = _AGREED[agreed - 1]
        if reason is not None and reason.kind == kind:
            return reason
        return StopReason(kind, done, f"{kind} on another process")

    def local_stop_reason(self, done: int) -> StopReason | None:
        if self.nonfinite_at is not None:
            return StopReason(
                StopKind.NONFINITE,
                self.nonfinite_at,
                f"non-finite loss or gradients at step {self.nonfinite_at}; the "
                "returned state is the last finite one",
            )
        if self.hook_stop is not None:
            return self.hook_stop
        if self.signals.received is not None:
            name = signal.Signals(self.signals.received).name
            return StopReason(StopKind.SIGNAL, done, name)
        if done >= self.num_steps:
            return StopReason(
                StopKind.MAX_STEPS, done, f"reached {self.num_steps} steps"
            )
        if self.time_limit is not None and now() - self.start >= self.time_limit:
            return StopReason(
                StopKind.TIME_LIMIT, done, f"time limit of {self.time_limit:g}s reached"
            )
        if self.kill_switch is not None and os.path.exists(self.kill_switch):
            return StopReason(StopKind.KILL_SWITCH, done, f"found {self.kill_switch}")
        return None

    # -- per-step work ----------------------------------------------------------
    def needs_sync(self, step: int, due: list[Scheduled]) -> bool:
        return (
            any(h.uses_state for h in due)
            or self.eval_due(step)
            or (self.checkpointer is not None and self.checkpointer.due(step))
        )

    def eval_due(self, step: int) -> bool:
        return self.eval_every is not None and step % self.eval_every == 0

    def should_read(self, unread: list[_Pending]) -> bool:
        """Read metrics that are `read_every` steps or `read_seconds` old."""
        return len(unread) >= self.read_every or (
            now() - unread[0].dispatched >= self.read_seconds
        )

    def read(self, pendings: list[_Pending], state: TrainState | None) -> None:
        """Read the metrics of `pendings` in one transfer, then run each step's
        evaluation, hooks and checkpoint in order. `state` is the state after the
        last of them (`None` when it was already donated to a later step)."""
        host = _to_host([p.metrics for p in pendings])
        done = now()
        step_time = (done - self.last_done) / len(pendings)
        self.last_done = done
        for i, (pending, metrics) in enumerate(zip(pendings, host, strict=True)):
            last = i == len(pendings) - 1
            self.complete(pending, metrics, step_time, state if last else None, done)
        if state is not None:  # the device idled for this work: don't bill a step
            self.last_done = now()

    def complete(
        self,
        pending: _Pending,
        metrics: dict[str, Any],
        step_time: float,
        state: TrainState | None,
        done: float,
    ) -> None:
        self.watch_nonfinite(pending.step, metrics)
        if state is not None and self.eval_due(pending.step):
            metrics.update(self.evaluate(state))
            self.last_eval_step = pending.step
        tokens = pending.tokens
        rate = None if tokens is None or step_time <= 0 else tokens / step_time
        if tokens is not None:
            self.tokens_seen += tokens
        info = StepInfo(
            step=pending.step,
            metrics=metrics,
            num_steps=self.num_steps,
            step_time=step_time,
            data_time=pending.data_time,
            tokens=tokens,
            tokens_per_second=rate,
            tokens_seen=self.tokens_seen if tokens is not None else None,
            mfu=self.mfu(rate),
            elapsed=done - self.start,
            _state=state,
        )
        self.record(info)
        self.run_hooks(pending.due, info)
        ckpt = self.checkpointer
        if state is not None and ckpt is not None and self.nonfinite_at is None:
            if ckpt.due(pending.step):
                ckpt.save(info, final=False)

    def mfu(self, tokens_per_second: float | None) -> float | None:
        if None in (tokens_per_second, self.flops_per_token, self.peak_flops):
            return None
        return tokens_per_second * self.flops_per_token / self.peak_flops

    def watch_nonfinite(self, step: int, metrics: dict[str, Any]) -> None:
        # Steps built with nonfinite="stop" report `halted` once the state froze.
        if metrics.get("halted") and self.nonfinite_at is None:
            self.nonfinite_at = step

    def record(self, info: StepInfo) -> None:
        self.history.append({"step": info.step, **info.metrics})
        if self.history_limit is not None and len(self.history) > self.history_limit:
            del self.history[0]

    def run_hooks(self, hooks: Iterable[Hook], info: StepInfo) -> None:
        for hook in hooks:
            try:
                hook(info)
            except StopTraining as request:
                if self.hook_stop is None:
                    self.hook_stop = StopReason(
                        StopKind.HOOK, info.step, request.message
                    )

    def evaluate(self, state: TrainState) -> dict[str, float]:
        assert self.evaluator is not None and self.eval_data is not None
        return evaluate(state, self.evaluator, self.eval_data)


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
    compiled = (
        eval_step if isinstance(eval_step, Jitted) else jit(eval_step, donate=False)
    )
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
    eval_step: Callable[..., Any] | Jitted | None = None,
    eval_data: Iterable[Batch] | None = None,
    eval_every: int | None = None,
    eval_at_end: bool = True,
    checkpointer: Checkpointer | None = None,
    time_limit: float | int | None = None,
    kill_switch: str | os.PathLike[str] | None = None,
    handle_signals: bool = True,
    history: int | None = None,
    read_every: int = 10,
    read_seconds: float | int = 0.5,
    flops_per_token: float | int | None = None,
    peak_flops: float | int | None = None,
    tokens_seen: int = 0,
    agree_every: int = 10,
) -> FitResult:
    """Train `state` with `step` on `data` until a stop condition holds.

    The host stays one step ahead of the device: it dispatches step k+1 before it
    reads step k's metrics, so the device never waits for Python between steps. A
    hook that uses the state (the default for plain callables), an evaluation or a
    checkpoint due at step k makes the loop wait for step k before dispatching k+1,
    so they see the exact state of step k; hooks with `uses_state = False` (the
    built-in loggers) run a little late (metrics are read in batches) and never
    make the loop wait.

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
            wrap it with `every`, `at`, `every_seconds`, `at_end`. Raise
            `StopTraining` from a hook to stop after the current step.
        eval_step: `eval_step(loss_fn)` (compiled with `eqtrain.jit(...,
            donate=False)` if it is a plain function).
        eval_data: a re-iterable of eval batches (a list, or a loader).
        eval_every: evaluate after every `eval_every` steps; metrics are averaged
            over `eval_data` weighted by `weight` and reported as `eval/<name>`.
        eval_at_end: also evaluate when the run ends by reaching `num_steps` or
            running out of data (if it did not just evaluate).
        checkpointer: see `Checkpointer`; saved when due, and once at any stop.
        time_limit: stop after this many seconds of wall-clock time.
        kill_switch: stop when this file exists (checked after every step).
        handle_signals: make the first SIGINT/SIGTERM a clean stop (the current
            step finishes, final hooks and the checkpointer run); a second one
            aborts. Previous handlers are restored on exit. Only in the main
            thread.
        history: keep at most this many entries in `FitResult.history`
            (default: all).
        read_every: metrics that no state-using work needs are read from the
            device in batches, one transfer for up to `read_every` steps...
        read_seconds: ...or for the steps dispatched over `read_seconds`,
            whichever comes first. Metrics-only hooks (`uses_state = False`) thus
            run for every due step, in order, a little late; a step that needs
            the state reads everything before it. `read_every=1` reads each
            step's metrics as soon as the next step is dispatched.
        flops_per_token: training FLOPs per token (forward and backward, e.g.
            `eqtrain.models.llama.flops_per_token(config, seq_len)`); with
            `peak_flops` it gives `StepInfo.mfu`.
        peak_flops: the peak FLOP/s of all devices the step runs on together
            (see `eqtrain.hooks.peak_flops` for known devices).
        tokens_seen: tokens already trained on before this call (a resumed run
            passes its count), the start of `StepInfo.tokens_seen`.
        agree_every: in a multi-process run, how often (in steps) the processes
            pool their stop requests (a signal to one process, a kill switch, a
            time limit, a hook), so that all stop at the same step and save once.
            Each agreement waits for the current step. Unused with one process.

    Returns:
        A `FitResult` with the final state, the `StopReason` and the history.
    """
    _check_args(num_steps, eval_every, eval_data, eval_step)
    if not isinstance(read_every, int) or read_every < 1:
        raise ConfigError(f"`read_every` must be an int >= 1; got {read_every!r}.")
    if not read_seconds >= 0:
        raise ConfigError(f"`read_seconds` must be >= 0; got {read_seconds!r}.")
    if time_limit is not None and not time_limit > 0:
        raise ConfigError(f"`time_limit` must be > 0 seconds; got {time_limit!r}.")
    compiled = step if isinstance(step, Jitted) else jit(step)
    evaluator = None
    if eval_step is not None:
        evaluator = (
            eval_step if isinstance(eval_step, Jitted) else jit(eval_step, donate=False)
        )
    scheduled = [as_scheduled(h) for h in hooks]
    check_live(state, "`fit`")
    first = int(jax.device_get(state.step))
    arrays, layout = compiled.prepare(state)
    iterator = iter(data)

    with _Signals(handle_signals) as signals:
        loop = _Loop(
            compiled,
            num_steps=num_steps,
            hooks=scheduled,
            evaluator=evaluator,
            eval_data=eval_data,
            eval_every=eval_every,
            checkpointer=checkpointer,
            time_limit=time_limit,
            kill_switch=kill_switch,
            history=history,
            signals=signals,
            eval_at_end=eval_at_end,
            read_every=read_every,
            read_seconds=read_seconds,
            flops_per_token=flops_per_token,
            peak_flops=peak_flops,
            tokens_seen=tokens_seen,
            agree_every=agree_every,
        )
        for hook in scheduled:
            hook.start(loop.start)
        try:
            arrays, reason = _run(loop, compiled, arrays, layout, iterator, first)
            final = layout.rebuild(arrays)
            info = _final_info(loop, final, reason, first)
            loop.run_hooks(loop.end_hooks, info)
            if checkpointer is not None:
                checkpointer.save(info, final=True)
        finally:
            for hook in scheduled:
                hook.close()
            if checkpointer is not None and callable(
                getattr(checkpointer, "close", None)
            ):
                checkpointer.close()
    return FitResult(state=final, stop_reason=reason, history=loop.history)


def _run(
    loop: _Loop,
    compiled: Jitted,
    arrays: list[Any],
    layout: Any,
    iterator: Any,
    done: int,
) -> tuple[list[Any], StopReason]:
    """The step loop proper. Returns the final arrays and the stop reason."""
    unread: list[_Pending] = []  # dispatched steps whose metrics were not read yet
    while True:
        reason = loop.stop_reason(done)
        if reason is not None:
            break
        waited = now()
        try:
            batch = next(iterator)
        except StopIteration:
            reason = StopReason(
                StopKind.DATA_EXHAUSTED, done, "the data iterable ran out"
            )
            break
        dispatched = now()
        arrays, metrics = compiled.call_flat(arrays, batch)  # dispatch step done+1
        done += 1
        due = [h for h in loop.loop_hooks if h.due(done, dispatched)]
        current = _Pending(
            done, metrics, due, dispatched - waited, count_tokens(batch), dispatched
        )
        if loop.needs_sync(done, due):  # wait for this step: its state is needed
            loop.read([*unread, current], layout.rebuild(arrays))
            unread = []
        elif unread and loop.should_read(unread):  # older steps, while this one runs
            loop.read(unread, None)
            unread = [current]
        else:
            unread.append(current)
    if unread:
        loop.read(unread, layout.rebuild(arrays))
    # A non-finite step seen only in this last read still explains the end: the
    # state froze there, whatever stopped the loop afterwards.
    frozen = loop.stop_reason(done)
    if frozen is not None and frozen.kind == StopKind.NONFINITE:
        reason = frozen
    return arrays, reason


def _final_info(
    loop: _Loop, state: TrainState, reason: StopReason, first: int
) -> StepInfo:
    """The info for `at_end` hooks and the final save; evaluates at a natural end."""
    done = int(jax.device_get(state.step))
    last = loop.history[-1] if loop.history else None
    metrics = {k: v for k, v in last.items() if k != "step"} if last else {}
    natural = reason.kind in (StopKind.MAX_STEPS, StopKind.DATA_EXHAUSTED)
    if (
        loop.eval_at_end
        and natural
        and loop.evaluator is not None
        and loop.eval_data is not None
        and loop.last_eval_step != done
    ):
        evaluated = loop.evaluate(state)
        metrics.update(evaluated)
        if last is not None and last["step"] == done:
            last.update(evaluated)
        loop.last_eval_step = done
    return StepInfo(
        step=done,
        metrics=metrics,
        num_steps=loop.num_steps,
        tokens_seen=loop.tokens_seen or None,
        elapsed=now() - loop.start,
        stop_reason=reason,
        _state=state,
    )
