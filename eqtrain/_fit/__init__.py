"""`fit` and its parts: the loop (`_loop`), the ways a run stops (`_stops`,
`_signals`), metrics read off the device (`_reading`), evaluation inside the
loop (`_evaluation`), the checkpointer's guard (`_checkpointer`), what an
exception on the way out says (`_failures`), the states of hooks that keep one
across a resume (`_hook_states`), and the previous release's flat keywords
(`_fit_keywords`). The root facade re-exports `fit` and its types;
the job and the CLI take the rest from here.
"""

from ._checkpointer import CheckpointerProtocol as CheckpointerProtocol
from ._evaluation import Evaluation as Evaluation, evaluate as evaluate
from ._failures import failed_at as failed_at
from ._loop import FitResult as FitResult, fit as fit
from ._reading import Reading as Reading
from ._signals import (
    SignalGuard as SignalGuard,
    guarded as guarded,
    install_for_process as install_for_process,
)
from ._stops import StopConditions as StopConditions
