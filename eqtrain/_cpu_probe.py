"""`python -P -m eqtrain._cpu_probe`: the training step `eqtrain.tune_cpu`
times its candidate settings with, one process per candidate (XLA reads its
flags once, when its CPU backend starts).

The workload is eqtrain's own: `eqtrain.models.Llama` at the sizes of
`benchmarks/models.py` (4 layers of 256 wide, 4 heads, an MLP of 704, a
vocabulary of 2048) trained by `eqtrain.train_step` with AdamW on 16 rows of
256 tokens, the step `docs/performance.md`'s figures are about. A plain-JAX
decoder of the same shapes ranked the candidates differently from this step
(Eigen's products 3-5% ahead on it; XLA's own ahead on the Llama in two
rounds of three of `benchmarks/cpu_settings.py`, on processor B), so the
probe runs the real step. It runs once with the layers
scanned and once unrolled, and prints one JSON line,
`{"scanned_ms": ..., "unrolled_ms": ...}` (the median step of `--steps`, after
two untimed). It never calls `tune_cpu` itself: the caller sets `XLA_FLAGS`
and glibc's variables.
"""

import argparse
import dataclasses
import json
import statistics
import time

import jax
import jax.random as jr
import numpy as np
import optax

import eqtrain
from eqtrain.losses import causal_lm_loss
from eqtrain.models import Llama, LlamaConfig


CONFIG = LlamaConfig(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    max_position_embeddings=1024,
)
ROWS, SEQ = 16, 256


def _batch() -> dict[str, np.ndarray]:
    shape, vocab = (ROWS, SEQ + 1), CONFIG.vocab_size
    tokens = np.random.default_rng(0).integers(0, vocab, shape, np.int32)
    mask = np.ones((ROWS, SEQ), np.float32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": mask}


def time_step(scan: bool, steps: int) -> float:
    """The median milliseconds of `steps` training steps, after two untimed."""
    config = dataclasses.replace(CONFIG, scan_layers=scan)
    optimizer = optax.adamw(1e-3, weight_decay=0.1)
    state = eqtrain.TrainState.create(Llama(config, jr.key(0)), optimizer, key=0)
    step = eqtrain.jit(eqtrain.train_step(causal_lm_loss, optimizer), donate=True)
    batch, times = jax.device_put(_batch()), []
    for i in range(steps + 2):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics["loss"])
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
