"""`eqtrain info`: a run's steps, checkpoints, metrics, export and config
(`eqtrain.job.run_info`), as text or JSON; the text ends with the CPU settings
this process chose (`eqtrain.cpu.tune_cpu`)."""

from typing import Annotated, Any

import typer

from ..cpu import cpu_settings as describe_cpu
from ._shared import RunPath, errors, json_text


AsJson = Annotated[bool, typer.Option("--json", help="Print JSON.")]
# The metrics of `last logged:`, when the run logged them.
_LAST_METRICS = (
    "step",
    "loss",
    "eval/loss",
    "eval/accuracy",
    "eval/rewards/accuracies",
    "stop_reason",
)


def info(path: RunPath, as_json: AsJson = False) -> None:
    """Steps, checkpoints, metrics, export and config of a run."""
    from .. import job

    with errors():
        data = job.run_info(path)
    typer.echo(json_text(data, indent=2) if as_json else format_info(data))


def format_info(data: dict[str, Any]) -> str:
    """`eqtrain info`'s text: one `name: value` line per topic."""
    config = data["config"]
    lines = [
        f"run:          {data['run_dir']}",
        _model_line(config["model"]),
        *_task_line(config),
        *_lora_line(config),
        f"trained:      {data['steps_trained']} / {data['target_steps']} steps",
        *_sources_lines(data.get("sources") or []),
    ]
    if data["last_metrics"]:
        shown = {k: v for k, v in data["last_metrics"].items() if k in _LAST_METRICS}
        lines.append(f"last logged:  {json_text(shown)}")
    lines += _checkpoint_lines(data["checkpoints"], data.get("damaged") or [])
    lines.append(f"HF export:    {data['export'] or '(none)'}")
    lines.append(f"CPU settings: {describe_cpu()}")
    return "\n".join(lines)


def _model_line(model: dict[str, Any]) -> str:
    return (
        f"model:        {model['arch']} ({model['num_layers']} layers, hidden "
        f"{model['hidden_size']}, vocab {model['vocab_size'] or 'tokenizer'}"
        f"{_experts(model)})"
    )


def _experts(model: dict[str, Any]) -> str:
    """`, 8 experts (top-2)` for a mixture-of-experts `[model]` section."""
    if not model.get("num_experts"):
        return ""
    return f", {model['num_experts']} experts (top-{model['experts_per_token']})"


def _lora_line(config: dict[str, Any]) -> list[str]:
    """The adapters' rank, for a LoRA run."""
    adapters = config.get("lora") or {}
    if not (adapters.get("rank") or config["model"].get("adapter_from")):
        return []
    rank = adapters.get("rank") or "(from adapter_from)"
    return [f"lora:         rank {rank}, adapters only (the base stays frozen)"]


def _task_line(config: dict[str, Any]) -> list[str]:
    """The task, when it is not plain language modelling."""
    task = config.get("task") or {}
    if task.get("kind", "lm") == "lm":
        return []
    reference = task.get("reference")
    with_ref = task["kind"] in ("dpo", "ipo") and reference
    return [
        f"task:         {task['kind']}"
        + (f" (reference: {reference})" if with_ref else "")
    ]


def _sources_lines(sources: list[dict[str, Any]]) -> list[str]:
    """The tokens trained of each data source."""
    return [
        ("data:         " if i == 0 else "              ")
        + f"{source['name']} ({source['path']}, weight {source['weight']:g}): "
        f"{source['tokens']:,} tokens trained"
        for i, source in enumerate(sources)
    ]


def _checkpoint_lines(
    checkpoints: list[dict[str, Any]], damaged: list[str]
) -> list[str]:
    lines = [f"checkpoints:  {len(checkpoints)}"]
    lines += [_checkpoint_line(c) for c in checkpoints]
    return lines + [f"  moved aside (damaged): {name}" for name in damaged]


def _checkpoint_line(c: dict[str, Any]) -> str:
    """A checkpoint's step, its eval loss and why the run stopped there."""
    if c.get("error"):
        return f"  step {c['step']:>8}  DAMAGED: {c['error']}"
    reason = (c.get("stop_reason") or {}).get("kind", "")
    loss = (c.get("metrics") or {}).get("eval/loss")
    extra = f"  eval/loss {loss:.4f}" if isinstance(loss, float) else ""
    return f"  step {c['step']:>8}{extra}  {reason}".rstrip()
