"""Training curves from a run directory: read `metrics.jsonl`, draw a 2x2 PNG.

Builds on `eqtrain.hooks.JsonlWriter`'s file format. Needs matplotlib
(`pip install 'eqtrain[plot]'`), imported only when a figure is drawn.

Example:
    >>> from eqtrain.plot import plot_run, read_metrics
    >>> records = read_metrics("runs/exp1")   # doctest: +SKIP
    >>> plot_run("runs/exp1")                 # doctest: +SKIP
    PosixPath('runs/exp1/plot.png')
"""

import json
import math
import os
import uuid
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._errors import ConfigError, EqtrainWarning


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
# Eval entries that are bookkeeping (the example count), not curves worth a panel.
_EVAL_SKIP = ("eval/loss", "eval/weight")


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The step records of a run's `metrics.jsonl`, one per step, in step order.

    The file is appended to across resumes and restarts, so the records are
    cleaned up as a reader would expect:

    - a step lower than the previous one starts a new history from that step:
      earlier records with a step at or above it are dropped (a resumed run re-runs
      the steps after its checkpoint; a run restarted from scratch starts at 1);
    - consecutive records of the same step are merged, later keys winning (the
      final `at_end` line repeats the last step with `stop_reason` and the final
      evaluation), unless `time` went backwards, which marks a new run whose
      record replaces the old one;
    - the strings `"nan"`, `"inf"` and `"-inf"` become floats again;
    - lines without a `step` are ignored.

    Args:
        path: a run directory (holding `metrics.jsonl`) or the file itself.

    Returns:
        A list of dicts with strictly increasing `step`.

    Raises:
        ConfigError: the file is missing, holds no step records, or has a
            malformed line before its last one. A malformed last line (a crash can
            leave one half-written) is skipped with a warning instead.
    """
    file = _metrics_file(Path(path))
    records = _records(_read_bytes(file).splitlines(), file)
    if not records:
        raise ConfigError(
            f"{file} holds no step records (lines with a `step`). Was it written "
            "by eqtrain.hooks.JsonlWriter, and did the run finish a step?"
        )
    return records


def plot_run(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    *,
    title: str | None = None,
) -> Path:
    """Draw a run's training curves into a PNG and return its path.

    Four panels: the train loss (raw, smoothed when there are many steps) with
    `eval/loss` as markers; the learning rate; throughput (tokens/s, or steps/s
    when batches have no tokens) with MFU on a second axis when logged; the other
    eval metrics (e.g. `eval/accuracy`), or `grad_norm` when there are none. A
    panel with no data says so. Works headless and from threads (no pyplot).

    Args:
        path: a run directory or its `metrics.jsonl` (see `read_metrics`).
        out: the PNG to write; default `<run_dir>/plot.png`; a directory gets
            `plot.png` inside it. Written atomically.
        title: the figure title; default the run directory's name and, when the
            run recorded one, its stop reason.

    Returns:
        The path of the written PNG.

    Raises:
        ConfigError: matplotlib is not installed, `read_metrics` failed, or
            `out` cannot be written (read-only, not a directory, disk full).
    """
    path = Path(path)
    records = read_metrics(path)
    run_dir = path if path.is_dir() else path.parent
    out = run_dir / "plot.png" if out is None else Path(out)
    if out.is_dir():
        out = out / "plot.png"
    if title is None:
        title = _default_title(run_dir, records)
    figure = _new_figure()
    from matplotlib.ticker import MaxNLocator

    figure.suptitle(title)
    (loss, lr), (speed, other) = figure.subplots(2, 2, sharex=True)
    _loss_panel(loss, records)
    _line_panel(lr, records, "learning_rate", "learning rate")
    _throughput_panel(speed, records)
    _other_panel(other, records)
    for ax in (speed, other):
        ax.set_xlabel("step")
    other.xaxis.set_major_locator(MaxNLocator(integer=True))  # shared by all four
    _save(figure, out)
    return out


# ----------------------------------------------------------------- reading


def _metrics_file(path: Path) -> Path:
    file = path / "metrics.jsonl" if path.is_dir() or not path.suffix else path
    if not file.is_file():
        where = file.parent
        raise ConfigError(
            f"no {file.name} in {where}: was this run started? eqtrain writes it "
            "with eqtrain.hooks.JsonlWriter(run_dir / 'metrics.jsonl'); pass the "
            "run directory or the file itself."
        )
    return file


def _read_bytes(file: Path) -> bytes:
    try:
        return file.read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read {file}: {e.strerror or e}.") from None


def _records(lines: list[bytes], file: Path) -> list[dict[str, Any]]:
    """The step records of the file's lines, cleaned up (see `read_metrics`)."""
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        where = f"{file}:{i + 1}"
        try:
            record = _json_object(line)
        except ValueError as e:
            _skip_malformed(line, e, where, is_last=i == last)
            continue
        if "step" not in record:
            continue
        step = record["step"]
        if not isinstance(step, int) or isinstance(step, bool):
            raise ConfigError(f"{where}: `step` must be an integer; got {step!r}.")
        _add_record(records, {k: _decode(v) for k, v in record.items()})
    return records


