"""`eqtrain plot`: a run's curves as a PNG (`eqtrain.plot.plot_run`)."""

from typing import Annotated

import typer

from ._shared import errors


RunDir = Annotated[str, typer.Argument(help="A run directory (metrics.jsonl).")]
Output = Annotated[
    str | None,
    typer.Option(
        "-o",
        "--output",
        help="The PNG to write (default: RUN_DIR/plot.png); a directory gets "
        "plot.png inside it.",
    ),
]


def plot(run_dir: RunDir, output: Output = None) -> None:
    """Loss (train and eval), learning rate and throughput curves as a PNG."""
    from .. import plot as plot_lib

    with errors():
        out = plot_lib.plot_run(run_dir, output)
    typer.echo(f"wrote {out}")
