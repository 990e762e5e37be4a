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
`job.new_state(mesh)` reads the value, it does not walk back into a phase.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/job_walk.py   # ~20 s
"""

import json
import os
import sys
import tempfile
from typing import Any


os.environ.setdefault("JAX_PLATFORMS", "cpu")

import eqtrain.config  # noqa: E402
import eqtrain.job  # noqa: E402


VALUES = ("Job", "Placement", "Prepared")  # the frozen values handed between phases


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


def walk() -> dict[str, Any]:
    """The rooms a 2-step run of the default config visits, in order, with its
    returns and the cruder `calls_back` count (see the module's docstring)."""
    visits: list[str] = []
    returns: list[str] = []
    entries: list[str] = []

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        room = _room(frame) if event == "call" else None
        if room is None:
            return
        if not entries or entries[-1] != room:
            entries.append(room)
        if (visits and visits[-1] == room) or _on_stack(frame, room):
            return
        if room in visits:
            value = " (a method of the value)" if _value_method(frame) else ""
            returns.append(f"{room}.{frame.f_code.co_name}{value}")
        visits.append(room)

    with tempfile.TemporaryDirectory() as tmp:
        sets = [f"run_dir={tmp}/run", "loop.steps=2", "data.batch_size=2"]
        config = eqtrain.config.load(None, [*sets, "data.seq_len=32"])
        sys.setprofile(profile)
        try:
            eqtrain.job.run(config, echo=lambda text: None)
        finally:
            sys.setprofile(None)
    rooms = len(set(visits))
    return {"visits": visits, "returned_to": returns, "rooms": rooms,
            "calls_back": len(entries) - rooms}  # fmt: skip


def main() -> None:
    walked = walk()
    print(" -> ".join(walked["visits"]))
    for name in walked["returned_to"]:
        print(f"  returns to {name}")
    returned = walked["returned_to"]
    record = {
        "rooms": walked["rooms"],
        "visits": len(walked["visits"]),
        "returns": len(returned),
        "returns_outside_values": sum("of the value" not in r for r in returned),
        "calls_back": walked["calls_back"],
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
