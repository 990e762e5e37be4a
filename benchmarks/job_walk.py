"""The walk through `eqtrain.job.run`: which job/ modules ("rooms") a small run
enters, in order, and how often it comes back to a room it has already left.

Issue 31's measure of the job's shape. Every call into a function of an
`eqtrain.job.*` module is recorded (`sys.setprofile`); code Python generates
(a dataclass's `__init__`) is not a room's code and is left out. Not a speed
benchmark: the figures do not depend on the machine.

Two counts of coming back:

- `returns`: a visit to a room that was entered before and has been left (none
  of its functions is still running). A room that calls another room and then
  goes on with its own work has not been left, so a phase calling the rooms
  below it in turn adds nothing; calling the same room twice with another room
  in between does. The walk prints these visits, and names each return.
- `calls_back`: the cruder count the issue first measured (29 returns on the
  job before its phases): every entry into a room other than the last one
  entered, whether or not the room was left in between.

Returns into the methods of the frozen values the phases hand on (`Job`,
`Placement`, `Prepared`) are counted too, and marked as such: calling
`placement.place(state)` reads the value, it does not walk back into a phase.
Each return names the room it came from (a library callback, such as an
export hook calling the function `job.exported`, comes from outside job/).

Two counts of what must stay at zero:

- `returns_into_phases`: returns into a phase's own module (`PHASES`) other
  than a value's method: a phase walking back into another.
- `build_after_plan`: calls into `job/_build.py` after `_plan.plan` returned,
  every one (not only those that are returns): the phases after the plan read
  the `Job`'s fields, they do not call back into the module that built it.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/job_walk.py   # ~20 s
    .venv/bin/python benchmarks/job_walk.py lora.rank=4 lora.alpha=8  # --set's
"""

import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import eqtrain.config  # noqa: E402
import eqtrain.job  # noqa: E402


VALUES = ("Job", "Placement", "Prepared")  # the frozen values handed between phases
# the phases' own modules (`_build` is the plan's): no walk returns into them
PHASES = (
    *("_prepare", "_resumable", "_plan", "_build"),
    *("_claim", "_start", "_assemble", "_run"),
)


def _room(frame: Any) -> str | None:
    """The job/ module `frame` runs in, or None (elsewhere, or generated code)."""
    module = frame.f_globals.get("__name__", "")
    if not module.startswith("eqtrain.job.") or frame.f_code.co_filename[0] == "<":
        return None
    return module.rsplit(".", 1)[-1]


def _on_stack(frame: Any, room: str) -> bool:
    """Whether a caller of `frame` still runs in `room` (it was not left)."""
    caller = frame.f_back
    while caller is not None:
        if _room(caller) == room:
            return True
        caller = caller.f_back
    return False


def _value_method(frame: Any) -> bool:
    """Whether `frame` runs a method of one of the frozen `VALUES`."""
    names = frame.f_code.co_varnames
    this = frame.f_locals.get("self") if names[:1] == ("self",) else None
    return type(this).__name__ in VALUES


def _caller(frame: Any) -> str:
    """Where `frame` was called from: a job/ room, or the module outside job/."""
    caller = frame.f_back
    room = _room(caller)
    return room or caller.f_globals.get("__name__", "?")


def walk(sets: Sequence[str] = ()) -> dict[str, Any]:
    """The rooms a 2-step run of the default config (with `sets`, `--set`'s)
    visits, in order, with its returns, the calls into `_build` after the plan
    and the cruder `calls_back` count (see the module's docstring)."""
    visits: list[str] = []
    returns: list[dict[str, Any]] = []
    entries: list[str] = []
    after_plan: list[str] = []
    planned = False

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        nonlocal planned
        room = _room(frame) if event in ("call", "return") else None
        if room is None:
            return
        if event == "return":
            planned = planned or (room, frame.f_code.co_name) == ("_plan", "plan")
            return
        if planned and room == "_build" and _room(frame.f_back) != "_build":
            after_plan.append(f"{frame.f_code.co_name} (from {_caller(frame)})")
        if not entries or entries[-1] != room:
            entries.append(room)
        if (visits and visits[-1] == room) or _on_stack(frame, room):
            return
        if room in visits:
            name = f"{room}.{frame.f_code.co_name} (from {_caller(frame)})"
            value = _value_method(frame)
            returns.append({"name": name, "value": value, "room": room})
        visits.append(room)

    with tempfile.TemporaryDirectory() as tmp:
        sets = [f"run_dir={tmp}/run", "loop.steps=2", "data.batch_size=2", *sets]
        config = eqtrain.config.load(None, ["data.seq_len=32", *sets])
        sys.setprofile(profile)
        try:
            eqtrain.job.run(config, echo=lambda text: None)
        finally:
            sys.setprofile(None)
    rooms = len(set(visits))
    return {
        "visits": visits,
        "returned_to": returns,
        "rooms": rooms,
        "calls_back": len(entries) - rooms,
        "build_after_plan": after_plan,
    }


def main() -> None:
    walked = walk(sys.argv[1:])
    print(" -> ".join(walked["visits"]))
    returned = walked["returned_to"]
    for r in returned:
        print(f"  returns to {r['name']}" + (" (a method of the value)" * r["value"]))
    after_plan = walked["build_after_plan"]
    print(f"  calls into _build after the plan: {len(after_plan)}")
    for name in after_plan:
        print(f"    {name}")
    outside = [r for r in returned if not r["value"]]
    record = {
        "rooms": walked["rooms"],
        "visits": len(walked["visits"]),
        "returns": len(returned),
        "returns_outside_values": len(outside),
        "returns_into_phases": sum(r["room"] in PHASES for r in outside),
        "build_after_plan": len(after_plan),
        "calls_back": walked["calls_back"],
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
