"""`prepare(config)`: a run assembled phase by phase, without training. Each
phase is a function from one frozen value to the next, and each lives in its
own module:

    _resumable.check   the config against its directory's checkpoints
    _plan.plan         -> Plan: job, rows, placement, samples (no directory yet)
    _claim.claim       -> Claimed: outputs checked, the directory's lock
    _start.start       -> Start: loader, state restored or new, run files
    _assemble.assemble -> Prepared: compiled steps, checkpointer, hooks
"""

import sys
from collections.abc import Callable

from ..config import Config
from . import _assemble, _claim, _plan, _resumable, _start
from ._assemble import Prepared


def stderr(text: str) -> None:
    """Print a progress note to standard error."""
    print(text, file=sys.stderr, flush=True)


def prepare(
    config: Config,
    *,
    resume: str | None = None,
    overwrite: bool = False,
    echo: Callable[[str], None] | None = None,
    export: bool = True,
) -> Prepared:
    """Assemble the run `config` describes, without training: check everything,
    create the run directory, restore or initialise the state (and for
    `task.reference = "precomputed"`, compute or read the reference log-probs),
    compile nothing yet. `run` is `prepare` followed by `eqtrain.fit`.
    Progress notes go to `echo` (default: standard error); `export=False` leaves
    out the Hugging Face export (see `run`)."""
    request = _start.Request(
        resume or config.checkpoint.resume, overwrite, echo or stderr, export
    )
    # Before any data is read: a config its checkpoints cannot continue.
    recorded = _resumable.check(config, request.resume)
    planned = _plan.plan(config, recorded=recorded)
    claimed = _claim.claim(planned.job, export=export)
    try:
        start = _start.start(planned, request)  # closes its loader if it fails
    except BaseException:
        _release(claimed)
        raise
    try:
        return _assemble.assemble(planned, start, claimed, export)
    except BaseException:
        start.loader.close()
        _release(claimed)
        raise


def _release(claimed: _claim.Claimed) -> None:
    """Let go of the run directory's lock (a run that failed to start)."""
    if claimed.lock is not None:
        claimed.lock.release()
