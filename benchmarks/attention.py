"""One layer's causal attention, forward and backward, by kernel: XLA's causal
blocks (the default past 128 tokens), flash blocks (`attention_impl="flash"`,
`eqtrain.models._flash`) and one masked XLA call over the whole sequence, at
several sequence lengths, with the heads of `benchmarks/models.py`'s Llama
(4 heads of 64; a batch of rows `vmap`ped as the losses do); and, where torch
is installed, torch's `scaled_dot_product_attention` (causal) on the same
inputs as transformers' Llama passes them (`[b, t, n, d]` viewed as `[b, n, t,
d]`), the attention `benchmarks/models.py` compares against.

On a GPU (`--kernels blocks,pallas,cudnn --dtype bfloat16`) the same walk
times eqtrain's Pallas flash kernels (`attention_impl="pallas"`, Triton) and
cuDNN's fused kernel; `--softcap` and `--window` give Gemma 2's scores (which
cuDNN cannot take) and `--heads`/`--kv-heads`/`--head-dim` a model's heads
(Llama 3.2 1B: 32, 8, 64). Each record then also holds every kernel's
compiled memory (`{kernel}_bytes`: XLA's plan of temporaries for the call),
and `{kernel}_vs_blocks` for every kernel timed.

Rounds alternate the kernels in one process (the machine's noise hits all of
them alike); it prints one JSON line per sequence length:

    {"seq", "batch", "blocks_ms", "flash_ms", "one_call_ms", "torch_ms",
     "flash_vs_blocks", "one_call_vs_blocks", "blocks_vs_torch",
     "cpu_products", "rounds"}

with each kernel's median time of the gradient of the summed squares (ms per
call), the ratios of the blocks' time to the others' (> 1: faster than the
causal blocks), and of torch's time to the blocks' (> 1: the blocks faster).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/attention.py [--seqs 256,1024]
        [--batch 4] [--rounds 5] [--quick]
    python3 benchmarks/attention.py --kernels blocks,pallas,cudnn --dtype bfloat16 \
        --heads 32 --kv-heads 8 --seqs 2048,8192 --batch 8 --no-torch   # a GPU
    python3 benchmarks/attention.py --kernels blocks,pallas --dtype bfloat16 \
        --heads 8 --kv-heads 4 --head-dim 256 --softcap 50 --window 4096 \
        --seqs 2048,8192 --batch 8 --no-torch       # Gemma 2's scores on a GPU
"""

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from _machine import print_machine

import eqtrain
from eqtrain.models._attention import attention, one_call_attention


HEADS, KV_HEADS, HEAD_DIM = 4, 4, 64
KERNELS = {
    "blocks": None,
    "flash": "flash",
    "one_call": "one_call",
    "pallas": "pallas",
    "cudnn": "cudnn",
}
"""The kernels by name (`--kernels`): `attention`'s `implementation`, or
`one_call` (one masked XLA call over the whole sequence)."""
DEFAULT_KERNELS = ("blocks", "flash", "one_call")
"""The CPU's comparison (the Pallas kernels run interpreted there; cuDNN
needs a GPU)."""


def _kernel(impl: str | None, args: argparse.Namespace) -> Callable[..., Any]:
    """`jax.grad` of one layer's attention over a batch, compiled by
    `eqtrain.jit` as a training step is (with oneDNN's products where
    `tune_cpu` chose them and the step admits them: `cpu_products`)."""
    kw = dict(segment_ids=None, sliding_window=args.window)
    score = dict(softcap=args.softcap)

    def one(q: Any, k: Any, v: Any) -> Any:
        if impl == "one_call":  # the whole sequence, masked, in one call
            return one_call_attention(q, k, v, implementation=None, **kw, **score)
        return attention(q, k, v, implementation=impl, **kw, **score)

    def loss(q: Any, k: Any, v: Any) -> Any:
        return jnp.sum(jax.vmap(one)(q, k, v) ** 2)

    grad = jax.grad(loss, (0, 1, 2))
    compiled = eqtrain.jit(
        lambda state, qkv: grad(*qkv), donate=False,
        compiler_options=eqtrain.cpu.step_options(),
    )  # fmt: skip
    none = jnp.zeros(())

    def call(q: Any, k: Any, v: Any) -> Any:
        return compiled(none, (q, k, v))

    call.compiled = compiled  # type: ignore[attr-defined]
    return call


def _inputs(batch: int, seq: int, args: argparse.Namespace) -> tuple[Any, ...]:
    keys = jr.split(jr.key(0), 3)
    heads = (args.heads, args.kv_heads, args.kv_heads)
    shapes = [(batch, seq, h, args.head_dim) for h in heads]
    return tuple(
        jr.normal(key, shape).astype(args.dtype)
        for key, shape in zip(keys, shapes, strict=True)
    )


