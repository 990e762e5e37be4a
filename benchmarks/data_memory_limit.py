"""Does a corpus larger than the memory a run may use train? `eqtrain data
prepare` and `eqtrain fit` on a JSON Lines corpus of `--size` (default 4 GB)
under a memory limit of `--limit` (default 2 GB), enforced by a Linux control
group (cgroup v2 `memory.max`, or v1 `memory.limit_in_bytes`; needs root), so
that going over it kills the command instead of slowing it down.

The corpus is the Python standard library's sources, one document per file,
repeated with a counter prepended (so no two documents are equal) until the size
is reached; the tokenizer is `byte` (no file needed; the store then holds two
bytes per source byte, 8 GB for 4 GB). It prints one JSON line per command:

    {"command", "corpus_gb", "limit_gb", "seconds", "exit_code",
     "peak_gb" (the group's peak usage, page cache of the mapped store included),
     "steps"}

and a last line `{"measure": "memory_limit", "ok": ...}`: both commands
exited 0 under the limit.

Usage (Linux, root, CPU):

    .venv/bin/python benchmarks/data_memory_limit.py [--size 4GB] [--limit 2GB]
        [--steps 50] [--dir DIR] [--keep]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from _machine import print_machine


EQTRAIN = [sys.executable, "-m", "eqtrain.cli"]


def parse_size(text: str) -> int:
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def make_corpus(path: Path, size: int) -> None:
    """JSON Lines of the stdlib's sources, repeated with a counter, to `size`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for file in sorted(root.rglob("*.py")):
        try:
            texts.append(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    written, copy = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            for text in texts:
                line = json.dumps({"text": f"# copy {copy}\n{text}"}) + "\n"
                f.write(line)
                written += len(line)
                if written >= size:
                    break
            copy += 1


class MemoryGroup:
    """A cgroup with a memory limit; `command(args)` runs args inside it."""

    def __init__(self, limit: int):
        self.limit = limit
        v2 = Path("/sys/fs/cgroup/cgroup.controllers")
        if v2.exists() and "memory" in v2.read_text():
            self.path = Path(f"/sys/fs/cgroup/eqtrain-bench-{os.getpid()}")
            self.path.mkdir()
            (self.path / "memory.max").write_text(str(limit))
            (self.path / "memory.swap.max").write_text("0")
            self.peak_file = "memory.peak"
        else:
            self.path = Path(f"/sys/fs/cgroup/memory/eqtrain-bench-{os.getpid()}")
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limit))
            self.peak_file = "memory.max_usage_in_bytes"

    def run(self, args: list[str], env: dict[str, str]) -> tuple[int, float, str]:
        """(exit code, seconds, stderr tail) of `args` inside the group."""
        procs = self.path / "cgroup.procs"
        wrapper = ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *args]
        start = time.monotonic()
        done = subprocess.run(wrapper, env=env, capture_output=True, text=True)
        return done.returncode, time.monotonic() - start, done.stderr[-2000:]

    def peak(self) -> float:
        try:
            return int((self.path / self.peak_file).read_text()) / 1e9
        except OSError:
            return float("nan")

    def reset_peak(self) -> None:
        if self.peak_file == "memory.max_usage_in_bytes":
            (self.path / self.peak_file).write_text("0")

    def close(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def main() -> None:
    print_machine()  # the processor and settings: figures are per machine
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="4GB")
    parser.add_argument("--limit", default="2GB")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    size, limit = parse_size(args.size), parse_size(args.limit)
    work = Path(args.dir or tempfile.mkdtemp(prefix="eqtrain-memlimit-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.jsonl"
    if not corpus.exists() or corpus.stat().st_size < size:
        print(f"writing a {size / 1e9:.1f} GB corpus to {corpus}", file=sys.stderr)
        make_corpus(corpus, size)
    env = dict(os.environ, EQTRAIN_DATA_CACHE=str(work / "cache"), JAX_PLATFORMS="cpu")
    sets = [
        f"data.train={corpus}",
        "data.tokenizer=byte",
        "data.eval=none",
        "data.seq_len=256",
        f"loop.steps={args.steps}",
        "export.hf=",
        "log.progress=none",
        f"run_dir={work / 'run'}",
    ]
    flags = [f for s in sets for f in ("--set", s)]
    group = MemoryGroup(limit)
    results = []
    try:
        for name, command in (
            ("data prepare", [*EQTRAIN, "data", "prepare", *flags]),
            ("fit", [*EQTRAIN, "fit", *flags, "--overwrite"]),
        ):
            group.reset_peak()
            code, seconds, tail = group.run(command, env)
            steps = None
            metrics = work / "run" / "metrics.jsonl"
            if name == "fit" and metrics.exists():
                lines = metrics.read_text().splitlines()
                steps = json.loads(lines[-1])["step"] if lines else 0
            record = {
                "command": f"eqtrain {name}",
                "corpus_gb": round(corpus.stat().st_size / 1e9, 2),
                "limit_gb": round(limit / 1e9, 2),
                "seconds": round(seconds, 1),
                "exit_code": code,
                "peak_gb": round(group.peak(), 3),
                "steps": steps,
            }
            results.append(record)
            print(json.dumps(record), flush=True)
            if code:
                print(tail, file=sys.stderr)
    finally:
        group.close()
        if not args.keep and args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    ok = all(r["exit_code"] == 0 for r in results)
    print(json.dumps({"measure": "memory_limit", "ok": ok}))


if __name__ == "__main__":
    main()
