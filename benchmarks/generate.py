"""Generation throughput of `eqtrain.generate` against transformers' `generate`
on the CPU: the same Llama-shaped model and weights, the same prompts, greedy,
float32.

The model is transformers' `LlamaForCausalLM` at random initialisation, saved
with `save_pretrained` and read into eqtrain with `eqtrain.hf.load` (identical
weights). Each side generates for `--batch` prompts of `--prompt` random tokens
(no padding), greedily, twice per round:

- prefill: `max_new_tokens=1` (the prompt through the model and one token);
- total: `max_new_tokens=--new`, never stopping early (eqtrain: no stop ids;
  transformers: `min_new_tokens=--new`, no EOS).

prefill tokens/s = batch x prompt / prefill seconds; decode tokens/s = batch x
(new - 1) / (total - prefill) seconds. eqtrain is compiled for both lengths
before timing (one compile per shape, reused afterwards); transformers runs with
torch's default threads (`--threads` to set them) and its default attention
(SDPA), `use_cache=True`. Rounds alternate the order of the two sides (ABBA).
It prints the machine and one JSON line:

    {"machine", "cpu_settings", "config", "params", "batch", "prompt", "new",
     "rounds", "torch_threads", "tokens_match",
     "eqtrain": {"prefill_tokens_per_s", "decode_tokens_per_s", "total_s"},
     "transformers": {...},
     "ratio": {"prefill", "decode", "total"}, "ratio_range": {...},
     "best": {"eqtrain": {...}, "transformers": {...}}, "ratio_of_best": {...}}

with each side's medians over rounds and each ratio the median over rounds of
eqtrain / transformers within a round (> 1: eqtrain is faster; for `total`,
transformers' seconds / eqtrain's); `best`: each side's fastest round (on a
shared machine the least disturbed: torch's threads suffer most from other
load) and `ratio_of_best` their ratios. `tokens_match`: the fraction of the total
run's tokens that agree (float rounding may flip a near-tie of random weights).
Per-round figures go to stderr.

Usage (CPU; needs the `hf` extra):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/generate.py [--rounds 3]
        [--batch 8] [--prompt 128] [--new 128] [--hidden 512] [--layers 4]
        [--threads N] [--no-tune-cpu] [--quick]
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import Any

from _machine import machine, print_machine

import eqtrain


def models(args: argparse.Namespace, transformers: Any, torch: Any) -> tuple:
    """transformers' Llama at random init and eqtrain's copy of it."""
    from eqtrain import hf

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt + args.new,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).float().eval()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        theirs.save_pretrained(tmp)
        ours, _ = hf.load(tmp)
    return ours, theirs


class Eqtrain:
    def __init__(self, model: Any, prompts: Any) -> None:
        import jax.numpy as jnp
        import jax.random as jr

        from eqtrain.generate import generate

        self.model, self.key = model, jr.key(0)
        self.prompts = jnp.asarray(prompts)
        self.lengths = jnp.full((prompts.shape[0],), prompts.shape[1], jnp.int32)
        self.generate = generate

    def __call__(self, new: int) -> tuple[float, Any]:
        start = time.perf_counter()
        out = self.generate(
            self.model, self.prompts, self.lengths, max_new_tokens=new, key=self.key
        )
        tokens = out.tokens.block_until_ready()
        return time.perf_counter() - start, tokens


class Transformers:
    def __init__(self, model: Any, prompts: Any, torch: Any) -> None:
        self.model, self.torch = model, torch
        self.ids = torch.from_numpy(prompts).long()
        self.mask = torch.ones_like(self.ids)

    def __call__(self, new: int) -> tuple[float, Any]:
        start = time.perf_counter()
        with self.torch.no_grad():
            out = self.model.generate(
                input_ids=self.ids, attention_mask=self.mask, do_sample=False,
                max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                eos_token_id=None, use_cache=True,
            )  # fmt: skip
        return time.perf_counter() - start, out[:, self.ids.shape[1] :].numpy()


def rates(run: Any, args: argparse.Namespace) -> dict[str, float]:
    prefill, _ = run(1)
    total, _ = run(args.new)
    return {
        "prefill_tokens_per_s": args.batch * args.prompt / prefill,
        "decode_tokens_per_s": args.batch * (args.new - 1) / max(total - prefill, 1e-9),
        "total_s": total,
    }


def _rounded(row: dict[str, float], digits: int = 1) -> dict[str, float]:
    return {k: round(v, digits) for k, v in row.items()}


def _ratios(e: dict[str, float], t: dict[str, float]) -> dict[str, float]:
    """eqtrain / transformers (> 1: eqtrain is faster)."""
    return {
        "prefill": round(e["prefill_tokens_per_s"] / t["prefill_tokens_per_s"], 4),
        "decode": round(e["decode_tokens_per_s"] / t["decode_tokens_per_s"], 4),
        "total": round(t["total_s"] / e["total_s"], 4),
    }


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import torch
    import transformers

    from eqtrain.models import num_params

    if args.threads:
        torch.set_num_threads(args.threads)
    ours, theirs = models(args, transformers, torch)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, args.vocab, (args.batch, args.prompt), dtype=np.int32)
    runners = {
        "eqtrain": Eqtrain(ours, prompts),
        "transformers": Transformers(theirs, prompts, torch),
    }
    for run in runners.values():  # compile (eqtrain) and warm up, untimed
        run(1)
        run(args.new)
    a = np.asarray(runners["eqtrain"](args.new)[1])
    b = runners["transformers"](args.new)[1]
    per_round: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for r in range(args.rounds):
        for name in list(runners) if r % 2 == 0 else list(reversed(runners)):
            per_round[name].append(rates(runners[name], args))
        shown = {k: _rounded(v[-1]) for k, v in per_round.items()}
        print(f"round {r}: {shown}", file=sys.stderr)
    keys = ("prefill_tokens_per_s", "decode_tokens_per_s", "total_s")
    med = {
        name: {k: round(statistics.median(x[k] for x in rows), 5) for k in keys}
        for name, rows in per_round.items()
    }
    best = {
        name: {
            "prefill_tokens_per_s": max(x["prefill_tokens_per_s"] for x in rows),
            "decode_tokens_per_s": max(x["decode_tokens_per_s"] for x in rows),
            "total_s": min(x["total_s"] for x in rows),
        }
        for name, rows in per_round.items()
    }
    pairs = list(zip(per_round["eqtrain"], per_round["transformers"], strict=True))
    faster = lambda k: [e[k] / t[k] for e, t in pairs]
    paired = {
        "prefill": faster("prefill_tokens_per_s"),
        "decode": faster("decode_tokens_per_s"),
        "total": [t["total_s"] / e["total_s"] for e, t in pairs],
    }
    return {
        "machine": machine(),
        "cpu_settings": args.cpu_settings,
        "config": "quick" if args.quick else "llama",
        "params": num_params(ours),
        "hidden": args.hidden,
        "layers": args.layers,
        "vocab": args.vocab,
        "batch": args.batch,
        "prompt": args.prompt,
        "new": args.new,
        "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "tokens_match": round(float((a == b).mean()), 4),
        **med,
        "ratio": {k: round(statistics.median(v), 4) for k, v in paired.items()},
        "ratio_range": {
            k: [round(min(v), 4), round(max(v), 4)] for k, v in paired.items()
        },
        # each side's fastest round: the least disturbed on a shared machine
        "best": {name: _rounded(row, 5) for name, row in best.items()},
        "ratio_of_best": _ratios(best["eqtrain"], best["transformers"]),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens")
    parser.add_argument("--new", type=int, default=None, help="new tokens")
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: default)"
    )
    parser.add_argument(
        "--tune-cpu",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="eqtrain.cpu.tune_cpu() first, as the eqtrain command does",
    )
    parser.add_argument("--quick", action="store_true", help="tiny smoke test")
    args = parser.parse_args(argv)
    q = args.quick
    args.rounds = args.rounds or (1 if q else 3)
    args.batch = args.batch or (2 if q else 8)
    args.prompt = args.prompt or (16 if q else 128)
    args.new = args.new or (4 if q else 128)
    args.hidden = args.hidden or (32 if q else 512)
    args.layers = args.layers or (2 if q else 4)
    args.vocab = args.vocab or (128 if q else 32000)
    args.intermediate = args.hidden * 11 // 4
    args.heads = max(1, args.hidden // 64)
    args.kv_heads = args.heads
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.cpu_settings = eqtrain.cpu.tune_cpu() if args.tune_cpu else []
    print_machine()  # the processor and settings: figures are per machine
    print(json.dumps(benchmark(args)), flush=True)


if __name__ == "__main__":
    main()
