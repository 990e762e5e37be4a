"""GRPO at a real size on the CPU: a few steps of `eqtrain fit` with
`task.kind = "grpo"` on a model of Qwen2.5-0.5B's shape (random weights).

The architecture is Qwen2.5-0.5B's published config.json (`QWEN2_5_0_5B` below),
given to the job as `[model]` keys (`arch = "qwen2"`, nothing downloaded). The
script writes, in a temporary directory, a prompt file (`--prompts` rows of
`--prompt-len` bytes with an `answer` column) and a config: the byte tokenizer (259
ids; the model keeps its 151,936-row embedding and head, so the random model samples
over the whole vocabulary and every completion runs to `--completion` tokens),
`--prompts` prompts per step x `--group` completions each, the `exact_answer`
reward, float32 (the default; `--precision bf16`: `loop.precision = "bf16"`),
`EQTRAIN_CPU_TUNING` as the environment has it (the cached `tune_cpu` choice).
It runs `eqtrain fit --dry-run` (the compiled step's memory estimate) and then
`eqtrain fit` for `--steps` + 2 steps in fresh processes.

Step times come from the run's metrics.jsonl: `step_time` of steps 2 to N-1 (the
first includes compilation; the last is read after the loop, when the final
checkpoint is due, and says nothing). `time/generate` and `time/reward` are
measured inside the step by the rollout's host clock; the update (log-probs,
loss, gradients and AdamW) is the step time minus those two. Peak resident memory
is the `eqtrain fit` process's `VmHWM` when the last timed step's metrics were
written (`peak_rss_steps`) and its `ru_maxrss` at exit (`peak_rss_process`,
which includes writing the final checkpoint).

Prints the machine and one JSON line:

    {"config", "precision", "params", "prompts", "group", "rows", "prompt_len",
     "completion_len", "seq_len", "tokens", "completion_tokens", "timed_steps",
     "step_s", "generate_s", "reward_s", "update_s" (medians over the timed steps),
     "step_s_all", "generate_s_all", "peak_rss_steps_gib", "peak_rss_process_gib",
     "dry_run_peak_gib", "dry_run", "wall_s"}

Usage (CPU):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/grpo_size.py [--steps 3]
        [--prompts 2] [--group 4] [--prompt-len 32] [--completion 32]
        [--precision float32|bf16] [--keep DIR]
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/grpo_size.py --quick  # smoke test
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _machine import machine, print_machine


# Qwen2.5-0.5B's config.json (the values that shape the model)
QWEN2_5_0_5B = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
}

# --quick: the same family and vocabulary, a tiny body
QUICK = QWEN2_5_0_5B | {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 4096,
}


def model_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json's values as eqtrain's `[model]` keys (Qwen2: q/k/v biases)."""
    return {
        "arch": hf["model_type"],
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf["num_key_value_heads"],
        "rope_theta": hf["rope_theta"],
        "norm_eps": hf["rms_norm_eps"],
        "tie_embeddings": hf["tie_word_embeddings"],
        "max_seq_len": hf["max_position_embeddings"],
        "attention_bias": True,
    }


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def write_run(root: Path, hf: dict[str, Any], args: Any) -> Path:
    """The prompt file and the config; returns the config's path."""
    rows = []
    for i in range(max(args.prompts, 8)):
        a, b = 100 + 37 * i % 900, 10 + 13 * i % 90
        text = f"Q{i}: what is {a} plus {b}? A:"
        text = (text + " " * args.prompt_len)[: args.prompt_len - 1]  # + BOS
        rows.append({"prompt": text, "answer": str(a + b)})
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sections = {
        "model": model_keys(hf),
        "task": {
            "kind": "grpo",
            "group_size": args.group,
            "max_completion_len": args.completion,
            "temperature": 1.0,
            "rewards": "exact_answer",
        },
        "data": {
            "train": str(data),
            "tokenizer": "byte",
            "seq_len": args.prompt_len + args.completion,
            "batch_size": args.prompts,
        },
        "optim": {"warmup_steps": 0},
        "loop": {"steps": args.steps + 2, "precision": args.precision},
        "log": {"every": 1, "progress": "none"},
        "checkpoint": {"every": 0, "async_save": False},
        "export": {"hf": ""},
    }
    lines = [f"run_dir = {json.dumps(str(root / 'run'))}", "seed = 0", ""]
    for name, keys in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in keys.items()]
        lines.append("")
    config = root / "grpo.toml"
    config.write_text("\n".join(lines))
    return config


def eqtrain_cmd(*args: str) -> list[str]:
    return [sys.executable, "-c", "from eqtrain.cli import main; main()", *args]


GIB = 1024**3
UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": GIB, "TiB": 1024**4}


