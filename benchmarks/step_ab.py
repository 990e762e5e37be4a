"""Two or more versions of eqtrain's Llama step, side by side in one process:
which is faster, by how much, measured so that the machine's drift cancels.

Each variant compiles `benchmarks/models.py`'s step (the same model, weights,
batches, optimizer and CPU settings) with one change to the model's code, and
the variants then alternate **single steps** (`--pairs` times, the order
flipped every pair), each step waited for. The figure is the median of the
per-pair time ratios (first variant / this one: > 1 means this one is faster)
with its quartiles. On a shared 2-core machine whole runs drift by 5-10%
between minutes; adjacent single steps drift together, so 1-2% differences
show where `models.py`'s rounds cannot tell them apart.

Variants (`--variants`, comma-separated; the first is the reference; `a+b`
applies both changes):

- `current`: the code as it is;
- `block<N>`: causal attention in blocks of N queries at every length
  (`causal_block_size`; the default is 128 up to 512 tokens, 256 past them);
- `rev:<git revision>`: the attention kernels of that revision
  (`eqtrain/models/_attention.py` as `git show <rev>:...` gives it, imported
  as a module of its own) in place of the current `causal_blocks`, and the
  MLP's gate by autodiff (`act(gate) * up`) as before `gated` had its own
  gradient;
- `autodiff_gate`: only the MLP's gate by autodiff;
- `recomputed_rope`: the rotary tables without `_rope.stored_once`, so that
  XLA:CPU evaluates their cos and sin inside every fusion that reads them, as
  before it had that product;
- `windowed_reductions`: the row sums and maxima of the softmax, the loss and
  the norms as one reduction each (`eqtrain._reduce` made plain), which
  XLA:CPU rewrites into an unfused `reduce-window` of 32 and a reduction of
  the windows, as before `eqtrain._reduce`;
- `kept_activation`: the gated MLP's hidden layer kept for the down
  projection's gradient (not recomputed by `_decoder_mlps.gated_down`);
- `kept_norms`: the norms' outputs kept for the first projections' weight
  gradients (not made again by `_decoder_mlps.normed`; under
  `--scan-layers` only: unrolled layers do not fold them);
- `hoisted_mask`: the attention mask and masked score not tied to the
  queries (`_attention._in_layer` made the identity), so that under
  `--scan-layers` JAX computes their broadcasts before the loop and every
  layer reads them from memory.

It prints the machine line, then one JSON line per variant:
{"variant", "step_ms" (median), "ratio" (median of reference / variant per
pair), "quartiles", "pairs", "cpu_products", "first_loss", "temp_mib" (the
compiled step's temporary memory, XLA's `memory_analysis()`)}.

Usage (CPU; needs git for `rev:`):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/step_ab.py \\
        --variants rev:0a7f3dc,current [--batch 16 --seq 256] [--pairs 60]
        [--scan-layers] [--quick]
"""

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import jax.random as jr
import models as bench  # benchmarks/models.py: the workload
from _machine import print_machine

import eqtrain
import eqtrain._reduce as reduce
import eqtrain.models._attention as attention
import eqtrain.models._decoder_blocks as blocks
import eqtrain.models._decoder_mlps as mlps
import eqtrain.models._rope as rope
from eqtrain.models import Llama
from eqtrain.models._layers import ACTIVATIONS


REPO = Path(__file__).resolve().parent.parent


