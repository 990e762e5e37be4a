"""`eqtrain data prepare`: tokenize a config's text sources (or post-training
records) into stores on disk, with local worker processes
(`eqtrain.job.prepare_data`) or Ray tasks (`eqtrain.ray.prepare_data`)."""

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Annotated, Any

import typer

from ._shared import (
    ConfigArgument,
    SetOption,
    echo_err,
    errors,
    fail,
    json_text,
    load_config,
)


Verify = Annotated[
    bool,
    typer.Option(
        "--verify/--no-verify",
        help="Check every committed part's sha256 (and rebuild damaged ones).",
    ),
]
Launcher = Annotated[
    str,
    typer.Option(
        "--launcher",
        help="`local`: worker processes (data.workers); `ray`: Ray tasks on the "
        "cluster of distributed.ray_address (or a local Ray).",
    ),
]


def data_prepare(
    config: ConfigArgument = None,
    set_: SetOption = None,
    verify: Verify = True,
    launcher: Launcher = "local",
) -> None:
    """Tokenize the config's text sources into stores on disk (in parallel, in
    parts that a killed run continues), so that `eqtrain fit` starts at once;
    for post-training tasks (sft, dpo, grpo, ...) encode the record files with
    the run's chat template into post-training stores. Prints one JSON line per
    store."""
    if launcher not in ("local", "ray"):
        fail(f"--launcher must be 'local' or 'ray'; got {launcher!r}.")
    with _interruptible(), errors():
        stores = _prepare(load_config(config, set_), verify, launcher)
    for entry in stores:
        typer.echo(json_text(entry))


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGINT (Ctrl-C) or SIGTERM ends the command at once, with one line and
    exit 128 + the signal's number. The build stops where it is: its worker
    processes (which ignore SIGINT) are killed and their unfinished files
    removed, the parts committed so far are kept. Nothing else runs here that a
    `KeyboardInterrupt` could tear (no checkpoint, no JAX), so SIGTERM is simply
    turned into one."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers are set from the main thread only
        return
    received = [signal.SIGINT]

    def on_term(signum: int, frame: Any) -> None:
        received[0] = signal.SIGTERM
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except KeyboardInterrupt:
        name = signal.Signals(received[0]).name
        typer.echo(
            f"error: interrupted by {name}: the parts committed so far are kept "
            "(the unfinished ones were removed); `eqtrain data prepare` with the "
            "same config continues from them.",
            err=True,
        )
        raise typer.Exit(128 + received[0]) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _prepare(cfg: Any, verify: bool, launcher: str) -> list[dict[str, Any]]:
    """The stores of `cfg`'s sources, prepared by `launcher`."""
    from .. import job, ray

    if launcher == "ray":
        return ray.prepare_data(cfg, verify=verify, echo=echo_err)
    return job.prepare_data(cfg, verify=verify, say=echo_err)
