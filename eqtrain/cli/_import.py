"""`eqtrain import`: a new run whose step-0 checkpoint is a Hugging Face model's
weights (`eqtrain.job.import_hf`)."""

from pathlib import Path
from typing import Annotated

import typer

from ._shared import SetOption, errors, load_config


HFDir = Annotated[str, typer.Argument(help="A Hugging Face model directory.")]
Out = Annotated[str, typer.Argument(help="The new run directory to create.")]
ConfigOption = Annotated[
    Path | None,
    typer.Option(help="A TOML config for the rest of the run (data, optim, ...)."),
]
Overwrite = Annotated[bool, typer.Option(help="Replace an existing, non-empty OUT.")]


def import_(
    hf_dir: HFDir,
    out: Out,
    config: ConfigOption = None,
    set_: SetOption = None,
    overwrite: Overwrite = False,
) -> None:
    """Start a run from a Hugging Face model: its weights become OUT's step-0
    checkpoint, ready for `eqtrain fit OUT/config.toml`."""
    from .. import job

    with errors():
        cfg = load_config(config, set_)
        run_dir = job.import_hf(hf_dir, out, config=cfg, overwrite=overwrite)
    typer.echo(
        f"imported into {run_dir}; fine-tune with: eqtrain fit {run_dir}/config.toml"
    )
