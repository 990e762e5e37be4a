"""Generation throughput of `eqtrain.generate` against transformers' `generate`
on the same device, CPU or CUDA GPU: the same Llama-shaped model and weights,
the same prompts, greedy; and the memory each side's key/value cache takes.

The model is transformers' `LlamaForCausalLM` at random initialisation (seed 0),
cast to `--dtype`, saved with `save_pretrained` and read into eqtrain with
`eqtrain.hf.load(dtype=--dtype)` (identical weights; a bf16 model generates as
is: cache in bf16, logits cast to f32). Each side generates for `--batch`
prompts of `--prompt` random tokens (no padding), greedily, twice per round:

- prefill: `max_new_tokens=1` (the prompt through the model and one token);
- total: `max_new_tokens=--new`, never stopping early (eqtrain: no stop ids;
  transformers: `min_new_tokens=--new`, no EOS).

prefill tokens/s = batch x prompt / prefill seconds; decode tokens/s = batch x
(new - 1) / (total - prefill) seconds. eqtrain is compiled for both lengths
before timing (one compile per shape, reused afterwards), runs on JAX's CPU or
GPU and each timing waits for its tokens (`block_until_ready`); transformers
runs with its default attention (SDPA), `use_cache=True` (its `DynamicCache`),
on the CPU with torch's default threads (`--threads` to set them) or on
`torch.device("cuda")`, each timing ending with `torch.cuda.synchronize()`.
Rounds alternate the order of the two sides (ABBA). On a GPU both share the
device: JAX allocates as it goes (`XLA_PYTHON_CLIENT_PREALLOCATE=false`, unless
set) instead of taking 75% of it at its start.

Sizes (`--config`; `--hidden`, `--layers`, `--vocab` override a preset):

- `llama` (the CPU default): hidden 512, 4 layers, 8 heads, MLP 1408, vocab
  32000 (45.6M parameters); 8 prompts of 128 tokens, 128 new;
- `1b` (the CUDA default): Llama 3.2 1B's shape, hidden 2048, 16 layers, 32
  query and 8 key/value heads, MLP 8192, vocab 128256, tied embeddings, rope
  theta 500000 (1.24B parameters); 16 prompts of 512 tokens, 256 new;
- `--quick`: hidden 32, 2 layers, vocab 128; 2 prompts of 16 tokens, 4 new.

`--device` defaults to cuda where JAX's default backend is a GPU, else cpu;
`--dtype` to float32 on the CPU and bfloat16 on CUDA. On the CPU
`eqtrain.cpu.tune_cpu()` applies first (`--no-tune-cpu`: not), as the eqtrain
command does; on CUDA not (it changes nothing a GPU runs). After the timed
rounds each side generates the total once more, for `tokens_match` and memory:

- `cache_bytes_per_row`: eqtrain: the keys and values of the `KVCache` that
  `generate` allocates (`model.init_cache(batch, prompt + new, ...)`, its
  `[layers, rows, kv_heads, prompt + new, head_dim]` arrays, shapes from
  `jax.eval_shape`); transformers: the key and value tensors of the
  `past_key_values` that `generate(return_dict_in_generate=True)` returns (it
  holds prompt + new - 1 positions: the last token is never fed); each over the
  batch;
- `peak_device_bytes` (CUDA; null on the CPU): transformers:
  `torch.cuda.max_memory_allocated()` over that run (`reset_peak_memory_stats`
  first); eqtrain: the device's `memory_stats()["peak_bytes_in_use"]` (null where
  JAX has none), the peak of the whole process (loading and compiling included:
  JAX cannot reset it). Each includes that side's weights.

It prints the machine and one JSON line:

    {"machine", "cpu_settings", "config", "device", "dtype", "device_kind",
     "versions", "date", "params", "hidden", "layers", "vocab", "batch",
     "prompt", "new", "rounds", "torch_threads", "tokens_match",
     "cache_bytes_per_row": {"eqtrain", "transformers"},
     "peak_device_bytes": {"eqtrain", "transformers"},
     "eqtrain": {"prefill_tokens_per_s", "decode_tokens_per_s", "total_s"},
     "transformers": {...},
     "ratio": {"prefill", "decode", "total"}, "ratio_range": {...},
     "best": {"eqtrain": {...}, "transformers": {...}}, "ratio_of_best": {...}}

with each side's medians over rounds and each ratio the median over rounds of
eqtrain / transformers within a round (> 1: eqtrain is faster; for `total`,
transformers' seconds / eqtrain's); `best`: each side's fastest round (on a
shared machine the least disturbed: torch's threads suffer most from other
load) and `ratio_of_best` their ratios. `tokens_match`: the fraction of the total
run's tokens that agree (float rounding may flip a near-tie of random weights;
in bf16 many more do, and a row differs from its first flip on). `device_kind`:
JAX's `device_kind` and torch's `get_device_name()` ("cpu" on the CPU);
`versions`: jax, torch and transformers; `date`: UTC, ISO 8601. Per-round
figures go to stderr.

Usage (CPU; needs the `hf` extra):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/generate.py [--rounds 3]
        [--batch 8] [--prompt 128] [--new 128] [--hidden 512] [--layers 4]
        [--threads N] [--no-tune-cpu] [--quick]

On a CUDA GPU, as docs/performance.md runs `mfu.py`: the machine's `python3`
with jax[cuda], torch and transformers, eqtrain importable from the checkout
(`pip install -e . --no-deps`, or `PYTHONPATH=.` before the command):

    python3 benchmarks/generate.py --device cuda --config 1b --rounds 3
        [--dtype bfloat16] [--batch 16] [--prompt 512] [--new 256]
"""

