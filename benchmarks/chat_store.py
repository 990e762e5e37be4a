"""The post-training store at scale: `eqtrain.data.prepare_post` on chat JSON Lines
sets of growing size: the preparing process's peak memory, the process tree's,
the wall time, and the second start's time to open the store and read a batch.

It writes its inputs in a work directory (`--dir`; default a temporary one,
deleted at the end unless `--keep`), with no download: conversations of 1-4
user/assistant turns (a system message in a third of them) of seeded random
words, ~3 KB each, written streaming up to each of `--sizes`. The tokenizer is
the byte tokenizer and the template the built-in one, so it runs on CPU in
minutes; rows are packed SFT rows of `--seq-len` (4096).

One JSON line per size on stdout:

- `prepare_s`: wall time of `prepare_post(path, ByteTokenizer(), kind="sft",
  seq_len, workers=--workers)` in a fresh process and cache (imports excluded);
- `peak_rss_mb`: that process's peak RSS (`VmHWM`, its own pages only);
  `tree_rss_mb`: the peak summed RSS of it and its worker processes, sampled
  from /proc every 0.2 s (mapped file pages count once per process);
- `open_s`: in another fresh process, `prepare_post` again (the store is found
  by its key: the file's status and edge hashes, nothing parsed or tokenized)
  and the first batch of 16 rows read; `open_peak_rss_mb` its peak RSS;
- `conversations`, `rows`, `tokens`, `skipped`.

With `--baseline`, one more line for the first size: the in-memory path that
`eqtrain fit` took before the store (`sft_rows(from_files(path), ...)`, then the
rows written as `.npy` files): its wall time and peak RSS, in a fresh process.

Usage (2 cores: ~30 s for 0.2 GB, ~2.5 min for 2 GB):

    .venv/bin/python benchmarks/chat_store.py [--sizes 0.2GB,2GB] [--workers N]
        [--dir DIR] [--keep] [--baseline]
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import print_machine  # noqa: E402


WORDS = [
    "".join(random.Random(i).choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))
    for i, n in enumerate(random.Random(0).choices(range(2, 11), k=4000))
]


def conversation(r: random.Random) -> dict:
    """One chat of 1-4 turns, ~3 KB."""

    def text(n: int) -> str:
        return " ".join(r.choices(WORDS, k=n)).capitalize() + "."

    messages = []
    if r.random() < 1 / 3:
        messages.append({"role": "system", "content": text(r.randint(5, 20))})
    for _ in range(r.randint(1, 4)):
        messages.append({"role": "user", "content": text(r.randint(10, 60))})
        messages.append({"role": "assistant", "content": text(r.randint(20, 200))})
    return {"messages": messages}


def write_chats(path: Path, size: int, seed: int = 0) -> int:
    """Conversations into `path` (JSON Lines) up to `size` bytes; their number."""
    r, n, written = random.Random(seed), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            line = json.dumps(conversation(r)) + "\n"
            f.write(line)
            written += len(line.encode("utf-8"))
            n += 1
    return n


PREPARE = """
import json, sys, time
t0 = time.perf_counter()
from eqtrain import data
imported = time.perf_counter()
rows = data.prepare_post(sys.argv[1], data.ByteTokenizer(), kind="sft",
    seq_len=int(sys.argv[3]), cache_dir=sys.argv[2],
    workers=int(sys.argv[4]) or None, say=lambda line: print(line, file=sys.stderr))
done = time.perf_counter()
batch = rows.take(list(range(16)))
read = time.perf_counter()
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(json.dumps({"prepare_s": done - imported, "batch_s": read - done,
    "import_s": imported - t0, "peak_rss_mb": int(hwm.split()[1]) / 1024,
    "rows": rows.num_rows, "records": rows.report.total,
    "skipped": rows.report.total - rows.report.kept,
    "tokens": sum(p["tokens"] for p in rows.meta["parts"]),
    "parts": len(rows.meta["parts"])}))
