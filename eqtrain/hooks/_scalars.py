"""The scalars a logger writes for one `StepInfo`, by tag (`train/loss`,
`eval/loss`, `perf/mfu`), shared by `TensorBoardWriter` and `WandbLogger`."""

import importlib
import numbers
from typing import Any

from .._errors import ConfigError
from .._hooks import StepInfo


def require(module: str, hook: str, extra: str) -> Any:
    """`import module` for `hook`, or a `ConfigError` naming the extra that
    installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"`{hook}` needs {module}, which is not installed: "
            f"`pip install 'eqtrain[{extra}]'`."
        ) from e


def _tag(name: str) -> str:
    # A name with a "/" already names its group (`eval/loss`); the step's own
    # metrics go under `train/` so that TensorBoard and W&B show `train/loss` next
    # to `eval/loss`.
    return name if "/" in name else f"train/{name}"


def scalars(info: StepInfo) -> dict[str, float]:
    """The scalars a logger writes for `info`, by tag.

    - the step's metrics as `train/<name>` (`train/loss`, `train/grad_norm`, ...);
      names that already hold a `/` keep it (`eval/loss`, `eval/weight`);
    - `perf/step_time`, `perf/data_time` and, when known, `perf/tokens_per_second`,
      `perf/tokens_seen`, `perf/mfu` (not on the final call, `info.stop_reason` set:
      that repeats the last step and has no timings).

    Non-numeric values (strings, lists) are left out; NaN and infinities are kept.
    """
    out = {
        _tag(k): float(v)
        for k, v in info.metrics.items()
        if isinstance(v, numbers.Real)  # Python/NumPy floats and ints, bools
    }
    if info.stop_reason is None:
        out.update(_perf(info))
    return out


def _perf(info: StepInfo) -> dict[str, float]:
    """The step's timings, throughput and MFU as `perf/<name>`, those known."""
    perf = {
        "step_time": info.step_time,
        "data_time": info.data_time,
        "tokens_per_second": info.tokens_per_second,
        "tokens_seen": info.tokens_seen,
        "mfu": info.mfu,
    }
    return {f"perf/{k}": float(v) for k, v in perf.items() if v is not None}


class Dedup:
    """Drops what was already written at a step: the final call (`at_end`) repeats
    the last step's metrics, and only its new entries (an end-of-run evaluation)
    should be written again."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.written: set[str] = set()

    def new(self, step: int, values: dict[str, float]) -> dict[str, float]:
        if step != self.step:
            self.step, self.written = step, set()
        fresh = {k: v for k, v in values.items() if k not in self.written}
        self.written.update(fresh)
        return fresh
