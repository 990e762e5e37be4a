"""Does the data pipeline keep up? `eqtrain.fit` fed by a `Loader` vs by a list.

Both runs train the same small causal LM (defined below: an embedding, two dense
layers with a causal running mean over `[seq, dim]`, and a head) with
`optax.adamw` for the same number of steps on the same batches:

- loader: the real pipeline, the standard-library corpus -> `ByteTokenizer` ->
  `chunk_documents` (pre-training rows) -> `Loader(..., sharding=..., prefetch=2)`,
  so every batch is gathered from a fresh permutation, assembled and placed on the
  device by the background thread while `fit` runs;
- list: the very same batches, taken from such a loader beforehand and already on
  the device, in a Python list.

The corpus is read and tokenised once, before timing (it is setup, not per-step
work). Compilation is excluded (both warm up first); the two alternate (ABBA) over
`--rounds` rounds in one process, and each round starts a fresh loader at a
different position. Two sizes (`--size`): a ~14 ms and a ~5-7 ms step on two
cores. It prints one JSON line per size:

    {"size", "source", "steps", "batch", "seq_len", "rows", "step_ms",
     "loader_tokens_per_s", "list_tokens_per_s", "ratio", "quartiles",
     "ratio_of_medians"}

`ratio` is the median over rounds of the per-round loader / list throughput: 1.0
means the loader costs nothing; `quartiles` are those ratios' first and third
quartiles. On a shared 2-core machine single rounds of a ~10 ms step scatter by
±5%, so the median needs about 20 rounds to settle within 1%. Per-round rates
go to stderr.

Usage (CPU):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/data.py [--size both]
        [--steps N] [--rounds 21] [--prefetch 2] [--source memory|store] [--quick]

`--source store` reads the rows from the tokenized store of the same corpus
(`eqtrain.data.prepare("stdlib", ...)`, memory-mapped) instead of numpy arrays:
the ratio is then the store-fed loader against the same batches in memory.
"""

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import optax
from _machine import print_machine

import eqtrain
from eqtrain.data import (
    ByteTokenizer,
    Loader,
    chunk_documents,
    prepare,
    stdlib_corpus,
)


class TinyLM(eqx.Module):
    """tokens [S] -> logits [S, V]: embedding, two dense layers each mixing in a
    causal running mean of the sequence, and a head (batched `x @ W` layers)."""

    embed: jax.Array
    layers: tuple[tuple[jax.Array, jax.Array], ...]
    head: jax.Array

    def __init__(self, vocab: int, dim: int, hidden: int, key: jax.Array):
        ke, kh, *kl = jr.split(key, 4)
        self.embed = jr.normal(ke, (vocab, dim)) * 0.02
        self.layers = tuple(
            (
                jr.normal(k1, (dim, hidden)) / math.sqrt(dim),
                jr.normal(k2, (hidden, dim)) / math.sqrt(hidden),
            )
            for k1, k2 in (jr.split(k) for k in kl)
        )
        self.head = jr.normal(kh, (dim, vocab)) / math.sqrt(dim)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed[tokens]
        counts = jnp.arange(1, tokens.shape[0] + 1, dtype=x.dtype)[:, None]
        for w_in, w_out in self.layers:
            context = jnp.cumsum(x, axis=0) / counts  # causal: positions <= t
            x = x + jax.nn.gelu((x + context) @ w_in) @ w_out
        return x @ self.head


