"""`resume_run`'s decision, as a table: what the run directory holds and what
`resume` names -> what is restored and which steps are discarded, or the refusal
(pure: no files, no arrays)."""

from pathlib import Path

import pytest

from eqtrain.checkpoint import CheckpointError
from eqtrain.checkpoint._resume_plan import Decision, Situation, decide


RUN = Path("/runs/a/checkpoints")
OTHER = "/runs/b/checkpoints/4"


def _seen(asked, existing=(), **more):
    source = {"step": f"{RUN}/2", "other": OTHER}.get(asked)
    return Situation(RUN, asked, source=source, existing=existing, **more)


CASES = [
    # auto: the newest step, or a fresh start; never over damaged steps alone
    (_seen("auto"), False, Decision("fresh")),
    (_seen("auto", (2, 4)), False, Decision("newest")),
    (_seen("auto", (2, 4)), True, Decision("newest")),  # nothing to overwrite
    (_seen("auto", damaged=("4.damaged-x",)), False, "only damaged ones"),
    (_seen("auto", (2,), damaged=("4.damaged-x",)), False, Decision("newest")),
    # never: a fresh start; over existing steps only with overwrite (deleted)
    (_seen("never"), False, Decision("fresh")),
    (_seen("never", (2, 4)), False, r"steps \[2, 4\]\) and --resume never"),
    (_seen("never", (2, 4)), True, Decision("fresh", discard=(2, 4))),
    # a step of this run: a rollback, discarding later steps only with overwrite
    (_seen("step", (2,), step=2), False, Decision("step", 2)),
    (_seen("step", (2, 4, 6), step=2), False, r"later checkpoint\(s\) \[4, 6\]"),
    (_seen("step", (2, 4, 6), step=2), True, Decision("step", 2, discard=(4, 6))),
    # another run's checkpoint: a new run, over this one's steps only with overwrite
    (_seen("other"), False, Decision("other")),
    (_seen("other", (2,)), False, f"of another run; starting it over from {OTHER}"),
    (_seen("other", (2,)), True, Decision("other", discard=(2,))),
    # ... unless this run started from it: the same command again continues it
    (_seen("other", (2,), continued=True), False, Decision("newest")),
]


@pytest.mark.parametrize("situation, overwrite, expected", CASES)
def test_resume_decision(situation, overwrite, expected):
    if isinstance(expected, Decision):
        assert decide(situation, overwrite=overwrite) == expected
    else:
        with pytest.raises(CheckpointError, match=expected):
            decide(situation, overwrite=overwrite)


def test_restore_or_init_names_its_replacement(tmp_path):
    from eqtrain import ConfigError
    from eqtrain.checkpoint import restore_or_init

    with pytest.raises(ConfigError, match="call `resume_run` with the same"):
        restore_or_init(tmp_path, lambda: None)
