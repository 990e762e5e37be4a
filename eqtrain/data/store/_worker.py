"""A store-building worker process: `python -m eqtrain.data.store._worker`.

It reads JSON lines on standard input (first the tokenizer spec, or a
post-training store's encoder spec, then one task per line), builds each part,
and answers one JSON line per task on standard output: the ledger entry, or
`{"error": ..., "message": ...}`. Tasks and answers are plain JSON (no pickle),
and the worker never imports the caller's script.
"""

import dataclasses
import json
import signal
import sys
import traceback
from typing import Any

from .._errors import DataError
from ._encoder import Encoder
from ._parts import Task, build_part
from ._post_parts import PostEncoder, build_post_part


def main() -> None:
    # Ctrl-C reaches the whole process group: the parent decides (it kills the
    # workers and removes their unfinished files), no traceback from here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write to the answer channel
    spec = json.loads(sys.stdin.readline())
    if "post" in spec:  # a post-training store's part: records, not texts
        encoder: Any = PostEncoder.from_spec(spec)
        build: Any = build_post_part
    else:
        encoder, build = Encoder(spec), build_part
    for line in sys.stdin:
        out.write(json.dumps(_answer(_task(line), encoder, build)) + "\n")
        out.flush()


def _task(line: str) -> Task:
    """A task from its JSON line (its texts, a JSON list, back to a tuple)."""
    task = Task(**json.loads(line))
    if task.texts is not None:
        task = dataclasses.replace(task, texts=tuple(task.texts))
    return task


def _answer(task: Any, encoder: Any, build: Any = build_part) -> dict[str, Any]:
    """The ledger entry of `task`'s part, or the error that stopped it."""
    try:
        return {"entry": build(task, encoder)}
    except DataError as error:
        return {"error": "DataError", "message": str(error)}
    except OSError as error:
        return {"error": "OSError", "message": f"{error}"}
    except Exception as error:  # a bug: its traceback here, the part named there
        traceback.print_exc()
        return {"error": type(error).__name__, "message": str(error)}


if __name__ == "__main__":
    main()
