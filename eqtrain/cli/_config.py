"""`eqtrain config`: the fully resolved config of a file and `--set` overrides,
as TOML (`eqtrain.config.to_toml`)."""

from typing import Annotated

import typer

from ._shared import ConfigArgument, SetOption, errors, load_config


Show = Annotated[
    bool, typer.Option("--show", help="Print the fully resolved config as TOML.")
]


def config_(
    config: ConfigArgument = None, show: Show = True, set_: SetOption = None
) -> None:
    """Print the fully resolved config (defaults, file and --set) as TOML."""
    from .. import config as config_lib

    with errors():
        cfg = load_config(config, set_)
    if show:
        typer.echo(config_lib.to_toml(cfg), nl=False)