def _json_object(raw: bytes) -> dict[str, Any]:
    """A line's JSON object; `ValueError` for invalid UTF-8 (a malformed line,
    like bad JSON), bad JSON or another JSON value."""
    record = json.loads(raw.decode("utf-8"))
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    return record


def _skip_malformed(
    raw: bytes, error: ValueError, where: str, *, is_last: bool
) -> None:
    """Warn of a truncated last line (a crash can leave one); refuse any other."""
    if is_last:
        warnings.warn(
            f"{where}: skipping a truncated last line (a crash can "
            f"leave one half-written): {error}",
            EqtrainWarning,
            stacklevel=4,  # read_metrics' caller
        )
        return
    line = raw.decode("utf-8", errors="replace")
    raise ConfigError(
        f"{where}: malformed line ({error}): {line[:80]!r}. Only the last "
        "line may be truncated; fix or delete this line."
    ) from None


def _decode(value: Any) -> Any:
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def _add_record(records: list[dict[str, Any]], record: dict[str, Any]) -> None:
    """`record` merged into the last one of its step, unless `time` went
    backwards (a new run); else added after the records at or above its step."""
    step = record["step"]
    if records and records[-1]["step"] == step:
        t0, t1 = records[-1].get("time"), record.get("time")
        numbers = (int, float)
        if not (isinstance(t0, numbers) and isinstance(t1, numbers) and t1 < t0):
            records[-1].update(record)
            return
    while records and records[-1]["step"] >= step:
        records.pop()
    records.append(record)


# ----------------------------------------------------------------- series


def _series(
    records: Sequence[dict[str, Any]], key: str
) -> tuple[list[int], list[float]]:
    """(steps, values) of the records holding a number under `key`; inf -> nan."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            steps.append(r["step"])
            values.append(float(v) if math.isfinite(v) else math.nan)
    return steps, values


def _smoothed(values: Sequence[float]) -> list[float]:
    """A debiased EMA spanning about 1/50 of the run; NaNs are passed over."""
    beta = 1.0 - 1.0 / max(2.0, len(values) / 50)
    avg, weight, out = 0.0, 0.0, []
    for v in values:
        if not math.isnan(v):
            avg = beta * avg + (1 - beta) * v
            weight = beta * weight + (1 - beta)
        out.append(avg / weight if weight else math.nan)
    return out


def _default_title(run_dir: Path, records: Sequence[dict[str, Any]]) -> str:
    name = run_dir.resolve().name or str(run_dir)
    title = f"{name}: {records[-1]['step']} steps"
    reason = records[-1].get("stop_reason")
    return f"{title}, stopped: {reason}" if reason else title


# ----------------------------------------------------------------- drawing


def _new_figure() -> Any:
    """An empty figure (here matplotlib, an optional dependency, is first needed)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError(
            "plotting needs matplotlib, which is not installed: "
            "pip install 'eqtrain[plot]'"
        ) from None
    return Figure(figsize=(12, 8), dpi=100, layout="constrained")


def _no_data(ax: Any, what: str) -> None:
    ax.text(
        0.5, 0.5, f"no data\n({what})", ha="center", va="center",
        transform=ax.transAxes, color="0.5",
    )  # fmt: skip
    ax.set_yticks([])


def _plot_noisy(ax: Any, steps: list[int], values: list[float], **style: Any) -> None:
    """A thin raw line, plus a smoothed one on top when there are many points."""
    many = len(steps) > 50
    # Markers when few: a point between two NaNs would otherwise not show.
    raw = {"lw": 0.6, "alpha": 0.35} if many else {"lw": 1.0, "marker": ".", "ms": 4}
    ax.plot(steps, values, **{**style, **raw, "label": style.get("label")})
    if many:
        label = style.get("label")
        ema = {**style, "label": f"{label} (EMA)" if label else None}
        ax.plot(steps, _smoothed(values), **{"lw": 1.6, **ema})


