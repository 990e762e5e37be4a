"""The `eqtrain` command: a thin Typer shell over `eqtrain.config` and
`eqtrain.job`. Each command lives in a module of its own (`_fit`, `_eval`,
`_export`, ...), parses its arguments into a config and calls one library
function; errors of ours exit with code 2 and one paragraph, no traceback
(`_shared`)."""

import sys

import typer

from .._errors import ConfigError
from . import _fit
from ._config import config_
from ._data import data_prepare
from ._eval import eval_
from ._export import export
from ._generate import generate
from ._import import import_
from ._info import info
from ._plot import plot
from ._shared import EXIT_USAGE as EXIT_USAGE


app = typer.Typer(
    name="eqtrain",
    help="Train, evaluate, inspect and export eqtrain runs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command()(_fit.fit)
app.command(name="eval")(eval_)
app.command()(export)
app.command(name="import")(import_)
app.command()(info)
app.command()(plot)
app.command(name="config")(config_)
app.command(name="generate")(generate)

data_app = typer.Typer(
    help="Tokenized stores of a config's text data.", no_args_is_help=True
)
data_app.command(name="prepare")(data_prepare)
app.add_typer(data_app, name="data")


def main() -> None:
    """The console entry point. It first applies eqtrain's CPU settings to its own
    process (`eqtrain.cpu.tune_cpu`: glibc's allocator thresholds and the XLA flags
    measured fastest on this processor, but not XLA's flags for `eqtrain
    generate`, whose decode Eigen's products slow down; `EQTRAIN_CPU_TUNING=0`
    opts out), before JAX starts a backend."""
    from ..cpu import tune_cpu

    say = lambda text: print(text, file=sys.stderr, flush=True)
    command = sys.argv[1:2]  # only a run that trains waits for the probe
    try:
        tune_cpu(dots=command != ["generate"], say=say, measure=command == ["fit"])
    except ConfigError as e:  # EQTRAIN_CPU_TUNING names no setting
        say(f"error: {e}")
        raise SystemExit(2) from None
    _fit.owns_process = True
    app(prog_name="eqtrain")