def dry_run(config: Path) -> dict[str, Any]:
    """`eqtrain fit --dry-run`'s memory estimate per device (GiB), its parameter
    count and its `cpu` line (the products and layer form the run uses)."""
    proc = subprocess.run(
        eqtrain_cmd("fit", str(config), "--dry-run"), capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"dry run failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    found = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"\s+(\w[\w ]*?)\s{2,}([\d.]+) (B|KiB|MiB|GiB|TiB)\b", line)
        if m and m.group(1) in (
            "parameters",
            "optimizer state",
            "gradients",
            "activations",
            "peak",
        ):
            found[m.group(1)] = float(m.group(2)) * UNITS[m.group(3)] / GIB
        if line.startswith("cpu "):
            found["cpu"] = line[3:].strip()
        m = re.match(r"model\s+\S+, ([\d,]+) parameters", line)
        if m:
            found["params"] = int(m.group(1).replace(",", ""))
    if "peak" not in found:
        raise SystemExit(f"no memory estimate in the dry run's output:\n{proc.stdout}")
    return found


def vm_hwm(pid: int) -> int | None:
    """The process's peak resident memory so far (bytes), or None once gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    m = re.search(r"VmHWM:\s+(\d+) kB", text)
    return int(m.group(1)) * 1024 if m else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # being written
            break
        if "time/generate" in row:
            rows.append(row)
    return rows


def fit(config: Path, run_dir: Path, last_timed: int) -> tuple[list[dict], int, int]:
    """Run `eqtrain fit`; its metrics, its VmHWM once step `last_timed` was
    written, and its ru_maxrss at exit (bytes)."""
    proc = subprocess.Popen(
        eqtrain_cmd("fit", str(config)), stdout=sys.stderr, stderr=subprocess.PIPE
    )
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()))
    reader.start()
    metrics_path, hwm = run_dir / "metrics.jsonl", 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:  # reaped: its own rusage
            break
        now_hwm = vm_hwm(proc.pid) or 0
        if not hwm:
            rows = read_metrics(metrics_path)
            if rows and rows[-1]["step"] >= last_timed:
                hwm = now_hwm
        time.sleep(0.5)
    proc.returncode = os.waitstatus_to_exitcode(status)
    maxrss = usage.ru_maxrss * 1024  # KiB on Linux
    reader.join()
    rows = read_metrics(metrics_path)
    if proc.returncode != 0 or len(rows) < last_timed + 1:
        tail = b"".join(err).decode(errors="replace")[-4000:]
        raise SystemExit(f"eqtrain fit stopped early:\n{tail}")
    return rows, hwm, maxrss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model: smoke test")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens")
    parser.add_argument("--completion", type=int, default=32, help="completion tokens")
    parser.add_argument("--precision", default="float32", choices=("float32", "bf16"))
    parser.add_argument(
        "--keep", help="write the run here (kept) instead of a temp dir"
    )
    args = parser.parse_args()
    if args.quick:
        args.steps, args.completion, args.prompt_len = 1, 8, 16
    hf = QUICK if args.quick else QWEN2_5_0_5B
    print_machine()
    start = time.perf_counter()
    root = Path(args.keep or tempfile.mkdtemp(prefix="grpo_size_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        config = write_run(root, hf, args)
        estimate = dry_run(config)
        last_timed = args.steps + 1
        rows, hwm, maxrss = fit(config, root / "run", last_timed)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    timed = [r for r in rows if 2 <= r["step"] <= last_timed]
    med = lambda key: statistics.median(r[key] for r in timed)  # noqa: E731
    step, gen, rew = med("step_time"), med("time/generate"), med("time/reward")
    rows_per_step = args.prompts * args.group
    seq_len = args.prompt_len + args.completion
    record = {
        "config": "quick" if args.quick else "qwen2.5-0.5b",
        "precision": args.precision,
        "params": estimate.get("params"),
        "prompts": args.prompts,
        "group": args.group,
        "rows": rows_per_step,
        "prompt_len": args.prompt_len,
        "completion_len": args.completion,
        "seq_len": seq_len,
        "tokens": rows_per_step * seq_len,
        "completion_tokens": med("completions/mean_length") * rows_per_step,
        "timed_steps": len(timed),
        "step_s": round(step, 3),
        "generate_s": round(gen, 3),
        "reward_s": round(rew, 4),
        "update_s": round(step - gen - rew, 3),
        "step_s_all": [round(r["step_time"], 3) for r in rows],
        "generate_s_all": [round(r["time/generate"], 3) for r in rows],
        "peak_rss_steps_gib": round(hwm / GIB, 2),
        "peak_rss_process_gib": round(maxrss / GIB, 2),
        "dry_run_peak_gib": round(estimate["peak"], 2),
        "dry_run": {
            k: round(v, 3) for k, v in estimate.items() if k not in ("params", "cpu")
        },
        "cpu_setting": estimate.get("cpu"),
        "wall_s": round(time.perf_counter() - start, 1),
        "load_after": machine()["load"],
    }
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
