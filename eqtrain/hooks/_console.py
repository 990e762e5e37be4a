"""`ConsoleLogger`: one plain line per logged step, formatted by `format_line`
(also the fallback of `ProgressBar` off a terminal)."""

import sys
from typing import Any

from .._hooks import StepInfo


def fmt_value(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


def fmt_rate(tokens_per_second: float | None) -> str:
    if tokens_per_second is None:
        return ""
    if tokens_per_second >= 1e6:
        return f"{tokens_per_second / 1e6:.2f}M tok/s"
    if tokens_per_second >= 1e3:
        return f"{tokens_per_second / 1e3:.1f}k tok/s"
    return f"{tokens_per_second:.0f} tok/s"


def fmt_mfu(mfu: float | None) -> str:
    return "" if mfu is None else f"mfu {mfu:.1%}"


_DEFAULT_KEYS = ("loss", "grad_norm", "learning_rate", "eval/loss")


def format_line(info: StepInfo, keys: tuple[str, ...] | None = None) -> str:
    """`step 10/100 | loss 2.3412 | lr 1.000e-03 | 12.3k tok/s | mfu 41.2%` for one
    step (tokens/s and MFU when known)."""
    parts = [f"step {info.step}/{info.num_steps}"]
    names = keys or _DEFAULT_KEYS
    short = {"learning_rate": "lr", "grad_norm": "gnorm"}
    for name in names:
        if name in info.metrics:
            parts.append(f"{short.get(name, name)} {fmt_value(info.metrics[name])}")
    parts += [p for p in (fmt_rate(info.tokens_per_second), fmt_mfu(info.mfu)) if p]
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
