"""What `eqtrain.cpu.tune_cpu()` (the CLI's CPU settings) is worth: the training step of
`benchmarks/models.py`'s Llama, and of `benchmarks/overhead.py`'s many-small-leaves
model, in fresh processes with and without each setting.

Variants (each a new Python process, since both settings act at start-up):

- `default`: nothing set (XLA's YNNPACK dots, glibc's defaults);
- `thresholds`: the environment variables `MALLOC_MMAP_THRESHOLD_` and
  `MALLOC_TRIM_THRESHOLD_` = 4000000000 only (`tune_cpu`'s allocator setting
  before it also kept one arena);
- `allocator`: `tune_cpu()`'s `mallopt` settings only, the thresholds and one
  arena (`XLA_FLAGS` untouched);
- `allocator_env`: the same as environment variables set before start-up (the
  two thresholds and `MALLOC_ARENA_MAX=1`);
- `xla_flag`: `--xla_cpu_experimental_ynn_fusion_type=` only (Eigen dots);
- `tune_cpu`: both, as `eqtrain.cpu.tune_cpu()` applies them (what the CLI runs).

Every process compiles and warms up, then times `--steps` steps `--repeats` times
and reports its best-of-median rate; the variants' processes alternate over
`--rounds` rounds, and each ratio is the median over rounds of variant / default
within a round. One JSON line per workload:

    {"workload", "rounds", "tokens_per_s": {variant: median}, "ratio": {variant:
     median ratio to default}, "ratio_range": {variant: [min, max]}}

Usage (CPU):

    .venv/bin/python benchmarks/cpu_settings.py [--rounds 5] [--workload llama]
        [--quick]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _machine import print_machine


VARIANTS = (
    "default", "thresholds", "allocator", "allocator_env", "xla_flag", "tune_cpu",
)  # fmt: skip
HERE = Path(__file__).resolve().parent


def worker(args: argparse.Namespace) -> None:
    """One process: apply the variant, build the workload, print its tokens/s."""
    import eqtrain

    if args.variant in ("allocator", "tune_cpu"):
        flags = os.environ.get("XLA_FLAGS")
        applied = eqtrain.cpu.tune_cpu()
        if args.variant == "allocator":  # keep only the allocator part
            if flags is None:
                os.environ.pop("XLA_FLAGS", None)
            else:
                os.environ["XLA_FLAGS"] = flags
        assert {"allocator", "arena"} <= set(applied), applied
    import dataclasses

    import jax
    import jax.random as jr

    sys.path.insert(0, str(HERE))
    if args.workload == "llama":
        import models as bench

        base = bench.QUICK if args.quick else bench.CONFIG
        cfg = dataclasses.replace(base, scan_layers=args.scan_layers)
        batch, seq = (2, 16) if args.quick else (args.batch, args.seq)
        model = bench.Llama(cfg, jr.key(0))
        runner = bench.JaxRunner(model, bench.make_batches(cfg, args.steps, batch, seq))
        tokens = args.steps * batch * seq

        def run() -> float:
            return runner.run(args.steps)[0]
    else:
        import overhead

        run, tokens = overhead.raw_runner(args.steps, quick=args.quick)
    run()  # compile and warm up
    times = [run() for _ in range(args.repeats)]
    print(json.dumps({"tokens_per_s": tokens / statistics.median(times)}), flush=True)
    del jax


def measure(args: argparse.Namespace, variant: str) -> float:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for name in (
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TRIM_THRESHOLD_",
        "MALLOC_ARENA_MAX",
        "EQTRAIN_CPU_TUNING",
    ):
        env.pop(name, None)
    env["XLA_FLAGS"] = ""
    if variant in ("thresholds", "allocator_env"):
        env["MALLOC_MMAP_THRESHOLD_"] = env["MALLOC_TRIM_THRESHOLD_"] = "4000000000"
    if variant == "allocator_env":
        env["MALLOC_ARENA_MAX"] = "1"
    if variant == "xla_flag":
        env["XLA_FLAGS"] = "--xla_cpu_experimental_ynn_fusion_type="
    cmd = [sys.executable, __file__, "--worker", variant, "--workload", args.workload]
    cmd += ["--steps", str(args.steps), "--repeats", str(args.repeats)]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq)]
    cmd += ["--scan-layers" if args.scan_layers else "--no-scan-layers"]
    cmd += ["--quick"] if args.quick else []
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
    line = [x for x in done.stdout.splitlines() if x.startswith("{")][-1]
    return json.loads(line)["tokens_per_s"]


def main(argv: list[str] | None = None) -> None:
    print_machine()  # the processor and settings: figures are per machine
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=None, help="runs per process")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument(
        "--scan-layers", action=argparse.BooleanOptionalAction, default=False
    )
    parser.add_argument(
        "--workload", choices=("llama", "many_small_leaves", "both"), default="both"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--worker", choices=VARIANTS, default=None, dest="variant")
    parser.add_argument("--quick", action="store_true", help="tiny smoke test")
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.steps = args.steps or (2 if args.quick else 8)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.variant is not None:
        return worker(args)
    variants = [v for v in args.variants.split(",") if v]
    if "default" not in variants:
        variants.insert(0, "default")
    workloads = (
        ("llama", "many_small_leaves") if args.workload == "both" else (args.workload,)
    )
    for workload in workloads:
        args.workload = workload
        rates: dict[str, list[float]] = {v: [] for v in variants}
        start = time.perf_counter()
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else list(reversed(variants)):
                rates[v].append(measure(args, v))
            shown = {v: round(rates[v][-1]) for v in variants}
            print(f"{workload} round {r}: {shown}", file=sys.stderr)
        paired = {
            v: [x / d for x, d in zip(rates[v], rates["default"], strict=True)]
            for v in variants
        }
        print(
            json.dumps(
                {
                    "workload": workload,
                    "scan_layers": args.scan_layers,
                    "rounds": args.rounds,
                    "seconds": round(time.perf_counter() - start),
                    "tokens_per_s": {
                        v: round(statistics.median(x)) for v, x in rates.items()
                    },
                    "ratio": {
                        v: round(statistics.median(x), 3) for v, x in paired.items()
                    },
                    "ratio_range": {
                        v: [round(min(x), 3), round(max(x), 3)]
                        for v, x in paired.items()
                    },
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
