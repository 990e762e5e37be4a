"""eqtrain: an Equinox-based, functional training toolkit for JAX.

The whole run is one immutable pytree (`TrainState`); pure step builders advance it
(`train_step`, `eval_step`); `jit` compiles a step over the state's array leaves; and
`fit` drives it, calling plain-callable hooks between steps.
"""

from . import (
    hooks as hooks,
    lora as lora,
    optim as optim,
    sharding as sharding,
    step as step,
)
from ._copy import copy as copy
from ._errors import (
    ConfigError as ConfigError,
    DonatedStateError as DonatedStateError,
    EqtrainError as EqtrainError,
    EqtrainWarning as EqtrainWarning,
    StopTraining as StopTraining,
    StructureError as StructureError,
)
from ._fit import (
    CheckpointerProtocol as CheckpointerProtocol,
    Evaluation as Evaluation,
    FitResult as FitResult,
    Reading as Reading,
    StopConditions as StopConditions,
    evaluate as evaluate,
    fit as fit,
)
from ._hooks import (
    Scheduled as Scheduled,
    StateUnavailableError as StateUnavailableError,
    StepInfo as StepInfo,
    StopKind as StopKind,
    StopReason as StopReason,
    at as at,
    at_end as at_end,
    every as every,
    every_seconds as every_seconds,
    metrics_only as metrics_only,
    uses_state as uses_state,
)
from ._jit import CheckedOptions as CheckedOptions, Jitted as Jitted, jit as jit
from ._precision import Precision as Precision
from ._state import TrainState as TrainState, trainable_mask as trainable_mask
from .step import (
    TrainStep as TrainStep,
    batch_weight as batch_weight,
    eval_step as eval_step,
    train_step as train_step,
)


__version__ = "0.1.0"

# The sub-packages a user reaches for, imported on first use (`eqtrain.data`
# works after `import eqtrain` alone) and not before: `import eqtrain` stays
# the core's import.
_SUBPACKAGES = frozenset(
    {
        "checkpoint", "config", "cpu", "data", "distributed", "generate", "hf",
        "losses", "models", "plot", "post_training",
    }
)  # fmt: skip

# Names that moved, kept for one release: `name -> (new module, new name)`.
_MOVED = {
    "tune_cpu": ("eqtrain.cpu", "tune_cpu"),
    "cpu_settings": ("eqtrain.cpu", "cpu_settings"),
    "CPUPerformanceWarning": ("eqtrain.cpu", "CPUPerformanceWarning"),
    "Checkpointer": ("eqtrain._fit", "CheckpointerProtocol"),
}


def __getattr__(name: str) -> object:
    import importlib

    if name in _SUBPACKAGES:
        return importlib.import_module(f"eqtrain.{name}")
    if name in _MOVED:
        import warnings

        module, new = _MOVED[name]
        public = "eqtrain" if module == "eqtrain._fit" else module
        hint = (
            " (the class that saves checkpoints is `eqtrain.checkpoint.Checkpointer`)"
            if name == "Checkpointer"
            else ""
        )
        warnings.warn(
            f"`eqtrain.{name}` is now `{public}.{new}`{hint}; the old name goes "
            "in the next release.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(module), new)
    raise AttributeError(f"module 'eqtrain' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _SUBPACKAGES)
