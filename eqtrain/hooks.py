"""Built-in hooks: a JSONL metrics writer, a progress bar, a console logger, and
writers for TensorBoard and Weights & Biases; `peak_flops` for MFU.

Each is a plain callable `hook(info)`; schedule it with `eqtrain.every(n, hook)` or
pass it as is (every step). They read only metrics (`uses_state = False`), so they
run a little late (the loop reads metrics in batches) and never make the loop wait
for the device.
"""

import json
import math
import os
import sys
from pathlib import Path
from typing import IO, Any

from ._hooks import StepInfo


def _finite_or_str(value: Any) -> Any:
    """JSON has no NaN/inf: write them as strings ("nan", "inf", "-inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list):
        return [_finite_or_str(v) for v in value]
    return value


class JsonlWriter:
    """Append one JSON line per call to `path`, flushed at once.

    Each line holds:
        - `step` (int, 1-based completed steps), `time` (seconds since `fit`
          started);
        - every metric of that step under its own name (`loss`, `grad_norm`,
          `learning_rate`, `skipped`, `weight`, the loss's `aux` entries, and
          `eval/...` on evaluation steps); NaN/inf are written as the strings
          `"nan"`, `"inf"`, `"-inf"`;
        - `step_time`, `data_time` (seconds) and, when the batch has tokens,
          `tokens_per_second` and `tokens_seen` (tokens trained on so far); `mfu`
          (model FLOPs utilisation, a fraction) when `fit` was given
          `flops_per_token` and `peak_flops`;
        - on the final line only, `stop_reason` (e.g. `"max_steps"`), when the
          writer is also given to `at_end`.

    The file is opened in append mode, so a resumed run continues the same file.
    """

    uses_state = False

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._file: IO[str] | None = None

    def __call__(self, info: StepInfo) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        record: dict[str, Any] = {"step": info.step, "time": round(info.elapsed, 6)}
        record.update({k: _finite_or_str(v) for k, v in info.metrics.items()})
        if info.stop_reason is not None:
            record["stop_reason"] = info.stop_reason.kind.value
        else:
            record["step_time"] = info.step_time
            record["data_time"] = info.data_time
            for key in ("tokens_per_second", "tokens_seen", "mfu"):
                if getattr(info, key) is not None:
                    record[key] = getattr(info, key)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


def _rate(tokens_per_second: float | None) -> str:
    if tokens_per_second is None:
        return ""
    if tokens_per_second >= 1e6:
        return f"{tokens_per_second / 1e6:.2f}M tok/s"
    if tokens_per_second >= 1e3:
        return f"{tokens_per_second / 1e3:.1f}k tok/s"
    return f"{tokens_per_second:.0f} tok/s"


def _mfu(mfu: float | None) -> str:
    return "" if mfu is None else f"mfu {mfu:.1%}"


def format_line(info: StepInfo, keys: tuple[str, ...] | None = None) -> str:
    """`step 10/100 | loss 2.3412 | lr 1.000e-03 | 12.3k tok/s | mfu 41.2%` for one
    step (tokens/s and MFU when known)."""
    parts = [f"step {info.step}/{info.num_steps}"]
    names = keys or tuple(
        k
        for k in ("loss", "grad_norm", "learning_rate", "eval/loss")
        if k in info.metrics
    )
    short = {"learning_rate": "lr", "grad_norm": "gnorm"}
    for name in names:
        if name in info.metrics:
            parts.append(f"{short.get(name, name)} {_fmt(info.metrics[name])}")
    parts += [p for p in (_rate(info.tokens_per_second), _mfu(info.mfu)) if p]
    return " | ".join(parts)


class ConsoleLogger:
    """Print one line per call: step, loss, learning rate, eval loss, tokens/s, MFU.

    Args:
        keys: metric names to show (default: loss, grad_norm, learning_rate and
            eval/loss when present).
        stream: where to write (default: standard output).
    """

    uses_state = False

    def __init__(self, keys: tuple[str, ...] | None = None, stream: Any = None):
        self.keys = keys
        self.stream = stream

    def __call__(self, info: StepInfo) -> None:
        stream = self.stream or sys.stdout
        print(format_line(info, self.keys), file=stream, flush=True)


class ProgressBar:
    """A `rich` progress bar: step, loss, tokens/s, MFU, elapsed and ETA.

    When the output is not a terminal (a log file, CI), it degrades to a plain
    line every `plain_every` steps (default: about every 5% of the run), so logs
    stay readable.

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
        tty = self.force_terminal
        if tty is None:
            tty = hasattr(stream, "isatty") and stream.isatty()
        self._plain = not tty
        if self._plain:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        console = Console(file=stream, force_terminal=True)
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._progress.start()
        first = max(info.step - 1, 0)
        self._task = self._progress.add_task(
            "train", total=info.num_steps, completed=first, status=""
        )

    def __call__(self, info: StepInfo) -> None:
        if self._plain is None:
            self._start(info)
        status = "  ".join(
            p
            for p in (
                f"loss {_fmt(info.metrics['loss'])}" if "loss" in info.metrics else "",
                _rate(info.tokens_per_second),
                _mfu(info.mfu),
            )
            if p
        )
        if self._plain:
            every = self.plain_every or max(1, info.num_steps // 20)
            final = info.stop_reason is not None or info.step >= info.num_steps
            if info.step % every == 0 or final:
                eta = ""
                if info.step and info.elapsed and info.num_steps > info.step:
                    left = (info.num_steps - info.step) * info.elapsed / info.step
                    eta = f" | eta {left:.0f}s"
                stream = self.stream or sys.stderr
                print(format_line(info) + eta, file=stream, flush=True)
            return
        self._progress.update(self._task, completed=info.step, status=status)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        self._plain = None


from ._devices import (  # noqa: E402
    peak_flops as peak_flops,
    total_peak_flops as total_peak_flops,
)
from ._tensorboard import TensorBoardWriter as TensorBoardWriter  # noqa: E402
from ._wandb import WandbLogger as WandbLogger  # noqa: E402
