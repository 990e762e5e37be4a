"""Training throughput of `eqtrain.models.Llama` against transformers'
`LlamaForCausalLM` in PyTorch, on the same configuration and batches.

- eqtrain: `eqtrain.jit(eqtrain.train_step(causal_lm_loss, optax.adamw(...)))`,
  a plain loop that waits for the device only at the end of a run;
- torch: `LlamaForCausalLM` (transformers' default attention, SDPA) in eager mode,
  `torch.optim.AdamW`, `torch.set_num_threads(--threads)`, the same cross-entropy
  over `targets` (no internal shift).

Both start from the same weights (copied from the JAX model into torch, which also
checks that the two compute the same loss: `first_loss_diff`), run in f32 and are
warmed up before timing; rounds alternate (ABBA) in one process. It prints one
JSON line:

    {"config", "params", "batch", "seq", "threads", "remat", "scan_layers",
     "attention", "cpu_settings", "cpu_products", "steps", "rounds",
     "eqtrain_tokens_per_s", "torch_tokens_per_s", "ratio", "first_loss_diff"}

with the median tokens/s of each and `ratio` = the median over rounds of
eqtrain / torch within a round (> 1: eqtrain is faster). Per-round rates go to
stderr.

Usage (CPU; needs `pip install torch==2.13.0 transformers`):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/models.py [--steps 8]
        [--rounds 3] [--batch 16] [--seq 256] [--threads 2] [--remat none]
        [--no-scan-layers] [--attention xla|flash] [--quick]
        [--family MODEL_TYPE|all]

`--family` (one Hugging Face `model_type` of `eqtrain.models.archs.ARCHS`, several
separated by commas, or `all`) measures the decoder families instead, each at the
same sizes (those of the Llama above, or `--quick`'s): transformers' config class
for that model type is built with those sizes and the family's own defaults
(activations, norms, q/k norms, soft-caps, rotary bases, no-rope layers), plus a
few switches that make the family's distinguishing features act at this size
(`family_extras`: a sliding window of `seq // 2` for the windowed families, Gemma
3's full layer last, Granite 3's multipliers). eqtrain's config is read from it by
the family's `Arch` (as `eqtrain.hf.load` reads a config.json), the randomly
initialised eqtrain model is exported with `eqtrain.hf.export` and loaded by
`transformers.AutoModelForCausalLM.from_pretrained` (its default attention: SDPA,
Gemma 2 eager), so both start from equal weights. One JSON line per family:

    {"family", "architecture", "config", "params", "batch", "seq", "threads",
     "remat", "scan_layers", "cpu_settings", "cpu_products", "steps", "rounds",
     "eqtrain_step_ms", "torch_step_ms", "eqtrain_tokens_per_s",
     "torch_tokens_per_s", "ratio", "ratio_range", "eqtrain_best_step_ms",
     "torch_best_step_ms", "ratio_of_best", "first_loss_diff"}

with the median step time of each side over rounds, `ratio` as above (> 1:
eqtrain faster) and its range over rounds, and the fastest round's step time of
each side and their ratio (on a busy machine the least disturbed figures).
"""

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
from _machine import print_machine

import eqtrain
from eqtrain.cpu._probe import CONFIG  # the step tune_cpu's probe times
from eqtrain.losses import causal_lm_loss
from eqtrain.models import Llama, LlamaConfig, num_params


# CONFIG: 4.3M parameters, the size of the design's performance notes
QUICK = LlamaConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LR, WEIGHT_DECAY = 1e-3, 0.1


def make_batches(cfg: LlamaConfig, n: int, batch: int, seq: int) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, cfg.vocab_size, (batch, seq + 1), dtype=np.int32)
        out.append(
            {
                "tokens": tokens[:, :-1],
                "targets": tokens[:, 1:],
                "loss_mask": np.ones((batch, seq), np.float32),
            }
        )
    return out


