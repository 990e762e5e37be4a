"""A CPU quota below the visible CPUs: XLA's own thread count against
`PJRT_NPROC` = the quota, on `tune_cpu`'s probe step (eqtrain's Llama, 16 x
256, under the allocator settings and Eigen's products).

XLA's CPU client starts one thread per CPU the process may run on; a
container's quota (cgroup `cpu.max` / `cpu.cfs_quota_us`) grants less CPU
time than that, and the kernel throttles the threads. This script makes such a
cgroup (root and a writable cgroup tree needed: v1's `cpu` controller or v2),
runs the probe in it with each thread count in turn, and prints the ratio per
round (XLA's own / the quota's; above 1: fewer threads faster).

    sudo .venv/bin/python benchmarks/cpu_quota.py --cpus 1 --rounds 3   # ~4 min
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _machine import print_machine

from eqtrain.cpu._tuning import CANDIDATES, PROBE_ALLOCATOR


def make_cgroup(cpus: int, name: str = "eqtrain_cpu_quota") -> Path:
    """A cgroup granting `cpus` CPUs of time per period; its directory."""
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
    if (v2 / "cgroup.controllers").exists():
        group = v2 / name
        group.mkdir(exist_ok=True)
        (group / "cpu.max").write_text(f"{cpus * 100000} 100000")
    else:
        group = v1 / name
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(cpus * 100000))
    return group


def probe_in(group: Path, threads: int | None) -> float:
    """The probe's unrolled step (ms) in `group`, `PJRT_NPROC=threads`."""
    env = {**os.environ, **PROBE_ALLOCATOR, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = CANDIDATES["eigen_dots"]
    env.pop("PJRT_NPROC", None)
    if threads:
        env["PJRT_NPROC"] = str(threads)
    procs = "cgroup.procs" if (group / "cgroup.procs").exists() else "tasks"
    enter = f'echo $$ > {group / procs} && exec "$@"'
    argv = ["sh", "-c", enter, "sh", sys.executable, "-P", "-m", "eqtrain.cpu._probe"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["unrolled_ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpus", type=int, default=1, help="the quota, in CPUs")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    visible = len(os.sched_getaffinity(0))
    if args.cpus >= visible:
        sys.exit(f"--cpus {args.cpus}: the quota must be below the {visible} CPUs")
    print_machine()
    try:
        group = make_cgroup(args.cpus)
    except OSError as e:
        sys.exit(f"cannot make a cgroup ({e}): run as root on a writable cgroup tree")
    ratios = []
    for r in range(args.rounds):
        own, quota = probe_in(group, None), probe_in(group, args.cpus)
        ratios.append(own / quota)
        mine = f"PJRT_NPROC={args.cpus} {quota:.0f} ms"
        print(f"round {r}: XLA's {visible} threads {own:.0f} ms, {mine}, "
              f"ratio {own / quota:.3f}")  # fmt: skip
    summary = {"cpus": args.cpus, "visible": visible}
    summary["ratio"] = round(statistics.median(ratios), 3)
    summary["range"] = [round(min(ratios), 3), round(max(ratios), 3)]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
