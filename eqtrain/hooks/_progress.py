"""`ProgressBar`: a `rich` progress bar on a terminal, plain lines elsewhere."""

import sys
from typing import Any

from .._hooks import StepInfo
from ._console import fmt_mfu, fmt_rate, fmt_value, format_line


class ProgressBar:
    """A `rich` progress bar: step, loss, tokens/s, MFU, elapsed and ETA.

    When the output is not a terminal (a log file, CI), it degrades to a plain
    line every `plain_every` steps (default: about every 5% of the run), at the
    steps that report evaluation metrics and at the last step, so logs stay
    readable.

    Args:
        plain_every: period of the plain lines when not on a terminal.
        stream: the output (default: standard error).
        force_terminal: `True`/`False` to override terminal detection.
    """

    uses_state = False

    def __init__(
        self,
        *,
        plain_every: int | None = None,
        stream: Any = None,
        force_terminal: bool | None = None,
    ):
        self.plain_every = plain_every
        self.stream = stream
        self.force_terminal = force_terminal
        self._progress: Any = None
        self._task: Any = None
        self._plain: bool | None = None

    def _start(self, info: StepInfo) -> None:
        stream = self.stream or sys.stderr
        self._plain = not _is_terminal(stream, self.force_terminal)
        if self._plain:
            return
        self._progress = _rich_progress(stream)
        self._progress.start()
        first = max(info.step - 1, 0)
        self._task = self._progress.add_task(
            "train", total=info.num_steps, completed=first, status=""
        )

    def __call__(self, info: StepInfo) -> None:
        if self._plain is None:
            self._start(info)
        if self._plain:
            self._plain_line(info)
            return
        self._progress.update(self._task, completed=info.step, status=_status(info))

    def _plain_line(self, info: StepInfo) -> None:
        """A log line at every `plain_every`-th step, at evaluations and at the end."""
        every = self.plain_every or max(1, info.num_steps // 20)
        final = info.stop_reason is not None or info.step >= info.num_steps
        evaluated = any(k.startswith("eval/") for k in info.metrics)
        if info.step % every == 0 or final or evaluated:
            stream = self.stream or sys.stderr
            print(format_line(info) + _eta(info), file=stream, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self._plain = None


def _is_terminal(stream: Any, force: bool | None) -> bool:
    if force is not None:
        return force
    return hasattr(stream, "isatty") and bool(stream.isatty())


def _status(info: StepInfo) -> str:
    """The bar's status text: loss, tokens/s and MFU, those known."""
    loss = f"loss {fmt_value(info.metrics['loss'])}" if "loss" in info.metrics else ""
    parts = (loss, fmt_rate(info.tokens_per_second), fmt_mfu(info.mfu))
    return "  ".join(p for p in parts if p)


def _eta(info: StepInfo) -> str:
    """`" | eta 42s"` from the mean step time so far ("" before it is known)."""
    if info.step and info.elapsed and info.num_steps > info.step:
        left = (info.num_steps - info.step) * info.elapsed / info.step
        return f" | eta {left:.0f}s"
    return ""


def _rich_progress(stream: Any) -> Any:
    """A `rich` progress bar on `stream`: step, status, elapsed and ETA."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=Console(file=stream, force_terminal=True),
        transient=False,
    )
