"""Rollout throughput on skewed completion lengths: `eqtrain.generate` with
finished rows leaving the batch (`shrink=True`, as GRPO's rollouts run) against
today's `generate` (every row decoded until the longest ends) and transformers'
`generate`, in one run, on the same Llama-shaped model and weights (float32, CPU).

Completion lengths follow a skewed (geometric) distribution: the model is
random, so at temperature 1 each new token is one of the `--stops` stop ids with
probability about stops / vocab, and most rows end early while a few run to
`--new`. Each side samples `--batch` completions of `--prompt`-token prompts per
round; tokens/s counts the tokens the rows actually generated (their lengths,
stop token included), so a side that decodes finished rows pays for them.
Rounds rotate the order of the sides; eqtrain is compiled before timing.

Prints the machine and one JSON line:

    {"machine", "cpu_settings", "config", "batch", "prompt", "new", "stops",
     "rounds", "torch_threads", "mean_length", "max_length",
     "tokens_per_s": {"shrink", "generate", "transformers"},
     "ratio": {"shrink_vs_generate", "shrink_vs_transformers",
               "generate_vs_transformers"}}

with medians over rounds, each ratio the median over rounds of the two sides'
tokens/s within a round (> 1: the first is faster).

Usage (CPU; needs the `hf` extra):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/rollout.py [--rounds 3]
        [--batch 64] [--prompt 32] [--new 256] [--stops 8] [--no-tune-cpu]
        [--padded 256]   # also: the prompts left-padded to 256 (no prompt buckets)
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/rollout.py --quick   # smoke test
"""

import argparse
import json
import statistics
import sys
import time
from typing import Any

from _machine import machine, print_machine
from generate import models

import eqtrain


class Eqtrain:
    def __init__(
        self, model: Any, prompts: Any, args: Any, shrink: bool, width: int = 0
    ) -> None:
        import jax.numpy as jnp
        import numpy as np

        self.model, self.args, self.shrink = model, args, shrink
        rows, n = prompts.shape
        if width > n:  # left-padded to `width`, as a prompt of a wider bucket
            padded = np.zeros((rows, width), prompts.dtype)
            padded[:, width - n :] = prompts
            prompts = padded
        self.prompts = jnp.asarray(prompts)
        self.lengths = jnp.full((rows,), n, jnp.int32)
        self.round = 0

    def __call__(self) -> tuple[float, int, int]:
        import jax.random as jr

        from eqtrain.generate import Sampling, generate

        self.round += 1
        start = time.perf_counter()
        out = generate(
            self.model,
            self.prompts,
            self.lengths,
            max_new_tokens=self.args.new,
            key=jr.key(self.round),
            sampling=Sampling(temperature=1.0),
            stop_ids=stop_ids(self.args),
            shrink=self.shrink,
        )
        lengths = out.lengths.block_until_ready()
        return time.perf_counter() - start, int(lengths.sum()), int(lengths.max())


class Transformers:
    def __init__(self, model: Any, prompts: Any, args: Any, torch: Any) -> None:
        self.model, self.args, self.torch = model, args, torch
        self.prompts = torch.tensor(prompts, dtype=torch.long)

    def __call__(self) -> tuple[float, int, int]:
        stops = list(stop_ids(self.args))
        start = time.perf_counter()
        with self.torch.no_grad():
            out = self.model.generate(
                self.prompts,
                attention_mask=self.torch.ones_like(self.prompts),
                max_new_tokens=self.args.new,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                eos_token_id=stops,
                pad_token_id=0,
            )
        seconds = time.perf_counter() - start
        new = out[:, self.prompts.shape[1] :]
        ended = self.torch.isin(new, self.torch.tensor(stops))
        first = self.torch.where(
            ended.any(1), ended.int().argmax(1) + 1, self.torch.tensor(new.shape[1])
        )
        return seconds, int(first.sum()), int(first.max())


def stop_ids(args: argparse.Namespace) -> tuple[int, ...]:
    return tuple(range(3, 3 + args.stops))


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ours, theirs = models(args, transformers, torch)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3 + args.stops, args.vocab, (args.batch, args.prompt))
    prompts = prompts.astype(np.int32)
    sides = {
        "shrink": Eqtrain(ours, prompts, args, shrink=True),
        "generate": Eqtrain(ours, prompts, args, shrink=False),
        "transformers": Transformers(theirs, prompts, args, torch),
    }
    if args.padded:  # GRPO without prompt buckets: every prompt at the full width
        sides["padded"] = Eqtrain(ours, prompts, args, shrink=True, width=args.padded)
    for run in sides.values():  # compile (eqtrain) and warm up, untimed
        run()
    rates: dict[str, list[float]] = {name: [] for name in sides}
    lengths: list[tuple[int, int]] = []
    order = list(sides)
    for r in range(args.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            seconds, tokens, longest = sides[name]()
            rates[name].append(tokens / seconds)
            lengths.append((tokens, longest))
        shown = {k: round(v[-1], 1) for k, v in rates.items()}
        print(f"round {r}: tokens/s {shown}", file=sys.stderr)

    def ratio(a: str, b: str) -> float:
        within = [x / y for x, y in zip(rates[a], rates[b], strict=True)]
        return round(statistics.median(within), 3)

    return {
        "machine": machine(),
        "cpu_settings": args.cpu_settings,
        "config": {
            k: getattr(args, k)
            for k in ("vocab", "hidden", "intermediate", "layers", "heads", "kv_heads")
        },
        "batch": args.batch,
        "prompt": args.prompt,
        "new": args.new,
        "stops": args.stops,
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "mean_length": round(statistics.mean(t / args.batch for t, _ in lengths), 1),
        "max_length": max(m for _, m in lengths),
        "tokens_per_s": {k: round(statistics.median(v), 1) for k, v in rates.items()},
        "ratio": {
            "shrink_vs_generate": ratio("shrink", "generate"),
            "shrink_vs_transformers": ratio("shrink", "transformers"),
            "generate_vs_transformers": ratio("generate", "transformers"),
            **({"shrink_vs_padded": ratio("shrink", "padded")} if args.padded else {}),
        },
        "padded": args.padded,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--rounds", type=int, default=3)
    add("--batch", type=int, default=64)
    add("--prompt", type=int, default=32)
    add("--new", type=int, default=256)
    add("--stops", type=int, default=8, help="stop ids (of --vocab)")
    add("--vocab", type=int, default=256)
    add("--hidden", type=int, default=256)
    add("--intermediate", type=int, default=688)
    add("--layers", type=int, default=4)
    add("--heads", type=int, default=4)
    add("--kv-heads", type=int, default=4)
    add("--threads", type=int, default=0, help="torch threads (0: default)")
    add(
        "--padded",
        type=int,
        default=0,
        help="also shrink with the prompts left-padded to this width (a GRPO "
        "batch without prompt buckets; 0: not run)",
    )
    add(
        "--tune-cpu",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="eqtrain.cpu.tune_cpu() first, as the eqtrain command does",
    )
    add("--quick", action="store_true", help="a tiny smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.batch, args.prompt, args.new = 1, 8, 8, 16
        args.hidden, args.intermediate, args.layers, args.vocab = 32, 64, 1, 64
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.cpu_settings = eqtrain.cpu.tune_cpu() if args.tune_cpu else []
    print_machine()  # the processor and settings: figures are per machine
    print(json.dumps(benchmark(args)), flush=True)


if __name__ == "__main__":
    main()
