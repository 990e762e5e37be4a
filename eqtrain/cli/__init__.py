"""The `eqtrain` command: a thin Typer shell over `eqtrain.config` and
`eqtrain.job`. Each command parses its arguments into a config and calls one
library function; errors of ours exit with code 2 and one paragraph, no traceback.
"""

import contextlib
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from .._errors import EqtrainError


app = typer.Typer(
    name="eqtrain",
    help="Train, evaluate, inspect and export eqtrain runs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)

EXIT_USAGE = 2
_OWNS_PROCESS = False  # set by `main`: the process is the `eqtrain` command

SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override a config key, e.g. --set optim.lr=1e-4 (repeatable).",
        metavar="KEY=VALUE",
    ),
]


def _json(data: Any, **kwargs: Any) -> str:
    """Strict JSON, as metrics.jsonl writes it: NaN and infinities (which JSON
    has no numbers for) become the strings "nan", "inf" and "-inf"."""
    return json.dumps(_finite(data), allow_nan=False, **kwargs)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _fail(message: str) -> None:
    typer.echo(f"error: {' '.join(message.split())}", err=True)  # one paragraph
    raise typer.Exit(EXIT_USAGE)


@contextlib.contextmanager
def _errors() -> Iterator[dict[str, Any]]:
    """Our errors (bad config, files, checkpoints) and failed writes (no space,
    read-only, not a directory, is a directory) become exit 2 with a message.
    The body may set `where["run_dir"]`: a failed write then names the run's
    last complete checkpoint."""
    where: dict[str, Any] = {}
    try:
        with _plain_warnings():
            yield where
    except EqtrainError as e:
        _fail(str(e))
    except OSError as e:
        from .. import job

        if not job.is_write_error(e):
            raise
        _fail(job.write_error_message(e, where.get("run_dir")))


@contextlib.contextmanager
def _plain_warnings() -> Iterator[None]:
    """eqtrain's warnings (a damaged checkpoint moved aside, ...) as one
    `warning: ...` paragraph, without Python's file and line."""
    import warnings

    previous = warnings.showwarning

    def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
        if category.__module__.startswith("eqtrain"):
            typer.echo(f"warning: {' '.join(str(message).split())}", err=True)
        else:
            previous(message, category, *args, **kwargs)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def _echo(text: str) -> None:
    typer.echo(text, err=True)


@app.command()
def fit(
    config: Annotated[
        Path | None,
        typer.Argument(help="A TOML config; none: the built-in default run."),
    ] = None,
    set_: SetOption = None,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the mesh, parameters, sharding and the compiled step's "
            "memory per device; do not train.",
        ),
    ] = False,
    memory_budget: Annotated[
        str | None,
        typer.Option(
            "--memory-budget",
            help="With --dry-run (implied): also find the longest data.seq_len "
            "whose step fits this much memory per device (e.g. 16GB), by "
            "compiling a few lengths.",
        ),
    ] = None,
    resume: Annotated[
        str | None,
        typer.Option(
            help="auto | never | PATH of a run or checkpoint (default: "
            "checkpoint.resume, itself 'auto').",
        ),
    ] = None,
    run_dir: Annotated[
        str | None, typer.Option(help="Where the run writes (overrides run_dir).")
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            help="Discard the run's checkpoints that would be mixed with new ones: "
            "with --resume never (all), a rollback --resume RUN/checkpoints/N "
            "(the later ones), or --resume of another run."
        ),
    ] = False,
    launcher: Annotated[
        str | None,
        typer.Option(
            help="ray: run as distributed.processes processes placed by Ray (the "
            "`ray` extra), restarted together from the last checkpoint when one "
            "fails (see distributed.*).",
            metavar="ray",
        ),
    ] = None,
    result_file: Annotated[str | None, typer.Option(hidden=True)] = None,
    export_: Annotated[bool, typer.Option("--export/--no-export", hidden=True)] = True,
) -> None:
    """Train. With no CONFIG: a small byte-level Llama on the Python standard
    library, on CPU, in a few minutes."""
    from .. import _signals, config as config_lib, distributed, job

    with _errors() as where, contextlib.ExitStack() as stack:
        if launcher is not None:
            return _launch(
                launcher,
                config,
                set_,
                run_dir,
                dry_run,
                resume,
                overwrite,
                memory_budget,
            )
        # a no-op unless EQTRAIN_* or SLURM say otherwise
        cluster = distributed.initialize()
        # After `initialize`: JAX's preemption notice takes SIGTERM over when it
        # starts, and the guard must be the handler the process ends up with.
        if _OWNS_PROCESS:
            # This process is `eqtrain fit`: a second signal at any moment from
            # here to the interpreter's exit aborts at once (exit 128 + signal).
            _signals.install_for_process()
        guard = stack.enter_context(_signals.guarded())
        overrides = list(set_ or [])
        if run_dir is not None:
            overrides.append(f"run_dir={run_dir}")
        cfg = config_lib.load(config, overrides)
        _check_processes(cfg, cluster.num_processes)
        if memory_budget is not None:
            budget = config_lib.parse_size(memory_budget, field="--memory-budget")
            typer.echo(job.report(cfg))
            typer.echo("")
            typer.echo(job.budget_report(cfg, budget, memory_budget))
            return
        if dry_run:
            typer.echo(job.report(cfg))
            return
        where["run_dir"] = cfg.run_dir
        if guard is not None:
            guard.note = lambda: abort_note(cfg)
        result = job.run(
            cfg, resume=resume, overwrite=overwrite, echo=_echo, export=export_
        )
    if result_file is not None:  # the launcher (eqtrain.ray) prints the summary
        _write_result(result_file, result)
        if result.fit.stop_reason.kind == "nonfinite":
            raise typer.Exit(1)
        return
    _summary(result)


