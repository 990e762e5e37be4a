"""The tokenized store at scale: `eqtrain.data.prepare`'s throughput, memory and
start-up time against corpus size, and a `Loader` over a store against memory.

It makes its inputs in a work directory (`--dir`; default a temporary one, deleted
at the end unless `--keep`), with no download: JSON Lines corpora of `{"text"}`
documents, the standard library's `*.py` files as they are and then over and over
with seeded variations (identifiers renamed, blocks of lines shuffled, numbers
changed), written streaming up to each of `--sizes` (the smaller a prefix of the
larger); and a byte-level BPE of 8192 ids with `<|endoftext|>`, trained with
`tokenizers` on ~20 MB of the sources. One JSON line per measure on stdout:

1. `prepare_throughput` (smallest corpus): MB/s of document text of `prepare(path,
   HFTokenizer.from_file(tok), cache_dir=fresh, workers=os.cpu_count())` against
   `tokenizers`' `encode_batch_fast` on all cores (Rayon) over the same texts read
   beforehand in ~1 MB batches (reading and parsing excluded: favours the
   baseline); ABAB, 2 rounds; `ratio` is the median per-round ratio. Target >= 0.8.
2. `peak_rss_prepare`, `peak_rss_train`: `eqtrain data prepare`, then `eqtrain fit`
   (default model, 20 steps, seq_len 256, no eval, no export) per size, in fresh
   cache and run directories. `peak_rss_mb`: `ru_maxrss` from `os.wait4` (in a
   small launcher process, see `LAUNCH`), the max of the command's process and the
   workers it reaped, each alone (not summed);
   `tree_rss_mb`: the peak summed RSS of the process tree, sampled from /proc
   every 0.2 s (shared and mapped file pages count once per process). Target:
   within 20% across sizes, under 1.5 GB.
3. `time_to_first_step`: with the stores prepared, wall time of `eqtrain fit ...
   loop.steps=1` per size and on the built-in corpus (`data.train=stdlib`, same
   tokenizer); median of 3 interleaved rounds after one untimed run. Target: flat
   in corpus size, within 2 s of the built-in corpus.
4. `loader_vs_memory` (smallest corpus): batches/s of a `Loader` over
   `store.lm_rows(256)` cut to its first 200k rows against one over those rows
   taken into memory; numpy batches of 16, default prefetch, nothing consuming
   them (harsher than training: `fit` gives the training rate and the share of
   step time spent waiting for data when measure 2 ran); 5 alternating rounds.
   Target >= 0.98.

Usage (~30 min on 2 cores with the default sizes; `--quick`: 50MB,200MB):

    .venv/bin/python benchmarks/data_prepare.py [--sizes 0.5GB,2GB] [--quick]
        [--dir DIR] [--keep] [--only MEASURE ...]

TOKENIZERS_PARALLELISM and RAYON_NUM_THREADS are removed from the environment
(the baseline uses every core; prepare's workers set their own). The machine
should be quiet: ratios are measured in one run, absolute rates are machine's.
"""

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
from _machine import print_machine


MEASURES = ("prepare_throughput", "peak_rss", "time_to_first_step", "loader_vs_memory")
SEQ_LEN, BATCH = 256, 16
BASE, EOS = "encode_batch_fast", "<|endoftext|>"
IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]{2,}\b")
NUMBER = re.compile(r"\b\d+\b")
SYLLABLES = "ka lo mi ne ru ta vex zor pi qu el an is sto dr_ _".split()
PAGE = os.sysconf("SC_PAGE_SIZE")
OWN = ("corpus-", "tokenizer", "cache", "runs", "logs")  # what goes in the work dir


def say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


