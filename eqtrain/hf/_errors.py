"""Errors of the Hugging Face import/export (subclasses of `EqtrainError`)."""

from .._errors import EqtrainError, EqtrainWarning


class HFFormatError(EqtrainError, ValueError):
    """A Hugging Face directory or file is not what `eqtrain.hf` can read or
    write: unknown `model_type`, missing/unexpected/misshapen tensors, a pickle
    checkpoint, a damaged safetensors header, an unsupported config option."""


class HFFileNotFoundError(EqtrainError, FileNotFoundError):
    """A Hugging Face directory or one of its files does not exist."""


class HFExportExistsError(EqtrainError, FileExistsError):
    """The export directory exists already and `overwrite=False`."""


class HFExportWarning(EqtrainWarning):
    """Replacing an earlier export kept files that are not part of an export."""
