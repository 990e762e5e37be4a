"""What sequence parallelism saves: per-device temp memory and step time of a Llama
training step for long rows, each scheme on `sequence=4` against `sequence=1`.

For each `seq_len` and each setup, the script compiles `eqtrain.train_step` (a
small Llama; 8 simulated CPU devices unless real ones are there) and prints one
JSON line:

    {"seq_len", "scheme", "layout", "mesh", "tokens_per_device",
     "temp_bytes_per_device", "temp_vs_sequence_1", "compile_s", "step_ms"}

Setups: `sequence=1` (the baseline: 2 devices, one row each, plain attention),
and `data=2, sequence=4` (the same 2 rows, each split over 4 devices) with
Ulysses, ring (contiguous and zigzag) and all-gather K/V. The temp memory is the
compiled program's `memory_analysis().temp_size_in_bytes`: activations and other
temporaries of one device, a property of the partitioned program (the same on any
hardware). `temp_vs_sequence_1` is the baseline's temp memory over this one's
(4 is the ideal at n=4). Steps are run only while the baseline's temporaries fit
`--run-limit` (all simulated devices share the host's memory); `step_ms` is the
median of `--steps` steps. Simulated devices share the machine's two cores, so
the times say nothing about accelerators.

Usage:

    .venv/bin/python benchmarks/sequence.py [--quick] [--steps 3] [--seq-len 2048 ...]

`--steps 0` compiles only: the memory figures, which do not depend on the
machine's load, without the times, which do.
"""

import os

from _machine import print_machine


if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import eqtrain  # noqa: E402
from eqtrain import losses, models, sharding  # noqa: E402


SETUPS = [
    (None, "contiguous", {"data": 2}),
    ("ulysses", "contiguous", {"data": 2, "sequence": 4}),
    ("ring", "contiguous", {"data": 2, "sequence": 4}),
    ("ring", "zigzag", {"data": 2, "sequence": 4}),
    ("all_gather", "contiguous", {"data": 2, "sequence": 4}),
]


def _model(scheme: str | None, layout: str, seq_len: int) -> models.Llama:
    config = models.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=seq_len,
        sequence_parallel=scheme,
        sequence_layout=layout,
    )
    return models.Llama(config, jr.key(0))


def _batch(seq_len: int, scheme: str | None, layout: str) -> dict[str, np.ndarray]:
    tokens = np.asarray(jr.randint(jr.key(1), (2, seq_len + 1), 0, 256), np.int32)
    rows = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    if scheme is None:
        return rows
    return models.sequence_rows(rows, layout=layout, ways=4)


def point(
    seq_len: int, scheme: str | None, layout: str, axes: dict[str, int], args: Any
) -> dict[str, Any]:
    ways = axes.get("sequence", 1)
    devices = jax.devices()[: 2 * ways]
    mesh = sharding.make_mesh(axes, devices=devices)
    model = _model(scheme, layout, seq_len)
    optimizer = optax.adamw(1e-3)
    state = eqtrain.TrainState.create(model, optimizer, key=jr.key(0))
    state_sh = sharding.state_shardings(state, mesh, optimizer=optimizer)
    state = sharding.shard(state, state_sh)
    batch_sh = sharding.batch_sharding(mesh, sequence=ways > 1)
    batch = jax.device_put(_batch(seq_len, scheme, layout), batch_sh)
    step_fn = models.under_mesh(
        eqtrain.train_step(losses.causal_lm_loss, optimizer), mesh
    )
    start = time.perf_counter()
    compiled = (
        jax.jit(step_fn, out_shardings=(state_sh, None)).lower(state, batch).compile()
    )
    compile_s = time.perf_counter() - start
    temp = int(compiled.memory_analysis().temp_size_in_bytes)
    times = []
    if args.steps > 0 and temp * len(devices) <= args.run_limit:
        for _ in range(args.steps + 1):
            start = time.perf_counter()
            state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
    return {
        "seq_len": seq_len,
        "scheme": scheme or "none",
        "layout": layout,
        "mesh": {k: v for k, v in sharding.axis_sizes(mesh).items() if v > 1},
        "tokens_per_device": seq_len // ways,
        "temp_bytes_per_device": temp,
        "compile_s": round(compile_s, 2),
        "step_ms": round(1e3 * statistics.median(times[1:]), 1) if times else None,
    }


def main() -> None:
    print_machine()  # the processor and settings: figures are per machine
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="seq_len 256, 1 step")
    parser.add_argument(
        "--steps", type=int, default=3, help="0: compile only (memory, no times)"
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        nargs="+",
        default=[2048, 4096, 8192, 16384],
        help="row lengths to measure",
    )
    parser.add_argument(
        "--run-limit",
        type=float,
        default=6e9,
        help="run steps only while all devices' temporaries fit this (bytes)",
    )
    args = parser.parse_args()
    lengths = [256] if args.quick else args.seq_len
    if args.quick:
        args.steps = 1
    for seq_len in lengths:
        base = None
        for scheme, layout, axes in SETUPS:
            row = point(seq_len, scheme, layout, axes, args)
            if base is None:
                base = row["temp_bytes_per_device"]
            row["temp_vs_sequence_1"] = round(base / row["temp_bytes_per_device"], 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
