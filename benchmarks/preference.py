"""DPO step time against an SFT step on the same pairs, for each way of getting
the reference log-probabilities.

For `eqtrain fit`'s default model (seq 128, 16 pairs), every step below is
`eqtrain.jit(eqtrain.train_step(loss_fn, optax.adamw(1e-3)))` over its own
`TrainState`, fed the same random pairs (a shared prompt, masked out, then a
chosen and a rejected completion):

- `sft`: `causal_lm_loss` on the 2 x pairs sequences (chosen and rejected
  stacked), full fine-tuning: the cost of plain SFT over both sequences of each
  pair, the yardstick;
- `copy` (mode a): `preference_loss_fn("dpo", reference="copy")`, the state
  built from `preference.with_reference(model)` (a frozen copy: one more forward
  pass per step);
- `precomputed` (mode c): `preference_loss_fn("dpo", reference="precomputed")`,
  the reference log-probs in the batch (from `pair_logprobs`, computed once
  before timing);
- `lora_sft` and `adapters_off`: the same model under `lora.apply` (rank 8),
  only the adapters trained; SFT against `preference_loss_fn("dpo",
  reference="adapters_off")` (the reference is the policy with its adapters off:
  one more forward pass, no second copy of the weights), the default for LoRA.

Every step is compiled and warmed up first. Each round times a chunk of steps
of every variant (blocking on the result at the end of the chunk), the order
reversed every other round so that the shared machine's drifts cancel. Reported
per config: `copy` and `precomputed` (step time / `sft` step time) and
`adapters_off` (/ `lora_sft`), each the median over rounds of the per-round
ratio with `_range` [lowest, highest]; `ms`, the median milliseconds per step of
each variant; and the issue's `targets`. One JSON line per config:

    {"config", "pairs", "seq", "copy", "copy_range", "precomputed",
     "precomputed_range", "adapters_off", "adapters_off_range", "ms", "targets",
     "rounds"}

Usage (CPU):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/preference.py [--rounds 7] [--quick]
"""

import argparse
import json
import os
import statistics
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from _machine import print_machine

import eqtrain
from eqtrain import lora
from eqtrain.losses import causal_lm_loss
from eqtrain.models import Llama, LlamaConfig
from eqtrain.post_training import preference


VARIANTS = ("sft", "copy", "precomputed", "lora_sft", "adapters_off")
RATIOS = {"copy": "sft", "precomputed": "sft", "adapters_off": "lora_sft"}
TARGETS = {"precomputed": 1.1, "copy": 1.5}


def configs(quick: bool) -> dict[str, tuple[LlamaConfig, int, int]]:
    """name -> (model config, pairs, seq). `default` is `eqtrain fit`'s default
    model (hidden 128, 4 layers, 4 heads, 2 kv heads, byte vocabulary)."""
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
    return {"default": (default, 16, 128)}


def make_pairs(vocab: int, pairs: int, seq: int) -> dict[str, np.ndarray]:
    """Random pairs: each row a prompt (a quarter to a half of the sequence,
    shared by both completions, mask 0) then its completion (mask 1)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, (pairs, seq + 1), dtype=np.int32)
    start = rng.integers(seq // 4, seq // 2 + 1, (pairs, 1))
    in_prompt = np.arange(seq + 1) < start
    mask = (~in_prompt[:, 1:]).astype(np.float32)  # on the targets: shifted by one
    batch = {}
    for name in ("chosen", "rejected"):
        completion = rng.integers(0, vocab, (pairs, seq + 1), dtype=np.int32)
        tokens = np.where(in_prompt, prompt, completion)
        batch[f"{name}_tokens"] = tokens[:, :-1]
        batch[f"{name}_targets"] = tokens[:, 1:]
        batch[f"{name}_mask"] = mask
    return batch


def sft_batch(pairs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Both sequences of every pair as 2 x pairs SFT rows."""
    stack = lambda k: np.concatenate([pairs[f"chosen_{k}"], pairs[f"rejected_{k}"]])
    return {
        "tokens": stack("tokens"),
        "targets": stack("targets"),
        "loss_mask": stack("mask"),
    }


def fresh(model):
    """A copy of the arrays: each state donates its own."""
    return jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, model)


def setups(config: LlamaConfig, pairs: dict[str, np.ndarray]) -> dict:
    """variant -> (jitted step, initial state, batch)."""
    opt = optax.adamw(1e-3)
    model = Llama(config, jr.key(0))
    step = lambda loss_fn: eqtrain.jit(eqtrain.train_step(loss_fn, opt))
    dpo = lambda ref: step(preference.preference_loss_fn("dpo", reference=ref))
    state = lambda m, trainable=True: eqtrain.TrainState.create(
        m, opt, key=0, trainable=trainable
    )

    chosen, rejected = eqx.filter_jit(preference.pair_logprobs)(model, pairs)
    precomputed = {**pairs, "reference_chosen": chosen, "reference_rejected": rejected}
    wrapped = preference.with_reference(fresh(model))
    lora_sft = lora.apply(fresh(model), lora.LoRA(rank=8, alpha=16), key=jr.key(1))
    lora_dpo = fresh(lora_sft)
    sft = sft_batch(pairs)
    return {
        "sft": (step(causal_lm_loss), state(fresh(model)), sft),
        "copy": (
            dpo("copy"),
            state(wrapped, preference.reference_trainable(wrapped)),
            pairs,
        ),
        "precomputed": (dpo("precomputed"), state(fresh(model)), precomputed),
        "lora_sft": (
            step(causal_lm_loss),
            state(lora_sft, lora.trainable(lora_sft)),
            sft,
        ),
        "adapters_off": (
            dpo("adapters_off"),
            state(lora_dpo, lora.trainable(lora_dpo)),
            pairs,
        ),
    }


def measure(name: str, config: LlamaConfig, pairs: int, seq: int, rounds: int):
    data = make_pairs(config.vocab_size, pairs, seq)
    data = jax.device_put(data)
    runs = setups(config, data)
    steps = {k: step for k, (step, _, _) in runs.items()}
    batches = {k: batch for k, (_, _, batch) in runs.items()}
    states = {}
    for key in VARIANTS:  # compile and warm up
        state = runs[key][1]
        for _ in range(2):
            state, metrics = steps[key](state, batches[key])
        jax.block_until_ready(metrics)
        states[key] = state
    n = 3 if rounds < 3 else 5
    times = {k: [] for k in VARIANTS}
    for r in range(rounds):
        for key in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            state, step, batch = states[key], steps[key], batches[key]
            start = time.perf_counter()
            for _ in range(n):
                state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times[key].append((time.perf_counter() - start) / n)
            states[key] = state  # the step donated the old one
        shown = {k: round(v[-1] * 1e3, 2) for k, v in times.items()}
        print(f"{name} round {r} (ms/step): {shown}", file=sys.stderr)
    out: dict = {"config": name, "pairs": pairs, "seq": seq}
    for key, base in RATIOS.items():
        ratios = [t / b for t, b in zip(times[key], times[base], strict=True)]
        out[key] = statistics.median(ratios)
        out[f"{key}_range"] = [min(ratios), max(ratios)]
    out["ms"] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out["targets"] = TARGETS
    out["rounds"] = rounds
    return out


def main() -> None:
    print_machine()  # the processor and settings: figures are per machine
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 2 rounds")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rounds = 2 if args.quick else args.rounds
    for name, (config, pairs, seq) in configs(args.quick).items():
        print(json.dumps(measure(name, config, pairs, seq, rounds)), flush=True)


if __name__ == "__main__":
    main()
