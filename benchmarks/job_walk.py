"""The walk through `eqtrain.job.run`: which job/ modules ("rooms") a small run
enters, in order, and how often it returns to a room it has already left.

Issue 31's measure of the job's shape: every call into a function of an
`eqtrain.job.*` module is recorded (`sys.setprofile`), consecutive calls in the
same module collapsed. Not a speed benchmark: the figures do not depend on the
machine. A job whose phases run one after the other, each calling only the
rooms below it, has few returns.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/job_walk.py   # ~20 s
"""

import json
import os
import sys
import tempfile


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import eqtrain.config  # noqa: E402
import eqtrain.job  # noqa: E402


def walk() -> list[str]:
    """The job/ modules a 2-step run of the default config enters, in order."""
    entered: list[str] = []

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith("eqtrain.job."):
            if not entered or entered[-1] != module:
                entered.append(module)

    with tempfile.TemporaryDirectory() as tmp:
        sets = [f"run_dir={tmp}/run", "loop.steps=2", "data.batch_size=2"]
        config = eqtrain.config.load(None, [*sets, "data.seq_len=32"])
        sys.setprofile(profile)
        try:
            eqtrain.job.run(config, echo=lambda text: None)
        finally:
            sys.setprofile(None)
    return entered


def main() -> None:
    entered = walk()
    rooms = len(set(entered))
    print(" -> ".join(name.rsplit(".", 1)[-1] for name in entered))
    record = {"rooms": rooms, "entries": len(entered), "returns": len(entered) - rooms}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
