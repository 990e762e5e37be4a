"""QLoRA: what a frozen base in 4 or 8 bits saves (bytes per parameter, a dry
run's memory per device, peak host memory of a quantizing load) and what it
costs (step time), measured in one run.

Subcommands (each prints the machine first, then one JSON line per measurement):

- `bytes`: bytes per parameter of the quantized base weights, nf4 (with and
  without double quantization), fp4 and int8 against bf16 (2 bytes), on the
  linear layers of Llama-3.1-8B and of Qwen3-30B-A3B (their published
  config.json's shapes; the models are built abstractly, `quantize.apply` on
  `ShapeDtypeStruct`s, `quantize.quantized_bytes`), with the whole model's size
  (embeddings, head and norms stay bf16). One real-shaped tensor (q_proj,
  4096 x 4096, random) is also quantized for real, and its
  `QuantizedWeight.nbytes` checked against the abstract count.

      {"part": "bytes", "model", "kind", "double", "params", "bytes",
       "bytes_per_param", "bits_per_param", "vs_bf16", "model_gib", "model_vs_bf16"}

- `dry-run`: `eqtrain fit --dry-run`'s peak memory per device (the compiled
  step's, XLA's memory analysis) for a Llama-3.1-8B-shaped and a
  Qwen3-30B-A3B-shaped model given as `--set model.*` keys (random weights,
  nothing downloaded; the default `stdlib` data and byte tokenizer), LoRA rank
  16 on the default targets, data.seq_len 2048, batch 1, model.remat = "full",
  model.param_dtype = "bfloat16", a bf16 base against model.quantize = "nf4".
  Each dry run is a fresh `eqtrain fit` process; its wall time and its own peak
  RSS are recorded. (Llama 3.1's llama3 rope scaling has no `[model]` key; it
  changes no buffer.)

      {"part": "dry-run", "model", "quantize", "ok", "peak_gib", "parameters_gib",
       "optimizer_state_gib", "gradients_gib", "activations_gib", "params_line",
       "fits_24gib", "wall_s", "process_peak_rss_gib", "command"}
      {"part": "dry-run-ratio", "model", "nf4_over_bf16_peak", ...}

- `step`: a LoRA training step (rank 16, AdamW, `eqtrain.train_step` under
  `eqtrain.jit`, `tune_cpu` applied first as the CLI does) of a small Llama
  (hidden 512, 8 layers, bf16 parameters) with its base in nf4 against the
  same base in bf16; the two alternate within a round, the ratio is the median
  of per-round ratios nf4 / bf16 (> 1: the quantized step is slower).

      {"part": "step", "config", "bf16_ms", "nf4_ms", "ratio", "ratio_range",
       "rounds", "first_loss", "temp_mib", "model_mib", ...}

- `import-rss`: a random bf16 Llama (hidden 1024, intermediate 4096, 16 layers,
  vocabulary 32000: ~670 MB) is exported as safetensors to a temporary
  directory (in a subprocess), then read by `eqtrain.hf.load(dir,
  quantize=Quantize("nf4"))` in a fresh process, and by a plain `hf.load(dir)`
  in another: the process's `ru_maxrss` before (JAX and eqtrain imported, the
  CPU backend started) and after the load. `ratio` is "peak above baseline /
  (quantized size + largest tensor)", the quantized size being the loaded
  model's arrays (quantized linear layers, bf16 embedding, head and norms);
  about 1 is what the loader promises (the model and one tensor at a time).

      {"part": "import-rss", "bf16_mb", "quantized_mb", "largest_tensor_mb",
       "baseline_mb", "peak_mb", "above_baseline_mb", "ratio",
       "plain_above_baseline_mb", "plain_ratio", "load_s", "plain_load_s"}

- `codes`: the nf4 codes of one random bf16 tensor (Llama-3.1-8B's q_proj,
  4096 x 4096, and down_proj, 4096 x 14336) as eqtrain makes them (pieces of
  rows on a thread per core, a comparison per codebook midpoint) against the
  one-thread binary search it used before (`codes_one_thread`); the bytes are
  checked equal first, then the two alternate in each round. `ratio` is the
  median of per-round ratios (> 1: faster now); `llama8b_linear_s` what the
  rate makes of Llama-3.1-8B's 6.98 B linear weights.

      {"part": "codes", "tensor", "shape", "threads", "one_thread_ms",
       "pieces_ms", "ratio", "ratio_range", "mvalues_per_s", "llama8b_linear_s"}

Usage (CPU):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/qlora.py bytes
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/qlora.py dry-run [--models llama8b]
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/qlora.py step [--rounds 5]
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/qlora.py import-rss
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/qlora.py codes [--rounds 5]
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/qlora.py [all]    # all five
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/qlora.py --quick  # smoke test
"""

