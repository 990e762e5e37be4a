"""`eqtrain fit`: train in this process (`eqtrain.job.run`), report what a run
would do (`--dry-run`, `--memory-budget`), or supervise workers placed by Ray
(`--launcher ray`, `eqtrain.ray.fit`)."""

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer

from .._errors import ConfigError
from ._shared import SetOption, echo_err, errors
from ._summary import abort_note, exit_if_nonfinite, print_summary, write_result


# Set by `eqtrain.cli.main`: this process is the `eqtrain` command, so `fit` may
# keep its signal guard installed until the interpreter exits.
owns_process = False

ConfigPath = Annotated[
    Path | None,
    typer.Argument(help="A TOML config; none: the built-in default run."),
]
DryRun = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Print the mesh, parameters, sharding and the compiled step's "
        "memory per device; do not train.",
    ),
]
MemoryBudget = Annotated[
    str | None,
    typer.Option(
        "--memory-budget",
        help="With --dry-run (implied): also find the longest data.seq_len "
        "whose step fits this much memory per device (e.g. 16GB), by "
        "compiling a few lengths.",
    ),
]
Resume = Annotated[
    str | None,
    typer.Option(
        help="auto | never | PATH of a run or checkpoint (default: "
        "checkpoint.resume, itself 'auto').",
    ),
]
RunDir = Annotated[
    str | None, typer.Option(help="Where the run writes (overrides run_dir).")
]
Overwrite = Annotated[
    bool,
    typer.Option(
        help="Discard the run's checkpoints that would be mixed with new ones: "
        "with --resume never (all), a rollback --resume RUN/checkpoints/N "
        "(the later ones), or --resume of another run."
    ),
]
Launcher = Annotated[
    str | None,
    typer.Option(
        help="ray: run as distributed.processes processes placed by Ray (the "
        "`ray` extra), restarted together from the last checkpoint when one "
        "fails (see distributed.*).",
        metavar="ray",
    ),
]
ResultFile = Annotated[str | None, typer.Option(hidden=True)]
ExportAtEnd = Annotated[bool, typer.Option("--export/--no-export", hidden=True)]


@dataclasses.dataclass(frozen=True)
class _Request:
    """What `eqtrain fit` was asked to do, from its options."""

    config: Path | None
    overrides: list[str]  # --set, then --run-dir
    report_only: bool  # --dry-run or --memory-budget
    memory_budget: str | None
    resume: str | None
    overwrite: bool
    export: bool


def fit(
    config: ConfigPath = None,
    set_: SetOption = None,
    dry_run: DryRun = False,
    memory_budget: MemoryBudget = None,
    resume: Resume = None,
    run_dir: RunDir = None,
    overwrite: Overwrite = False,
    launcher: Launcher = None,
    result_file: ResultFile = None,
    export_: ExportAtEnd = True,
) -> None:
    """Train. With no CONFIG: a small byte-level Llama on the Python standard
    library, on CPU, in a few minutes."""
    overrides = list(set_ or [])
    if run_dir is not None:
        overrides.append(f"run_dir={run_dir}")
    report_only = dry_run or memory_budget is not None
    request = _Request(
        config, overrides, report_only, memory_budget, resume, overwrite, export_
    )
    with errors() as where:
        if launcher is not None:
            return _launch(launcher, request)
        result = _train(request, where)
    if result is not None:  # None: a dry run
        _finish(result, result_file)


def _finish(result: Any, result_file: str | None) -> None:
    """The summary, or for the launcher (`eqtrain.ray`, which prints the
    summary) the result file; exit 1 when the loss went non-finite."""
    if result_file is None:
        print_summary(result.fit.stop_reason, result.fit.metrics, result)
    else:
        write_result(result_file, result)
    exit_if_nonfinite(result.fit.stop_reason)


