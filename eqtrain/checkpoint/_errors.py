"""Checkpoint errors and the warning issued when a damaged checkpoint is skipped."""

from .._errors import EqtrainError


class CheckpointError(EqtrainError, RuntimeError):
    """No usable checkpoint where one was required, or a run directory in a state
    that would mix two runs."""


class IncompatibleCheckpointError(CheckpointError, ValueError):
    """A checkpoint's arrays do not match the state it is restored into."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (unreadable) and an older one used instead."""


class BaseChangedError(CheckpointError):
    """A checkpoint storing only trained leaves (a LoRA run) references a base
    model whose content changed since it was written."""
