"""What each mesh layout costs a training step, read from the compiled step.

For each layout of (data, fsdp, tensor) over 8 devices (8 simulated CPU devices
unless real ones are there), the script compiles `eqtrain.train_step` for a Llama
with its layers unrolled (`scan_layers=False`, so every collective in the compiled
program runs exactly once per step), places the state with `eqtrain.sharding`, runs
a few steps, and prints one JSON line:

    {"group", "model", "mesh", "state_bytes_per_device", "temp_bytes_per_device",
     "flops_per_device", "collectives": {op: [count, bytes_per_device]},
     "comm_bytes_per_device", "compile_s", "step_ms", "max_loss_diff"}

The memory, FLOPs and collectives are properties of the partitioned program (the
same on any hardware; collective bytes are the sizes of the per-device results).
`max_loss_diff` is the largest |loss - single-device loss| over the steps run (the
sharded step is exact up to float rounding). `step_time_vs_1_device` is the step time
relative to the same model on one device, measured in the same run; on simulated CPU
devices (which share the machine's cores) it says nothing about accelerators.

A second group (`gpt2_c_attn`) compares layouts of GPT-2's packed q/k/v projection
on data 4 x tensor 2: split over `tensor` (eqtrain's rule), replicated over
`tensor`, and split on its input dimension (see docs/sharding.md).

Usage:

    .venv/bin/python benchmarks/mesh.py [--steps 5] [--quick]
"""

import os

from _machine import print_machine


if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import eqtrain  # noqa: E402
import eqtrain.losses  # noqa: E402
from eqtrain import sharding  # noqa: E402
from eqtrain.models import GPT2, GPT2Config, Llama, LlamaConfig  # noqa: E402


LAYOUTS = [(8, 1, 1), (1, 8, 1), (4, 1, 2), (2, 2, 2), (1, 2, 4), (1, 1, 8)]
COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1}


def _elements(dims: str) -> int:
    return int(np.prod([int(d) for d in dims.split(",") if d]))


def collectives(hlo: str) -> dict[str, list[int]]:
    """`{op: [count, bytes]}` of the collectives in a compiled (per-device) HLO.
    Asynchronous pairs are counted once, by their `-done` result."""
    out = {op: [0, 0] for op in COLLECTIVES}
    for line in hlo.splitlines():
        for op in COLLECTIVES:
            match = re.search(rf"= (.*?) {op}(-done)?\(", line)
            if match:
                shapes = re.findall(r"(\w+)\[([\d,]*)\]", match.group(1))
                size = sum(
                    BYTES.get(dtype, 4) * _elements(dims) for dtype, dims in shapes
                )
                out[op][0] += 1
                out[op][1] += size
    return {op: v for op, v in out.items() if v[0]}


def batches(vocab: int, batch: int, seq: int, num: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=(num, batch, seq + 1), dtype=np.int32)
    return [{"tokens": t[:, :-1], "targets": t[:, 1:]} for t in tokens]