def old_attention(rev: str) -> Any:
    """`eqtrain/models/_attention.py` at git revision `rev`, as a module of its
    own (its relative imports made absolute)."""
    text = subprocess.run(
        ["git", "show", f"{rev}:eqtrain/models/_attention.py"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    text = text.replace("from .._", "from eqtrain._").replace(
        "from ._", "from eqtrain.models._"
    )
    path = Path(tempfile.mkdtemp()) / f"attention_{rev}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _autodiff_gate(act: str, gate: Any, up: Any) -> Any:
    return ACTIVATIONS[act](gate) * up


@contextlib.contextmanager
def variant(name: str) -> Iterator[None]:
    """The model's code changed as `name` says (changes joined by `+` all
    apply), while the step is traced."""
    modules = (attention, blocks, mlps, rope, reduce)
    saved = [dict(vars(module)) for module in modules]
    try:
        for part in name.split("+"):
            _change(part)
        yield
    finally:
        for module, values in zip(modules, saved, strict=True):
            for key, value in values.items():
                setattr(module, key, value)


def _change(name: str) -> None:
    """One of `variant`'s changes."""
    if name.startswith("block"):
        size = int(name.removeprefix("block"))
        attention.causal_block_size = lambda seq: size
    elif name.startswith("rev:"):
        attention.causal_blocks = old_attention(name[4:]).causal_blocks
        mlps.gated = _autodiff_gate
    elif name == "autodiff_gate":
        mlps.gated = _autodiff_gate
    elif name == "recomputed_rope":
        rope.stored_once = lambda *tables: tables
    elif name == "windowed_reductions":
        reduce.windowed = lambda: False
    elif name == "kept_activation":
        mlps.gated_down = lambda lin, act, g, u, k: lin(mlps.gated(act, g, u), key=k)
    elif name == "kept_norms":
        kept = lambda norm, fn, x, *args, name=None: fn(
            x if norm is None else norm(x), *args
        )
        blocks.normed = mlps.normed = kept
    elif name == "hoisted_mask":
        attention._in_layer = lambda q, keep: (q, keep, attention._MASKED)
    elif name != "current":
        raise SystemExit(f"unknown variant {name!r} (see --help)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="current,block128")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--pairs", type=int, default=None, help="steps of each")
    parser.add_argument("--scan-layers", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny smoke test")
    args = parser.parse_args(argv)
    eqtrain.cpu.tune_cpu()  # as the CLI does, for every variant alike
    print_machine()
    batch = args.batch or (2 if args.quick else 16)
    seq = args.seq or (16 if args.quick else 256)
    pairs = args.pairs or (4 if args.quick else 60)
    base = bench.QUICK if args.quick else bench.CONFIG
    cfg = dataclasses.replace(base, scan_layers=args.scan_layers)
    model = Llama(cfg, jr.key(0))
    batches = bench.make_batches(cfg, 4, batch, seq)
    names = args.variants.split(",")
    runs: dict[str, list[Any]] = {}
    for name in names:
        with variant(name):  # traced and compiled under the change
            runner = bench.JaxRunner(model, batches)
            state = runner.fresh()
            first = None
            for b in runner.batches[:2]:
                state, metrics = runner.step(state, b)
                first = float(metrics["loss"]) if first is None else first
            jax.block_until_ready(state)
            compiled = runner.step.lower(state, runner.batches[0]).compile()
            temp = compiled.memory_analysis().temp_size_in_bytes
        runs[name] = [runner, state, first, temp]
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(pairs):
        for name in names if i % 2 == 0 else names[::-1]:
            runner, state = runs[name][:2]
            b = runner.batches[i % len(runner.batches)]
            start = time.perf_counter()
            state, _ = runner.step(state, b)
            jax.block_until_ready(state)
            times[name].append(time.perf_counter() - start)
            runs[name][1] = state
    reference = times[names[0]]
    for name in names:
        ratios = [a / b for a, b in zip(reference, times[name], strict=True)]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios
        record = {
            "variant": name,
            "batch": batch,
            "seq": seq,
            "scan_layers": args.scan_layers,
            "step_ms": round(1e3 * statistics.median(times[name]), 1),
            "ratio": round(statistics.median(ratios), 4),
            "quartiles": [round(quartiles[0], 4), round(quartiles[-1], 4)],
            "pairs": pairs,
            "cpu_products": runs[name][0].step.compile_note,
            "first_loss": runs[name][2],
            "temp_mib": round(runs[name][3] / 2**20, 3),
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    sys.exit(main())
