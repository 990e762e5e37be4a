"""Errors raised by `eqtrain.data`: both are `EqtrainError`s and builtin errors."""

import os
from typing import Any

from .._errors import ConfigError, EqtrainError, EqtrainWarning


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


def positive(name: str, value: Any) -> int:
    """`value`, checked to be an int >= 1 (the setting `name`'s)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"`{name}` must be an int >= 1; got {value!r}.")
    return value


def too_few_tokens(seq_len: int, documents: int, tokens: int) -> DataError:
    """The error for data too short for one row of `seq_len` (+ 1) tokens."""
    return DataError(
        f"seq_len={seq_len} is too large for the data: {documents} documents hold "
        f"{tokens} tokens (with EOS), and one row needs seq_len + 1 = "
        f"{seq_len + 1}. Use a smaller seq_len or more documents."
    )


def missing_field(field: str, available: list[str], where: str) -> DataError:
    """The error for a column/field `field` absent from `where`."""
    return DataError(
        f"{where} has no field {field!r}; available: {sorted(available)}. Pass the "
        "right name (the config's data.text_column; in Python the `field=` or "
        "`column=` argument) or rename the field in the data."
    )
