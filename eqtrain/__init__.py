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
from ._cpu import (
    CPUPerformanceWarning as CPUPerformanceWarning,
    cpu_settings as cpu_settings,
    tune_cpu as tune_cpu,
)
from ._errors import (
    ConfigError as ConfigError,
    DonatedStateError as DonatedStateError,
    EqtrainError as EqtrainError,
    EqtrainWarning as EqtrainWarning,
    StopTraining as StopTraining,
    StructureError as StructureError,
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
from ._jit import Jitted as Jitted, jit as jit
from ._loop import (
    Checkpointer as Checkpointer,
    Evaluation as Evaluation,
    FitResult as FitResult,
    evaluate as evaluate,
    fit as fit,
)
from ._precision import Precision as Precision
from ._reading import Reading as Reading
from ._state import TrainState as TrainState, trainable_mask as trainable_mask
from ._stops import StopConditions as StopConditions
from .step import (
    TrainStep as TrainStep,
    batch_weight as batch_weight,
    eval_step as eval_step,
    train_step as train_step,
)


__version__ = "0.1.0"