import os


# JAX takes 75% of a GPU's memory at its start by default; here torch shares the
# GPU, and JAX's peak should be what it used. No effect on the CPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pkgutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from _machine import machine, print_machine  # noqa: E402

import eqtrain  # noqa: E402


# sizes and default lengths; without `heads`: hidden // 64 heads, as many
# key/value heads and an MLP of 11/4 the hidden size, untied, rope theta 10000
CONFIGS = {
    "quick": dict(hidden=32, layers=2, vocab=128, batch=2, prompt=16, new=4),
    "llama": dict(hidden=512, layers=4, vocab=32000, batch=8, prompt=128, new=128),
    "1b": dict(
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        intermediate=8192,
        vocab=128256,
        tie=True,
        rope_theta=500000.0,
        batch=16,
        prompt=512,
        new=256,
    ),  # fmt: skip
}


def models(args: argparse.Namespace, transformers: Any, torch: Any) -> tuple:
    """transformers' Llama at random init in `args.dtype` on `args.device`, and
    eqtrain's copy of it (on JAX's default device). `benchmarks/rollout.py`
    calls it too, with only the sizes: float32 on the CPU, untied, rope theta
    10000 where its arguments say nothing."""
    from eqtrain import hf

    theta = getattr(args, "rope_theta", None)
    dtype = getattr(args, "dtype", "float32")
    rope = {}
    if theta is not None:
        rope["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt + args.new,
        tie_word_embeddings=getattr(args, "tie", False),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        **rope,
    )
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(config).float().eval()
    # cast before saving: both sides then read the same (rounded) tensors
    theirs = theirs.to(getattr(torch, dtype))
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        theirs.save_pretrained(tmp)
        ours, _ = hf.load(tmp, dtype=dtype)
    return ours, theirs.to(torch.device(getattr(args, "device", "cpu")))