def _check_processes(cfg: Any, running: int) -> None:
    from .._errors import ConfigError

    wanted = cfg.distributed.processes
    if wanted > 1 and running == 1:
        raise ConfigError(
            f"distributed.processes = {wanted} needs a launcher that starts the "
            "processes: add `--launcher ray`, or start them yourself with "
            "EQTRAIN_* or SLURM variables (docs/distributed.md)."
        )


def _launch(
    launcher: str,
    config: Path | None,
    set_: list[str] | None,
    run_dir: str | None,
    dry_run: bool,
    resume: str | None,
    overwrite: bool,
    memory_budget: str | None = None,
) -> None:
    """`eqtrain fit --launcher ray`: the supervisor runs here; the workers run
    `eqtrain fit` themselves."""
    from .. import config as config_lib, job
    from .._errors import ConfigError

    if launcher != "ray":
        raise ConfigError(
            f"--launcher must be `ray` (the only launcher so far); got {launcher!r}. "
            "Leave it out to train in this process."
        )
    from .. import ray as ray_launcher

    overrides = list(set_ or []) + ([f"run_dir={run_dir}"] if run_dir else [])
    cfg = config_lib.load(config, overrides)
    if dry_run or memory_budget is not None:
        ray_launcher.plan(cfg)  # what the launcher refuses, refused now
        typer.echo(job.report(cfg))
        if memory_budget is not None:
            budget = config_lib.parse_size(memory_budget, field="--memory-budget")
            typer.echo("")
            typer.echo(job.budget_report(cfg, budget, memory_budget))
        return
    result = ray_launcher.fit(cfg, resume=resume, overwrite=overwrite, echo=_echo)
    lines = [f"restarts: {result.restarts}"] if result.restarts else []
    _print_summary(
        result.stop_reason,
        result.metrics,
        result.run_dir,
        result.config,
        result.export_dir,
        lines,
    )


def _write_result(path: str, result: Any) -> None:
    """The stop reason and last metrics as JSON, for the launcher."""
    fit_result = result.fit
    stop = fit_result.stop_reason
    metrics = {}
    for name, value in fit_result.metrics.items():
        with contextlib.suppress(TypeError, ValueError):
            metrics[name] = float(value)
    data = {
        "stop_reason": {
            "kind": str(stop.kind),
            "step": stop.step,
            "message": stop.message,
        },
        "metrics": metrics,
        "resumed_from": result.resumed_from,
        "trained": bool(fit_result.history),
    }
    # Python reads it back: NaN stays a float in `LaunchResult.metrics`.
    Path(path).write_text(json.dumps(data), encoding="utf-8")


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


def _summary(result: Any) -> None:
    fit_result = result.fit
    _print_summary(
        fit_result.stop_reason,
        fit_result.metrics,
        result.run_dir,
        result.config,
        result.export_dir,
    )


def _print_summary(
    stop_reason: Any,
    metrics: dict[str, Any],
    run_dir: Path,
    config: Any,
    export_dir: Path | None,
    extra: list[str] | None = None,
) -> None:
    final = "  ".join(
        f"{k} {metrics[k]:.4f}"
        for k in ("loss", "eval/loss", "eval/accuracy", "eval/rewards/accuracies")
        if isinstance(metrics.get(k), float)
    )
    lines = [
        f"stopped: {stop_reason}",
        *([f"final: {final}"] if final else []),
        *(extra or []),
        f"run directory:  {run_dir}",
        f"  config:       {run_dir / 'config.toml'}",
        f"  metrics:      {run_dir / 'metrics.jsonl'}",
        f"  checkpoints:  {run_dir / 'checkpoints'}",
    ]
    if config.log.tensorboard:
        lines.append(f"  tensorboard:  {run_dir / 'tb'}")
    if export_dir is not None:
        lines.append(f"  HF export:    {export_dir}")
    lines.append(f"plot it:        eqtrain plot {run_dir}")
    typer.echo("\n".join(lines))
    if stop_reason.kind == "nonfinite":
        raise typer.Exit(1)


