"""The eqtrain error family: errors raised on purpose subclass `EqtrainError`."""


class EqtrainError(Exception):
    """Base class of the errors eqtrain raises on purpose."""


class ConfigError(EqtrainError, ValueError):
    """A builder or function was given a value it cannot use."""


class EqtrainWarning(UserWarning):
    """Base class of eqtrain's warnings (the `eqtrain` command prints them as one
    `warning: ...` paragraph, without Python's file and line)."""


class StructureError(EqtrainError, ValueError):
    """A pytree did not have the expected structure (e.g. a step changed it)."""


class DonatedStateError(EqtrainError, RuntimeError):
    """A step was given a state whose arrays an earlier donating step consumed."""


class StopTraining(Exception):  # noqa: N818 -- a request, not an error
    """Raise from a hook to stop `fit` cleanly.

    `fit` catches it, records a `StopReason` of kind ``"hook"`` with the message,
    runs the final hooks and the checkpointer, and returns normally. A hook that
    declares `uses_state = True` stops the run at exactly the step it was called
    for; other hooks run late, so the run stops at the first step boundary after
    the hook ran (`StopReason.step` says which, and a warning says how far).
    """

    def __init__(self, message: str = "a hook requested a stop"):
        super().__init__(message)
        self.message = message
