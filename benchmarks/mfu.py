"""Training throughput and MFU (model FLOPs utilisation) of `eqtrain.models.Llama`
on the local accelerators.

Two sizes, each trained the way a run on a GPU would train it:

- `125m`: hidden 768, 12 layers, 12 heads, MLP 2048, vocab 32000 (134M parameters);
- `1b`: Llama 3.2 1B's body (hidden 2048, 16 layers, 32 query and 8 K/V heads,
  MLP 8192) with an untied 32000-id vocabulary (1.10B parameters).

How:

- precision: `eqtrain.train_step(loss, optax.adamw(...), precision="bf16")`:
  parameters, gradients and AdamW's moments stay f32 (master weights) and the
  forward and backward run in bf16, cast inside the differentiated function: the
  documented mixed-precision path (docs/steps.md; `eqtrain fit`'s
  `loop.precision = "bf16"`). `--param-dtype bfloat16` stores bf16 parameters;
- attention: the models' default, `attention_impl="auto"`: cuDNN's fused kernel
  on CUDA GPUs for bf16 heads of 8 to 128 without a soft-cap, eqtrain's Pallas
  flash kernels for soft-capped scores (Gemma 2) and other heads, XLA's on the
  CPU; `--attention` names one instead (`pallas`, `flash`, `cudnn`, `xla`);
- loss: `losses.chunked_causal_lm_loss_fn(chunk=--loss-chunk)` against
  `model.features` and `model.head_weight()`, so the `[tokens, 32000]` logits
  never exist at once (`--loss-chunk 0`: the plain loss);
- FSDP over all local devices: `sharding.make_mesh({"fsdp": -1},
  devices=jax.local_devices())`, the model's rules (`sharding.rules_for`), the
  state's shardings (`sharding.state_shardings`), batches of random tokens over
  the same axis (`sharding.batch_sharding`). The step is `eqtrain.jit(step,
  shardings=...)` (donating), compiled ahead of time from the abstract state
  (`Jitted.lower`), and the state is then built by a jitted init straight onto
  its shardings;
- remat: `--remat auto` (the default) takes the first of `none`, `dots_no_batch`,
  `full` whose compiled step fits the device by XLA's memory plan (remat's
  recomputation is not model FLOPs: less of it, more MFU); or name a preset.

Each model is compiled, warmed up (`--warmup` steps), then timed over `--rounds`
runs of `--steps` steps with no host sync inside a run (one wait at its end);
`step_ms` is the median over rounds. FLOPs per token are
`eqtrain.models.llama.flops_per_token(config, seq)` (PaLM's `6 N + 12 L H d T`,
attention not halved for causality). MFU = flops_per_token x tokens_per_s /
(devices x peak), with the device's dense bf16 peak from `eqtrain.hooks.peak_flops`
(the vendors' datasheets: H100 SXM and H200 989, H100 PCIe 756, A100 312, L4 121,
A10G ~70, TPU v4 275, v5e 197, v5p 459 TFLOP/s); an unknown kind (a CPU) gives
`mfu: null` unless `--peak-tflops` gives it. One JSON line per model:

    {"model", "params", "devices", "device_kind", "batch", "seq", "dtype",
     "param_dtype", "attention", "remat", "loss_chunk", "steps", "rounds",
     "compile_s", "step_ms", "tokens_per_s", "flops_per_token",
     "model_tflops_per_s_per_device", "peak_tflops_per_device", "mfu",
     "step_bytes_per_device"}

(`step_bytes_per_device`: XLA's plan for the compiled step: state, batch and
temporaries). Per-round times and the last loss go to stderr.

The goal: MFU >= 50% for the 1B model on one H100 (MaxText publishes 46.5% for
Llama2-70B on H100s). The figures are recorded in docs/performance.md, "MFU on
accelerators".

Usage:

    .venv/bin/python benchmarks/mfu.py [--model 1b|125m|both] [--batch B]
        [--seq 2048] [--steps 10] [--warmup 3] [--rounds 3] [--remat auto]
        [--loss-chunk 256] [--attention auto|cudnn|pallas|flash|xla]
        [--param-dtype float32]
        [--peak-tflops T]
    .venv/bin/python benchmarks/mfu.py --quick     # CPU smoke test, ~10 s

`--batch` is global (default: 8 rows per device for `1b`, 16 for `125m`). One
process, its local devices: no multi-host runs. `--quick` trains a 0.14M-parameter
Llama on 64-token rows (2 steps, 1 round; on a CPU over two simulated devices, so
that FSDP really splits the state): the same mesh, sharding, precision, chunked
loss and record. On a CUDA machine it goes through cuDNN too (head size 16), a
check of that path in seconds.
"""

