"""What `eqtrain.fit` with the default step costs against a hand-written `jax.jit` loop.

One small Llama-like decoder (defined below) trains with `optax.adamw` on the same
pre-generated random-token batches, compiled once and warmed up before timing, in
six ways per round (their order rotates from round to round):

- raw: the overhead limit. A hand-written step (`jax.value_and_grad` of the loss,
  `optimizer.update`, `optax.apply_updates`, nothing else) under `jax.jit` over the
  state's flat array leaves with donation; the loop never syncs with the host until
  `jax.block_until_ready` at the end;
- default: what a user gets by default: `eqtrain.fit(state,
  eqtrain.jit(eqtrain.train_step(loss_fn, opt)), batches, hooks=[ProgressBar,
  JsonlWriter])`, i.e. the default step (non-finite guard, gradient norm, metrics)
  and a loop that reads every step's metrics and runs both hooks for every step;
- plain_hook: the same plus a plain function as a hook on every step
  (`lambda info: losses.append(info.metrics["loss"])`), which reads metrics only and
  runs late (the default for hooks);
- state_hook: the same function declared `eqtrain.uses_state`: the loop waits for
  every step before dispatching the next (what a hook that reads `info.state` at
  every step costs);
- guard_skip / guard_ignore: the raw loop over `train_step`'s step with
  `nonfinite="skip"` (the default) and `"ignore"`, to isolate the guard's cost.

It prints one JSON line per model configuration:

    {"config", "params", "leaves", "steps", "rounds", "raw_tokens_per_s",
     "default", "plain_hook", "state_hook", "guard", "default_range",
     "plain_hook_range", "state_hook_range", "guard_range"}

`default` is the median over rounds of the per-round default / raw throughput (the
runs of a round are adjacent in time, so slow drifts of the shared machine
cancel), `plain_hook` and `state_hook` the same for the two hooks, and `guard`
the median of guard_skip / guard_ignore. `*_range` are the lowest and highest per-round
ratios. 1.0 means no cost; 0.95 means 5% fewer tokens per second. `base` is a step
that is mostly compute; `many_small_leaves` (hundreds of state leaves, short steps)
is where per-step host work and per-leaf device work would show. On the shared
2-core CPU machines, read a ratio within 0.97-1.03 as "no measurable cost"; the
per-round rates go to stderr (stdout holds only the JSON lines).

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
from _machine import print_machine

import eqtrain
import eqtrain.cpu
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


# -- the loops ----------------------------------------------------------------------
def array_leaves(tree: Any) -> list[jax.Array]:
    return [x for x in jtu.tree_leaves(tree) if eqx.is_array(x)]


def hand_written_step(optimizer: optax.GradientTransformation) -> Callable:
    """The step a user would write by hand: loss, gradients, update. Nothing else."""

    def step(state: eqtrain.TrainState, batch: Any) -> tuple[Any, dict]:
        params, static = eqx.partition(state.model, state.trainable)
        key, step_key = jr.split(state.key)
        objective = lambda p: loss_fn(eqx.combine(p, static), batch, step_key)[0]
        loss, grads = jax.value_and_grad(objective)(params)
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
        model = eqx.combine(optax.apply_updates(params, updates), static)
        new = dataclasses.replace(
            state, model=model, opt_state=opt_state, step=state.step + 1, key=key
        )
        return new, {"loss": loss}

    return step


def raw_jit(step: Callable, state: eqtrain.TrainState, batch: Any) -> Callable:
    """`jax.jit(step)` over the flat array leaves of `state`, donated; the static
    part of the state (its structure and non-array leaves) is closed over. It
    compiles with the products `eqtrain.jit` would use (oneDNN's, where
    `tune_cpu` chose them and the step's fusions pass `eqtrain.cpu._onednn`'s
    check for `batch`), so that both loops run the same kernels."""
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

    checked = eqtrain.cpu.step_options()  # what `eqtrain fit` compiles with
    options = checked.options(dump=True)
    if options:
        arrays = [x for x, a in zip(leaves, is_array, strict=True) if a]
        fn = jax.jit(flat_step, donate_argnums=0, compiler_options=options)
        if checked.check(fn, options, arrays, batch):
            return fn
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
    compiled: eqtrain.Jitted,
    state: eqtrain.TrainState,
    batches: list,
    log: Path,
    *,
    hook: str | None = None,
) -> tuple[float, float]:
    """Seconds for `eqtrain.fit` over `batches` with a progress bar and JSONL log
    (and a plain-function hook, `"plain"` or declared `"state"`), and the last
    loss."""
    losses: list[float] = []
    hooks: list[Any] = [
        eqtrain.hooks.ProgressBar(stream=io.StringIO()),
        eqtrain.hooks.JsonlWriter(log),
    ]
    if hook is not None:
        log = lambda info: losses.append(info.metrics["loss"])  # noqa: E731
        hooks.append(eqtrain.uses_state(log) if hook == "state" else log)
    start = time.perf_counter()
    result = eqtrain.fit(state, compiled, batches, num_steps=len(batches), hooks=hooks)
    jax.block_until_ready(jtu.tree_leaves(result.state))  # fit has already waited
    elapsed = time.perf_counter() - start
    if result.stop_reason.kind != "max_steps" or len(result.history) != len(batches):
        raise RuntimeError(f"fit stopped early: {result.stop_reason}")
    if hook is not None and len(losses) != len(batches):
        raise RuntimeError(f"the plain hook ran {len(losses)} times")
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


def raw_runner(steps: int, *, quick: bool = False) -> tuple[Callable[[], float], int]:
    """`many_small_leaves` under the default step, raw loop: a function timing
    `steps` steps from a fresh state (seconds), and the tokens they train on. For
    `benchmarks/cpu_settings.py`."""
    cfg = (QUICK_CONFIGS if quick else CONFIGS)["many_small_leaves"]
    optimizer = optax.adamw(1e-3, weight_decay=0.1)
    batches = make_batches(cfg, steps)
    step = eqtrain.train_step(loss_fn, optimizer)
    jitted = raw_jit(step, make_state(cfg, optimizer), batches[0])
    run = lambda: run_raw(jitted, make_state(cfg, optimizer), batches)[0]  # noqa: E731
    return run, steps * cfg.batch * cfg.seq


def time_rounds(
    runners: dict[str, Callable], new_state: Callable, batches: list, *, rounds: int
) -> dict[str, list[tuple[float, float]]]:
    """`(seconds, last loss)` of each runner per round; the order rotates each round
    (and reverses every other round) so that drifts in machine speed hit all alike."""
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in runners}
    names = list(runners)
    for r in range(rounds):
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        for name in order if r % 2 == 0 else reversed(order):
            results[name].append(runners[name](new_state(), batches))
    return results


def paired(rates: dict[str, list[float]], num: str, den: str) -> list[float]:
    return [a / b for a, b in zip(rates[num], rates[den], strict=True)]


def benchmark(cfg: Config, steps: int, rounds: int, warmup: int) -> dict[str, Any]:
    """Warm up and time the loops on `cfg`; returns the JSON record."""
    optimizer = optax.adamw(1e-3, weight_decay=0.1)
    default_step = eqtrain.train_step(loss_fn, optimizer)  # what users get
    new_state = lambda: make_state(cfg, optimizer)
    batches = make_batches(cfg, steps)
    state = new_state()
    raw = raw_jit(hand_written_step(optimizer), state, batches[0])
    skip = raw_jit(default_step, state, batches[0])
    ignored = eqtrain.train_step(loss_fn, optimizer, nonfinite="ignore")
    ignore = raw_jit(ignored, state, batches[0])
    compiled = eqtrain.jit(default_step, compiler_options=eqtrain.cpu.step_options())

    with tempfile.TemporaryDirectory() as tmp:
        logs = (Path(tmp) / f"run{i}.jsonl" for i in itertools.count())
        runners = {
            "raw": lambda s, b: run_raw(raw, s, b),
            "default": lambda s, b: run_fit(compiled, s, b, next(logs)),
            "plain_hook": lambda s, b: run_fit(
                compiled, s, b, next(logs), hook="plain"
            ),
            "state_hook": lambda s, b: run_fit(
                compiled, s, b, next(logs), hook="state"
            ),
            "guard_skip": lambda s, b: run_raw(skip, s, b),
            "guard_ignore": lambda s, b: run_raw(ignore, s, b),
        }
        for run in runners.values():  # compile and warm up, untimed
            run(new_state(), batches[:warmup])
        results = time_rounds(runners, new_state, batches, rounds=rounds)

    tokens = steps * cfg.batch * cfg.seq
    rates = {k: [tokens / seconds for seconds, _ in v] for k, v in results.items()}
    _check(cfg.name, compiled, results, rates)
    ratios = {
        "default": paired(rates, "default", "raw"),
        "plain_hook": paired(rates, "plain_hook", "raw"),
        "state_hook": paired(rates, "state_hook", "raw"),
        "guard": paired(rates, "guard_skip", "guard_ignore"),
    }
    record: dict[str, Any] = {
        "config": cfg.name,
        "params": int(sum(x.size for x in array_leaves(state.params))),
        "leaves": len(array_leaves(state)),
        "steps": steps,
        "rounds": rounds,
        "raw_tokens_per_s": round(statistics.median(rates["raw"]), 1),
    }
    for name, values in ratios.items():
        record[name] = round(statistics.median(values), 4)
    for name, values in ratios.items():
        record[f"{name}_range"] = [round(min(values), 3), round(max(values), 3)]
    return record


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
    eqtrain.cpu.tune_cpu()  # as the CLI does: every loop alike
    print_machine()  # the processor and settings: figures are per machine
    configs = QUICK_CONFIGS if args.quick else CONFIGS
    names = list(configs) if args.config == "all" else [args.config]
    for name in names:
        result = benchmark(configs[name], args.steps, args.rounds, args.warmup)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
