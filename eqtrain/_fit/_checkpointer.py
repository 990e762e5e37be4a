"""What `fit` needs from a checkpointer (`CheckpointerProtocol`), and the
guard that tells the checkpointer's own failures from the run's (`fit` must
not retry a save that just failed when it saves on the way out of an error)."""

from typing import Protocol, runtime_checkable

from .._hooks import StepInfo
from ._failures import first_line, say


@runtime_checkable
class CheckpointerProtocol(Protocol):
    """What `fit(..., checkpointer=...)` needs from a checkpointer.

    `due(step)` is asked after every step (before the next is dispatched);
    `save(info, final=False)` then receives the exact state. When `fit` stops, for
    any `StopReason`, it calls `save(info, final=True)` exactly once with the final
    state, then `close()` (which should wait for asynchronous writes).
    """

    def due(self, step: int) -> bool: ...

    def save(self, info: StepInfo, *, final: bool) -> None: ...

    def close(self) -> None: ...


class CheckpointFailed(Exception):
    """Marks an exception raised by the checkpointer itself (see `fit`)."""


class GuardedCheckpointer:
    """Marks the checkpointer's own failures, so `fit` does not retry a save that
    just failed when it saves on the way out of an error; and remembers a save
    that a `KeyboardInterrupt` cut short (`interrupted`, its step), which `fit`
    does not retry either: the checkpointer may be in the middle of a write."""

    def __init__(self, inner: CheckpointerProtocol):
        self.inner = inner
        self.interrupted: int | None = None

    def due(self, step: int) -> bool:
        return self.inner.due(step)

    def save(self, info: StepInfo, *, final: bool) -> None:
        try:
            self.inner.save(info, final=final)
        except Exception as e:
            raise CheckpointFailed(e) from e
        except KeyboardInterrupt:
            self.interrupted = info.step
            raise

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if callable(close):
            try:
                close()
            except Exception as e:
                raise CheckpointFailed(e) from e


def close_checkpointer(checkpointer: GuardedCheckpointer, *, quietly: bool) -> None:
    """Close the checkpointer (waiting for its writes). While an exception is
    already propagating (`quietly`), a failure here must not replace it."""
    if not quietly:
        try:
            checkpointer.close()
        except CheckpointFailed as failed:
            raise failed.__cause__ from None  # type: ignore[misc]
        return
    try:
        checkpointer.close()
    except Exception as e:
        say(f"[eqtrain] closing the checkpointer failed too: {first_line(e)}")
