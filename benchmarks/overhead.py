"""Overhead of `eqtrain.fit` against a hand-written `jax.jit` training loop.

Both loops train the same small Llama-like decoder (defined below) with
`optax.adamw` on the same pre-generated random-token batches, with the same step
body (`eqtrain.train_step`), compiled once and warmed up before timing:

- raw: the state is partitioned once into array leaves, `jax.jit` runs the step
  over the flat array list with donation, and the loop never syncs with the host
  until `jax.block_until_ready` at the end;
- eqtrain: `eqtrain.fit(state, eqtrain.jit(step), batches, ...)` with the
  `ProgressBar` (into a `StringIO`) and `JsonlWriter` (into a temporary file)
  hooks on, i.e. the loop reads every step's metrics (in batches, a few steps
  late) and runs the hooks for every step.

The rounds alternate the two (ABBA order) in one process. It prints one JSON line
per configuration:

    {"config", "params", "leaves", "steps", "raw_tokens_per_s",
     "eqtrain_tokens_per_s", "ratio", "ratio_of_medians"}

with the median tokens/s of each loop. `ratio` is the median over rounds of the
per-round eqtrain / raw throughput (the two runs of a round are adjacent in time, so
slow drifts of the shared machine cancel); `ratio_of_medians` divides the two
medians. 1.0 means `fit` costs nothing over the raw
loop; 0.95 means `fit` trains 5% fewer tokens per second. `base` shows the cost on a
step that is mostly compute; `many_small_leaves` (hundreds of state leaves, short
steps) is where per-step host work (flattening, dispatch, metrics, hooks) would show.
On the shared 2-core CPU machines, run-to-run noise is about +-3%, so read a ratio
within 0.97-1.03 as "no measurable overhead"; the per-round rates go to stderr
(stdout holds only the JSON lines).

Usage (CPU):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/overhead.py [--config all]
        [--steps 40] [--rounds 9] [--quick]
"""

import argparse
import dataclasses
import io
import itertools
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax

import eqtrain
import eqtrain.hooks


@dataclasses.dataclass(frozen=True)
class Config:
    """Model and batch sizes of one benchmark configuration."""

    name: str
    vocab: int
    dim: int
    hidden: int
    layers: int
    heads: int
    seq: int
    batch: int


CONFIGS = {
    "base": Config("base", vocab=256, dim=256, hidden=704, layers=4, heads=4, seq=128,
                   batch=4),
    "many_small_leaves": Config("many_small_leaves", vocab=256, dim=64, hidden=176,
                                layers=24, heads=2, seq=64, batch=4),
}  # fmt: skip

QUICK_CONFIGS = {
    "base": Config("base", vocab=64, dim=64, hidden=176, layers=2, heads=2, seq=32,
                   batch=2),
    "many_small_leaves": Config("many_small_leaves", vocab=64, dim=32, hidden=96,
                                layers=6, heads=2, seq=16, batch=2),
}  # fmt: skip


