"""Where a CPU step's system time goes: page faults on the step's temporary
buffer, with and without each of `eqtrain.cpu.tune_cpu()`'s allocator settings.

XLA:CPU allocates one temporary buffer per step (`temp_size_in_bytes` of the
compiled step: 600 MB for `benchmarks/models.py`'s Llama at 16 x 256) and
frees it at the end. The allocation is made on one of XLA's worker threads,
from that thread's glibc arena, whose heaps hold at most 64 MB: a larger
block is mapped afresh (`mmap`) whatever the thresholds say, and the step then
faults on every one of its pages. In the one main arena the thresholds keep it
in the heap from step to step.

Variants, each in a fresh process (glibc reads its settings at start-up; the
`mallopt` ones must come before XLA's threads exist):

- `default`: nothing set (`EQTRAIN_CPU_TUNING=0`);
- `thresholds`: `MALLOC_MMAP_THRESHOLD_` and `MALLOC_TRIM_THRESHOLD_` only (what
  `tune_cpu` set before it also kept one arena);
- `arena`: `MALLOC_ARENA_MAX=1` only;
- `both`: the thresholds and `MALLOC_ARENA_MAX=1` (XLA's own products);
- `tune_cpu`: `eqtrain.cpu.tune_cpu()`'s settings (the thresholds and one arena, by
  `mallopt`) with its cached choice of XLA flags, as the `eqtrain` command runs.

Each process compiles `models.py`'s Llama step (`eqtrain.train_step`, AdamW,
unrolled layers), runs `--warmup` steps, then `--steps` steps, and reports per
step: minor page faults, milliseconds, and the cores' user and system time
over wall time. One JSON line per variant (after the machine's line):

    {"variant", "temp_mb", "faults_per_step", "step_ms", "user_cores", "sys_cores"}

Usage (Linux, glibc):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/page_faults.py [--steps 8]
        [--batch 16] [--seq 256] [--quick]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from _machine import print_machine


HERE = Path(__file__).resolve().parent
THRESHOLDS = {
    "MALLOC_MMAP_THRESHOLD_": "4000000000",
    "MALLOC_TRIM_THRESHOLD_": "4000000000",
}
VARIANTS = {
    "default": {"EQTRAIN_CPU_TUNING": "0"},
    "thresholds": {"EQTRAIN_CPU_TUNING": "0", **THRESHOLDS},
    "arena": {"EQTRAIN_CPU_TUNING": "0", "MALLOC_ARENA_MAX": "1"},
    "both": {"EQTRAIN_CPU_TUNING": "0", "MALLOC_ARENA_MAX": "1", **THRESHOLDS},
    "tune_cpu": {},
}


def worker(args: argparse.Namespace) -> None:
    """One process: the step, timed with its page faults and CPU times."""
    import eqtrain

    eqtrain.cpu.tune_cpu(measure=False)
    import dataclasses

    import jax
    import jax.random as jr

    sys.path.insert(0, str(HERE))
    import models as bench

    base = bench.QUICK if args.quick else bench.CONFIG
    cfg = dataclasses.replace(base, scan_layers=False)
    batches = bench.make_batches(cfg, args.warmup + args.steps, args.batch, args.seq)
    runner = bench.JaxRunner(bench.Llama(cfg, jr.key(0)), batches)
    state = runner.fresh()
    compiled = runner.step.lower(state, runner.batches[0]).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    for batch in runner.batches[: args.warmup]:
        state, _ = runner.step(state, batch)
    jax.block_until_ready(state)
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for batch in runner.batches[args.warmup :]:
        state, _ = runner.step(state, batch)
    jax.block_until_ready(state)
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
    out = {
        "variant": args.variant,
        "temp_mb": round(temp / 2**20),
        "faults_per_step": round((after.ru_minflt - before.ru_minflt) / args.steps),
        "step_ms": round(wall / args.steps * 1000, 1),
        "user_cores": round((after.ru_utime - before.ru_utime) / wall, 2),
        "sys_cores": round((after.ru_stime - before.ru_stime) / wall, 2),
    }
    print(json.dumps(out), flush=True)


def measure(args: argparse.Namespace, variant: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("EQTRAIN_CPU_TUNING", None)
    env |= {"JAX_PLATFORMS": "cpu", **VARIANTS[variant]}
    cmd = [sys.executable, __file__, "--worker", variant, "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup), "--batch", str(args.batch)]
    cmd += ["--seq", str(args.seq)] + (["--quick"] if args.quick else [])
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
    return json.loads([x for x in done.stdout.splitlines() if x.startswith("{")][-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument(
        "--worker", choices=tuple(VARIANTS), default=None, dest="variant"
    )
    parser.add_argument("--quick", action="store_true", help="tiny smoke test")
    args = parser.parse_args(argv)
    args.steps = args.steps or (2 if args.quick else 8)
    args.batch = args.batch or (2 if args.quick else 16)
    args.seq = args.seq or (16 if args.quick else 256)
    if args.variant is not None:
        worker(args)
        return
    print_machine()
    for variant in VARIANTS:
        print(json.dumps(measure(args, variant)), flush=True)


if __name__ == "__main__":
    main()
