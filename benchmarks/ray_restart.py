"""How long a Ray-launched run takes from a worker's death to its first resumed
step: two workers on a local Ray (one CPU device each) train a tiny Llama; at
step --kill-at one worker's `eqtrain fit` process gets SIGKILL; the supervisor
restarts the group from the last checkpoint. Prints one JSON line.

    python benchmarks/ray_restart.py            # needs the `ray` extra
"""

import argparse
import json
import os
import re
import signal
import tempfile
import time
from pathlib import Path

from _machine import print_machine


TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 60
STEP = re.compile(r"^\[w0\] step (\d+)/")
PIDS = re.compile(r"worker (\d+): pid (\d+)")


def main() -> None:
    print_machine()  # the processor and settings: figures are per machine
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-at", type=int, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=4)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="eqtrain-ray-restart-"))
    os.environ.setdefault("HOME", str(root))  # Ray writes ~/.ray
    (root / "train").mkdir()
    for i in range(3):
        (root / "train" / f"{i}.txt").write_text(TEXT * (i + 1))

    import eqtrain.config
    import eqtrain.ray

    config = eqtrain.config.load(
        overrides=[
            f"run_dir={root / 'run'}",
            f"data.train={root / 'train'}",
            "data.eval=",
            "model.hidden_size=32",
            "model.num_layers=1",
            "data.seq_len=16",
            "data.batch_size=8",
            f"loop.steps={args.steps}",
            "loop.eval_every=0",
            "loop.eval_at_end=false",
            f"checkpoint.every={args.checkpoint_every}",
            "log.progress=lines",
            "optim.schedule=constant",
            "distributed.processes=2",
            "distributed.restart_delay=0",
        ]
    )
    marks: dict[str, float] = {}
    pids: dict[int, int] = {}

    def echo(line: str) -> None:
        for worker, pid in PIDS.findall(line):
            pids[int(worker)] = int(pid)
        step = STEP.match(line)
        if step and "killed" not in marks and int(step.group(1)) >= args.kill_at:
            os.kill(pids[1], signal.SIGKILL)
            marks["killed"] = time.monotonic()
        elif "restarting" in line.lower() and "killed" in marks:
            marks.setdefault("noticed", time.monotonic())
        elif line.startswith("[ray] started") and "noticed" in marks:
            marks.setdefault("started", time.monotonic())
        elif step and "started" in marks:
            marks.setdefault("first_step", time.monotonic())
        print(line, flush=True)

    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    result = eqtrain.ray.fit(config, echo=echo, env={**env, "JAX_PLATFORMS": "cpu"})
    killed = marks["killed"]
    print(
        json.dumps(
            {
                "restarts": result.restarts,
                "stop": str(result.stop_reason),
                "resumed_from": result.resumed_from,
                "noticed_s": round(marks["noticed"] - killed, 2),
                "workers_started_s": round(marks["started"] - killed, 2),
                "first_resumed_step_s": round(marks["first_step"] - killed, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