"""


BASELINE = """
import json, sys, time
from eqtrain import data
t = time.perf_counter()
rows, report = data.sft_rows(data.from_files(sys.argv[1]), data.ByteTokenizer(),
    seq_len=int(sys.argv[3]), format="chat")
done = time.perf_counter() - t
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(json.dumps({"in_memory_s": round(done, 1), "rows": len(rows["tokens"]),
    "in_memory_peak_rss_mb": round(int(hwm.split()[1]) / 1024)}))
"""


def run_baseline(path: Path, cache: Path, seq_len: int) -> dict:
    """`BASELINE` in a fresh process (the datasets cache under `cache`)."""
    done = subprocess.run(
        [sys.executable, "-c", BASELINE, str(path), str(cache), str(seq_len)],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "HF_DATASETS_CACHE": str(cache)},
    )
    return json.loads(done.stdout.splitlines()[-1])


def _tree_rss(pid: int) -> int:
    """The summed RSS (KiB) of `pid` and its descendants now."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith("VmRSS"):
                    total += int(line.split()[1])
            for task in os.listdir(f"/proc/{p}/task"):
                children = open(f"/proc/{p}/task/{task}/children").read().split()
                todo.extend(int(c) for c in children)
        except OSError:
            continue
    return total


def run_prepare(path: Path, cache: Path, seq_len: int, workers: int) -> dict:
    """`PREPARE` in a fresh process, its tree's RSS sampled meanwhile."""
    process = subprocess.Popen(
        [sys.executable, "-c", PREPARE, str(path), str(cache), str(seq_len),
         str(workers)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    peak = [0]

    def sample() -> None:
        while process.poll() is None:
            peak[0] = max(peak[0], _tree_rss(process.pid))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = process.communicate()
    sampler.join()
    if process.returncode:
        raise SystemExit(f"prepare failed ({process.returncode})")
    return {**json.loads(out.splitlines()[-1]), "tree_rss_mb": peak[0] / 1024}


def parse_size(text: str) -> int:
    units = {"GB": 10**9, "MB": 10**6, "KB": 10**3}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * scale)
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.2GB,2GB")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=0, help="0: the CPU count")
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--baseline", action="store_true")
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="chat_store_"))
    work.mkdir(parents=True, exist_ok=True)
    print_machine()
    try:
        for text in args.sizes.split(","):
            size = parse_size(text)
            path = work / f"chat_{text}.jsonl"
            t = time.perf_counter()
            n = write_chats(path, size)
            written = time.perf_counter() - t
            cache = work / f"cache_{text}"
            shutil.rmtree(cache, ignore_errors=True)
            first = run_prepare(path, cache, args.seq_len, args.workers)
            second = run_prepare(path, cache, args.seq_len, args.workers)
            print(
                json.dumps(
                    {
                        "size": text,
                        "bytes": path.stat().st_size,
                        "conversations": n,
                        "write_s": round(written, 1),
                        **{k: first[k] for k in ("records", "rows", "tokens")},
                        **{k: first[k] for k in ("skipped", "parts")},
                        "prepare_s": round(first["prepare_s"], 1),
                        "mb_per_s": round(
                            path.stat().st_size / 1e6 / first["prepare_s"], 2
                        ),
                        "peak_rss_mb": round(first["peak_rss_mb"]),
                        "tree_rss_mb": round(first["tree_rss_mb"]),
                        "open_s": round(second["prepare_s"] + second["batch_s"], 3),
                        "open_peak_rss_mb": round(second["peak_rss_mb"]),
                        "import_s": round(second["import_s"], 1),
                    }
                ),
                flush=True,
            )
            if args.baseline and text == args.sizes.split(",")[0]:
                base = run_baseline(path, work / "hf_cache", args.seq_len)
                print(json.dumps({"size": text, **base}), flush=True)
    finally:
        if not args.keep and args.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