# -- eqtrain -----------------------------------------------------------------------
class JaxRunner:
    def __init__(self, model: Llama, batches: list[dict]):
        self.model = model
        self.optimizer = optax.adamw(LR, weight_decay=WEIGHT_DECAY)
        step = eqtrain.train_step(causal_lm_loss, self.optimizer)
        options = eqtrain.cpu.step_options()  # as `eqtrain fit` compiles
        self.step = eqtrain.jit(step, donate=True, compiler_options=options)
        self.batches = [jax.device_put(b) for b in batches]

    def fresh(self) -> eqtrain.TrainState:
        model = jax.tree_util.tree_map(jnp.copy, self.model)  # the steps donate it
        return eqtrain.TrainState.create(model, self.optimizer, key=0)

    def run(self, n: int) -> tuple[float, float]:
        """Seconds for `n` steps from the initial weights, and the first loss."""
        state = self.fresh()
        jax.block_until_ready(state)
        start = time.perf_counter()
        first = None
        for batch in self.batches[:n]:
            state, metrics = self.step(state, batch)
            first = metrics["loss"] if first is None else first
        jax.block_until_ready(state)
        return time.perf_counter() - start, float(first)  # type: ignore[arg-type]


# -- torch -------------------------------------------------------------------------
def to_torch(model: Llama, cfg: LlamaConfig) -> Any:
    """transformers' `LlamaForCausalLM` with the JAX model's weights (our Linear
    weights are `[out, in]` like PyTorch's, so this is a rename)."""
    import torch
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_size,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).float()
    flat = {
        jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(model)
    }
    state = {}
    for name, value in flat.items():
        if name.startswith("layers."):
            for i in range(cfg.num_hidden_layers):
                state[f"model.layers.{i}.{name[7:]}"] = value[i]
        elif name.startswith("lm_head."):
            state[name] = value
        else:
            state[f"model.{name}"] = value
    tensors = {k: torch.from_numpy(np.array(v)) for k, v in state.items()}
    missing, unexpected = hf.load_state_dict(tensors, strict=False)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"weight copy: missing {missing}, unexpected {unexpected}")
    return hf


class TorchRunner:
    def __init__(
        self, model: Llama, cfg: LlamaConfig, batches: list[dict], hf: Any = None
    ):
        """`hf`: the transformers model to train (default: `to_torch(model, cfg)`)."""
        import torch

        self.torch = torch
        self.hf = to_torch(model, cfg) if hf is None else hf
        self.state = {k: v.clone() for k, v in self.hf.state_dict().items()}
        self.hf.train()
        self.batches = [
            {k: torch.from_numpy(v).long() for k, v in b.items() if k != "loss_mask"}
            for b in batches
        ]
        self.vocab = cfg.vocab_size

    def run(self, n: int) -> tuple[float, float]:
        """Seconds for `n` steps from the initial weights, and the first loss."""
        torch = self.torch
        self.hf.load_state_dict(self.state)
        opt = torch.optim.AdamW(self.hf.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        start = time.perf_counter()
        first = None
        for batch in self.batches[:n]:
            logits = self.hf(input_ids=batch["tokens"]).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, self.vocab), batch["targets"].reshape(-1)
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            first = float(loss.detach()) if first is None else first
        return time.perf_counter() - start, float(first)  # type: ignore[arg-type]