import argparse
import json
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import print_machine


GIB = 1024**3
MB = 2**20
# A 24 GB card (an RTX 4090, an A10's 24 GB) holds 24 GiB: the issue's bound.
BUDGET_GIB = 24.0

# The published config.json values that shape the models (meta-llama/Llama-3.1-8B,
# Qwen/Qwen3-30B-A3B).
LLAMA_3_1_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
QWEN3_30B_A3B = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "router_aux_loss_coef": 0.001,
    "vocab_size": 151936,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "sliding_window": None,
    "use_sliding_window": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
# --quick: the same families, tiny bodies (rows of whole 64-value blocks)
QUICK_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}
MODELS = {
    "llama8b": LLAMA_3_1_8B,
    "qwen3_30b_a3b": QWEN3_30B_A3B,
}
QUICK_MODELS = {
    "llama8b": LLAMA_3_1_8B | QUICK_SHAPE,
    "qwen3_30b_a3b": QWEN3_30B_A3B
    | QUICK_SHAPE
    | {
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
    },
}


def models_for(quick: bool) -> dict[str, dict[str, Any]]:
    return QUICK_MODELS if quick else MODELS


def emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


# --- bytes ------------------------------------------------------------------------


def abstract_model(hf_config: dict[str, Any]) -> Any:
    """The model of a config.json, as `ShapeDtypeStruct`s in bf16 (nothing
    allocated)."""
    import equinox as eqx
    import jax.random as jr

    from eqtrain import models
    from eqtrain.hf import _maps

    model_type, config = _maps.eqtrain_config(hf_config, "config.json", "bfloat16")
    build = models.family(model_type).model
    return eqx.filter_eval_shape(build, config, jr.key(0))


def tree_bytes(tree: Any) -> int:
    import jax
    import numpy as np

    return int(
        sum(
            np.prod(x.shape) * x.dtype.itemsize
            for x in jax.tree.leaves(tree)
            if hasattr(x, "shape") and hasattr(x, "dtype")
        )
    )


KINDS = (("nf4", True), ("nf4", False), ("fp4", True), ("fp4", False), ("int8", False))


def run_bytes(args: argparse.Namespace) -> None:
    import jax.numpy as jnp
    import numpy as np

    from eqtrain import quantize
    from eqtrain._quant import abstract

    for name, hf_config in models_for(args.quick).items():
        model = abstract_model(hf_config)
        bf16_total = tree_bytes(model)
        for kind, double in KINDS:
            spec = quantize.Quantize(kind, double=double)
            q = quantize.apply(model, spec)
            qbytes, params = quantize.quantized_bytes(q)
            per = qbytes / params
            total = tree_bytes(q)
            emit(
                {
                    "part": "bytes",
                    "model": name,
                    "kind": kind,
                    "double": double,
                    "params": params,
                    "bytes": qbytes,
                    "bytes_per_param": round(per, 5),
                    "bits_per_param": round(8 * per, 3),
                    "vs_bf16": round(per / 2, 4),
                    "model_bytes": total,
                    "model_gib": round(total / GIB, 3),
                    "bf16_model_gib": round(bf16_total / GIB, 3),
                    "model_vs_bf16": round(total / bf16_total, 4),
                }
            )

    # One real tensor (Llama-3.1-8B's q_proj, 4096 x 4096; --quick 64 x 128),
    # quantized for real: its arrays' bytes are what the abstract count says.
    shape = (64, 128) if args.quick else (4096, 4096)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * 0.02, jnp.bfloat16)
    for kind, double in KINDS:
        start = time.perf_counter()
        real = quantize.quantize_array(w, kind, double=double)
        seconds = time.perf_counter() - start
        expected = abstract(shape, jnp.bfloat16, kind, double=double).nbytes
        error = np.asarray(real.dequantize(jnp.float32)) - np.asarray(w, np.float32)
        emit(
            {
                "part": "bytes-real",
                "shape": list(shape),
                "kind": kind,
                "double": double,
                "nbytes": real.nbytes,
                "matches_abstract": real.nbytes == expected,
                "bytes_per_param": round(real.nbytes / w.size, 5),
                "rms_error_over_rms": round(
                    float(np.sqrt((error**2).mean()) / np.asarray(w, np.float32).std()),
                    4,
                ),
                "quantize_s": round(seconds, 2),
            }
        )


