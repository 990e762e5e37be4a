"""When an exception ends `fit`: where it came from (`FailedAt`, read with
`failed_at`), and the notes `fit` writes to the standard error on its way out."""

import dataclasses
import sys


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


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0][:200] if lines else ""


def say(text: str) -> None:
    """A note to the standard error, flushed at once."""
    print(text, file=sys.stderr, flush=True)


def say_ended(error: BaseException, where: FailedAt, outcome: str) -> None:
    """Say which error ended the run where, and what became of its latest state."""
    say(f"[eqtrain] {type(error).__name__} ended the run {where}; {outcome}")