# -- the corpus and the tokenizer -------------------------------------------------
def stdlib_sources() -> list[tuple[str, list[str]]]:
    """Each stdlib `*.py` file's text and its identifiers (sorted: deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    out = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            out.append((text, sorted(set(IDENT.findall(text)))))
    return out


def variant(text: str, names: list[str], rng: random.Random) -> str:
    """`text` with some identifiers renamed, maybe blocks of lines shuffled and
    numbers changed."""
    if names:
        chosen = rng.sample(names, min(len(names), rng.randint(5, 30)))
        new = {n: "".join(rng.choices(SYLLABLES, k=rng.randint(2, 4))) for n in chosen}
        alternatives = "|".join(map(re.escape, chosen))
        text = re.sub(rf"\b(?:{alternatives})\b", lambda m: new[m.group()], text)
    if rng.random() < 0.5:  # shuffle blocks of 1-12 lines
        lines, blocks, i = text.split("\n"), [], 0
        while i < len(lines):
            k = rng.randint(1, 12)
            blocks.append("\n".join(lines[i : i + k]))
            i += k
        rng.shuffle(blocks)
        text = "\n".join(blocks)
    if rng.random() < 0.5:
        text = NUMBER.sub(lambda m: str(rng.randrange(4096)), text)
    return text


def write_corpora(sources: list, targets: dict[Path, int], seed: int) -> None:
    """Write every `path: bytes` of `targets` at once, streaming: the sources as
    they are, then seeded variants, each file stopping at the first document that
    reaches its size (so a smaller corpus is a prefix of a larger one)."""
    todo = {p: t for p, t in targets.items() if not _done(p, t, seed)}
    files = {p: open(p, "wb") for p in todo}  # noqa: SIM115
    sizes = dict.fromkeys(todo, 0)
    docs, rng, start = 0, random.Random(seed), time.perf_counter()
    for round_ in range(1_000_000):
        order = list(range(len(sources)))
        if round_:
            rng.shuffle(order)
        for i in order:
            text, names = sources[i]
            text = variant(text, names, rng) if round_ else text
            line = (json.dumps({"text": text}, ensure_ascii=False) + "\n").encode()
            docs += 1
            for path in [p for p in files if sizes[p] < todo[p]]:
                files[path].write(line)
                sizes[path] += len(line)
                if sizes[path] >= todo[path]:
                    files.pop(path).close()
                    info = {"seed": seed, "target": todo[path], "bytes": sizes[path]}
                    Path(f"{path}.done").write_text(json.dumps(info | {"docs": docs}))
                    rate = sizes[path] / 1e6 / (time.perf_counter() - start)
                    say(f"wrote {path.name}: {docs:,} documents, {rate:.0f} MB/s")
            if not files:  # (also when every corpus was written before)
                return


def _done(path: Path, target: int, seed: int) -> bool:
    try:
        info = json.loads(Path(f"{path}.done").read_text())
    except OSError:
        return False
    return info["target"] == target and info["seed"] == seed and path.is_file()


def train_tokenizer(sources: list, path: Path, seed: int) -> None:
    """A byte-level BPE of 8192 ids (with `<|endoftext|>`) on ~20 MB of sources."""
    if path.is_file():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts, total = [], 0
    for i in random.Random(seed).sample(range(len(sources)), len(sources)):
        texts.append(sources[i][0])
        total += len(sources[i][0])
        if total >= 20e6:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        special_tokens=[EOS],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    start = time.perf_counter()
    tok.train_from_iterator(texts, trainer, length=len(texts))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    seconds = time.perf_counter() - start
    say(f"trained the tokenizer on {total / 1e6:.0f} MB in {seconds:.0f} s")


# -- 1. prepare against encode_batch_fast ------------------------------------------
def prepare_throughput(args: argparse.Namespace, corpus: Path, tok: Path) -> dict:
    import tokenizers

    from eqtrain.data import HFTokenizer, prepare

    batches, batch, size, nbytes = [], [], 0, 0  # ~1 MB of text per batch, as prepare
    with open(corpus, "rb") as f:
        for line in f:
            text = json.loads(line)["text"]
            batch.append(text)
            size += len(text)
            nbytes += len(text.encode("utf-8"))
            if size >= 1 << 20:
                batches.append(batch)
                batch, size = [], 0
    batches += [batch] if batch else []
    docs = sum(map(len, batches))
    fast = tokenizers.Tokenizer.from_file(str(tok))
    rates: dict[str, list[float]] = {"prepare": [], BASE: []}
    for r in range(2):  # ABAB
        cache = args.dir / f"cache-throughput-{r}"
        start = time.perf_counter()
        tokenizer, workers = HFTokenizer.from_file(tok), os.cpu_count()
        store = prepare(str(corpus), tokenizer, cache_dir=cache, workers=workers)
        rates["prepare"].append(nbytes / 1e6 / (time.perf_counter() - start))
        tokens, parts = store.num_tokens, store.num_parts
        shutil.rmtree(cache)
        elapsed, counted = 0.0, 0
        for batch in batches:
            start = time.perf_counter()
            encodings = fast.encode_batch_fast(batch, add_special_tokens=False)
            elapsed += time.perf_counter() - start
            counted += sum(map(len, encodings))
        rates[BASE].append(nbytes / 1e6 / elapsed)
        say(f"round {r}: MB/s { {k: round(v[-1], 1) for k, v in rates.items()} }")
    ratios = [a / b for a, b in zip(*rates.values(), strict=True)]
    return {
        "measure": "prepare_throughput",
        "corpus_mb": round(corpus.stat().st_size / 1e6),
        "text_mb": round(nbytes / 1e6),
        "documents": docs,
        "tokens": tokens,
        "parts": parts,
        "tokens_match": tokens == counted + docs,  # one EOS per document
        "workers": os.cpu_count(),
        "prepare_mb_per_s": round(statistics.median(rates["prepare"]), 2),
        "encode_batch_fast_mb_per_s": round(statistics.median(rates[BASE]), 2),
        "rounds": {k: [round(x, 2) for x in v] for k, v in rates.items()},
        "ratio": round(statistics.median(ratios), 3),
        "target": ">= 0.8",
    }


# -- running the CLI, with its memory -----------------------------------------------
def tree_rss(root: int) -> int:
    """Summed RSS (bytes) of the descendants of `root`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, todo = 0, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            pass
    return total