# --- dry-run ----------------------------------------------------------------------


def model_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json's values as eqtrain's `[model]` keys."""
    keys = {
        "arch": hf["model_type"],
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf["intermediate_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf["num_key_value_heads"],
        "rope_theta": hf["rope_theta"],
        "norm_eps": hf["rms_norm_eps"],
        "tie_embeddings": hf["tie_word_embeddings"],
    }
    if "head_dim" in hf:
        keys["head_dim"] = hf["head_dim"]
    if hf.get("num_experts"):
        keys |= {
            "num_experts": hf["num_experts"],
            "experts_per_token": hf["num_experts_per_tok"],
            "expert_size": hf["moe_intermediate_size"],
            "norm_topk_prob": hf["norm_topk_prob"],
        }
    return keys


def set_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def dry_run_args(hf: dict[str, Any], quantize: str | None, seq: int) -> list[str]:
    keys = {f"model.{k}": v for k, v in model_keys(hf).items()}
    keys |= {
        "model.param_dtype": "bfloat16",
        "model.remat": "full",
        "lora.rank": 16,
        "lora.alpha": 32,
        "data.seq_len": seq,
        "data.batch_size": 1,
    }
    if quantize:
        keys["model.quantize"] = quantize
    out = []
    for k, v in keys.items():
        out += ["--set", f"{k}={set_value(v)}"]
    return out


UNITS = {"B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": GIB, "TiB": 1024**4}
PARTS = ("parameters", "optimizer state", "gradients", "activations", "peak")


def parse_memory(stdout: str) -> dict[str, Any]:
    """The dry run's memory per device (bytes, as printed: 3 digits) and its
    `model` line."""
    found: dict[str, Any] = {}
    for line in stdout.splitlines():
        m = re.match(r"\s+(\w[\w ]*?)\s{2,}([\d.]+) (B|KiB|MiB|GiB|TiB)\b", line)
        if m and m.group(1) in PARTS:
            key = m.group(1).replace(" ", "_") + "_bytes"
            found[key] = round(float(m.group(2)) * UNITS[m.group(3)])
        if line.startswith("model "):
            found["params_line"] = line[5:].strip()
    return found


def dry_run(
    name: str, hf: dict[str, Any], quantize: str | None, seq: int, root: Path
) -> dict[str, Any]:
    config = root / "run.toml"
    config.write_text(f"run_dir = {json.dumps(str(root / 'run'))}\nseed = 0\n")
    args = ["fit", str(config), "--dry-run", *dry_run_args(hf, quantize, seq)]
    cmd = [sys.executable, "-c", "from eqtrain.cli import main; main()", *args]
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # reaped here: its own rusage
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    record: dict[str, Any] = {
        "part": "dry-run",
        "model": name,
        "quantize": quantize or "bf16",
        "seq_len": seq,
        "ok": proc.returncode == 0,
        "wall_s": round(wall, 1),
        "process_peak_rss_gib": round(usage.ru_maxrss * 1024 / GIB, 2),
        "command": "eqtrain fit run.toml --dry-run " + shlex.join(args[3:]),
    }
    if proc.returncode != 0:
        record["error"] = (stdout[-1500:] + stderr[-4000:]).strip()
        return record
    memory = parse_memory(stdout)
    if "peak_bytes" not in memory:
        record["ok"] = False
        record["error"] = "no memory estimate in the output:\n" + stdout[-3000:]
        return record
    record |= memory
    for key in PARTS:
        key = key.replace(" ", "_")
        if f"{key}_bytes" in memory:
            record[f"{key}_gib"] = round(memory[f"{key}_bytes"] / GIB, 2)
    record["fits_24gib"] = memory["peak_bytes"] < BUDGET_GIB * GIB
    return record


def run_dry_run(args: argparse.Namespace) -> None:
    seq = 64 if args.quick else args.seq
    models = models_for(args.quick)
    # --quick: the mixture of experts alone (its experts quantized too); each
    # dry run is a fresh `eqtrain fit` process, ~10 s
    default = ["qwen3_30b_a3b"] if args.quick else list(models)
    names = args.models.split(",") if args.models else default
    with tempfile.TemporaryDirectory(prefix="qlora_dry_") as tmp:
        for name in names:
            peaks = {}
            for quantize in (None, "nf4"):
                record = dry_run(name, models[name], quantize, seq, Path(tmp))
                emit(record)
                if record["ok"]:
                    peaks[record["quantize"]] = record
            if len(peaks) == 2:
                bf16, nf4 = peaks["bf16"], peaks["nf4"]
                emit(
                    {
                        "part": "dry-run-ratio",
                        "model": name,
                        "nf4_over_bf16_peak": round(
                            nf4["peak_bytes"] / bf16["peak_bytes"], 4
                        ),
                        "nf4_over_bf16_parameters": round(
                            nf4["parameters_bytes"] / bf16["parameters_bytes"], 4
                        ),
                        "bf16_peak_gib": bf16["peak_gib"],
                        "nf4_peak_gib": nf4["peak_gib"],
                    }
                )


# --- step -------------------------------------------------------------------------


def run_step(args: argparse.Namespace) -> None:
    import equinox as eqx
    import jax
    import jax.random as jr
    import numpy as np
    import optax

    import eqtrain
    from eqtrain import lora, quantize
    from eqtrain.losses import causal_lm_loss
    from eqtrain.models import Llama, LlamaConfig, num_params

    if args.quick:
        hidden, layers, heads, kv, batch, seq = 64, 2, 4, 2, 2, 32
    else:
        hidden, layers, heads, kv = args.hidden, args.layers, 8, 4
        batch, seq = args.batch, args.seq
    config = LlamaConfig(
        vocab_size=259,  # the byte tokenizer's: the linear layers dominate
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=False,
        max_position_embeddings=seq,
        param_dtype="bfloat16",
    )
    opt = optax.adamw(1e-4)
    base = Llama(config, jr.key(0))
    copied = jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, base)
    quantized = quantize.apply(base, quantize.Quantize("nf4"))
    spec = lora.LoRA(rank=16, alpha=32)
    variants = {
        "bf16": lora.apply(copied, spec, key=jr.key(1)),
        "nf4": lora.apply(quantized, spec, key=jr.key(1)),
    }
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (batch, seq + 1), dtype=np.int32)
    data = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    runs: dict[str, list[Any]] = {}
    first_loss, temp = {}, {}
    for name, model in variants.items():
        state = eqtrain.TrainState.create(
            model, opt, key=0, trainable=lora.trainable(model)
        )
        step = eqtrain.jit(eqtrain.train_step(causal_lm_loss, opt))
        if not args.quick:  # a second compilation: seconds each
            compiled = step.lower(state, data).compile()
            temp[name] = round(compiled.memory_analysis().temp_size_in_bytes / MB, 1)
        for i in range(2):  # compile and warm up
            state, metrics = step(state, data)
            if i == 0:
                first_loss[name] = float(metrics["loss"])
        jax.block_until_ready(state)
        runs[name] = [step, state]
    model_mib = {
        name: round(
            sum(
                x.nbytes
                for x in jax.tree.leaves(m, is_leaf=quantize.is_quantized)
                if hasattr(x, "nbytes")
            )
            / MB,
            2,
        )
        for name, m in variants.items()
    }
    rounds = 2 if args.quick else args.rounds
    n = 1 if args.quick else args.steps
    times: dict[str, list[float]] = {"bf16": [], "nf4": []}
    for r in range(rounds):
        for name in ("bf16", "nf4") if r % 2 == 0 else ("nf4", "bf16"):
            step, state = runs[name]
            start = time.perf_counter()
            for _ in range(n):
                state, metrics = step(state, data)
            jax.block_until_ready(state)
            times[name].append((time.perf_counter() - start) / n)
            runs[name][1] = state
        said = ", ".join(f"{k} {v[-1]:.3f} s" for k, v in times.items())
        print(f"round {r}: {said}", file=sys.stderr, flush=True)
    ratios = [q / b for q, b in zip(times["nf4"], times["bf16"], strict=True)]
    emit(
        {
            "part": "step",
            "config": f"hidden {hidden}, {layers} layers, {heads} heads ({kv} kv), "
            f"intermediate {4 * hidden}, vocab 259, bf16 params",
            "params": num_params(base),
            "adapter_params": lora.num_adapter_params(variants["bf16"]),
            "batch": batch,
            "seq": seq,
            "bf16_ms": round(1e3 * statistics.median(times["bf16"]), 1),
            "nf4_ms": round(1e3 * statistics.median(times["nf4"]), 1),
            "ratio": round(statistics.median(ratios), 4),
            "ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
            "rounds": rounds,
            "steps_per_round": n,
            "first_loss": {k: round(v, 5) for k, v in first_loss.items()},
            "temp_mib": temp,
            "model_mib": model_mib,
        }
    )


# --- import-rss -------------------------------------------------------------------

IMPORT_CONFIGS = {
    # 334M parameters: 668 MB in bf16
    "full": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
    ),
    # Llama-3.1-8B's shapes (8.03B parameters: 16 GB in bf16), written tensor
    # by tensor without building the model (`write_streamed`)
    "8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    "quick": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    ),
}


# --- codes ------------------------------------------------------------------------


def codes_one_thread(x: Any, kind: str) -> tuple[Any, Any]:
    """A tensor's 4-bit codes and block maxima as eqtrain made them until
    2026-12-07, the reference the `codes` part times against: one piece of
    4M values after another on one thread, each value's code found by numpy's
    binary search over the codebook's midpoints (`np.searchsorted`)."""
    import numpy as np

    from eqtrain import _quant

    out, width = x.shape
    codes = np.empty((out, width // 2), np.uint8)
    absmax = np.empty((out, width // _quant.BLOCK), np.float32)
    mid, order = _quant._bounds(kind)
    rows = max(1, 2**22 // width)
    for r in range(0, out, rows):
        part = np.asarray(x[r : r + rows], np.float32)
        scaled, am = _quant._scaled(part.reshape(-1, _quant.BLOCK))
        q = order[np.searchsorted(mid, scaled.reshape(-1), side="left")]
        q = q.reshape(part.shape)
        codes[r : r + rows] = (q[:, 0::2] << 4) | q[:, 1::2]
        absmax[r : r + rows] = am.reshape(part.shape[0], -1)
    return codes, absmax


def llama8b_linear_values() -> int:
    """How many values Llama-3.1-8B's linear layers hold (what a quantizing
    load of it quantizes): attention's four projections and the MLP's three,
    per layer."""
    c = LLAMA_3_1_8B
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    layers = c["num_hidden_layers"]
    head = hidden // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head
    return layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter)


def run_codes(args: argparse.Namespace) -> None:
    """nf4 codes of one tensor: `_quant._tensor_4bit` (pieces on every core,
    a comparison per midpoint) against `codes_one_thread`, alternating in
    each round; the ratio is the median of per-round ratios (> 1: faster now).
    The two give the same bytes (checked first)."""
    import jax.numpy as jnp
    import numpy as np

    from eqtrain import _quant

    shapes = {"q_proj": (4096, 4096), "mlp_down": (4096, 14336)}
    if args.quick:
        shapes = {"quick": (256, 512)}
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        x = (rng.standard_normal(shape, np.float32) * 0.02).astype(jnp.bfloat16)
        ours, theirs = _quant._tensor_4bit(x, "nf4"), codes_one_thread(x, "nf4")
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
        times: dict[str, list[float]] = {"one_thread": [], "pieces": []}
        fns = {"one_thread": codes_one_thread, "pieces": _quant._tensor_4bit}
        for i in range(2 if args.quick else args.rounds):
            for key in list(fns)[:: 1 if i % 2 == 0 else -1]:
                start = time.perf_counter()
                fns[key](x, "nf4")
                times[key].append(time.perf_counter() - start)
        ratios = sorted(a / b for a, b in zip(*times.values(), strict=True))
        pieces_s = statistics.median(times["pieces"])
        rate = x.size / pieces_s
        emit({
            "part": "codes", "tensor": name, "shape": list(shape), "kind": "nf4",
            "threads": _quant._threads(),
            "one_thread_ms": round(statistics.median(times["one_thread"]) * 1e3, 1),
            "pieces_ms": round(pieces_s * 1e3, 1),
            "ratio": round(statistics.median(ratios), 2),
            "ratio_range": [round(ratios[0], 2), round(ratios[-1], 2)],
            "mvalues_per_s": round(rate / 1e6, 1),
            "llama8b_linear_s": round(llama8b_linear_values() / rate, 1),
        })  # fmt: skip


def maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def write_streamed(name: str, path: str) -> None:
    """(In a subprocess.) A Llama-shaped bf16 checkpoint written one shard of
    about 2 GB at a time, from one random tensor per distinct shape (the values
    do not matter to memory): no model is ever built."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    c = IMPORT_CONFIGS[name]
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    rng = np.random.default_rng(0)
    cache: dict[tuple[int, ...], np.ndarray] = {}

    def tensor(*shape: int) -> np.ndarray:
        if shape not in cache:
            x = rng.standard_normal(shape, dtype=np.float32) * 0.02
            cache[shape] = x.astype(ml_dtypes.bfloat16)
        return cache[shape]

    names: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (kv * d, h)),
            (p + "self_attn.v_proj.weight", (kv * d, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (f, h)),
            (p + "mlp.up_proj.weight", (f, h)),
            (p + "mlp.down_proj.weight", (h, f)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    names += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    os.makedirs(path, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for key, shape in names:
        t = tensor(*shape) if len(shape) == 2 else np.ones(shape, ml_dtypes.bfloat16)
        if size and size + t.nbytes > 2 * 10**9:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += t.nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.nbytes for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    Path(path, "model.safetensors.index.json").write_text(json.dumps(index))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **c,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
    }
    Path(path, "config.json").write_text(json.dumps(config))
    largest = max(t.nbytes for shard in shards for t in shard.values())
    count = sum(len(shard) for shard in shards)
    print(json.dumps({"bf16_bytes": total, "largest_bytes": largest, "tensors": count}))


def write_export(name: str, path: str) -> None:
    """(In a subprocess.) A random bf16 Llama, written as safetensors."""
    if name == "8b":
        write_streamed(name, path)
        return
    import jax
    import jax.random as jr
    from safetensors import safe_open

    from eqtrain import hf
    from eqtrain.models import Llama, LlamaConfig

    model = Llama(
        LlamaConfig(**IMPORT_CONFIGS[name], param_dtype="bfloat16"), jr.key(0)
    )
    hf.export(
        model, None, path, dtype="bfloat16", max_shard_size="200MB", overwrite=True
    )
    del model
    total, largest, count = 0, 0, 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "numpy") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total, largest, count = total + 2 * n, max(largest, 2 * n), count + 1
    print(json.dumps({"bf16_bytes": total, "largest_bytes": largest, "tensors": count}))
    jax.clear_caches()


def load_child(kind: str, path: str) -> None:
    """(In a fresh process.) Peak RSS of one load, above its baseline."""
    import jax
    import jax.numpy as jnp

    from eqtrain import hf, quantize

    jnp.zeros(8).block_until_ready()  # the CPU backend started: the baseline's
    baseline = maxrss()
    start = time.perf_counter()
    spec = quantize.Quantize("nf4") if kind == "nf4" else None
    model, _ = hf.load(path, quantize=spec)
    leaves = jax.tree.leaves(model)
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - start
    peak = maxrss()
    model_bytes = sum(x.nbytes for x in leaves if hasattr(x, "nbytes"))
    qbytes, qparams = quantize.quantized_bytes(model)
    print(
        json.dumps(
            {
                "baseline": baseline,
                "peak": peak,
                "model_bytes": model_bytes,
                "quantized_linear_bytes": qbytes,
                "quantized_params": qparams,
                "s": seconds,
            }
        )
    )


def _sub(args: list[str]) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, env=env
    )
    if proc.returncode:
        raise SystemExit(f"{' '.join(args[:2])} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_import_rss(args: argparse.Namespace) -> None:
    name = "quick" if args.quick else getattr(args, "config", None) or "full"
    with tempfile.TemporaryDirectory(prefix="qlora_import_", dir=args.tmp) as tmp:
        path = os.path.join(tmp, "hf")
        info = _sub(["--write", name, path])  # in a subprocess: nothing held here
        quant = _sub(["--child", "nf4", path])
        # an 8B bf16 load would not fit this machine's memory: its bound is known
        plain = None if name == "8b" else _sub(["--child", "bf16", path])
    above = quant["peak"] - quant["baseline"]
    bound = quant["model_bytes"] + info["largest_bytes"]
    if plain is None:  # not measured
        plain = {"peak": 0, "baseline": 0, "model_bytes": 0, "s": 0.0}
    plain_above = plain["peak"] - plain["baseline"]
    plain_bound = plain["model_bytes"] + info["largest_bytes"]
    mb = lambda b: round(b / MB, 1)
    emit(
        {
            "part": "import-rss",
            "config": name,
            "tensors": info["tensors"],
            "bf16_mb": mb(info["bf16_bytes"]),
            "quantized_mb": mb(quant["model_bytes"]),
            "quantized_linear_mb": mb(quant["quantized_linear_bytes"]),
            "quantized_params": quant["quantized_params"],
            "largest_tensor_mb": mb(info["largest_bytes"]),
            "baseline_mb": mb(quant["baseline"]),
            "peak_mb": mb(quant["peak"]),
            "above_baseline_mb": mb(above),
            "ratio": round(above / bound, 3),
            "plain_above_baseline_mb": mb(plain_above),
            "plain_ratio": round(plain_above / plain_bound, 3) if plain_above else None,
            "nf4_over_plain_above_baseline": round(above / plain_above, 3)
            if plain_above > 0
            else None,  # --quick: a load too small to raise the process's peak
            "load_s": round(quant["s"], 2),
            "plain_load_s": round(plain["s"], 2) if plain_above else None,
        }
    )


# --- main -------------------------------------------------------------------------

PARTS_RUN = {
    "bytes": run_bytes,
    "dry-run": run_dry_run,
    "step": run_step,
    "import-rss": run_import_rss,
    "codes": run_codes,
}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--write", "--child"):
        flag, first, second = sys.argv[1:4]
        (write_export if flag == "--write" else load_child)(first, second)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: smoke test")
    sub = parser.add_subparsers(dest="part")
    sub.add_parser("bytes", help="bytes per parameter of the quantized base")
    dry = sub.add_parser("dry-run", help="the dry run's peak memory, bf16 vs nf4 base")
    dry.add_argument("--models", default="", help=f"of {','.join(MODELS)}")
    dry.add_argument("--seq", type=int, default=2048)
    step = sub.add_parser("step", help="nf4 vs bf16-base LoRA step time (CPU)")
    step.add_argument("--hidden", type=int, default=512)
    step.add_argument("--layers", type=int, default=8)
    step.add_argument("--batch", type=int, default=4)
    step.add_argument("--seq", type=int, default=256)
    step.add_argument("--rounds", type=int, default=5)
    step.add_argument("--steps", type=int, default=3, help="steps per round")
    rss = sub.add_parser("import-rss", help="peak RSS of hf.load(..., quantize=nf4)")
    rss.add_argument(
        "--config",
        default="full",
        choices=("full", "8b"),
        help="full: 334M parameters; 8b: Llama-3.1-8B's shapes (16 GB written to "
        "--tmp; the plain load is skipped)",
    )
    rss.add_argument("--tmp", default=None, help="where the checkpoint is written")
    codes = sub.add_parser("codes", help="nf4 codes of one tensor: pieces on threads")
    codes.add_argument("--rounds", type=int, default=5)
    sub.add_parser("all", help="all five (their default options)")
    args = parser.parse_args()
    defaults = {
        "models": "",
        "seq": 2048,
        "hidden": 512,
        "layers": 8,
        "batch": 4,
        "rounds": 5,
        "steps": 3,
        "config": "full",
        "tmp": None,
    }
    for key, value in defaults.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    parts = [args.part] if args.part not in (None, "all") else list(PARTS_RUN)
    if "step" in parts:
        import eqtrain.cpu

        eqtrain.cpu.tune_cpu()  # as the CLI does, before JAX's CPU backend starts
    print_machine()
    for part in parts:
        start = time.perf_counter()
        PARTS_RUN[part](args)
        print(
            f"{part}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True
        )


if __name__ == "__main__":
    main()
