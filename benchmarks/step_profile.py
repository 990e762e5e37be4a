"""Where a training step's time goes: the top ops of eqtrain's Llama step (XLA) and
of transformers' `LlamaForCausalLM` step (PyTorch), on `benchmarks/models.py`'s
workload (same model, weights and batches).

- XLA: `jax.profiler.trace` around `--steps` steps of the jitted, donated step
  (`eqtrain.train_step(causal_lm_loss, optax.adamw)`), read back with
  `jax.profiler.ProfileData`. Each op event of XLA's CPU threads is matched to its
  HLO instruction in the compiled step, whose metadata gives the phase (`jvp` =
  forward, `transpose(jvp)` = backward, else the optimizer update) and the part
  of the model (the named scopes `embed`, `norm`, `attention`, `mlp`, `head`,
  `loss` that eqtrain's models and losses open). Times are *thread* ms per step
  (an op runs on one thread; two ops may run at once). The timeline also says how
  many ms per step no traced op, one op, or two ops ran: with XLA's default
  (YNNPACK) dots every op is traced and single-threaded; with Eigen dots
  (`--xla_cpu_experimental_ynn_fusion_type=`, the CLI's CPU default) the dots
  split over the threads and are not traced, so they show as "untraced" time.
- PyTorch: `torch.profiler.profile` over the same steps, with `forward`,
  `backward` and `optimizer` ranges; ops are aggregated by name with their self
  CPU time (an op's own time on the main thread; its intra-op threads work
  inside it).

It prints, per side, a table of the `--top` ops to stderr and one JSON line to
stdout: {"side", "step_ms", "phases": {phase: ms}, "parts": {part: ms},
"top": [[name, phase, part, ms_per_step, calls_per_step, shape_or_note], ...],
and for XLA "concurrency_ms": [none, one, two_or_more]}.

Usage (CPU; torch needs `pip install torch==2.13.0 transformers`):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/step_profile.py [--side both]
        [--batch 16] [--seq 256] [--steps 4] [--no-scan-layers] [--top 15]
        [--tune-cpu] [--quick]

`--tune-cpu` profiles under the CLI's CPU settings (`eqtrain.cpu.tune_cpu()`):
where it chose oneDNN's products each of them is one traced op (its fusion,
`onednn_fusion.N`), so the products show; under Eigen's they are untraced.
"""

import argparse
import collections
import dataclasses
import glob
import json
import re
import sys
import tempfile
import time
from typing import Any

import jax
import jax.random as jr
import models as bench  # benchmarks/models.py: the workload
from _machine import print_machine

from eqtrain.models import Llama


PARTS = ("embed", "norm", "attention", "mlp", "head", "loss")


def hlo_ops(text: str) -> dict[str, tuple[str, str]]:
    """HLO instruction name -> (result shape, op_name metadata) of a compiled module."""
    ops = {}
    for line in text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+?\[[^\]]*\]|\([^)]*\))", line)
        if m:
            op = re.search(r'op_name="([^"]*)"', line)
            ops[m.group(1)] = (m.group(2), op.group(1) if op else "")
    return ops


def classify(op_name: str) -> tuple[str, str]:
    """(phase, part) of an HLO op from its metadata's name stack (XLA drops the
    metadata of some ops it creates: those are "unnamed")."""
    if not op_name:
        return "unnamed", "unnamed"
    phase = "backward" if "transpose(" in op_name else "forward"
    if "jvp(" not in op_name:
        phase = "update"
    found = [(op_name.rfind(p), p) for p in PARTS if p in op_name]
    part = max(found)[1] if found else ("optimizer" if phase == "update" else "other")
    return phase, part


def profile_jax(args: argparse.Namespace, model: Llama, batches: list[dict]) -> dict:
    runner = bench.JaxRunner(model, batches)
    state = runner.fresh()
    ops = hlo_ops(runner.step.lower(state, runner.batches[0]).compile().as_text())
    for batch in runner.batches[:2]:  # compile and warm up
        state, _ = runner.step(state, batch)
    jax.block_until_ready(state)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        with jax.profiler.trace(tmp):
            for batch in runner.batches[: args.steps]:
                state, _ = runner.step(state, batch)
            jax.block_until_ready(state)
        wall = time.perf_counter() - start
        (path,) = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    spans, per_op = [], collections.defaultdict(lambda: [0, 0])
    for plane in data.planes:
        for line in plane.lines:
            if "XLA" not in line.name:
                continue
            for ev in line.events:
                if ev.name in ops:
                    per_op[ev.name][0] += ev.duration_ns
                    per_op[ev.name][1] += 1
                    spans.append((ev.start_ns, ev.start_ns + ev.duration_ns))
    n = args.steps
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    # the timeline: how long no traced op, one op, or two or more ran
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running, prev, busy = 0, first, [0.0, 0.0, 0.0]
    for t, d in edges:
        busy[min(running, 2)] += t - prev
        running, prev = running + d, t
    phases: collections.Counter = collections.Counter()
    parts: collections.Counter = collections.Counter()
    rows = []
    for name, (ns, calls) in per_op.items():
        shape, op_name = ops[name]
        phase, part = classify(op_name)
        ms = ns / 1e6 / n
        phases[phase] += ms
        parts[f"{part} ({phase})"] += ms
        rows.append([name, phase, part, round(ms, 2), round(calls / n, 2), shape])
    rows.sort(key=lambda r: -r[3])
    untraced = busy[0] / 1e6 / n
    phases["untraced"] = untraced
    return {
        "side": "xla",
        "step_ms": round(1e3 * wall / n, 1),
        "timeline_step_ms": round((last - first) / 1e6 / n, 1),
        "concurrency_ms": [round(b / 1e6 / n, 1) for b in busy],
        "phases": {k: round(v, 1) for k, v in phases.most_common()},
        "parts": {k: round(v, 1) for k, v in parts.most_common()},
        "top": rows[: args.top],
    }