# A child's ru_maxrss starts from the RSS of the process it was forked from (the
# kernel records the old memory's peak at exec), and this script holds ~1 GB after
# measure 1: so each command is started by a small launcher process, and reads
# ru_maxrss from it.
LAUNCH = """import os, sys
pid = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ)
_, status, usage = os.wait4(pid, 0)
open(sys.argv[1], "w").write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))"""


def run_cli(args: argparse.Namespace, argv: list[str], cache: Path, name: str) -> dict:
    """Run `eqtrain *argv` with `cache` as the data cache; its wall time, peak RSS
    (`ru_maxrss` of it and the children it reaped) and sampled tree RSS."""
    env = dict(os.environ, EQTRAIN_DATA_CACHE=str(cache))
    log = args.dir / "logs" / f"{name}.log"
    log.parent.mkdir(exist_ok=True)
    launch = [sys.executable, "-I", "-S", "-c", LAUNCH, f"{log}.rss", args.eqtrain]
    with open(log, "wb") as out:
        start = time.perf_counter()
        proc = subprocess.Popen([*launch, *argv], env=env, stdout=out, stderr=out)
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            peak[0] = max(peak[0], tree_rss(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    proc.wait()
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"eqtrain {' '.join(argv)} failed:\n{tail}")
    rss = int(Path(f"{log}.rss").read_text()) * 1024
    return {"seconds": seconds, "rss": rss, "tree": peak[0]}


def cli_args(args: argparse.Namespace, train: str, run: str, *more: str) -> list[str]:
    sets = {
        "data.train": train,
        "data.tokenizer": str(args.tok),
        "data.seq_len": SEQ_LEN,
        "data.eval": "none",
        "export.hf": "",
        "run_dir": str(args.dir / "runs" / run),
        **dict(m.split("=", 1) for m in more),
    }
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


def peak_rss(args: argparse.Namespace, corpora: dict[str, Path]) -> list[dict]:
    out = {"prepare": {}, "train": {}}
    for label, corpus in corpora.items():
        cache = args.dir / "cache" / label
        shutil.rmtree(cache, ignore_errors=True)
        sets = cli_args(args, str(corpus), f"rss-{label}", "loop.steps=20")
        for kind, argv in (("prepare", ["data", "prepare"]), ("train", ["fit"])):
            r = run_cli(args, argv + sets, cache, f"{kind}-{label}")
            out[kind][label] = {
                "seconds": round(r["seconds"], 1),
                "peak_rss_mb": round(r["rss"] / 1e6),
                "tree_rss_mb": round(r["tree"] / 1e6),
            }
            say(f"{kind} {label}: {out[kind][label]}")
        metrics = args.dir / "runs" / f"rss-{label}" / "metrics.jsonl"
        lines = [json.loads(x) for x in metrics.read_text().splitlines()]
        steps = [x for x in lines if "step_time" in x][5:]  # after warm-up
        args.train_rate[label] = {
            "train_tokens_per_s": round(
                statistics.median(x["tokens_per_second"] for x in steps)
            ),
            "data_time_fraction": round(
                sum(x["data_time"] for x in steps) / sum(x["step_time"] for x in steps),
                4,
            ),
        }
        shutil.rmtree(args.dir / "runs" / f"rss-{label}")
    records = []
    for kind, by_size in out.items():
        peaks = [v["peak_rss_mb"] for v in by_size.values()]
        spread = max(peaks) / min(peaks) - 1
        records.append(
            {
                "measure": f"peak_rss_{kind}",
                "by_size": by_size,
                "peak_rss": "ru_maxrss: max of the process and its workers, each alone",
                "tree_rss": "summed RSS of the process tree, sampled every 0.2 s",
                "spread": round(spread, 3),
                "target": "spread <= 0.2 and peak_rss_mb < 1500",
                "met": spread <= 0.2 and max(peaks) < 1500,
            }
        )
    return records


# -- 3. time to the first step --------------------------------------------------------
def time_to_first_step(args: argparse.Namespace, corpora: dict[str, Path]) -> dict:
    sources = {"stdlib": "stdlib", **{k: str(v) for k, v in corpora.items()}}
    for label, train in sources.items():  # prepare each store, untimed
        run_cli(args, ["data", "prepare", *cli_args(args, train, "x")],
                args.dir / "cache" / label, f"ttfs-prepare-{label}")  # fmt: skip

    def first_step(label: str, run: str) -> float:
        sets = cli_args(args, sources[label], run, "loop.steps=1")
        seconds = run_cli(args, ["fit", *sets], args.dir / "cache" / label, run)
        shutil.rmtree(args.dir / "runs" / run)
        return seconds["seconds"]

    first_step("stdlib", "ttfs-warmup")  # untimed: the first run of a fresh process
    times: dict[str, list[float]] = {k: [] for k in sources}
    for r in range(3):  # rounds interleave the corpora
        for label in sources:
            times[label].append(first_step(label, f"ttfs-{label}-{r}"))
        say(f"round {r}: { {k: [round(x, 1) for x in v] for k, v in times.items()} }")
    median = {k: statistics.median(v) for k, v in times.items()}
    sizes = list(corpora)
    return {
        "measure": "time_to_first_step",
        "median_s": {k: round(v, 2) for k, v in median.items()},
        "runs_s": {k: [round(x, 2) for x in v] for k, v in times.items()},
        "minus_stdlib_s": {k: round(median[k] - median["stdlib"], 2) for k in sizes},
        "largest_minus_smallest_s": round(median[sizes[-1]] - median[sizes[0]], 2),
        "target": "flat in corpus size; within 2 s of stdlib",
        "met": all(median[k] - median["stdlib"] <= 2 for k in sizes),
    }


# -- 4. a Loader over the store against one over the same rows in memory ---------------
def loader_vs_memory(args: argparse.Namespace, label: str, corpus: Path) -> dict:
    from eqtrain.data import HFTokenizer, Loader, prepare

    cache = args.dir / "cache" / label  # the store of measures 2-3 when they ran
    store = prepare(str(corpus), HFTokenizer.from_file(args.tok), cache_dir=cache)
    rows = store.lm_rows(SEQ_LEN)
    n = min(200_000, rows.num_rows)
    memory = rows.take(np.arange(n))  # also opens (and checks) the parts it reads
    head = types.SimpleNamespace(num_rows=n, take=rows.take)  # the first n rows
    sources = {"store": head, "memory": memory}
    batches = 2000 if args.quick else 20000

    def rate(name: str, r: int) -> float:
        loader = Loader(
            sources[name], BATCH, seed=r + 1, process_index=0, process_count=1
        )
        it = iter(loader)
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        elapsed = time.perf_counter() - start
        it.close()
        return batches / elapsed

    first = [next(iter(Loader(s, BATCH, seed=0, process_count=1, process_index=0)))
             for s in sources.values()]  # fmt: skip
    same = all(np.array_equal(first[0][k], first[1][k]) for k in first[0])
    rates: dict[str, list[float]] = {"store": [], "memory": []}
    for r in range(-1, 5):  # round -1: warm-up
        for name in rates if r % 2 else reversed(rates):
            value = rate(name, r)
            if r >= 0:
                rates[name].append(value)
    ratios = [a / b for a, b in zip(rates["store"], rates["memory"], strict=True)]
    per_s = {k: statistics.median(v) for k, v in rates.items()}
    record = {
        "measure": "loader_vs_memory",
        "corpus": label,
        "rows": n,
        "batch": BATCH,
        "seq_len": SEQ_LEN,
        "batches": batches,
        "same_batches": same,
        "store_batches_per_s": round(per_s["store"], 1),
        "memory_batches_per_s": round(per_s["memory"], 1),
        "store_tokens_per_s": round(per_s["store"] * BATCH * SEQ_LEN),
        "ratio": round(statistics.median(ratios), 3),
        "rounds": {k: [round(x) for x in v] for k, v in rates.items()},
        "target": ">= 0.98 (iteration only)",
    }
    if label in args.train_rate:  # the 20-step fit of measure 2 on this corpus
        record["fit"] = args.train_rate[label]
    return record


# -- main ---------------------------------------------------------------------------
def parse_size(text: str) -> int:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9}
    text = text.strip().upper()
    return int(float(text[:-2]) * units[text[-2:]])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="corpus sizes (0.5GB,2GB)")
    parser.add_argument("--quick", action="store_true", help="sizes 50MB,200MB")
    parser.add_argument("--dir", type=Path, default=None, help="work directory")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--seed", type=int, default=0)
    names = (*MEASURES, "peak_rss_prepare", "peak_rss_train")
    parser.add_argument("--only", action="append", choices=names, help="repeatable")
    args = parser.parse_args(argv)
    args.sizes = args.sizes or ("50MB,200MB" if args.quick else "0.5GB,2GB")
    only = args.only or MEASURES  # peak_rss_prepare and _train run together
    args.only = {"peak_rss" if m.startswith("peak_rss") else m for m in only}
    return args


