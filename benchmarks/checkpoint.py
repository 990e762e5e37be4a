"""How long an asynchronous checkpoint save blocks the training loop.

Trains a stack of dense layers (a few hundred MB of state with Adam) with
`eqtrain.fit`, once without checkpoints and once with an async `Checkpointer`
saving every `--every` steps, and prints one JSON line:

    {"config", "state_mb", "steps", "saves", "step_s", "blocking_s",
     "blocking_fraction_of_step", "write_s", "slowdown"}

- `step_s`: median step time without checkpoints;
- `blocking_s`: median time one `save` call kept the loop waiting (device->host
  copy, serialising the manifest, handing the write to Orbax's background thread);
- `blocking_fraction_of_step`: `blocking_s / step_s` (target: < 1);
- `write_s`: how long the background write of the last save took after `save`
  returned (measured with `Checkpointer.wait()` after a separate save);
- `slowdown`: wall time of the run with checkpoints / without, minus 1.

Usage (CPU):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/checkpoint.py [--width 2048]
        [--layers 8] [--steps 40] [--every 10] [--quick]
"""

import argparse
import json
import statistics
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from _machine import print_machine

import eqtrain
from eqtrain.checkpoint import Checkpointer


class Stack(eqx.Module):
    weights: jax.Array  # [layers, width, width]

    def __call__(self, x):
        def layer(h, w):
            return jnp.tanh(h @ w), None

        return jax.lax.scan(layer, x, self.weights)[0]


def loss_fn(model, batch, key):
    out = model(batch["x"])
    return jnp.mean((out - batch["y"]) ** 2), {}


def make_state(width, layers, opt):
    w = jr.normal(jr.key(0), (layers, width, width), jnp.float32) / np.sqrt(width)
    return eqtrain.TrainState.create(Stack(w), opt, key=0)


def run(width, layers, steps, every, run_dir):
    opt = optax.adam(1e-4)
    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(64, width)).astype(np.float32),
            "y": rng.normal(size=(64, width)).astype(np.float32),
        }
        for _ in range(4)
    ]

    def data():
        while True:
            yield from batches

    step = eqtrain.jit(eqtrain.train_step(loss_fn, opt))
    state = make_state(width, layers, opt)
    state_mb = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(state, eqx.is_array)))
    state_mb /= 2**20
    state = eqtrain.fit(state, step, data(), num_steps=2).state  # compile

    times = []

    def timer(info):
        times.append(info.step_time)

    timer.uses_state = False  # metrics only: keep the loop asynchronous

    start = time.perf_counter()
    base = eqtrain.fit(state, step, data(), num_steps=2 + steps, hooks=[timer])
    base_wall = time.perf_counter() - start
    step_s = statistics.median(times[1:])

    ckpt = Checkpointer(run_dir, every_steps=every, keep_last=2)
    start = time.perf_counter()
    result = eqtrain.fit(
        base.state, step, data(), num_steps=2 + 2 * steps, checkpointer=ckpt
    )
    ckpt_wall = time.perf_counter() - start
    blocking = ckpt.blocking_times

    # One more save, timed to the end of its background write.
    writer = Checkpointer(run_dir + "-write", keep_last=1)
    info = eqtrain.StepInfo(step=1, metrics={}, num_steps=1, _state=result.state)
    t0 = time.perf_counter()
    writer.save(info, final=True)
    t1 = time.perf_counter()
    writer.wait()
    write_s = time.perf_counter() - t1
    writer.close()
    del t0
    blocking_s = statistics.median(blocking)
    return {
        "state_mb": round(state_mb, 1),
        "steps": steps,
        "saves": len(blocking),
        "step_s": round(step_s, 4),
        "blocking_s": round(blocking_s, 4),
        "blocking_max_s": round(max(blocking), 4),
        "blocking_each_s": [round(b, 3) for b in blocking],
        "blocking_fraction_of_step": round(blocking_s / step_s, 3),
        "write_s": round(write_s, 3),
        "slowdown": round(ckpt_wall / base_wall - 1, 3),
    }


def main():
    print_machine()  # the processor and settings: figures are per machine
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="smoke test, seconds")
    args = parser.parse_args()
    if args.quick:
        args.width, args.layers, args.steps, args.every = 128, 2, 4, 2
    with tempfile.TemporaryDirectory() as tmp:
        record = run(args.width, args.layers, args.steps, args.every, tmp + "/run")
    print(json.dumps({"config": "quick" if args.quick else "default", **record}))


if __name__ == "__main__":
    main()
