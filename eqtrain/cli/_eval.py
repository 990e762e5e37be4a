"""`eqtrain eval`: evaluate a run's checkpoint on its eval data
(`eqtrain.job.evaluate_run`)."""

import typer

from ._shared import RunPath, SetOption, errors, json_text


def eval_(path: RunPath, set_: SetOption = None) -> None:
    """Evaluate a run's latest checkpoint (or the given step) on its eval data;
    prints one JSON object."""
    from .. import job

    with errors():
        metrics = job.evaluate_run(path, list(set_ or []))
    typer.echo(json_text(metrics))