# -- the benchmark -----------------------------------------------------------------
def measure(
    runners: dict[str, Any], args: argparse.Namespace
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Per-round tokens/s of each runner (rounds alternate ABBA after an untimed
    warm-up, which also compiles), and each one's first loss."""
    firsts = {}
    for name, run in runners.items():  # compile and warm up, untimed
        _, firsts[name] = run(args.warmup)
    rates: dict[str, list[float]] = {name: [] for name in runners}
    tokens = args.steps * args.batch * args.seq
    for r in range(args.rounds):
        for name in list(runners) if r % 2 == 0 else list(reversed(runners)):
            seconds, _ = runners[name](args.steps)
            rates[name].append(tokens / seconds)
    shown = {k: [round(x) for x in v] for k, v in rates.items()}
    print(f"tokens/s per round: {shown}", file=sys.stderr)
    return rates, firsts


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    base = QUICK if args.quick else CONFIG
    cfg = dataclasses.replace(
        base,
        remat=args.remat,
        scan_layers=args.scan_layers,
        attention_impl=args.attention,
    )
    model = Llama(cfg, jr.key(0))
    batches = make_batches(cfg, args.steps, args.batch, args.seq)
    jax_runner = JaxRunner(model, batches)
    runners = {"eqtrain": jax_runner.run, "torch": TorchRunner(model, cfg, batches).run}
    rates, firsts = measure(runners, args)
    paired = [e / t for e, t in zip(rates["eqtrain"], rates["torch"], strict=True)]
    return {
        **_settings(args, model),
        "cpu_products": jax_runner.step.compile_note,
        "eqtrain_tokens_per_s": round(statistics.median(rates["eqtrain"]), 1),
        "torch_tokens_per_s": round(statistics.median(rates["torch"]), 1),
        "ratio": round(statistics.median(paired), 4),
        "first_loss_diff": abs(firsts["eqtrain"] - firsts["torch"]),
    }


# -- the decoder families ----------------------------------------------------------
def family_extras(model_type: str, seq: int, layers: int) -> dict[str, Any]:
    """transformers config keys beyond the shared sizes, so that what tells the
    family apart acts at the benchmark's size: windowed families get a window of
    half the sequence (their defaults, 4096 or none, would cover it whole); Gemma 3
    gets its global layer last (its default 5:1 pattern has none in 4 layers);
    Granite takes granite-3.0-2b-base's multipliers (all 1.0 by default)."""
    window = max(1, seq // 2)
    if model_type in ("mistral", "gemma2", "phi3", "starcoder2"):
        return {"sliding_window": window}
    if model_type == "gemma3_text":
        types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        return {"sliding_window": window, "layer_types": types}
    if model_type == "granite":
        return dict(
            embedding_multiplier=12.0,
            attention_multiplier=0.015625,
            residual_multiplier=0.22,
            logits_scaling=8.0,
        )
    return {}


def family_models(
    model_type: str, base: LlamaConfig, args: argparse.Namespace
) -> tuple[Llama, Any]:
    """The eqtrain model of one family at `base`'s sizes and the transformers
    model with the same weights (exported by `eqtrain.hf.export`, loaded by
    `from_pretrained`)."""
    import torch
    import transformers

    from eqtrain import hf
    from eqtrain.models.archs import ARCHS, Reader

    sizes = dict(
        vocab_size=base.vocab_size,
        hidden_size=base.hidden_size,
        intermediate_size=base.intermediate_size,
        num_hidden_layers=base.num_hidden_layers,
        num_attention_heads=base.num_attention_heads,
        num_key_value_heads=base.kv_heads,
        head_dim=base.head_size,
        max_position_embeddings=base.max_position_embeddings,
        tie_word_embeddings=base.tie_word_embeddings,
        pad_token_id=0,  # some defaults (SmolLM3's 128004) lie outside the vocab
        bos_token_id=1,
        eos_token_id=2,
    )
    extras = family_extras(model_type, args.seq, base.num_hidden_layers)
    hf_cfg = transformers.AutoConfig.for_model(model_type, **sizes, **extras)
    reader = Reader(hf_cfg.to_dict(), f"transformers' {type(hf_cfg).__name__}")
    cfg = ARCHS[model_type].from_hf(reader, "float32")
    cfg = dataclasses.replace(
        cfg,
        remat=args.remat,
        scan_layers=args.scan_layers,
        attention_impl=args.attention,
    )
    model = Llama(cfg, jr.key(0))
    transformers.utils.logging.disable_progress_bar()  # "Loading weights"
    with tempfile.TemporaryDirectory() as tmp:
        path = hf.export(model, None, f"{tmp}/hf")
        torch_model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32
        )
    return model, torch_model


def family_benchmark(model_type: str, args: argparse.Namespace) -> dict[str, Any]:
    """One family's step times, eqtrain against transformers."""
    base = QUICK if args.quick else CONFIG
    model, torch_model = family_models(model_type, base, args)
    cfg = model.config
    batches = make_batches(cfg, args.steps, args.batch, args.seq)
    jax_runner = JaxRunner(model, batches)
    runners = {
        "eqtrain": jax_runner.run,
        "torch": TorchRunner(model, cfg, batches, hf=torch_model).run,
    }
    rates, firsts = measure(runners, args)
    tokens = args.steps * args.batch * args.seq
    step_ms = lambda r: 1000 * tokens / r / args.steps
    paired = [e / t for e, t in zip(rates["eqtrain"], rates["torch"], strict=True)]
    return {
        "family": model_type,
        "architecture": type(torch_model).__name__,
        **_settings(args, model),
        "cpu_products": jax_runner.step.compile_note,
        "eqtrain_step_ms": round(step_ms(statistics.median(rates["eqtrain"])), 1),
        "torch_step_ms": round(step_ms(statistics.median(rates["torch"])), 1),
        "eqtrain_tokens_per_s": round(statistics.median(rates["eqtrain"]), 1),
        "torch_tokens_per_s": round(statistics.median(rates["torch"]), 1),
        "ratio": round(statistics.median(paired), 4),
        "ratio_range": [round(min(paired), 4), round(max(paired), 4)],
        # the fastest round of each: the least disturbed on a shared machine
        "eqtrain_best_step_ms": round(step_ms(max(rates["eqtrain"])), 1),
        "torch_best_step_ms": round(step_ms(max(rates["torch"])), 1),
        "ratio_of_best": round(max(rates["eqtrain"]) / max(rates["torch"]), 4),
        "first_loss_diff": abs(firsts["eqtrain"] - firsts["torch"]),
    }


def families(spec: str) -> list[str]:
    """`--family`'s model types, in `ARCHS` order for `all`."""
    from eqtrain.models.archs import ARCHS

    if spec == "all":
        return list(ARCHS)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in ARCHS]
    if unknown or not names:
        raise SystemExit(
            f"--family: unknown model type(s) {unknown}; expected 'all' or some "
            f"of {', '.join(ARCHS)}, separated by commas."
        )
    return names


