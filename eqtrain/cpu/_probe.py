"""`python -P -m eqtrain.cpu._probe`: the training step `eqtrain.cpu.tune_cpu`
times its candidate settings with, one process per candidate (XLA reads its
flags once, when its CPU backend starts).

The workload is eqtrain's own: `eqtrain.models.Llama` at the sizes of
`benchmarks/models.py` (4 layers of 256 wide, 4 heads, an MLP of 704, a
vocabulary of 2048) trained by `eqtrain.train_step` with AdamW on 16 rows of
256 tokens, the step `docs/performance.md`'s figures are about. A plain-JAX
decoder of the same shapes can rank the candidates differently from this
step (`benchmarks/cpu_settings.py`), so the probe runs the real step. It runs
once with the layers
scanned and once unrolled, and prints one JSON line,
`{"scanned_ms": ..., "unrolled_ms": ...}` (the median step of `--steps`, after
two untimed). It never calls `tune_cpu` itself: the caller sets `XLA_FLAGS`
and glibc's variables.

With `--serve` it compiles and warms up both forms, prints `READY`, and then
times a round for each line `round` read from its standard input (the median
of `--steps` steps of each form, the forms' order alternating from round to
round), one JSON line per round, until its input closes. `tune_cpu` keeps one
such process per candidate alive and asks them in turn (`_tuning.Probes`),
so that rounds of different candidates interleave in time and each
compilation is paid once.
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Iterable

import jax
import jax.random as jr
import numpy as np
import optax

import eqtrain
from eqtrain.losses import causal_lm_loss
from eqtrain.models import Llama, LlamaConfig

from ._tune import step_options


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


FORMS = (("scanned", True), ("unrolled", False))


class Stepper:
    """The probe step with the layers scanned or unrolled, compiled and warmed
    up (two untimed steps) when made."""

    def __init__(self, scan: bool) -> None:
        config = dataclasses.replace(CONFIG, scan_layers=scan)
        optimizer = optax.adamw(1e-3, weight_decay=0.1)
        model = Llama(config, jr.key(0))
        self.state = eqtrain.TrainState.create(model, optimizer, key=0)
        loss = eqtrain.train_step(causal_lm_loss, optimizer)
        self.step = eqtrain.jit(loss, donate=True, compiler_options=step_options())
        self.batch = jax.device_put(_batch())
        self.time(2)

    def time(self, steps: int) -> float:
        """The median milliseconds of `steps` training steps."""
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            self.state, metrics = self.step(self.state, self.batch)
            jax.block_until_ready(metrics["loss"])
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)


def serve(steps: int, lines: Iterable[str]) -> None:
    """Time a round for each line of `lines` (see the module's doc)."""
    steppers = {name: Stepper(scan) for name, scan in FORMS}
    print("READY", flush=True)
    for i, _ in enumerate(lines):
        order = list(steppers) if i % 2 == 0 else list(steppers)[::-1]
        record = {f"{n}_ms": round(steppers[n].time(steps), 3) for n in order}
        print(json.dumps(record), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="eqtrain.cpu.tune_cpu's probe")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--serve", action="store_true")
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.steps, sys.stdin)
        return
    record = {f"{name}_ms": round(Stepper(scan).time(args.steps), 3)
              for name, scan in FORMS}  # fmt: skip
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
