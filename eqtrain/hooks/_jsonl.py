"""`JsonlWriter`: a metrics-only hook appending one JSON line per step, the file
`eqtrain.plot` and `eqtrain info` read back. The file tells one story: a resumed
run replaces the lines of the steps it redoes, and each step has one line."""

import json
import math
import os
from pathlib import Path
from typing import IO, Any

from .._hooks import StepInfo


END_KEYS = ("stop_reason", "stop_message")  # only on a run's last line


def _finite_or_str(value: Any) -> Any:
    """JSON has no NaN/inf: write them as strings ("nan", "inf", "-inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, list):
        return [_finite_or_str(v) for v in value]
    return value


def _step_of(line: bytes) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def _without_end_keys(line: bytes) -> bytes:
    """A line without the keys the end of a run adds (`END_KEYS`)."""
    record = json.loads(line)
    if not any(k in record for k in END_KEYS):
        return line
    return json.dumps({k: v for k, v in record.items() if k not in END_KEYS}).encode()


def cut_after(path: Path, start: int) -> None:
    """Keep the lines of `path` up to step `start` (a resumed run redoes the
    rest), without the end keys of step `start`'s line; atomically."""
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return
    kept = []
    for line in lines:
        step = _step_of(line)
        if step is not None and step <= start:
            kept.append((_without_end_keys(line) if step == start else line) + b"\n")
    _replace_bytes(path, b"".join(kept))


def _replace_bytes(path: Path, data: bytes) -> None:
    """Write `data` to a sibling and rename it onto `path` (atomic)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


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
          `flops_per_token` and `peak_flops`.

    Given also to `at_end`, the writer records how the run ended on the line of
    the step the final state is at: `stop_reason` (e.g. `"max_steps"`),
    `stop_message`, and an end-of-run evaluation's `eval/...`. When that step's
    line is the file's last, it is completed in place; otherwise (the step was not
    logged, `every(n)`) a line for it is added.

    One story per file:
        - a step whose update was not applied (`halted`: the state froze at a
          non-finite loss, `nonfinite="stop"`) gets no line; the end line names
          the first such step in `stop_message`;
        - `start=k` (a run resumed from step k; 0 for a fresh start) drops every
          line after step k, and the end keys of the line of step k, when the
          writer first opens the file (atomically: a new file replaces the old).

    Args:
        path: the file (its directory is created).
        start: the step the run starts from; None: keep the file as it is and
            append.
    """

    uses_state = False

    def __init__(self, path: str | os.PathLike[str], *, start: int | None = None):
        self.path = Path(path)
        self.start = start
        self._file: IO[bytes] | None = None

    def __call__(self, info: StepInfo) -> None:
        if info.stop_reason is None and info.metrics.get("halted"):
            return  # not trained: the state stayed at the last finite step
        file = self._open()
        record = _record(info)
        if info.stop_reason is not None:
            record["stop_reason"] = info.stop_reason.kind.value
            record["stop_message"] = info.stop_reason.message
            self._end(file, record)
            return
        record.update(_timings(info))
        file.write(json.dumps(record).encode() + b"\n")
        file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- the file ---------------------------------------------------------------
    def _open(self) -> IO[bytes]:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.start is not None:
                self._cut(self.start)
            self._file = open(self.path, "ab")  # noqa: SIM115
        return self._file

    def _cut(self, start: int) -> None:
        cut_after(self.path, start)

    def _end(self, file: IO[bytes], record: dict[str, Any]) -> None:
        """Complete the last line when it is the same step's, else add one."""
        file.flush()
        size = self.path.stat().st_size
        offset, last = _last_line(self.path, size)
        if last is not None and _step_of(last) == record["step"]:
            merged = {**json.loads(last), **record, "time": json.loads(last)["time"]}
            # the step's own timings stay; only the end keys and eval are added
            file.truncate(offset)
            file.seek(offset)
            record = merged
        file.write(json.dumps(record).encode() + b"\n")
        file.flush()


def _record(info: StepInfo) -> dict[str, Any]:
    """The step, the time and the step's metrics (non-finite ones as strings)."""
    record: dict[str, Any] = {"step": info.step, "time": round(info.elapsed, 6)}
    record.update({k: _finite_or_str(v) for k, v in info.metrics.items()})
    return record


def _timings(info: StepInfo) -> dict[str, Any]:
    """The step's timings, and its throughput and MFU when known."""
    out = {"step_time": info.step_time, "data_time": info.data_time}
    for key in ("tokens_per_second", "tokens_seen", "mfu"):
        if getattr(info, key) is not None:
            out[key] = getattr(info, key)
    return out


def _last_line(path: Path, size: int) -> tuple[int, bytes | None]:
    """The offset and bytes of the file's last line (None if empty)."""
    if size == 0:
        return 0, None
    with open(path, "rb") as f:
        chunk = min(size, 1 << 20)
        f.seek(size - chunk)
        tail = f.read(chunk)
    body = tail.rstrip(b"\n")
    cut = body.rfind(b"\n")
    if cut < 0 and chunk < size:
        return size, None  # a line longer than the chunk: add a new one
    line = body[cut + 1 :]
    return size - chunk + cut + 1, line
