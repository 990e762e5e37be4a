"""Errors raised by `eqtrain.data`: both are `EqtrainError`s and builtin errors."""

import os

from .._errors import EqtrainError, EqtrainWarning


PathLike = str | os.PathLike[str]


class DataError(EqtrainError, ValueError):
    """The data cannot be used as given: empty, a missing column or field, a file
    that does not parse, or a sequence/batch size larger than the data."""


class ChatTemplateError(DataError):
    """One conversation that a chat template cannot encode.

    `reason` is a short phrase for skip reports, e.g. "with malformed messages".
    """

    def __init__(self, message: str, *, reason: str):
        super().__init__(message)
        self.reason = reason


class DataWarning(EqtrainWarning):
    """Rows of the data that were skipped (e.g. a null text): counted in one
    warning, never trained on."""


class DataFileNotFoundError(EqtrainError, FileNotFoundError):
    """A data or tokenizer file (or directory) that was asked for does not exist."""


def check_exists(path: PathLike, what: str) -> None:
    """Raise `DataFileNotFoundError` naming `what` if `path` does not exist."""
    path = os.fspath(path)
    if os.path.exists(path):
        return
    parent = os.path.dirname(os.path.abspath(path))
    hint = (
        f"its directory {parent} exists: check the name"
        if os.path.isdir(parent)
        else f"its directory {parent} does not exist either"
    )
    raise DataFileNotFoundError(
        f"{what} not found: {path} ({hint}). Pass the path of an existing local "
        "file; eqtrain.data never downloads."
    )


def missing_field(field: str, available: list[str], where: str) -> DataError:
    """The error for a column/field `field` absent from `where`."""
    return DataError(
        f"{where} has no field {field!r}; available: {sorted(available)}. Pass the "
        "right name (the config's data.text_column; in Python the `field=` or "
        "`column=` argument) or rename the field in the data."
    )