import os

from _machine import print_machine


# JAX preallocates 75% of a GPU's memory by default; the 1B step wants more.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import eqtrain  # noqa: E402
from eqtrain import hooks, losses, sharding  # noqa: E402
from eqtrain.models import Llama, LlamaConfig, archs, llama, num_params  # noqa: E402


MODELS = {
    "125m": LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
    ),
    "1b": LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
    ),
}
QUICK = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
ROWS_PER_DEVICE = {"125m": 16, "1b": 8, "quick": 2}  # --batch's default
# `--remat auto`: the first preset whose compiled step fits the device (by XLA's
# memory plan, within FIT of the allocator's limit). Remat's recomputation is not
# model FLOPs, so less of it is more MFU.
REMAT_LADDER = ("none", "dots_no_batch", "full")
FIT = 0.95
OPTIMIZER = optax.adamw(3e-4, weight_decay=0.1)


def is_cuda(device: Any) -> bool:
    """A CUDA GPU (where cuDNN's fused attention exists; not ROCm, not a CPU)."""
    version = str(getattr(getattr(device, "client", None), "platform_version", ""))
    return device.platform == "gpu" and "rocm" not in version.lower()


def attention_impl(choice: str, device: Any) -> str | None:
    """`attention_impl` for `LlamaConfig` (`auto`: the library's choice,
    `eqtrain.models._attention.resolved_implementation`)."""
    if choice == "cudnn" and not is_cuda(device):
        sys.exit(f"--attention cudnn needs a CUDA GPU; this is {device.platform}.")
    return None if choice == "xla" else choice


def attention_kernel(config: LlamaConfig) -> str:
    """The kernel the step's attention runs (`auto` resolved for bf16 heads
    of the config's size)."""
    from eqtrain.models._attention import resolved_implementation

    chosen = resolved_implementation(
        config.attention_impl,
        jnp.bfloat16,
        config.head_size,
        config.attn_logit_softcapping,
    )
    return chosen or "xla"


def compiled_step(
    config: LlamaConfig, args: argparse.Namespace, mesh: Any, batch: Any
) -> tuple[Any, Any, Any]:
    """The training step for `config`, compiled for its FSDP-sharded state
    (`eqtrain.jit(...).lower` of the abstract state: nothing is allocated), the
    state's shardings and its abstract value."""
    init = state_init(config)
    abstract = eqx.filter_eval_shape(init)
    rules = sharding.rules_for(abstract.model, mesh)
    state_sh = sharding.state_shardings(abstract, mesh, rules, optimizer=OPTIMIZER)
    loss_fn = losses.causal_lm_loss
    if args.loss_chunk:
        loss_fn = losses.chunked_causal_lm_loss_fn(chunk=args.loss_chunk)
    step = eqtrain.jit(
        eqtrain.train_step(loss_fn, OPTIMIZER, precision="bf16"),
        shardings=(state_sh, sharding.batch_sharding(mesh)),
    )
    return step.lower(abstract, batch).compile(), state_sh, abstract


def state_init(config: LlamaConfig) -> Any:
    """`init() -> TrainState`: a fresh model and AdamW state."""
    return lambda: eqtrain.TrainState.create(Llama(config, jr.key(0)), OPTIMIZER, key=0)


def init_arrays(config: LlamaConfig, state_sh: Any) -> list[jax.Array]:
    """The initial state's array leaves (the compiled step's flat input), made by a
    jitted init straight onto their FSDP shardings: no device ever holds the
    whole f32 state."""
    init = state_init(config)
    make = jax.jit(lambda: eqx.filter(init(), eqx.is_array), out_shardings=state_sh)
    return jax.tree_util.tree_leaves(make())


