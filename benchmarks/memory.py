"""Memory of the chunked LM head + loss, the tiled MLP and the remat presets, and
the longest sequence a fixed memory budget trains.

Every figure of memory is `temp_bytes`: XLA's `memory_analysis()` of the
compiled function (the bytes it holds besides its arguments and outputs), read
without running it. Times are milliseconds per call after warm-up, the median
over `--rounds` rounds in which the variants alternate (order reversed every
other round, so the shared machine's drifts cancel); `ratio` is the median of
the per-round time ratios, with its range.

Parts (one JSON line per point):

- `loss`: gradient of the LM loss w.r.t. the final hidden states and the head,
  `[seq, 256] x [32000, 256]` in f32, at seq 1k-8k: `plain` is
  `causal_lm_loss`'s math on full logits (`logits = h @ W.T`, f32
  cross-entropy), `chunked` is `losses.chunked_cross_entropy` with 256-token
  chunks. Targets at seq 4096: >= 8x less temp memory, <= 5% slower.
- `mlp`: gradient through one Llama SwiGLU MLP (hidden 256, intermediate 1024)
  over `[seq, 256]`, plain vs tiled (`mlp_chunks="auto"`: seq / 256 pieces).
- `vocab`: the chunked loss's time over the plain one by vocabulary size at
  seq 2048 (what `model.loss_chunk = "auto"` decides by).
- `budget`: the longest `data.seq_len` whose whole training step (a 4-layer,
  hidden-256 Llama with a 32k vocabulary, batch 1, AdamW) fits 2 GiB per device,
  everything off (`loss_chunk=0, mlp_chunks=1, remat=none`) vs everything on
  (`loss_chunk=256, mlp_chunks=auto, remat=full, attention_chunk=512`), found by
  `eqtrain fit --memory-budget`'s search (compiles, no run). Target: >= 4x.

Usage (CPU):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/memory.py [--rounds 5] [--quick]
        [--parts loss,mlp,vocab,budget]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
from _machine import print_machine

from eqtrain import config as config_lib
from eqtrain.losses import chunked_cross_entropy
from eqtrain.models import LlamaConfig
from eqtrain.models._layers import tiled
from eqtrain.models.llama import LlamaMLP


def temp_bytes(fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """The compiled `fn` and its `temp_size_in_bytes`."""
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, int(compiled.memory_analysis().temp_size_in_bytes)


def timed(fns: dict[str, Any], args: dict[str, tuple], rounds: int, calls: int):
    """Median ms per call of each compiled fn, and per-round times."""
    per_round: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for name in names:  # warm-up
        jax.block_until_ready(fns[name](*args[name]))
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            for _ in range(calls):
                out = fns[name](*args[name])
            jax.block_until_ready(out)
            per_round[name].append(1e3 * (time.perf_counter() - t) / calls)
    return per_round


def _ratio(per_round: dict[str, list[float]], a: str, b: str) -> dict[str, Any]:
    ratios = [x / y for x, y in zip(per_round[a], per_round[b], strict=True)]
    return {
        "ratio": round(statistics.median(ratios), 3),
        "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
    }


def plain_loss(h, w, t):
    z = (h @ w.T).astype(jnp.float32)
    log_z = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, t[:, None], axis=-1)[:, 0]
    return jnp.mean(log_z - picked)


def chunked_loss(h, w, t, chunk=256):
    ce = chunked_cross_entropy(h, w, t, jnp.ones(t.shape), chunk=chunk)
    return ce.total / t.shape[0]


def loss_part(seqs, vocab, hidden, rounds, calls, part="loss"):
    for seq in seqs:
        kh, kw, kt = jr.split(jr.key(seq), 3)
        h = jr.normal(kh, (seq, hidden))
        w = 0.02 * jr.normal(kw, (vocab, hidden))
        t = jr.randint(kt, (seq,), 0, vocab)
        fns, mem = {}, {}
        for name, fn in (("plain", plain_loss), ("chunked", chunked_loss)):
            fns[name], mem[name] = temp_bytes(jax.grad(fn, argnums=(0, 1)), h, w, t)
        per = timed(fns, {k: (h, w, t) for k in fns}, rounds, calls)
        line = {
            "part": part,
            "seq": seq,
            "vocab": vocab,
            "hidden": hidden,
            "temp_bytes": mem,
            "memory_reduction": round(mem["plain"] / max(mem["chunked"], 1), 1),
            "step_ms": {k: round(statistics.median(v), 2) for k, v in per.items()},
            **_ratio(per, "chunked", "plain"),
        }
        print(json.dumps(line), flush=True)


def mlp_part(seqs, rounds, calls):
    config = LlamaConfig(
        vocab_size=8, hidden_size=256, intermediate_size=1024, num_hidden_layers=1
    )
    mlp = LlamaMLP(config, jr.key(0))
    for seq in seqs:
        x = jr.normal(jr.key(seq), (seq, 256))
        chunks = -(-seq // 256)

        def plain(m, x):
            return jnp.sum(jnp.square(m(x)))

        def tiled_mlp(m, x, chunks=chunks):
            return jnp.sum(jnp.square(tiled(lambda c, k: m(c), x, chunks)))

        fns, mem = {}, {}
        for name, fn in (("plain", plain), ("tiled", tiled_mlp)):
            fns[name], mem[name] = temp_bytes(jax.grad(fn, argnums=(0, 1)), mlp, x)
        per = timed(fns, {k: (mlp, x) for k in fns}, rounds, calls)
        line = {
            "part": "mlp",
            "seq": seq,
            "chunks": chunks,
            "temp_bytes": mem,
            "memory_reduction": round(mem["plain"] / max(mem["tiled"], 1), 1),
            "step_ms": {k: round(statistics.median(v), 2) for k, v in per.items()},
            **_ratio(per, "tiled", "plain"),
        }
        print(json.dumps(line), flush=True)


def budget_part(budget: int, quick: bool):
    from eqtrain.job import _memory, _plan

    base = {
        "model": {
            "hidden_size": 64 if quick else 256,
            "num_layers": 2 if quick else 4,
            "num_heads": 4,
            "num_kv_heads": 2,
            "vocab_size": 4096 if quick else 32000,
        },
        "data": {"seq_len": 128, "batch_size": 1},
        "loop": {"steps": 10},
        "run_dir": tempfile.mkdtemp(),
    }
    variants = {
        "off": {"loss_chunk": 0, "mlp_chunks": 1, "remat": "none"},
        "on": {
            "loss_chunk": 256,
            "mlp_chunks": "auto",
            "remat": "full",
            "attention_chunk": 512,
        },
    }
    found = {}
    for name, opts in variants.items():
        raw = json.loads(json.dumps(base))
        raw["model"].update(opts)
        config = config_lib.from_dict(raw)
        rows = _plan.plan(config).rows
        fit = _memory.longest_seq_len(
            config, budget, rows, max_compiles=6 if quick else 12
        )
        found[name] = fit.seq_len
        line = {
            "part": "budget",
            "variant": name,
            "budget_bytes": budget,
            "options": opts,
            "longest_seq_len": fit.seq_len,
            "peak_bytes": fit.peak,
            "tried": fit.tried,
        }
        print(json.dumps(line), flush=True)
    if found["off"] and found["on"]:
        ratio = round(found["on"] / found["off"], 2)
        print(json.dumps({"part": "budget", "on_over_off": ratio, "target": 4.0}))


def main() -> None:
    print_machine()  # the processor and settings: figures are per machine
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smoke test")
    parser.add_argument("--parts", default="loss,mlp,vocab,budget")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    rounds = 2 if args.quick else args.rounds
    seqs = [256, 512] if args.quick else [1024, 2048, 4096, 8192]
    if "loss" in parts:
        vocab = 2048 if args.quick else 32000
        loss_part(
            seqs, vocab, 64 if args.quick else 256, rounds, 1 if args.quick else 3
        )
    if "mlp" in parts:
        mlp_part(seqs, rounds, 1 if args.quick else 3)
    if "vocab" in parts:
        vocabs = [512, 2048] if args.quick else [259, 2048, 8192, 32000]
        for v in vocabs:
            loss_part(
                [256 if args.quick else 2048],
                v,
                64 if args.quick else 256,
                rounds,
                1 if args.quick else 5,
                part="vocab",
            )
    if "budget" in parts:
        budget_part(2**24 if args.quick else 2 * 2**30, args.quick)
    print("done", file=sys.stderr)


if __name__ == "__main__":
    main()