def lm_loss(model: TinyLM, batch: dict[str, jax.Array], key: jax.Array) -> Any:
    """Causal-LM cross-entropy averaged over `loss_mask` (the LM batch format)."""
    del key
    logits = jax.vmap(model)(batch["tokens"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"]
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0), {}


def run_fit(
    compiled: eqtrain.Jitted, state: eqtrain.TrainState, data: Any, steps: int
) -> tuple[float, float]:
    """Seconds for `fit` to run `steps` steps over `data`, and the last loss."""
    start = time.perf_counter()
    result = eqtrain.fit(state, compiled, data, num_steps=steps)
    jax.block_until_ready(jtu.tree_leaves(result.state))
    elapsed = time.perf_counter() - start
    if result.stop_reason.kind != "max_steps":
        raise RuntimeError(f"fit stopped early: {result.stop_reason}")
    return elapsed, result.metrics["loss"]


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = ByteTokenizer()
    if args.source == "store":  # the tokenized store, memory-mapped (built once)
        store = prepare("stdlib", tokenizer, say=lambda _: None)
        rows = store.lm_rows(args.seq_len)
    else:
        rows = chunk_documents(stdlib_corpus("train"), tokenizer, seq_len=args.seq_len)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    optimizer = optax.adamw(1e-3, weight_decay=0.1)
    step = eqtrain.jit(eqtrain.train_step(lm_loss, optimizer))

    def new_state() -> eqtrain.TrainState:  # fresh arrays: fit donates the state
        model = TinyLM(tokenizer.vocab_size, args.dim, args.hidden, jr.key(0))
        state = eqtrain.TrainState.create(model, optimizer, key=1)
        return jax.block_until_ready(state)

    def loader_at(r: int) -> Loader:
        position = {"epoch": 0, "index": r * args.steps}
        return Loader(
            rows,
            args.batch,
            seed=0,
            sharding=sharding,
            position=position,
            prefetch=args.prefetch,
        )

    def in_memory(r: int) -> list:
        it = iter(loader_at(r))
        return [next(it) for _ in range(args.steps)]

    runners: dict[str, Callable[[int, Any], tuple[float, float]]] = {
        "loader": lambda r, _: run_fit(step, new_state(), loader_at(r), args.steps),
        "list": lambda r, batches: run_fit(step, new_state(), batches, args.steps),
    }
    for run in runners.values():  # compile and warm up, untimed
        run(args.rounds, in_memory(args.rounds))
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    for r in range(args.rounds):
        batches = in_memory(r)  # built before timing; the loader builds its own
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        for name in order:
            results[name].append(runners[name](r, batches))
    tokens = args.steps * args.batch * args.seq_len
    rates = {k: [tokens / s for s, _ in v] for k, v in results.items()}
    _check(step, results, rates)
    paired = [a / b for a, b in zip(rates["loader"], rates["list"], strict=True)]
    loader_rate, list_rate = (statistics.median(rates[k]) for k in ("loader", "list"))
    return {
        "size": args.size,
        "source": args.source,
        "steps": args.steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "rows": rows.num_rows if hasattr(rows, "num_rows") else len(rows["tokens"]),
        "step_ms": round(1000 * args.batch * args.seq_len / list_rate, 1),
        "loader_tokens_per_s": round(loader_rate, 1),
        "list_tokens_per_s": round(list_rate, 1),
        "ratio": round(statistics.median(paired), 4),
        "quartiles": [round(q, 4) for q in _quartiles(paired)],
        "ratio_of_medians": round(loader_rate / list_rate, 4),
    }


def _quartiles(values: list[float]) -> list[float]:
    """The first and third quartiles of `values` (the value itself if one)."""
    if len(values) < 2:
        return values * 2
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def _check(step: eqtrain.Jitted, results: dict, rates: dict) -> None:
    """On stderr: per-round rates, and warnings if the two did different work."""
    print(
        f"tokens/s per round: { {k: [round(r) for r in v] for k, v in rates.items()} }",
        file=sys.stderr,
    )
    for (_, a), (_, b) in zip(results["loader"], results["list"], strict=True):
        if abs(a - b) > 1e-5 * max(1.0, abs(a)):
            print(f"warning: different losses {a} vs {b}", file=sys.stderr)
    if step.num_traces != 1:
        print(f"warning: the step traced {step.num_traces}x", file=sys.stderr)


SIZES = {  # (batch, seq_len, dim, hidden): steps of ~14 ms and ~5-7 ms on 2 cores
    "14ms": (8, 128, 128, 512),
    "5ms": (8, 64, 128, 512),
    "quick": (2, 16, 32, 64),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=None, help="runs of each")
    parser.add_argument(
        "--size",
        choices=("14ms", "5ms", "both"),
        default="both",
        help="model and batch sizes: a ~14 ms step, a ~5 ms one, or each in turn",
    )
    parser.add_argument("--prefetch", type=int, default=2, help="the loader's prefetch")
    parser.add_argument(
        "--source",
        choices=("memory", "store"),
        default="memory",
        help="the loader's rows: numpy arrays in memory, or the tokenized store on "
        "disk (memory-mapped, read per batch in the prefetch thread)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args(argv)
    args.sizes = (
        ["quick"]
        if args.quick
        else (["14ms", "5ms"] if args.size == "both" else [args.size])
    )
    args.rounds = args.rounds or (2 if args.quick else 21)
    return args


def sized(args: argparse.Namespace, size: str) -> argparse.Namespace:
    """`args` with the sizes of `size` (and steps for ~0.5-1 s per run)."""
    batch, seq_len, dim, hidden = SIZES[size]
    steps = args.steps or {"quick": 5, "14ms": 40, "5ms": 100}[size]
    return argparse.Namespace(**{**vars(args), "size": size, "steps": steps,
        "batch": batch, "seq_len": seq_len, "dim": dim, "hidden": hidden})  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    eqtrain.cpu.tune_cpu()  # as the CLI does: both sides alike
    print_machine()  # the processor and settings: figures are per machine
    for size in args.sizes:
        print(json.dumps(benchmark(sized(args, size))), flush=True)


if __name__ == "__main__":
    main()