def measure(
    make_model: Any,
    layout: tuple[int, ...] | None,
    data: list[dict[str, Any]],
    extra: tuple[Any, ...] = (),
    fsdp_min_size: int = 2**14,
) -> dict[str, Any]:
    optimizer = optax.adamw(1e-3)
    state = eqtrain.TrainState.create(make_model(), optimizer, key=0)
    step_fn = eqtrain.train_step(eqtrain.losses.causal_lm_loss, optimizer)
    record: dict[str, Any] = {"mesh": None}
    if layout is None:
        step = eqtrain.jit(step_fn)
        batch_sh = None
    else:
        axes = dict(zip(("data", "fsdp", "tensor"), layout, strict=True))
        mesh = sharding.make_mesh(axes)
        rules = sharding.rules_for(
            state.model, mesh, fsdp_min_size=fsdp_min_size, extra=extra
        )
        state_sh = sharding.state_shardings(state, mesh, rules, optimizer=optimizer)
        batch_sh = sharding.batch_sharding(mesh)
        rows = sharding.describe(state, state_sh)
        record = {
            "mesh": axes,
            "state_bytes_per_device": sum(r.bytes_per_device for r in rows),
        }
        state = sharding.shard(state, state_sh)
        step = eqtrain.jit(step_fn, shardings=(state_sh, batch_sh))
        data = [jax.device_put(b, batch_sh) for b in data]
    arrays, _ = step.prepare(state)
    start = time.perf_counter()
    compiled = step._jitted.lower(arrays, data[0]).compile()
    record["compile_s"] = round(time.perf_counter() - start, 2)
    cost = compiled.cost_analysis() or {}
    record["flops_per_device"] = float(cost.get("flops", 0.0))
    memory = compiled.memory_analysis()
    record["temp_bytes_per_device"] = int(getattr(memory, "temp_size_in_bytes", 0))
    found = collectives(compiled.as_text())
    record["collectives"] = found
    record["comm_bytes_per_device"] = sum(v[1] for v in found.values())
    losses = []
    state, metrics = step(state, data[0])  # warm up (compiles through the cache)
    losses.append(metrics["loss"])
    jax.block_until_ready(state)
    start = time.perf_counter()
    for batch in data[1:]:
        state, metrics = step(state, batch)
        losses.append(metrics["loss"])
    jax.block_until_ready(state)
    record["step_ms"] = round(1e3 * (time.perf_counter() - start) / (len(data) - 1), 2)
    record["losses"] = np.asarray(jax.device_get(losses))
    assert step.num_traces == 1, "the step recompiled"
    return record


def emit(group: str, model: str, record: dict[str, Any], reference: Any) -> None:
    losses = record.pop("losses")
    record["max_loss_diff"] = float(np.max(np.abs(losses - reference["losses"])))
    # Measured in this run, so the ratio survives a noisy machine better than ms.
    record["step_time_vs_1_device"] = round(record["step_ms"] / reference["step_ms"], 3)
    print(json.dumps({"group": group, "model": model, **record}), flush=True)


def main(argv: list[str] | None = None) -> None:
    print_machine()  # the processor and settings: figures are per machine
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args(argv)
    steps = args.steps or (3 if args.quick else 6)
    if len(jax.devices()) < 8:
        raise SystemExit(f"needs 8 devices; found {jax.devices()}")

    if args.quick:
        llama = LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, scan_layers=False,
        )  # fmt: skip
        gpt2 = GPT2Config(
            vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
            scan_layers=False,
        )  # fmt: skip
        batch, seq, layouts, min_size = 8, 16, [(2, 2, 2)], 256
    else:
        llama = LlamaConfig(
            vocab_size=512, hidden_size=256, intermediate_size=704,
            num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
            scan_layers=False,
        )  # fmt: skip
        gpt2 = GPT2Config(
            vocab_size=512, n_positions=128, n_embd=256, n_layer=4, n_head=8,
            scan_layers=False,
        )  # fmt: skip
        batch, seq, layouts, min_size = 16, 128, LAYOUTS, 2**14

    data = batches(llama.vocab_size, batch, seq, steps)
    make = lambda: Llama(llama, jr.key(0))
    reference = measure(make, None, data)
    print(json.dumps({"group": "llama_layouts", "model": "llama", "mesh": "1 device",
                      "step_ms": reference["step_ms"]}), flush=True)  # fmt: skip
    for layout in layouts:
        record = measure(make, layout, data, fsdp_min_size=min_size)
        emit("llama_layouts", "llama", record, reference)

    data = batches(gpt2.vocab_size, batch, seq, steps)
    make = lambda: GPT2(gpt2, jr.key(0))
    reference = measure(make, None, data)
    variants = {
        "split_packed": (),
        "replicated": ((r"attn\.c_attn\.", P("layers")),),
        "split_input": (
            (r"attn\.c_attn\.weight$", P("layers", None, "tensor")),
            (r"attn\.c_attn\.bias$", P("layers")),
        ),
    }
    if args.quick:
        variants.pop("split_input")
    for name, extra in variants.items():
        record = measure(make, (4, 1, 2), data, extra=extra, fsdp_min_size=min_size)
        emit("gpt2_c_attn", f"gpt2:{name}", record, reference)


if __name__ == "__main__":
    main()