def _settings(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    """The record's fields that say what was run (shared by both benchmarks)."""
    return {
        "config": "quick" if args.quick else "llama_4m",
        "params": num_params(model),
        "batch": args.batch,
        "seq": args.seq,
        "threads": args.threads,
        "remat": args.remat,
        "scan_layers": args.scan_layers,
        "attention": args.attention or "xla",
        "cpu_settings": args.cpu_settings,
        "steps": args.steps,
        "rounds": args.rounds,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=None, help="runs of each")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--remat", default="none", help="eqtrain's remat policy")
    parser.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="eqtrain: lax.scan over layers (--no-scan-layers unrolls them)",
    )
    parser.add_argument(
        "--tune-cpu",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="eqtrain.cpu.tune_cpu() first, as the eqtrain command does "
        "(--no-tune-cpu: XLA's and glibc's defaults)",
    )
    parser.add_argument(
        "--attention",
        choices=["xla", "flash"],
        default="xla",
        help="eqtrain's attention kernel (the model's attention_impl): XLA's "
        "causal blocks, or flash blocks (eqtrain.models._flash)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny smoke test")
    parser.add_argument(
        "--family",
        default=None,
        help="decoder families to compare instead of the Llama: a Hugging Face "
        "model_type (llama, mistral, qwen2, qwen3, smollm3, gemma, gemma2, "
        "gemma3_text, phi3, olmo2, granite, starcoder2), several separated by "
        "commas, or 'all'; one JSON line each",
    )
    args = parser.parse_args(argv)
    args.families = None if args.family is None else families(args.family)
    args.attention = None if args.attention == "xla" else args.attention
    args.cpu_settings = []
    args.steps = args.steps or (3 if args.quick else 8)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.batch = args.batch or (2 if args.quick else 16)
    args.seq = args.seq or (16 if args.quick else 256)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.cpu_settings = eqtrain.cpu.tune_cpu() if args.tune_cpu else []
    print_machine()  # the processor and settings: figures are per machine
    if args.family is None:
        print(json.dumps(benchmark(args)), flush=True)
        return
    import torch

    torch.set_num_threads(args.threads)
    for model_type in args.families:
        print(f"{model_type}:", file=sys.stderr)
        print(json.dumps(family_benchmark(model_type, args)), flush=True)


if __name__ == "__main__":
    main()