def profile_torch(args: argparse.Namespace, model: Llama, batches: list[dict]) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(args.threads)
    runner = bench.TorchRunner(model, model.config, batches)
    hf, vocab = runner.hf, runner.vocab
    opt = torch.optim.AdamW(
        hf.parameters(), lr=bench.LR, weight_decay=bench.WEIGHT_DECAY
    )

    def step(batch: dict) -> None:
        with record_function("forward"):
            logits = hf(input_ids=batch["tokens"]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, vocab), batch["targets"].reshape(-1)
            )
        with record_function("backward"):
            opt.zero_grad(set_to_none=True)
            loss.backward()
        with record_function("optimizer"):
            opt.step()

    for batch in runner.batches[:2]:
        step(batch)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in runner.batches[: args.steps]:
            step(batch)
    wall = time.perf_counter() - start
    events = list(prof.events())
    ranges = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.name in ("forward", "backward", "optimizer")
    ]
    n = args.steps
    phases: collections.Counter = collections.Counter()
    per_op: dict = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.name in ("forward", "backward", "optimizer"):
            phases[e.name] += e.cpu_time_total / 1e3 / n
            continue
        phase = next((p for s, t, p in ranges if s <= e.time_range.start <= t), "?")
        key = (e.name, phase)
        per_op[key][0] += e.self_cpu_time_total / 1e3 / n
        per_op[key][1] += 1
    rows = [
        [name, phase, "", round(ms, 2), round(calls / n, 2), ""]
        for (name, phase), (ms, calls) in per_op.items()
    ]
    rows.sort(key=lambda r: -r[3])
    return {
        "side": "torch",
        "step_ms": round(1e3 * wall / n, 1),
        "phases": {k: round(v, 1) for k, v in phases.most_common()},
        "top": rows[: args.top],
    }


def show(record: dict) -> None:
    print(
        f"\n{record['side']}: {record['step_ms']} ms per step (profiled)",
        file=sys.stderr,
    )
    print(f"  phases (ms/step): {record['phases']}", file=sys.stderr)
    if "parts" in record:
        print(f"  parts (thread ms/step): {record['parts']}", file=sys.stderr)
        print(
            f"  ms/step with 0 / 1 / 2+ ops running: {record['concurrency_ms']}",
            file=sys.stderr,
        )
    for name, phase, part, ms, calls, shape in record["top"]:
        print(
            f"  {ms:8.2f} ms  x{calls:<5} {phase:9} {part:10} {name:34} {shape}",
            file=sys.stderr,
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("xla", "torch", "both"), default="both")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="profiled steps")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--scan-layers", action=argparse.BooleanOptionalAction, default=True
    )
    parser.add_argument(
        "--tune-cpu",
        action="store_true",
        help="profile under eqtrain.cpu.tune_cpu()'s settings (the CLI's: its "
        "products, oneDNN's where it chose them, traced as one op each)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny smoke test")
    args = parser.parse_args(argv)
    if args.tune_cpu:
        import eqtrain

        eqtrain.cpu.tune_cpu()
    print_machine()  # the processor and settings: figures are per machine
    args.batch = args.batch or (2 if args.quick else 16)
    args.seq = args.seq or (16 if args.quick else 256)
    args.steps = args.steps or (2 if args.quick else 4)
    base = bench.QUICK if args.quick else bench.CONFIG
    cfg = dataclasses.replace(base, scan_layers=args.scan_layers)
    model = Llama(cfg, jr.key(0))
    batches = bench.make_batches(cfg, max(args.steps, 2), args.batch, args.seq)
    sides = ("xla", "torch") if args.side == "both" else (args.side,)
    for side in sides:
        fn = profile_jax if side == "xla" else profile_torch
        record: dict[str, Any] = fn(args, model, batches)
        record.update(batch=args.batch, seq=args.seq, scan_layers=args.scan_layers)
        show(record)
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
