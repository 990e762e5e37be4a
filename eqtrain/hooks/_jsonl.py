"""`JsonlWriter`: a metrics-only hook appending one JSON line per step, the file
`eqtrain.plot` and `eqtrain info` read back."""

import json
import math
import os
from pathlib import Path
from typing import IO, Any

from .._hooks import StepInfo


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
