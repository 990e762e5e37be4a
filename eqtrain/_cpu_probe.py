"""`python -m eqtrain._cpu_probe`: the micro-benchmark `eqtrain.tune_cpu`
measures its candidate settings with, one process per candidate (XLA reads
its flags once, when its CPU backend starts).

The workload is a small decoder's training step written in plain JAX, the
shapes of `benchmarks/models.py`'s Llama (4 layers of 256 wide, 4 heads, an
MLP of 704, a vocabulary of 2048) on 8 rows of 256 tokens (smaller products
did not tell Eigen's from YNNPACK's apart): the products, fusions and
attention of real training, compiled in a few seconds. It runs
once with the layers under `lax.scan` and once unrolled, and prints one JSON
line, `{"scanned_ms": ..., "unrolled_ms": ...}` (the median step of
`--steps`, after a warm-up)."""

import argparse
import json
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr


LAYERS, WIDTH, HEADS, FF, VOCAB = 4, 256, 4, 704, 2048
ROWS, SEQ = 8, 256


def _layer_params(key: Any) -> dict[str, Any]:
    k = jr.split(key, 4)
    init = lambda key, shape: jr.normal(key, shape) * shape[0] ** -0.5
    return {
        "qkv": init(k[0], (WIDTH, 3 * WIDTH)),
        "out": init(k[1], (WIDTH, WIDTH)),
        "up": init(k[2], (WIDTH, 2 * FF)),
        "down": init(k[3], (FF, WIDTH)),
    }


def _params(key: Any) -> dict[str, Any]:
    keys = jr.split(key, LAYERS + 1)
    layers = [_layer_params(k) for k in keys[1:]]
    return {
        "embed": jr.normal(keys[0], (VOCAB, WIDTH)) * 0.02,
        "layers": jax.tree.map(lambda *x: jnp.stack(x), *layers),
    }


def _norm(x: Any) -> Any:
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)


def _layer(x: Any, p: dict[str, Any]) -> Any:
    """One pre-norm block on `[seq, width]`: causal attention, a gated MLP."""
    q, k, v = jnp.split(_norm(x) @ p["qkv"], 3, axis=-1)
    heads = lambda t: t.reshape(SEQ, HEADS, WIDTH // HEADS)
    att = jax.nn.dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    x = x + att.reshape(SEQ, WIDTH) @ p["out"]
    gate, up = jnp.split(_norm(x) @ p["up"], 2, axis=-1)
    return x + (jax.nn.silu(gate) * up) @ p["down"]


def _loss(params: dict[str, Any], tokens: Any, scan: bool) -> Any:
    def row(t: Any) -> Any:
        x = params["embed"][t]
        if scan:
            x, _ = jax.lax.scan(lambda x, p: (_layer(x, p), None), x, params["layers"])
        else:
            for i in range(LAYERS):
                x = _layer(x, jax.tree.map(lambda a, i=i: a[i], params["layers"]))
        logits = _norm(x) @ params["embed"].T
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(SEQ - 1), t[1:]])

    return jnp.mean(jax.vmap(row)(tokens))


def _step(scan: bool) -> Any:
    """A jitted training step (the gradient and an Adam-like update)."""

    def step(params: Any, moments: Any, tokens: Any) -> Any:
        loss, grads = jax.value_and_grad(_loss)(params, tokens, scan)
        moments = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g * g, moments, grads)
        update = lambda p, g, m: p - 1e-3 * g * jax.lax.rsqrt(m + 1e-8)
        return jax.tree.map(update, params, grads, moments), moments, loss

    return jax.jit(step, donate_argnums=(0, 1))


def time_step(scan: bool, steps: int) -> float:
    """The median milliseconds of `steps` training steps, after two untimed."""
    params = _params(jr.key(0))
    moments = jax.tree.map(jnp.zeros_like, params)
    tokens = jr.randint(jr.key(1), (ROWS, SEQ), 0, VOCAB)
    step, times = _step(scan), []
    for i in range(steps + 2):
        start = time.perf_counter()
        params, moments, loss = step(params, moments, tokens)
        jax.block_until_ready(loss)
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="eqtrain.tune_cpu's probe")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    record = {f"{name}_ms": round(time_step(scan, args.steps), 3)
              for name, scan in (("scanned", True), ("unrolled", False))}  # fmt: skip
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