def _train(request: _Request, where: dict[str, Any]) -> Any:
    """`eqtrain.job.run` in this process (one of several with EQTRAIN_* or
    SLURM variables), under a signal guard; None after a dry run."""
    from .. import _fit, config as config_lib, distributed, job

    cluster = distributed.initialize()  # a no-op unless EQTRAIN_* or SLURM say so
    # After `initialize`: JAX's preemption notice takes SIGTERM over when it
    # starts, and the guard must be the handler the process ends up with.
    if owns_process:
        # This process is `eqtrain fit`: a second signal at any moment from
        # here to the interpreter's exit aborts at once (exit 128 + signal).
        _fit.install_for_process()
    with _fit.guarded() as guard:
        cfg = config_lib.load(request.config, request.overrides)
        _check_processes(cfg, cluster.num_processes)
        if cluster.num_processes > 1:
            _same_cpu_settings(cluster)
        if request.report_only:
            return _dry_run(cfg, request.memory_budget)
        where["run_dir"] = cfg.run_dir
        if guard is not None:
            guard.note = lambda: abort_note(cfg)
        return job.run(
            cfg,
            resume=request.resume,
            overwrite=request.overwrite,
            echo=echo_err,
            export=request.export,
        )


def _check_processes(cfg: Any, running: int) -> None:
    wanted = cfg.distributed.processes
    if wanted > 1 and running == 1:
        raise ConfigError(
            f"distributed.processes = {wanted} needs a launcher that starts the "
            "processes: add `--launcher ray`, or start them yourself with "
            "EQTRAIN_* or SLURM variables (docs/distributed.md)."
        )


def _same_cpu_settings(cluster: Any) -> None:
    """Say this process's CPU settings, and refuse a multi-process run on the
    CPU whose processes apply different ones (a processor of another kind, a
    cache of its own): their products would round differently, and the
    processes would no longer compute as the devices of one process do."""
    import jax

    from .. import cpu as _cpu, distributed

    if jax.default_backend() != "cpu":
        return
    settings = _cpu.cpu_settings()
    echo_err(f"process {cluster.process_id}: CPU settings {settings}")
    code = _cpu.setting_code()
    highest, lowest = distributed.agree([code, -code])
    if highest != -lowest:
        spec = _cpu.shared_setting().get(_cpu.OPT_OUT, "fixed")
        raise ConfigError(
            f"the {cluster.num_processes} processes of this run apply different "
            f"CPU settings (process {cluster.process_id}: {settings}); the "
            "products would round differently from process to process. Give "
            f"every process the same: EQTRAIN_CPU_TUNING={spec} (and the same "
            "XLA_FLAGS and PJRT_NPROC), as `eqtrain fit --launcher ray` does."
        )


def _dry_run(cfg: Any, memory_budget: str | None) -> None:
    """`--dry-run`: the run's report; with `--memory-budget` also the longest
    `data.seq_len` that fits it."""
    from .. import config as config_lib, job

    budget = None
    if memory_budget is not None:
        budget = config_lib.parse_size(memory_budget, field="--memory-budget")
    typer.echo(job.report(cfg))
    if budget is not None:
        typer.echo("")
        typer.echo(job.budget_report(cfg, budget, memory_budget))


def _launch(launcher: str, request: _Request) -> None:
    """`eqtrain fit --launcher ray`: the supervisor runs here; the workers run
    `eqtrain fit` themselves."""
    from .. import config as config_lib, ray as ray_launcher

    if launcher != "ray":
        raise ConfigError(
            f"--launcher must be `ray` (the only launcher so far); got {launcher!r}. "
            "Leave it out to train in this process."
        )
    cfg = config_lib.load(request.config, request.overrides)
    if request.report_only:
        ray_launcher.plan(cfg)  # what the launcher refuses, refused now
        return _dry_run(cfg, request.memory_budget)
    result = ray_launcher.fit(
        cfg, resume=request.resume, overwrite=request.overwrite, echo=echo_err
    )
    restarts = (f"restarts: {result.restarts}",) if result.restarts else ()
    print_summary(result.stop_reason, result.metrics, result, restarts)
    exit_if_nonfinite(result.stop_reason)