@app.command(name="eval")
def eval_(
    path: Annotated[str, typer.Argument(help="A run directory or a checkpoint step.")],
    set_: SetOption = None,
) -> None:
    """Evaluate a run's latest checkpoint (or the given step) on its eval data;
    prints one JSON object."""
    from .. import job

    with _errors():
        metrics = job.evaluate_run(path, list(set_ or []))
    typer.echo(_json(metrics))


@app.command()
def export(
    path: Annotated[str, typer.Argument(help="A run directory or a checkpoint step.")],
    out_dir: Annotated[
        str, typer.Argument(help="The Hugging Face directory to write.")
    ],
    dtype: Annotated[
        str | None,
        typer.Option(help="float32 | bfloat16 | float16 (default: the parameters')."),
    ] = None,
    ema: Annotated[bool, typer.Option(help="Export the EMA weights.")] = False,
    merged: Annotated[
        bool,
        typer.Option(
            help="LoRA runs: write the full model with the adapters merged "
            "(default: the adapter in PEFT's format)."
        ),
    ] = False,
    overwrite: Annotated[
        bool,
        typer.Option(
            help="Replace an earlier export at OUT_DIR (never one that also holds "
            "other files, e.g. your notes: move them out first)."
        ),
    ] = False,
) -> None:
    """Export a run's latest checkpoint (or the given step) in Hugging Face format
    (safetensors, config.json, tokenizer); a LoRA run's adapter in PEFT's format,
    or with --merged the full model."""
    from .. import job

    with _errors():  # the refusals name --overwrite only where it would help
        out = job.export_run(
            path, out_dir, dtype=dtype, ema=ema, merged=merged, overwrite=overwrite
        )
    typer.echo(f"exported to {out}")


@app.command(name="import")
def import_(
    hf_dir: Annotated[str, typer.Argument(help="A Hugging Face model directory.")],
    out: Annotated[str, typer.Argument(help="The new run directory to create.")],
    config: Annotated[
        Path | None,
        typer.Option(help="A TOML config for the rest of the run (data, optim, ...)."),
    ] = None,
    set_: SetOption = None,
    overwrite: Annotated[
        bool, typer.Option(help="Replace an existing, non-empty OUT.")
    ] = False,
) -> None:
    """Start a run from a Hugging Face model: its weights become OUT's step-0
    checkpoint, ready for `eqtrain fit OUT/config.toml`."""
    from .. import config as config_lib, job

    with _errors():
        cfg = config_lib.load(config, list(set_ or []))
        run_dir = job.import_hf(hf_dir, out, config=cfg, overwrite=overwrite)
    typer.echo(
        f"imported into {run_dir}; fine-tune with: eqtrain fit {run_dir}/config.toml"
    )