def main(argv: list[str] | None = None) -> None:
    print_machine()  # the processor and settings: figures are per machine
    args = parse_args(argv)
    for name in ("TOKENIZERS_PARALLELISM", "RAYON_NUM_THREADS"):
        os.environ.pop(name, None)
    created = args.dir is None or not args.dir.exists()
    args.dir = (args.dir or Path(tempfile.mkdtemp(prefix="data_prepare-"))).absolute()
    args.dir.mkdir(parents=True, exist_ok=True)
    args.tok = args.dir / "tokenizer" / "tokenizer.json"
    args.train_rate = {}
    script = Path(sys.executable).parent / "eqtrain"  # the venv's CLI
    args.eqtrain = str(script) if script.exists() else shutil.which("eqtrain")
    sizes = sorted((parse_size(s), s.strip()) for s in args.sizes.split(","))
    corpora = {label: args.dir / f"corpus-{label}.jsonl" for _, label in sizes}
    smallest = next(iter(corpora.items()))  # measures 1 and 4 need only this one
    needed = corpora if {"peak_rss", "time_to_first_step"} & args.only else {}
    needed = needed or dict([smallest])
    say(f"work directory {args.dir}")
    try:
        sources = stdlib_sources()
        mb = sum(len(t) for t, _ in sources) / 1e6
        say(f"{len(sources)} stdlib files, {mb:.0f} MB")
        size_of = {label: n for n, label in sizes}
        write_corpora(sources, {p: size_of[k] for k, p in needed.items()}, args.seed)
        train_tokenizer(sources, args.tok, args.seed)
        del sources
        start = time.perf_counter()
        if "prepare_throughput" in args.only:
            emit(prepare_throughput(args, smallest[1], args.tok))
        if "peak_rss" in args.only:
            for record in peak_rss(args, corpora):
                emit(record)
        if "time_to_first_step" in args.only:
            emit(time_to_first_step(args, corpora))
        if "loader_vs_memory" in args.only:
            emit(loader_vs_memory(args, *smallest))
        say(f"measured in {time.perf_counter() - start:.0f} s")
    finally:
        if args.keep:
            say(f"kept {args.dir}")
        elif created:
            shutil.rmtree(args.dir, ignore_errors=True)
        else:  # a --dir that was there before: only what this script made
            for path in args.dir.glob("*"):
                if path.name.startswith(OWN):
                    shutil.rmtree(path) if path.is_dir() else path.unlink()


if __name__ == "__main__":
    main()
