"""What every `eqtrain` command shares: the `--set` option and the arguments of
several commands, strict JSON output, and our errors as exit 2 with one
paragraph (no traceback)."""

import contextlib
import json
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from .._errors import EqtrainError


EXIT_USAGE = 2

SetOption = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override a config key, e.g. --set optim.lr=1e-4 (repeatable).",
        metavar="KEY=VALUE",
    ),
]
ConfigArgument = Annotated[
    Path | None, typer.Argument(help="A TOML config; none: the defaults.")
]
RunPath = Annotated[str, typer.Argument(help="A run directory or a checkpoint step.")]


def load_config(path: Path | None, set_: list[str] | None) -> Any:
    """The command's config: defaults, the file at `path`, then `--set`."""
    from .. import config

    return config.load(path, list(set_ or []))


def echo_err(text: str) -> None:
    """A progress line, on standard error (standard output is the result)."""
    typer.echo(text, err=True)


def json_text(data: Any, **kwargs: Any) -> str:
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


def fail(message: str) -> NoReturn:
    """Exit 2 with `message` as one `error: ...` paragraph."""
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    raise typer.Exit(EXIT_USAGE)


@contextlib.contextmanager
def errors() -> Iterator[dict[str, Any]]:
    """Our errors (bad config, files, checkpoints) and failed writes (no space,
    read-only, not a directory, is a directory) become exit 2 with a message.
    The body may set `where["run_dir"]`: a failed write then names the run's
    last complete checkpoint."""
    where: dict[str, Any] = {}
    try:
        with _plain_warnings():
            yield where
    except EqtrainError as e:
        fail(str(e))
    except OSError as e:
        _write_failed(e, where.get("run_dir"))


def _write_failed(error: OSError, run_dir: Any) -> NoReturn:
    """A failed write as exit 2 (any other OSError propagates)."""
    from .. import job

    if not job.is_write_error(error):
        raise error
    fail(job.write_error_message(error, run_dir))


@contextlib.contextmanager
def _plain_warnings() -> Iterator[None]:
    """eqtrain's warnings (a damaged checkpoint moved aside, ...) as one
    `warning: ...` paragraph, without Python's file and line."""
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