class Eqtrain:
    def __init__(self, model: Any, prompts: Any, device: Any) -> None:
        import jax.numpy as jnp
        import jax.random as jr

        from eqtrain.generate import generate

        self.model, self.key, self.device = model, jr.key(0), device
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

    def cache_bytes(self, new: int) -> int:
        """Bytes of the keys and values of the cache `generate` allocates for
        `new` tokens (`_prefill`'s `init_cache(rows, width + new, pads)`)."""
        import jax

        rows, width = self.prompts.shape
        pads = width - self.lengths
        cache = jax.eval_shape(lambda: self.model.init_cache(rows, width + new, pads))
        return sum(math.prod(a.shape) * a.dtype.itemsize for a in (cache.k, cache.v))

    def peak_bytes(self) -> int | None:
        """The device's peak bytes in use so far (the process's: JAX keeps no
        resettable peak), or None where JAX reports none (the CPU)."""
        stats = self.device.memory_stats() or {}
        return stats.get("peak_bytes_in_use")


class Transformers:
    def __init__(self, model: Any, prompts: Any, torch: Any, device: str) -> None:
        self.model, self.torch, self.cuda = model, torch, device == "cuda"
        self.ids = torch.from_numpy(prompts).long().to(torch.device(device))
        self.mask = torch.ones_like(self.ids)

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def _generate(self, new: int, **extra: Any) -> Any:
        with self.torch.no_grad():
            return self.model.generate(
                input_ids=self.ids, attention_mask=self.mask, do_sample=False,
                max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                eos_token_id=None, use_cache=True, **extra,
            )  # fmt: skip

    def _new_tokens(self, sequences: Any) -> Any:
        return sequences[:, self.ids.shape[1] :].cpu().numpy()

    def __call__(self, new: int) -> tuple[float, Any]:
        self._sync()
        start = time.perf_counter()
        out = self._generate(new)
        self._sync()
        return time.perf_counter() - start, self._new_tokens(out)

    def measured(self, new: int) -> tuple[Any, int, int | None]:
        """The new tokens of a total run, the bytes of its `past_key_values`
        and (CUDA) its peak allocated bytes."""
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()
        out = self._generate(new, return_dict_in_generate=True)
        self._sync()
        peak = self.torch.cuda.max_memory_allocated() if self.cuda else None
        # `cache` from transformers 5.2x on (`past_key_values` then deprecated)
        cache = getattr(out, "cache", None)
        cache = out.past_key_values if cache is None else cache
        return self._new_tokens(out.sequences), cache_bytes(cache), peak


def cache_bytes(cache: Any) -> int:
    """Bytes of the key and value tensors of transformers' cache: `layers` with
    `.keys`/`.values` (transformers >= 4.56), `key_cache`/`value_cache` lists
    (before), or the legacy tuple of `(key, value)` per layer."""
    if hasattr(cache, "layers"):
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    elif hasattr(cache, "key_cache"):
        tensors = [*cache.key_cache, *cache.value_cache]
    else:
        tensors = [t for layer in cache for t in layer[:2]]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


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


def _environment(
    args: argparse.Namespace, jax: Any, torch: Any, transformers: Any
) -> dict:
    """The device, dtype, versions and date of the run."""
    cuda = args.device == "cuda"
    return {
        "device": args.device,
        "dtype": args.dtype,
        "device_kind": {
            "eqtrain": args.jax_device.device_kind,
            "transformers": torch.cuda.get_device_name() if cuda else "cpu",
        },
        "versions": {
            "jax": jax.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import jax
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
        "eqtrain": Eqtrain(ours, prompts, args.jax_device),
        "transformers": Transformers(theirs, prompts, torch, args.device),
    }
    for run in runners.values():  # compile (eqtrain) and warm up, untimed
        run(1)
        run(args.new)
    per_round: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    for r in range(args.rounds):
        for name in list(runners) if r % 2 == 0 else list(reversed(runners)):
            per_round[name].append(rates(runners[name], args))
        shown = {k: _rounded(v[-1]) for k, v in per_round.items()}
        print(f"round {r}: {shown}", file=sys.stderr)
    # after the timing: the tokens of a total run and what each side held for it
    a = np.asarray(runners["eqtrain"](args.new)[1])
    b, their_cache, their_peak = runners["transformers"].measured(args.new)
    cuda = args.device == "cuda"
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
        "config": args.config,
        **_environment(args, jax, torch, transformers),
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
        "cache_bytes_per_row": {
            "eqtrain": runners["eqtrain"].cache_bytes(args.new) // args.batch,
            "transformers": their_cache // args.batch,
        },
        "peak_device_bytes": {
            "eqtrain": runners["eqtrain"].peak_bytes() if cuda else None,
            "transformers": their_peak,
        },
        **med,
        "ratio": {k: round(statistics.median(v), 4) for k, v in paired.items()},
        "ratio_range": {
            k: [round(min(v), 4), round(max(v), 4)] for k, v in paired.items()
        },
        # each side's fastest round: the least disturbed on a shared machine
        "best": {name: _rounded(row, 5) for name, row in best.items()},
        "ratio_of_best": _ratios(best["eqtrain"], best["transformers"]),
    }