@app.command()
def info(
    path: Annotated[str, typer.Argument(help="A run directory or a checkpoint step.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Steps, checkpoints, metrics, export and config of a run."""
    from .. import job

    with _errors():
        data = job.run_info(path)
    if as_json:
        typer.echo(_json(data, indent=2))
        return
    typer.echo(_format_info(data))


def _experts(model: dict[str, Any]) -> str:
    """`, 8 experts (top-2)` for a mixture-of-experts `[model]` section."""
    if not model.get("num_experts"):
        return ""
    return f", {model['num_experts']} experts (top-{model['experts_per_token']})"


def _format_info(data: dict[str, Any]) -> str:
    model = data["config"]["model"]
    lines = [
        f"run:          {data['run_dir']}",
        f"model:        {model['arch']} ({model['num_layers']} layers, hidden "
        f"{model['hidden_size']}, vocab {model['vocab_size'] or 'tokenizer'}"
        f"{_experts(model)})",
        f"trained:      {data['steps_trained']} / {data['target_steps']} steps",
    ]
    adapters = data["config"].get("lora") or {}
    if adapters.get("rank") or model.get("adapter_from"):
        lines.insert(
            2,
            f"lora:         rank {adapters.get('rank') or '(from adapter_from)'}, "
            "adapters only (the base stays frozen)",
        )
    task = data["config"].get("task") or {}
    if task.get("kind", "lm") != "lm":
        reference = task.get("reference")
        with_ref = task["kind"] in ("dpo", "ipo") and reference
        lines.insert(
            2,
            f"task:         {task['kind']}"
            + (f" (reference: {reference})" if with_ref else ""),
        )
    for i, source in enumerate(data.get("sources") or []):
        lines.append(
            ("data:         " if i == 0 else "              ")
            + f"{source['name']} ({source['path']}, weight {source['weight']:g}): "
            f"{source['tokens']:,} tokens trained"
        )
    last = data["last_metrics"]
    if last:
        names = ("step", "loss", "eval/loss", "eval/accuracy")
        names += ("eval/rewards/accuracies", "stop_reason")
        shown = {k: v for k, v in last.items() if k in names}
        lines.append(f"last logged:  {_json(shown)}")
    lines.append(f"checkpoints:  {len(data['checkpoints'])}")
    for c in data["checkpoints"]:
        if c.get("error"):
            lines.append(f"  step {c['step']:>8}  DAMAGED: {c['error']}")
            continue
        reason = (c.get("stop_reason") or {}).get("kind", "")
        loss = (c.get("metrics") or {}).get("eval/loss")
        extra = f"  eval/loss {loss:.4f}" if isinstance(loss, float) else ""
        lines.append(f"  step {c['step']:>8}{extra}  {reason}".rstrip())
    for name in data.get("damaged") or []:
        lines.append(f"  moved aside (damaged): {name}")
    lines.append(f"HF export:    {data['export'] or '(none)'}")
    return "\n".join(lines)


@app.command()
def plot(
    run_dir: Annotated[str, typer.Argument(help="A run directory (metrics.jsonl).")],
    output: Annotated[
        str | None,
        typer.Option(
            "-o",
            "--output",
            help="The PNG to write (default: RUN_DIR/plot.png); a directory gets "
            "plot.png inside it.",
        ),
    ] = None,
) -> None:
    """Loss (train and eval), learning rate and throughput curves as a PNG."""
    from .. import plot as plot_lib

    with _errors():
        out = plot_lib.plot_run(run_dir, output)
    typer.echo(f"wrote {out}")


data_app = typer.Typer(
    help="Tokenized stores of a config's text data.", no_args_is_help=True
)
app.add_typer(data_app, name="data")


@data_app.command(name="prepare")
def data_prepare(
    config: Annotated[
        Path | None, typer.Argument(help="A TOML config; none: the defaults.")
    ] = None,
    set_: SetOption = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify/--no-verify",
            help="Check every committed part's sha256 (and rebuild damaged ones).",
        ),
    ] = True,
    launcher: Annotated[
        str,
        typer.Option(
            "--launcher",
            help="`local`: worker processes (data.workers); `ray`: Ray tasks on the "
            "cluster of distributed.ray_address (or a local Ray).",
        ),
    ] = "local",
) -> None:
    """Tokenize the config's text sources into stores on disk (in parallel, in
    parts that a killed run continues), so that `eqtrain fit` starts at once.
    Prints one JSON line per store."""
    from .. import config as config_lib, job

    if launcher not in ("local", "ray"):
        _fail(f"--launcher must be 'local' or 'ray'; got {launcher!r}.")
    with _errors():
        cfg = config_lib.load(config, list(set_ or []))
        if launcher == "ray":
            from ..ray import prepare_data as ray_prepare

            stores = ray_prepare(cfg, verify=verify, echo=_echo)
        else:
            stores = job.prepare_data(cfg, verify=verify, say=_echo)
    for entry in stores:
        typer.echo(_json(entry))


@app.command(name="config")
def config_(
    config: Annotated[
        Path | None, typer.Argument(help="A TOML config; none: the defaults.")
    ] = None,
    show: Annotated[
        bool, typer.Option("--show", help="Print the fully resolved config as TOML.")
    ] = True,
    set_: SetOption = None,
) -> None:
    """Print the fully resolved config (defaults, file and --set) as TOML."""
    from .. import config as config_lib

    with _errors():
        cfg = config_lib.load(config, list(set_ or []))
    if show:
        typer.echo(config_lib.to_toml(cfg), nl=False)


# One module per command from here on; each registers its function.
from ._generate import generate as _generate_command  # noqa: E402


app.command(name="generate")(_generate_command)


def main() -> None:
    """The console entry point. It first applies eqtrain's CPU settings to its own
    process (`eqtrain.tune_cpu`: glibc's allocator thresholds and Eigen dots, but
    not the dots for `eqtrain generate`, whose decode they slow down;
    `EQTRAIN_CPU_TUNING=0` opts out), before JAX starts a backend."""
    global _OWNS_PROCESS
    from .._cpu import tune_cpu

    tune_cpu(dots=sys.argv[1:2] != ["generate"])
    _OWNS_PROCESS = True
    app(prog_name="eqtrain")
