"""The driver's SIGINT/SIGTERM, recorded for the supervisor to pass on to the
workers: the first asks them to save and stop, a second aborts them."""

import signal
import threading
from collections.abc import Callable
from typing import Any


class Signals:
    """SIGINT/SIGTERM received by the driver, for the supervisor to pass on. The
    first is a stop request; the second also aborts."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.received: list[int] = []
        self.forwarded = 0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "Signals":
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
        self.say(_note(signal.Signals(signum).name, first=self.forwarded == 1))
        return [signum]


def _note(name: str, *, first: bool) -> str:
    if first:
        return (
            f"[ray] {name} received: asking every worker to save and stop "
            "(send it again to abort them without saving)."
        )
    return f"[ray] {name} received again: aborting the workers."
