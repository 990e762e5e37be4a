"""Mixture of experts: what the dropless dispatch costs, and what the
load-balancing loss does.

1. Step time (`--rounds` ABBA rounds in one process, compilation excluded) of a
   training step (loss, gradients, SGD update) of four models with the same
   attention and the same *active* MLP parameters per token:
   - `sorted`: a `SparseMoE` decoder, 8 experts, top-2, each expert
     `expert_size` wide, the dropless sorted dispatch (the CPU default);
   - `dense_dispatch`: the same model with `moe_impl="dense"` (every expert on
     every token, weighted: the reference, `experts / k` = 4x the MLP FLOPs);
   - `ragged`: `moe_impl="ragged"` (`jax.lax.ragged_dot`; XLA:CPU computes every
     group densely, so expect about `dense_dispatch`);
   - `pallas`: `moe_impl="pallas"` (the sorted blocks through the Pallas
     grouped matmul, Triton-compiled on GPUs). On CPU it runs interpreted
     (correct but slow, not a speed figure) and is left out unless `--pallas`;
     `--no-pallas` leaves it out on GPUs;
   - `dense_model`: a dense decoder whose MLP is `k * expert_size` wide (the
     active parameters of the MoE, without routing).
   Prints `{"step_ms": {...}, "ratio_sorted_vs_dense_model": ...,
   "ratio_sorted_vs_dense_dispatch": ..., "ratio_sorted_vs_ragged": ...,
   "ratio_sorted_vs_pallas": ...}`: a ratio is the other's time / the sorted
   dispatch's (> 1: sorted is faster).
2. Balance: `--balance-steps` steps on the standard-library corpus (bytes) with
   `router_aux_loss_coef` 0.01 and 0, the same seed; prints the expert loads
   (assignments per expert x experts / all assignments: 1 is even) of the last
   batch, their max and min, and the aux loss.

Usage (CPU):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/moe.py [--rounds 5]
        [--balance-steps 100] [--quick] [--pallas]
"""

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _machine import machine, print_machine

import eqtrain
from eqtrain import losses
from eqtrain.data import ByteTokenizer, chunk_documents, stdlib_corpus
from eqtrain.models import Decoder, DecoderConfig


def configs(args: argparse.Namespace) -> dict[str, DecoderConfig]:
    base = dict(
        vocab_size=512,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        scan_layers=False,
        max_position_embeddings=args.seq,
    )
    moe = DecoderConfig(
        intermediate_size=args.expert_size,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        **base,
    )
    return {
        "sorted": moe,
        "dense_dispatch": dataclasses.replace(moe, moe_impl="dense"),
        "ragged": dataclasses.replace(moe, moe_impl="ragged"),
        "pallas": dataclasses.replace(moe, moe_impl="pallas"),
        "dense_model": DecoderConfig(
            intermediate_size=args.top_k * args.expert_size, **base
        ),
    }


def with_pallas(args: argparse.Namespace) -> bool:
    """Whether to time the Pallas dispatch: by default on accelerators, not on
    CPU (interpreted there: a correctness path, not a speed figure)."""
    if args.pallas is not None:
        return args.pallas
    return jax.default_backend() != "cpu"


def step_fn(opt: Any) -> Any:
    @eqx.filter_jit
    def step(model: Any, state: Any, batch: dict[str, Any]) -> Any:
        loss, grads = eqx.filter_value_and_grad(
            lambda m: losses.causal_lm_loss(m, batch)[0]
        )(model)
        updates, state = opt.update(grads, state, model)
        return eqx.apply_updates(model, updates), state, loss

    return step


def time_steps(args: argparse.Namespace) -> dict[str, Any]:
    opt = optax.sgd(1e-3)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, (args.batch, args.seq + 1)).astype(np.int32)
    batch = {
        "tokens": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
    }
    runs = {}
    timed = configs(args)
    if not with_pallas(args):
        del timed["pallas"]
    for name, config in timed.items():
        model = Decoder(config, jax.random.key(0))
        state = opt.init(eqx.filter(model, eqx.is_array))
        step = step_fn(opt)
        model, state, loss = step(model, state, batch)  # compile
        jax.block_until_ready(loss)
        runs[name] = [model, state, step]
    times: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs)
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            model, state, step = runs[name]
            start = time.perf_counter()
            for _ in range(args.steps):
                model, state, loss = step(model, state, batch)
            jax.block_until_ready(loss)
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
            runs[name][:2] = [model, state]
        print(
            json.dumps({"round": r, **{k: round(v[-1], 2) for k, v in times.items()}}),
            file=sys.stderr,
        )
    ms = {k: statistics.median(v) for k, v in times.items()}
    return {
        "step_ms": {k: round(v, 2) for k, v in ms.items()},
        **{
            f"ratio_sorted_vs_{k}": round(v / ms["sorted"], 3)
            for k, v in ms.items()
            if k != "sorted"
        },
        # the bar: the Pallas step within 1.3x of the dense model's
        **(
            {"pallas_over_dense_model": round(ms["pallas"] / ms["dense_model"], 3)}
            if "pallas" in ms
            else {}
        ),
    }


ADAMW = optax.adamw(3e-3)


@eqx.filter_jit
def _balance_step(model: Any, state: Any, batch: dict[str, Any]) -> Any:
    (_, aux), grads = eqx.filter_value_and_grad(
        lambda m: losses.causal_lm_loss(m, batch), has_aux=True
    )(model)
    updates, state = ADAMW.update(grads, state, model)
    return eqx.apply_updates(model, updates), state, aux


def balance(args: argparse.Namespace) -> dict[str, Any]:
    rows = chunk_documents(stdlib_corpus()[:200], ByteTokenizer(), seq_len=args.seq)
    tokens = np.asarray(rows["tokens"])
    targets = np.asarray(rows["targets"])
    out = {}
    for coef in (0.01, 0.0):
        config = dataclasses.replace(
            configs(args)["sorted"], vocab_size=259, router_aux_loss_coef=coef
        )
        model = Decoder(config, jax.random.key(0))
        state = ADAMW.init(eqx.filter(model, eqx.is_array))
        rng = np.random.default_rng(1)
        for _ in range(args.balance_steps):
            pick = rng.integers(0, len(tokens), args.batch)
            batch = {"tokens": tokens[pick], "targets": targets[pick]}
            model, state, aux = _balance_step(model, state, batch)
        loads = [float(aux[f"moe/expert_load/{i}"]) for i in range(args.experts)]
        out[f"aux_coef_{coef}"] = {
            "loads": [round(x, 3) for x in loads],
            "max": round(max(loads), 3),
            "min": round(min(loads), 3),
            "aux_loss": round(float(aux["moe/aux_loss"]), 4),
        }
    return out


def main() -> None:
    print_machine()  # the processor and settings: figures are per machine
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-size", type=int, default=256)
    parser.add_argument("--balance-steps", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument(
        "--pallas",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time moe_impl='pallas' (default: on GPUs; on CPU it is interpreted)",
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.balance_steps = 1, 1, 3
        args.seq, args.hidden, args.expert_size = 32, 32, 32
    settings = eqtrain.cpu.tune_cpu()  # as the eqtrain command does, before JAX starts
    result = {"machine": machine(), "cpu_settings": settings, **vars(args)}
    result["device"] = jax.devices()[0].device_kind
    result["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    result.update(time_steps(args))
    # --balance-steps 0: the step times alone
    result["balance"] = balance(args) if args.balance_steps else None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