def make_batches(
    vocab: int, batch: int, seq: int, batch_sh: Any, n: int = 2
) -> list[dict[str, jax.Array]]:
    """`n` batches of random tokens, placed on the devices before timing."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, vocab, (batch, seq + 1), dtype=np.int32)
        rows = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
        out.append(jax.device_put(rows, batch_sh))
    return out


def run_steps(compiled: Any, arrays: list, batches: list, n: int) -> tuple:
    """`n` steps on the state's flat arrays, dispatched back to back with one wait
    at the end; the new arrays, the last metrics and the seconds taken."""
    start = time.perf_counter()
    metrics = None
    for i in range(n):
        arrays, metrics = compiled(arrays, batches[i % len(batches)])
    jax.block_until_ready((arrays, metrics))
    return arrays, metrics, time.perf_counter() - start


def step_bytes(compiled: Any) -> int | None:
    """Per-device bytes of the compiled step: its arguments, outputs that are not
    donated buffers reused, and temporaries (XLA's plan, before running)."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    out = m.output_size_in_bytes - m.alias_size_in_bytes
    return int(m.argument_size_in_bytes + out + m.temp_size_in_bytes)


def memory_limit(device: Any) -> int | None:
    """The device allocator's limit in bytes (None where unknown: a CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return None if not stats else stats.get("bytes_limit")


def compile_fitting(
    name: str, args: argparse.Namespace, mesh: Any, batch: Any
) -> tuple[LlamaConfig, Any, Any, Any]:
    """The first remat preset of `--remat` (`auto`: `REMAT_LADDER`) whose compiled
    step fits the device's memory (the last one regardless): its config, compiled
    step, state shardings and abstract state."""
    device = mesh.devices.flat[0]
    remats = REMAT_LADDER if args.remat == "auto" else (args.remat,)
    limit = memory_limit(device)
    for i, remat in enumerate(remats):
        config = dataclasses.replace(model_config(name, args, device), remat=remat)
        compiled, state_sh, abstract = compiled_step(config, args, mesh, batch)
        need = step_bytes(compiled)
        if i == len(remats) - 1 or None in (limit, need) or need <= FIT * limit:
            return config, compiled, state_sh, abstract
        print(
            f"{name}: remat {remat!r} needs {need / 2**30:.1f} GiB of "
            f"{limit / 2**30:.1f} GiB; trying {remats[i + 1]!r}",
            file=sys.stderr,
        )
    raise AssertionError("unreachable: the last preset is returned")


def base_config(name: str) -> LlamaConfig:
    return QUICK if name == "quick" else MODELS[name]


def family_config(config: LlamaConfig, family: str, seq: int) -> LlamaConfig:
    """`config`'s shape as architecture `family` (a model type of
    `eqtrain.models.archs.ARCHS`): its switches, and the attention pattern its
    checkpoints use, with windows of a quarter of the sequence (Mistral and
    StarCoder2 on every layer, Gemma 2 on every other one, Gemma 3 on five of
    six)."""
    arch = archs.ARCHS[family]
    config = dataclasses.replace(config, model_type=family, hidden_act=arch.act[1])
    config = dataclasses.replace(config, **arch.fixed(config))
    layers = config.num_hidden_layers
    every = {"gemma2": 2, "gemma3_text": 6}.get(family)
    if every:
        types = tuple(
            "sliding_attention" if (i + 1) % every else "full_attention"
            for i in range(layers)
        )
        config = dataclasses.replace(config, layer_types=types)
    if every or family in ("mistral", "starcoder2"):
        config = dataclasses.replace(config, sliding_window=seq // 4)
    if family == "gemma2":
        config = dataclasses.replace(
            config, attn_logit_softcapping=50.0, final_logit_softcapping=30.0
        )
    return config


def model_config(name: str, args: argparse.Namespace, device: Any) -> LlamaConfig:
    """The benchmarked configuration: the size's shape with this run's options
    (and `--family`'s architecture). cuDNN has no soft-capped scores: under
    `--attention auto` Gemma 2's attention runs through the Pallas kernels."""
    config = base_config(name)
    if args.family != "llama":
        config = family_config(config, args.family, args.seq)
    choice = args.attention
    return dataclasses.replace(
        config,
        max_position_embeddings=args.seq,
        param_dtype=args.param_dtype,
        attention_impl=attention_impl(choice, device),
    )


def benchmark(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Compile, warm up and time one model; its JSON record."""
    devices = jax.local_devices()
    batch = args.batch or ROWS_PER_DEVICE[name] * len(devices)
    mesh = sharding.make_mesh({"fsdp": -1}, devices=devices)
    sharding.check_batch(batch, mesh)
    vocab = base_config(name).vocab_size
    data = make_batches(vocab, batch, args.seq, sharding.batch_sharding(mesh))
    start = time.perf_counter()
    config, compiled, state_sh, abstract = compile_fitting(name, args, mesh, data[0])
    compile_s = time.perf_counter() - start
    arrays = init_arrays(config, state_sh)
    arrays, _, _ = run_steps(compiled, arrays, data, args.warmup)
    seconds = []
    for _ in range(args.rounds):
        arrays, metrics, s = run_steps(compiled, arrays, data, args.steps)
        seconds.append(s)
    step_ms = [1e3 * s / args.steps for s in seconds]
    loss = float(metrics["loss"])
    print(
        f"{name}: ms per step, per round: {[round(x, 2) for x in step_ms]}; "
        f"loss {loss:.4f}",
        file=sys.stderr,
    )
    if not math.isfinite(loss):
        sys.exit(f"{name}: the loss is {loss}; the step is broken.")
    return {
        "model": name,
        "family": args.family,
        "params": num_params(abstract.model),
        "devices": len(devices),
        "device_kind": devices[0].device_kind,
        "batch": batch,
        "seq": args.seq,
        "dtype": "bfloat16",
        "param_dtype": config.param_dtype,
        "attention": attention_kernel(config),
        "remat": config.remat,
        "loss_chunk": args.loss_chunk,
        "steps": args.steps,
        "rounds": args.rounds,
        "compile_s": round(compile_s, 2),
        **throughput(config, args, devices, batch, statistics.median(step_ms)),
        "step_bytes_per_device": step_bytes(compiled),
    }


def throughput(
    config: LlamaConfig,
    args: argparse.Namespace,
    devices: list[Any],
    batch: int,
    step_ms: float,
) -> dict[str, Any]:
    """The record's speed and MFU fields for a median step of `step_ms`."""
    tokens_per_s = batch * args.seq / (step_ms / 1e3)
    flops = llama.flops_per_token(config, args.seq)
    achieved = flops * tokens_per_s / len(devices) / 1e12
    peak = args.peak_tflops
    if peak is None:
        known = hooks.peak_flops(devices[0], "bfloat16")  # None for a CPU
        peak = None if known is None else known / 1e12
    return {
        "step_ms": round(step_ms, 3),
        "tokens_per_s": round(tokens_per_s, 1),
        "flops_per_token": flops,
        "model_tflops_per_s_per_device": float(f"{achieved:.4g}"),
        "peak_tflops_per_device": None if peak is None else round(peak, 1),
        "mfu": None if peak is None else float(f"{achieved / peak:.4g}"),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["1b", "125m", "both"], default="both")
    parser.add_argument("--batch", type=int, default=None, help="global rows")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row")
    parser.add_argument("--steps", type=int, default=None, help="timed steps a round")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--remat",
        default="auto",
        help="a REMAT_PRESETS name, or auto (see REMAT_LADDER)",
    )
    parser.add_argument(
        "--loss-chunk", type=int, default=None, help="tokens per chunk; 0: plain loss"
    )
    parser.add_argument(
        "--attention",
        choices=["auto", "cudnn", "pallas", "flash", "xla"],
        default="auto",
    )
    parser.add_argument(
        "--param-dtype", choices=["float32", "bfloat16"], default="float32"
    )
    parser.add_argument(
        "--peak-tflops", type=float, default=None, help="dense peak of one device"
    )
    parser.add_argument(
        "--family",
        default="llama",
        help="a model type of eqtrain.models.archs.ARCHS (the size's shape with "
        "that architecture's switches), a comma-separated list, or all",
    )
    parser.add_argument("--quick", action="store_true", help="tiny CPU smoke test")
    args = parser.parse_args(argv)
    quick = args.quick
    args.seq = args.seq or (64 if quick else 2048)
    args.steps = args.steps or (2 if quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if quick else 3)
    args.rounds = args.rounds or (1 if quick else 3)
    if args.loss_chunk is None:
        args.loss_chunk = 32 if quick else 256
    return args


def main(argv: list[str] | None = None) -> None:
    print_machine()  # the processor and settings: figures are per machine
    args = parse_args(argv)
    if args.quick:
        # Two CPU devices, so that FSDP really splits the state; no effect on a
        # GPU or TPU backend. Set before JAX touches a device.
        jax.config.update("jax_num_cpu_devices", 2)
    names = ["quick"] if args.quick else ["125m", "1b"]
    if not args.quick and args.model != "both":
        names = [args.model]
    families = list(archs.ARCHS) if args.family == "all" else args.family.split(",")
    unknown = sorted(set(families) - set(archs.ARCHS))
    if unknown:
        sys.exit(f"--family: unknown {unknown}; the families are {list(archs.ARCHS)}.")
    for name in names:
        for family in families:
            args.family = family
            print(json.dumps(benchmark(name, args)), flush=True)


if __name__ == "__main__":
    main()