def _loss_panel(ax: Any, records: Sequence[dict[str, Any]]) -> None:
    ax.set_title("loss")
    steps, loss = _series(records, "loss")
    eval_steps, eval_loss = _series(records, "eval/loss")
    if not steps and not eval_steps:
        _no_data(ax, "loss, eval/loss")
        return
    if steps:
        _plot_noisy(ax, steps, loss, color="C0", label="train")
    if eval_steps:
        ax.plot(eval_steps, eval_loss, "o-", ms=4, lw=1, color="C3", label="eval")
    _mark_bad_steps(ax, records)
    if _spans_decades(loss + eval_loss):
        ax.set_yscale("log")
    ax.legend(loc="upper right", fontsize="small")
    ax.grid(alpha=0.3)


def _mark_bad_steps(ax: Any, records: Sequence[dict[str, Any]]) -> None:
    """Ticks along the bottom at steps with a non-finite loss or a skipped update."""
    bad = [
        r["step"]
        for r in records
        if r.get("skipped")
        or (isinstance(r.get("loss"), float) and not math.isfinite(r["loss"]))
    ]
    if bad:
        ax.plot(
            bad, [0.0] * len(bad), "|", ms=10, color="red",
            transform=ax.get_xaxis_transform(), label="non-finite / skipped",
        )  # fmt: skip


def _spans_decades(values: Sequence[float]) -> bool:
    finite = [v for v in values if math.isfinite(v)]
    return bool(finite) and min(finite) > 0 and max(finite) / min(finite) > 30


def _line_panel(
    ax: Any, records: Sequence[dict[str, Any]], key: str, name: str
) -> None:
    ax.set_title(name)
    steps, values = _series(records, key)
    if not steps:
        _no_data(ax, key)
        return
    ax.plot(steps, values, lw=1.2, color="C2", marker="." if len(steps) <= 50 else "")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    ax.grid(alpha=0.3)


def _throughput_panel(ax: Any, records: Sequence[dict[str, Any]]) -> None:
    from matplotlib.ticker import EngFormatter

    steps, rate, unit = _rate(records)
    ax.set_title(f"throughput ({unit})")
    if not steps:
        _no_data(ax, "tokens_per_second, step_time")
        return
    _plot_noisy(ax, steps, rate, color="C1")
    ax.yaxis.set_major_formatter(EngFormatter())
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    mfu_steps, mfu = _series(records, "mfu")
    if mfu_steps:
        _mfu_axis(ax.twinx(), mfu_steps, mfu)
        ax.set_ylabel(unit, color="C1")


def _rate(records: Sequence[dict[str, Any]]) -> tuple[list[int], list[float], str]:
    """(steps, rate, unit): tokens/s, or steps/s when batches have no tokens."""
    steps, rate = _series(records, "tokens_per_second")
    if steps:
        return steps, rate, "tokens/s"
    steps, step_time = _series(records, "step_time")
    return steps, [1.0 / t if t > 0 else math.nan for t in step_time], "steps/s"


def _mfu_axis(twin: Any, steps: list[int], mfu: list[float]) -> None:
    """MFU on the throughput panel's second axis."""
    from matplotlib.ticker import PercentFormatter

    # MFU tracks tokens/s, so a dashed line keeps the two apart.
    _plot_noisy(twin, steps, mfu, color="C4", ls="--")
    twin.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    twin.set_ylim(bottom=0)
    twin.set_ylabel("MFU", color="C4")


def _other_panel(ax: Any, records: Sequence[dict[str, Any]]) -> None:
    numeric = {k for r in records for k, v in r.items() if isinstance(v, int | float)}
    keys = sorted(k for k in numeric - set(_EVAL_SKIP) if k.startswith("eval/"))
    if not keys:
        _line_panel(ax, records, "grad_norm", "grad norm")
        return
    ax.set_title("eval metrics")
    for i, key in enumerate(keys):
        ax.plot(*_series(records, key), "o-", ms=4, lw=1, color=f"C{i}", label=key)
    ax.legend(loc="best", fontsize="small")
    ax.grid(alpha=0.3)


def _save(figure: Any, out: Path) -> None:
    try:
        _write_png(figure, out)
    except OSError as e:
        raise ConfigError(
            f"cannot write the plot to {out} ({e.strerror or e}). Pass another "
            "file with -o/--output (`out=` in Python)."
        ) from None


def _write_png(figure: Any, out: Path) -> None:
    """Render to a temporary file beside `out`, then rename it into place."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    out.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)
    # Not tempfile.mkstemp: its 0600 mode would survive the rename.
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "xb") as f:
            figure.savefig(f, format="png")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