def default_device() -> str:
    """cuda where JAX's default backend is a GPU, else cpu. Without a GPU plugin
    for JAX (or with `JAX_PLATFORMS` naming no GPU) it answers without starting
    JAX's backends, so that `tune_cpu` can still set XLA's CPU flags."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not {"cuda", "gpu", "rocm"} & set(platforms.split(",")):
        return "cpu"
    try:
        import jax_plugins  # the namespace JAX's GPU plugins install into
    except ImportError:
        return "cpu"
    names = [m.name for m in pkgutil.iter_modules(jax_plugins.__path__)]
    if not any("cuda" in n or "rocm" in n for n in names):
        return "cpu"
    import jax

    return "cuda" if jax.default_backend() == "gpu" else "cpu"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default=None,
        help="cpu or cuda (default: cuda where JAX's default backend is a GPU)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default=None,
        help="both models' dtype (default: float32 on cpu, bfloat16 on cuda)",
    )  # fmt: skip
    parser.add_argument(
        "--config", choices=("llama", "1b"), default=None,
        help="llama: hidden 512, 4 layers (cpu default); 1b: Llama 3.2 1B's "
        "shape at random init (cuda default)",
    )  # fmt: skip
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
        default=None,
        help="eqtrain.cpu.tune_cpu() first, as the eqtrain command does "
        "(default: on cpu, not on cuda)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny smoke test")
    args = parser.parse_args(argv)
    cuda = (args.device or default_device()) == "cuda"
    args.device = "cuda" if cuda else "cpu"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.tune_cpu = not cuda if args.tune_cpu is None else args.tune_cpu
    if args.quick:
        args.config = "quick"
    args.config = args.config or ("1b" if cuda else "llama")
    preset = CONFIGS[args.config]
    args.rounds = args.rounds or (1 if args.quick else 3)
    for name in ("batch", "prompt", "new", "hidden", "layers", "vocab"):
        setattr(args, name, getattr(args, name) or preset[name])
    args.intermediate = preset.get("intermediate", args.hidden * 11 // 4)
    args.heads = preset.get("heads", max(1, args.hidden // 64))
    args.kv_heads = preset.get("kv_heads", args.heads)
    args.tie = preset.get("tie", False)
    args.rope_theta = preset.get("rope_theta")
    return args


def _jax_device(kind: str) -> Any:
    """The JAX device eqtrain runs on: the first GPU or the CPU."""
    import jax

    platform = "gpu" if kind == "cuda" else "cpu"
    try:
        return jax.devices(platform)[0]
    except RuntimeError as e:
        sys.exit(
            f"--device {kind}: JAX has no {platform} backend ({e}); install jax[cuda]"
        )


def main(argv: list[str] | None = None) -> None:
    import jax

    args = parse_args(argv)
    args.cpu_settings = eqtrain.cpu.tune_cpu() if args.tune_cpu else []
    print_machine()  # the processor and settings: figures are per machine
    args.jax_device = _jax_device(args.device)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.exit("--device cuda: torch sees no CUDA device")
    # only where JAX's default is another device (--device cpu on a GPU host)
    other = args.jax_device != jax.devices()[0]
    with jax.default_device(args.jax_device) if other else contextlib.nullcontext():
        record = benchmark(args)
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