def _temporaries(fn: Callable[..., Any], inputs: tuple[Any, ...]) -> int | None:
    """XLA's plan of temporary bytes for one call of a kernel's step."""
    try:
        lowered = fn.compiled.lower(jnp.zeros(()), inputs)  # type: ignore[attr-defined]
        stats = lowered.compile().memory_analysis()
    except Exception:  # a backend without the analysis  # noqa: BLE001
        return None
    return None if stats is None else int(stats.temp_size_in_bytes)


def _time(fn: Callable[..., Any], args: tuple[Any, ...], calls: int) -> float:
    """Milliseconds per call (the device waited for once at the end)."""
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) * 1e3 / calls


def _torch_kernel(inputs: tuple[Any, ...]) -> Callable[[], Any]:
    """One call of torch's causal SDPA, forward and backward, on `inputs` as
    transformers' Llama passes them (`[b, t, n, d]` transposed to `[b, n, t,
    d]` views)."""
    import torch

    leaves = [torch.from_numpy(np.array(x)).requires_grad_() for x in inputs]

    def call() -> Any:
        q, k, v = (x.transpose(1, 2) for x in leaves)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        (out**2).sum().backward()
        grads = [x.grad for x in leaves]
        for x in leaves:
            x.grad = None
        return grads

    return call


def measure(seq: int, args: argparse.Namespace) -> dict[str, Any]:
    inputs = _inputs(args.batch, seq, args)
    fns: dict[str, Callable[..., Any]] = {
        name: _kernel(KERNELS[name], args) for name in args.kernels
    }
    if not args.no_torch:
        call = _torch_kernel(inputs)
        fns["torch"] = lambda *_: call()
    for fn in fns.values():  # compile and warm up
        jax.block_until_ready(fn(*inputs))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(args.rounds):
        order = list(fns) if r % 2 == 0 else list(reversed(fns))
        for name in order:
            times[name].append(_time(fns[name], inputs, args.calls))
    ms = {name: statistics.median(t) for name, t in times.items()}
    record: dict[str, Any] = {
        "seq": seq, "batch": args.batch,
        **{f"{name}_ms": round(t, 2) for name, t in ms.items()},
    }  # fmt: skip
    if "blocks" in ms:
        for name in ms:
            if name not in ("blocks", "torch"):
                record[f"{name}_vs_blocks"] = round(ms["blocks"] / ms[name], 3)
    if args.kernels != DEFAULT_KERNELS:  # another device's run: the memory too
        record |= {
            "dtype": args.dtype, "heads": [args.heads, args.kv_heads, args.head_dim],
            "softcap": args.softcap, "window": args.window,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            **{f"{name}_bytes": _temporaries(fn, inputs)
               for name, fn in fns.items() if name != "torch"},
        }  # fmt: skip
    if "torch" in ms:
        record["blocks_vs_torch"] = round(ms["torch"] / ms["blocks"], 3)
    record["cpu_products"] = {
        name: fn.compiled.compile_note for name, fn in fns.items() if name != "torch"
    }
    return {**record, "rounds": args.rounds}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="256,1024,2048", help="sequence lengths")
    parser.add_argument("--batch", type=int, default=4, help="rows per call")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3, help="calls per timing")
    parser.add_argument("--quick", action="store_true", help="tiny smoke test")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's SDPA")
    parser.add_argument(
        "--kernels",
        default=",".join(DEFAULT_KERNELS),
        help=f"comma-separated, of {sorted(KERNELS)}",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--heads", type=int, default=HEADS)
    parser.add_argument("--kv-heads", type=int, default=KV_HEADS)
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    parser.add_argument("--softcap", type=float, default=None, help="Gemma 2: 50")
    parser.add_argument("--window", type=int, default=None, help="a sliding window")
    args = parser.parse_args(argv)
    args.kernels = tuple(k.strip() for k in args.kernels.split(",") if k.strip())
    unknown = sorted(set(args.kernels) - set(KERNELS))
    if unknown:
        parser.error(f"--kernels: unknown {unknown}; known: {sorted(KERNELS)}")
    if importlib.util.find_spec("torch") is None:
        args.no_torch = True
    if args.quick:
        args.seqs, args.batch, args.rounds, args.calls = "160", 1, 1, 1
        args.no_torch = True
    args.seqs = [int(s) for s in args.seqs.split(",")]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    eqtrain.cpu.tune_cpu()
    print_machine()
    for seq in args.seqs:
        print(json.dumps(measure(seq, args)), flush=True)


if __name__ == "__main__":
    main()
