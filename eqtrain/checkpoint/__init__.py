"""Checkpoints on Orbax: the state's arrays (OCDBT), the data position and a run
manifest per step, saved asynchronously by `Checkpointer` (for `fit`), restored with
`restore` / `resume_run` into an abstract template, with resharding.

    resumed = resume_run(run_dir, init, resume="auto", data=loader)
    ckpt = Checkpointer(run_dir, every_steps=500, keep_last=3, data=loader,
                        run_id=resumed.run_id)
    eqtrain.fit(resumed.state, step_fn, loader, num_steps=10_000, checkpointer=ckpt)
"""

from ._errors import (
    BaseChangedError as BaseChangedError,
    CheckpointError as CheckpointError,
    CheckpointWarning as CheckpointWarning,
    IncompatibleCheckpointError as IncompatibleCheckpointError,
)
from ._lock import RunInUseError as RunInUseError, RunLock as RunLock
from ._manager import Checkpointer as Checkpointer
from ._restore import (
    DamagedCheckpointError as DamagedCheckpointError,
    Restored as Restored,
    restore as restore,
)
from ._resume import (
    Resumed as Resumed,
    restore_or_init as restore_or_init,
    resume_run as resume_run,
)
from ._storage import (
    check_path as check_path,
    damaged_steps as damaged_steps,
    list_steps as list_steps,
    read_manifest as read_manifest,
    resolve as resolve,
    step_problems as step_problems,
)
