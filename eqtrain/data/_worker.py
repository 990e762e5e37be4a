"""A store-building worker process: `python -m eqtrain.data._worker`.

It reads JSON lines on standard input (first the tokenizer spec, then one task
per line), builds each part, and answers one JSON line per task on standard
output: the ledger entry, or `{"error": ..., "message": ...}`. Tasks and answers
are plain JSON (no pickle), and the worker never imports the caller's script.
"""

import json
import sys


def main() -> None:
    from ._encoder import Encoder
    from ._errors import DataError
    from ._parts import Task, build_part

    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write to the answer channel
    spec = json.loads(sys.stdin.readline())
    encoder = Encoder(spec)
    for line in sys.stdin:
        task = Task(**json.loads(line))
        if task.texts is not None:
            task = Task(**{**task.__dict__, "texts": tuple(task.texts)})
        try:
            answer = {"entry": build_part(task, encoder)}
        except DataError as error:
            answer = {"error": "DataError", "message": str(error)}
        except OSError as error:
            answer = {"error": "OSError", "message": f"{error}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
