"""One layer's causal attention, forward and backward, by kernel: XLA's causal
blocks (the default past 128 tokens), flash blocks (`attention_impl="flash"`,
`eqtrain.models._flash`) and one masked XLA call over the whole sequence, at
several sequence lengths, with the heads of `benchmarks/models.py`'s Llama
(4 heads of 64; a batch of rows `vmap`ped as the losses do); and, where torch
is installed, torch's `scaled_dot_product_attention` (causal) on the same
inputs as transformers' Llama passes them (`[b, t, n, d]` viewed as `[b, n, t,
d]`), the attention `benchmarks/models.py` compares against.

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
KERNELS = {"blocks": None, "flash": "flash", "one_call": "one_call"}


def _kernel(impl: str | None) -> Callable[..., Any]:
    """`jax.grad` of one layer's attention over a batch, compiled by
    `eqtrain.jit` as a training step is (with oneDNN's products where
    `tune_cpu` chose them and the step admits them: `cpu_products`)."""
    kw = dict(segment_ids=None, sliding_window=None)

    def one(q: Any, k: Any, v: Any) -> Any:
        if impl == "one_call":  # the whole sequence, masked, in one call
            return one_call_attention(q, k, v, implementation=None, **kw)
        return attention(q, k, v, implementation=impl, **kw)

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


def _inputs(batch: int, seq: int) -> tuple[Any, ...]:
    keys = jr.split(jr.key(0), 3)
    shapes = [(batch, seq, h, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS)]
    return tuple(jr.normal(key, shape) for key, shape in zip(keys, shapes, strict=True))


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
    inputs = _inputs(args.batch, seq)
    fns: dict[str, Callable[..., Any]] = {
        name: _kernel(impl) for name, impl in KERNELS.items()
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
    record = {
        "seq": seq, "batch": args.batch,
        **{f"{name}_ms": round(t, 2) for name, t in ms.items()},
        "flash_vs_blocks": round(ms["blocks"] / ms["flash"], 3),
        "one_call_vs_blocks": round(ms["blocks"] / ms["one_call"], 3),
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
    args = parser.parse_args(argv)
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
