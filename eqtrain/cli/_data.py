"""`eqtrain data prepare`: tokenize a config's text sources into stores on disk,
with local worker processes (`eqtrain.job.prepare_data`) or Ray tasks
(`eqtrain.ray.prepare_data`)."""

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
    parts that a killed run continues), so that `eqtrain fit` starts at once.
    Prints one JSON line per store."""
    if launcher not in ("local", "ray"):
        fail(f"--launcher must be 'local' or 'ray'; got {launcher!r}.")
    with errors():
        stores = _prepare(load_config(config, set_), verify, launcher)
    for entry in stores:
        typer.echo(json_text(entry))


def _prepare(cfg: Any, verify: bool, launcher: str) -> list[dict[str, Any]]:
    """The stores of `cfg`'s sources, prepared by `launcher`."""
    from .. import job, ray

    if launcher == "ray":
        return ray.prepare_data(cfg, verify=verify, echo=echo_err)
    return job.prepare_data(cfg, verify=verify, say=echo_err)
