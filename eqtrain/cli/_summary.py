"""What `eqtrain fit` says when a run ends (its stop reason, last metrics and
files), writes for the Ray launcher, or leaves behind when a second signal
aborts it."""

import contextlib
import json
from pathlib import Path
from typing import Any

import typer


# The metrics of the summary's `final:` line, when the run logged them.
_FINAL_METRICS = ("loss", "eval/loss", "eval/accuracy", "eval/rewards/accuracies")


def print_summary(
    stop_reason: Any,
    metrics: dict[str, Any],
    result: Any,
    extra: tuple[str, ...] = (),
) -> None:
    """The end of a run: why it stopped, its final metrics and its files
    (`result`: a `job.run` or Ray launcher result)."""
    final = _final(metrics)
    lines = [
        f"stopped: {stop_reason}",
        *([f"final: {final}"] if final else []),
        *extra,
        *_files(result.run_dir, result.config, result.export_dir),
    ]
    typer.echo("\n".join(lines))


def _final(metrics: dict[str, Any]) -> str:
    """`loss 1.2345  eval/loss 1.3456`: the final metrics the run logged."""
    shown = [k for k in _FINAL_METRICS if isinstance(metrics.get(k), float)]
    return "  ".join(f"{k} {metrics[k]:.4f}" for k in shown)


def _files(run_dir: Path, config: Any, export_dir: Path | None) -> list[str]:
    """Where the run's files are, and how to plot it."""
    lines = [
        f"run directory:  {run_dir}",
        f"  config:       {run_dir / 'config.toml'}",
        f"  metrics:      {run_dir / 'metrics.jsonl'}",
        f"  checkpoints:  {run_dir / 'checkpoints'}",
    ]
    if config.log.tensorboard:
        lines.append(f"  tensorboard:  {run_dir / 'tb'}")
    if export_dir is not None:
        lines.append(f"  HF export:    {export_dir}")
    return lines + [f"plot it:        eqtrain plot {run_dir}"]


def exit_if_nonfinite(stop_reason: Any) -> None:
    """Exit 1 when the run stopped on a non-finite loss."""
    if stop_reason.kind == "nonfinite":
        raise typer.Exit(1)


def write_result(path: str, result: Any) -> None:
    """The stop reason and last metrics as JSON, for the launcher."""
    fit_result = result.fit
    stop = fit_result.stop_reason
    data = {
        "stop_reason": {
            "kind": str(stop.kind),
            "step": stop.step,
            "message": stop.message,
        },
        "metrics": _floats(fit_result.metrics),
        "resumed_from": result.resumed_from,
        "trained": bool(fit_result.history),
    }
    # Python reads it back: NaN stays a float in `LaunchResult.metrics`.
    Path(path).write_text(json.dumps(data), encoding="utf-8")


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics that are numbers, as floats."""
    out = {}
    for name, value in metrics.items():
        with contextlib.suppress(TypeError, ValueError):
            out[name] = float(value)
    return out


def abort_note(cfg: Any) -> str:
    """What a run aborted by a second signal left behind (said by the signal
    guard's watchdog thread just before the process exits)."""
    from .. import job

    note = job.last_checkpoint_note(cfg.run_dir)
    export = ""
    if cfg.export.hf is not None:
        target = Path(cfg.run_dir) / cfg.export.hf
        export = (
            f" The HF export {target} was not updated to the last step (an "
            "interrupted export leaves the previous one or none); write it "
            f"from the checkpoint with `eqtrain export {cfg.run_dir} {target} "
            "--overwrite`."
        )
    return f"What was being saved was not completed. {note}{export}"
