"""LoRA against full fine-tuning of the same model: trainable fraction, checkpoint
bytes and step time, measured in one run.

For each model (the `eqtrain fit` default model, and a wider one), it builds the
model, wraps it with `eqtrain.lora.apply` (rank 8, the default targets: attention
and MLP projections), and measures:

- `trainable`: adapter parameters / all parameters;
- `checkpoint`: bytes on disk of one LoRA checkpoint (adapters, their optimizer
  state, step, key; written by `Checkpointer(base=...)`) / one full fine-tuning
  checkpoint (every weight and its AdamW state), both of the trained states
  (after the timed steps: fresh zeros would compress away), saved synchronously
  into fresh directories, summing the sizes of the state's files;
- `step`: the median over rounds of LoRA step time / full step time (the default
  `train_step` with AdamW, `jax.jit`ted, same batch; the two alternate within a
  round so that the shared machine's drifts cancel), with the lowest and highest
  per-round ratios. Below 1.0 the LoRA step is faster.

It prints one JSON line per model:

    {"config", "params", "adapter_params", "trainable", "checkpoint_bytes_lora",
     "checkpoint_bytes_full", "checkpoint", "step", "step_range", "rounds"}

Usage (CPU):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/lora.py [--rounds 7] [--quick]
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.random as jr
import numpy as np
import optax
from _machine import print_machine

import eqtrain
from eqtrain import checkpoint, lora
from eqtrain.losses import causal_lm_loss
from eqtrain.models import Llama, LlamaConfig, num_params


def configs(quick: bool) -> dict[str, tuple[LlamaConfig, int, int]]:
    """name -> (model config, batch, seq). `default` is `eqtrain fit`'s default
    model (hidden 128, 4 layers, 4 heads, 2 kv heads, byte vocabulary)."""
    default = LlamaConfig(
        vocab_size=259,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=128,
    )
    if quick:  # only checks that the script runs
        tiny = LlamaConfig(
            vocab_size=259,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=32,
        )
        return {"tiny": (tiny, 4, 32)}
    out = {"default": (default, 8, 128)}
    if not quick:
        out["wide"] = (
            LlamaConfig(
                vocab_size=259,
                hidden_size=512,
                intermediate_size=2048,
                num_hidden_layers=4,
                num_attention_heads=8,
                num_key_value_heads=4,
                tie_word_embeddings=True,
                max_position_embeddings=128,
            ),
            4,
            128,
        )
    return out


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def checkpoint_bytes(state, base) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = checkpoint.Checkpointer(tmp, async_save=False, base=base)
        ckpt.save(eqtrain.StepInfo(step=1, metrics={}, num_steps=1, _state=state))
        ckpt.close()
        return dir_bytes(Path(tmp) / "checkpoints" / "1" / "state")


def measure(name: str, config: LlamaConfig, batch: int, seq: int, rounds: int):
    opt = optax.adamw(1e-3)
    model = Llama(config, jr.key(0))
    # A copy: `apply` shares the base arrays, and the full step donates its own.
    copied = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model)
    adapted = lora.apply(copied, lora.LoRA(rank=8, alpha=16), key=jr.key(1))
    full = eqtrain.TrainState.create(model, opt, key=0)
    tuned = eqtrain.TrainState.create(
        adapted, opt, key=0, trainable=lora.trainable(adapted)
    )
    params, adapters = num_params(model), lora.num_adapter_params(adapted)

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (batch, seq + 1), dtype=np.int32)
    data = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    steps = {
        "full": (eqtrain.jit(eqtrain.train_step(causal_lm_loss, opt)), full),
        "lora": (eqtrain.jit(eqtrain.train_step(causal_lm_loss, opt)), tuned),
    }
    states = {}
    for key, (step, state) in steps.items():  # compile and warm up
        for _ in range(2):
            state, metrics = step(state, data)
        jax.block_until_ready(metrics)
        states[key] = state
    n = 3 if rounds < 3 else 10
    ratios = []
    for r in range(rounds):
        times = {}
        for key in ("full", "lora") if r % 2 == 0 else ("lora", "full"):
            step, state = steps[key][0], states[key]
            start = time.perf_counter()
            for _ in range(n):
                state, metrics = step(state, data)
            jax.block_until_ready(metrics)
            times[key] = time.perf_counter() - start
            states[key] = state
        ratios.append(times["lora"] / times["full"])
        print(f"{name} round {r}: {times}", file=sys.stderr)
    # Trained states: zeros (fresh lora_b, optimizer moments) would compress away.
    full_bytes = checkpoint_bytes(states["full"], None)
    base = {"path": None, "sha256": "0" * 64}
    lora_bytes = checkpoint_bytes(states["lora"], base)
    return {
        "config": name,
        "params": params,
        "adapter_params": adapters,
        "trainable": adapters / params,
        "checkpoint_bytes_lora": lora_bytes,
        "checkpoint_bytes_full": full_bytes,
        "checkpoint": lora_bytes / full_bytes,
        "step": statistics.median(ratios),
        "step_range": [min(ratios), max(ratios)],
        "rounds": rounds,
    }


def main() -> None:
    print_machine()  # the processor and settings: figures are per machine
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rounds = 2 if args.quick else args.rounds
    for name, (config, batch, seq) in configs(args.quick).items():
        print(json.dumps(measure(name, config, batch, seq, rounds)), flush=True)


if __name__ == "__main__":
    main()
