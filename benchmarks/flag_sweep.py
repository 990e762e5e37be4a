"""XLA:CPU's flags on `eqtrain.cpu.tune_cpu`'s probe step, one fresh process per
flag set (XLA reads its flags once, when its CPU backend starts).

The step is `eqtrain.cpu._probe`'s: eqtrain's Llama (4 layers of 256 wide, an
MLP of 704, vocabulary 2048) trained by `eqtrain.train_step` + `eqtrain.jit`
with AdamW on 16 rows of 256 tokens, layers unrolled, under `tune_cpu`'s
allocator settings (`MALLOC_ARENA_MAX=1` and the two thresholds), with
`EQTRAIN_CPU_TUNING=0` so that only the flags below are in force. Each process
prints the median of 6 steps after 2 untimed; the flag sets alternate over
`--rounds` rounds. One JSON line at the end:

    {"rounds", "step_ms": {name: median over rounds}, "ratio_to_eigen":
     {name: eigen's ms / its ms (> 1: faster)}, "runs": {name: [ms per round]}}

The flag sets (all but `xla_default` on top of Eigen's products,
`--xla_cpu_experimental_ynn_fusion_type=`):

- `eigen`, `xla_default`: Eigen's products; XLA's defaults (YNNPACK fusions);
- `eigen_no_concurrency`, `xla_default_no_concurrency`: without XLA's
  concurrency-optimised scheduler;
- `onednn_custom_call`: oneDNN's custom calls for products;
- `onednn_fusion`: oneDNN's fusions of products (what `tune_cpu`'s
  `onednn_dots` candidate measures, process-wide: safe for this step only,
  see `eqtrain.cpu._onednn`);
- `fast_math`: XLA's fast math;
- `xnn_dot`: XNNPACK's dot fusions.

docs/performance.md ("oneDNN's products") has processor B's figures.

Usage (CPU, ~10 minutes at 2 rounds):

    .venv/bin/python benchmarks/flag_sweep.py [--rounds 2] [--only eigen,onednn_fusion]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _machine import print_machine


EIGEN = "--xla_cpu_experimental_ynn_fusion_type="
NO_CONCURRENCY = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
FLAG_SETS = {
    "eigen": EIGEN,
    "xla_default": "",
    "eigen_no_concurrency": f"{EIGEN} {NO_CONCURRENCY}",
    "xla_default_no_concurrency": NO_CONCURRENCY,
    "onednn_custom_call": f"{EIGEN} --xla_cpu_experimental_onednn_custom_call=true",
    "onednn_fusion": (
        f"{EIGEN} --xla_cpu_use_onednn=true "
        "--xla_cpu_experimental_onednn_fusion_type=dot"
    ),
    "fast_math": f"{EIGEN} --xla_cpu_enable_fast_math=true",
    "xnn_dot": f"{EIGEN} --xla_cpu_experimental_xnn_fusion_type=dot",
}
ALLOCATOR = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": "2147483647",
    "MALLOC_TRIM_THRESHOLD_": "2147483647",
}
WORKER = (
    "import json; from eqtrain.cpu._probe import time_step; "
    "print(json.dumps({'ms': time_step(False, 6)}))"
)
ROOT = Path(__file__).resolve().parent.parent


def run(flags: str) -> float:
    """One fresh process's median step (ms) under `flags`; nan if it failed."""
    env = {
        **os.environ, **ALLOCATOR, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu",
        "EQTRAIN_CPU_TUNING": "0",
    }  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")])
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", WORKER], env=env, capture_output=True, text=True
    )
    try:
        return float(json.loads(done.stdout.strip().splitlines()[-1])["ms"])
    except (IndexError, KeyError, ValueError):
        print(f"failed: {flags}: {done.stderr.strip()[-300:]}", file=sys.stderr)
        return float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="", help="flag sets, comma-separated")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(FLAG_SETS)
    unknown = set(names) - set(FLAG_SETS)
    if unknown:
        parser.error(f"unknown flag sets {sorted(unknown)}; known: {list(FLAG_SETS)}")
    print_machine()
    runs: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names:
            runs[name].append(run(FLAG_SETS[name]))
            print(f"round {r}: {name} {runs[name][-1]:.0f} ms", file=sys.stderr)
    step = {n: round(statistics.median(v), 1) for n, v in runs.items()}
    base = step.get("eigen")
    ratio = {n: round(base / v, 3) for n, v in step.items()} if base else {}
    record = {"rounds": args.rounds, "step_ms": step, "ratio_to_eigen": ratio}
    print(json.dumps(record | {"runs": runs}))


if __name__ == "__main__":
    main()