# -- the model ----------------------------------------------------------------------
def _dense(key: jax.Array, fan_in: int, fan_out: int) -> jax.Array:
    return jr.normal(key, (fan_in, fan_out)) / math.sqrt(fan_in)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x: jax.Array, theta: float = 10_000.0) -> jax.Array:
    """Rotary embedding of `x: [seq, heads, head_dim]`, rotating halves (HF layout)."""
    seq, _, head_dim = x.shape
    half = head_dim // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * freqs[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class Block(eqx.Module):
    """Pre-norm decoder block: causal attention with RoPE, then a SwiGLU MLP."""

    attn_norm: jax.Array
    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array
    mlp_norm: jax.Array
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array
    heads: int = eqx.field(static=True)

    def __init__(self, cfg: Config, key: jax.Array):
        kq, kk, kv, ko, kg, ku, kd = jr.split(key, 7)
        self.attn_norm = jnp.ones((cfg.dim,))
        self.wq = _dense(kq, cfg.dim, cfg.dim)
        self.wk = _dense(kk, cfg.dim, cfg.dim)
        self.wv = _dense(kv, cfg.dim, cfg.dim)
        self.wo = _dense(ko, cfg.dim, cfg.dim)
        self.mlp_norm = jnp.ones((cfg.dim,))
        self.w_gate = _dense(kg, cfg.dim, cfg.hidden)
        self.w_up = _dense(ku, cfg.dim, cfg.hidden)
        self.w_down = _dense(kd, cfg.hidden, cfg.dim)
        self.heads = cfg.heads

    def __call__(self, x: jax.Array) -> jax.Array:
        seq, dim = x.shape
        split = lambda t: t.reshape(seq, self.heads, dim // self.heads)
        h = rms_norm(x, self.attn_norm)
        q, k, v = rope(split(h @ self.wq)), rope(split(h @ self.wk)), split(h @ self.wv)
        attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + attn.reshape(seq, dim) @ self.wo
        h = rms_norm(x, self.mlp_norm)
        return x + (jax.nn.silu(h @ self.w_gate) * (h @ self.w_up)) @ self.w_down


class Llama(eqx.Module):
    """A Llama-like decoder over one sequence: `tokens: [seq] -> logits: [seq, V]`."""

    embed: jax.Array
    blocks: tuple[Block, ...]
    norm: jax.Array
    head: jax.Array

    def __init__(self, cfg: Config, key: jax.Array):
        ke, kh, *kb = jr.split(key, cfg.layers + 2)
        self.embed = jr.normal(ke, (cfg.vocab, cfg.dim))
        self.blocks = tuple(Block(cfg, k) for k in kb)
        self.norm = jnp.ones((cfg.dim,))
        self.head = _dense(kh, cfg.dim, cfg.vocab)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed[tokens]
        for block in self.blocks:
            x = block(x)
        return rms_norm(x, self.norm) @ self.head


def loss_fn(
    model: Llama, batch: dict[str, jax.Array], key: jax.Array
) -> tuple[jax.Array, dict]:
    """Causal-LM cross-entropy; `batch["tokens"]: int32[B, S + 1]`."""
    del key
    tokens = batch["tokens"]
    logits = jax.vmap(model)(tokens[:, :-1])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return losses.mean(), {}


# -- the two loops ------------------------------------------------------------------
def array_leaves(tree: Any) -> list[jax.Array]:
    return [x for x in jtu.tree_leaves(tree) if eqx.is_array(x)]


def raw_jit(step: Callable, state: eqtrain.TrainState) -> Callable:
    """`jax.jit(step)` over the flat array leaves of `state`, donated; the static
    part of the state (its structure and non-array leaves) is closed over."""
    leaves, treedef = jtu.tree_flatten(state)
    is_array = [eqx.is_array(x) for x in leaves]
    statics = [None if a else x for a, x in zip(is_array, leaves, strict=True)]

    def rebuild(arrays: list[jax.Array]) -> eqtrain.TrainState:
        it = iter(arrays)
        filled = [next(it) if a else s for a, s in zip(is_array, statics, strict=True)]
        return treedef.unflatten(filled)

    def flat_step(arrays: list[jax.Array], batch: Any) -> tuple[list, dict]:
        new_state, metrics = step(rebuild(arrays), batch)
        return array_leaves(new_state), metrics

    return jax.jit(flat_step, donate_argnums=0)


def run_raw(
    jitted: Callable, state: eqtrain.TrainState, batches: list
) -> tuple[float, float]:
    """Seconds for the raw loop over `batches`, waiting only at the end, and the
    last loss."""
    start = time.perf_counter()
    arrays, metrics = array_leaves(state), None
    for batch in batches:
        arrays, metrics = jitted(arrays, batch)
    jax.block_until_ready((arrays, metrics))
    return time.perf_counter() - start, float(metrics["loss"])


def run_fit(
    compiled: eqtrain.Jitted, state: eqtrain.TrainState, batches: list, log: Path
) -> tuple[float, float]:
    """Seconds for `eqtrain.fit` over `batches` with a progress bar and JSONL log,
    and the last loss."""
    hooks = [
        eqtrain.hooks.ProgressBar(stream=io.StringIO()),
        eqtrain.hooks.JsonlWriter(log),
    ]
    start = time.perf_counter()
    result = eqtrain.fit(state, compiled, batches, num_steps=len(batches), hooks=hooks)
    jax.block_until_ready(jtu.tree_leaves(result.state))  # fit has already waited
    elapsed = time.perf_counter() - start
    if result.stop_reason.kind != "max_steps" or len(result.history) != len(batches):
        raise RuntimeError(f"fit stopped early: {result.stop_reason}")
    return elapsed, result.metrics["loss"]


# -- the benchmark ------------------------------------------------------------------
def make_batches(cfg: Config, steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    shape = (cfg.batch, cfg.seq + 1)
    return [
        {"tokens": rng.integers(0, cfg.vocab, shape, dtype=np.int32)}
        for _ in range(steps)
    ]


def make_state(
    cfg: Config, optimizer: optax.GradientTransformation
) -> eqtrain.TrainState:
    """A fresh state (the same each time): the steps donate the previous one."""
    return eqtrain.TrainState.create(Llama(cfg, jr.key(0)), optimizer, key=1)


def time_rounds(
    runners: dict[str, Callable], new_state: Callable, batches: list, *, rounds: int
) -> dict[str, list[tuple[float, float]]]:
    """`(seconds, last loss)` of each runner per round, alternating which goes first
    (ABBA...) so that drifts in machine speed hit both alike."""
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    for r in range(rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))
        for name in order:
            results[name].append(runners[name](new_state(), batches))
    return results


def benchmark(cfg: Config, steps: int, rounds: int, warmup: int) -> dict[str, Any]:
    """Warm up and time both loops on `cfg`; returns the JSON record."""
    optimizer = optax.adamw(1e-3, weight_decay=0.1)
    step = eqtrain.train_step(loss_fn, optimizer)
    new_state = lambda: make_state(cfg, optimizer)
    batches = make_batches(cfg, steps)
    state = new_state()
    raw, compiled = raw_jit(step, state), eqtrain.jit(step)

    with tempfile.TemporaryDirectory() as tmp:
        logs = (Path(tmp) / f"run{i}.jsonl" for i in itertools.count())
        runners = {
            "raw": lambda s, b: run_raw(raw, s, b),
            "eqtrain": lambda s, b: run_fit(compiled, s, b, next(logs)),
        }
        for run in runners.values():  # compile and warm up, untimed
            run(new_state(), batches[:warmup])
        results = time_rounds(runners, new_state, batches, rounds=rounds)

    tokens = steps * cfg.batch * cfg.seq
    rates = {k: [tokens / seconds for seconds, _ in v] for k, v in results.items()}
    _check(cfg.name, compiled, results, rates)
    raw_rate = statistics.median(rates["raw"])
    eqtrain_rate = statistics.median(rates["eqtrain"])
    # Each round runs both loops back to back, so the per-round ratio cancels the
    # machine's slow drifts; its median is the headline number.
    paired = [e / r for e, r in zip(rates["eqtrain"], rates["raw"], strict=True)]
    return {
        "config": cfg.name,
        "params": int(sum(x.size for x in array_leaves(state.params))),
        "leaves": len(array_leaves(state)),
        "steps": steps,
        "raw_tokens_per_s": round(raw_rate, 1),
        "eqtrain_tokens_per_s": round(eqtrain_rate, 1),
        "ratio": round(statistics.median(paired), 4),
        "ratio_of_medians": round(eqtrain_rate / raw_rate, 4),
    }


def _check(name: str, compiled: eqtrain.Jitted, results: dict, rates: dict) -> None:
    """On stderr: per-round rates, and warnings if the loops did different work."""
    shown = {k: [round(r) for r in v] for k, v in rates.items()}
    print(f"[{name}] tokens/s per round: {shown}", file=sys.stderr)
    losses = {loss for v in results.values() for _, loss in v}
    if max(losses) - min(losses) > 1e-4 * max(1.0, abs(max(losses))):
        print(
            f"[{name}] warning: the loops ended on different losses {losses}",
            file=sys.stderr,
        )
    if compiled.num_traces != 1:
        print(
            f"[{name}] warning: eqtrain.jit traced {compiled.num_traces}x",
            file=sys.stderr,
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=[*CONFIGS, "all"], default="all")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=None, help="runs of each loop")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, 2 rounds (smoke test)"
    )
    args = parser.parse_args(argv)
    args.steps = args.steps or (10 if args.quick else 40)
    args.rounds = args.rounds or (2 if args.quick else 9)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configs = QUICK_CONFIGS if args.quick else CONFIGS
    names = list(configs) if args.config == "all" else [args.config]
    for name in names:
        result = benchmark(configs[name], args.steps, args.rounds, args.warmup)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
