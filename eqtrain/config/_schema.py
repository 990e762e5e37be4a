"""The run configuration: typed, frozen dataclasses, one per TOML section.

Each field's metadata carries its help text and its checks (`choices`, `min`,
`max`, `kind`), which drive parsing, validation, `eqtrain config --show` and the
generated CLI reference alike, so they cannot drift apart.
"""

import dataclasses
from typing import Any

from ..models import FAMILIES


def setting(
    default: Any,
    help: str,
    *,
    choices: tuple[Any, ...] | None = None,
    min: float | int | None = None,
    max: float | int | None = None,
    above: float | int | None = None,
    below: float | int | None = None,
    kind: str | None = None,
) -> Any:
    """A config field: its default, a help text and its checks.

    `min`/`max` bound a number inclusively, `above`/`below` exclusively (a
    decay rate below 1; a scale above 0).

    `kind` refines how a value is read: `"duration"` (seconds, or a string like
    `"2h30m"`), `"size"` (bytes, or `"5GB"`), `"path"` (relative paths are taken
    from the run directory where the help says so).
    """
    meta = {"help": help, "choices": choices, "min": min, "max": max, "kind": kind}
    meta |= {"above": above, "below": below}
    return dataclasses.field(default=default, metadata=meta)


# The Hugging Face model types of the model families, in their registry's order.
ARCHS = tuple(t for family in FAMILIES.values() for t in family.model_types)
TASKS = ("lm", "sft", "dpo", "ipo", "orpo", "simpo", "grpo")
PREFERENCE_TASKS = ("dpo", "ipo", "orpo", "simpo")
DATA_FORMATS = ("auto", "text", "chat", "prompt_completion", "preference")
REFERENCES = ("auto", "copy", "adapters_off", "precomputed")
GRPO_LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo")  # = eqtrain.grpo.LOSS_TYPES
REWARD_SCALES = ("group", "batch", "none")  # = eqtrain.grpo.SCALES
OPTIMIZERS = ("adamw", "adam", "lion", "sgd", "adafactor")
SCHEDULES = ("constant", "linear", "cosine", "wsd")
DTYPES = ("float32", "bfloat16", "float16")
TRAIN_DTYPES = ("float32", "bfloat16")  # float16 would need loss scaling
# `model.loss_chunk = "auto"` chunks the loss from this vocabulary size on (see
# docs/performance.md, "Memory", for the measurement behind it: at 2048 ids the
# chunked loss was 0.79x the plain one's time, at 259 ids 1.56x).
LOSS_CHUNK_MIN_VOCAB = 2048
AUTO_LOSS_CHUNK = 256
SEQUENCE_SCHEMES = ("ulysses", "ring", "all_gather")  # = eqtrain.models.SCHEMES
SEQUENCE_LAYOUTS = ("contiguous", "zigzag")
# The defaults of unset `optim.warmup_steps` and `optim.final_lr`, which depend on
# other keys: see `OptimConfig.resolved`.
WARMUP_PERCENT = 5  # of loop.steps
FINAL_LR_DIVISOR = 10  # of optim.lr (0 for the constant schedule)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str = setting(
        "llama",
        "Architecture: a Hugging Face model type. All but gpt2 are one decoder "
        "with per-family switches (eqtrain.models.archs; docs/models.md).",
        choices=ARCHS,
    )
    init_from: str | None = setting(
        None,
        "Start from this Hugging Face directory (safetensors; e.g. written by "
        "`save_pretrained` or `eqtrain export`). The architecture fields come "
        "from its config.json; setting them too is an error.",
        kind="path",
    )
    vocab_size: int | None = setting(
        None, "Vocabulary size; unset: the tokenizer's.", min=1
    )
    hidden_size: int = setting(128, "Width of the residual stream.", min=1)
    intermediate_size: int | None = setting(
        None, "Width of the MLP; unset: 4 x hidden_size.", min=1
    )
    num_layers: int = setting(4, "Number of transformer blocks.", min=1)
    num_heads: int = setting(4, "Attention (query) heads.", min=1)
    num_kv_heads: int | None = setting(
        2,
        "Key/value heads (grouped-query attention; Llama family only); unset: "
        "num_heads.",
        min=1,
    )
    head_dim: int | None = setting(
        None,
        "Size of each head, an even number (rotary embeddings rotate pairs); "
        "unset: hidden_size / num_heads.",
        min=2,
    )
    max_seq_len: int | None = setting(
        None,
        "Longest sequence (position table size); unset: data.seq_len.",
        min=2,  # as data.seq_len, which must fit
    )
    rope_theta: float = setting(10000.0, "RoPE base (Llama family).", min=1)
    norm_eps: float | None = setting(
        None, "Epsilon of the norms; unset: 1e-6 (Llama family), 1e-5 (GPT-2).", min=0
    )
    tie_embeddings: bool = setting(
        True, "Share the input embedding with the output head (Llama family, GPT-2)."
    )
    attention_bias: bool = setting(
        False, "Biases on q/k/v projections (Qwen2 style; Llama family)."
    )
    mlp_bias: bool = setting(False, "Biases in the MLP (Llama family).")
    sliding_window: int | None = setting(
        None, "Sliding-window attention span (Mistral style).", min=1
    )
    num_experts: int = setting(
        0,
        "Experts of each mixture-of-experts MLP (Llama family; 0: dense MLPs). "
        "Every layer's MLP is then sparse, as in Mixtral and Qwen-MoE.",
        min=0,
    )
    experts_per_token: int = setting(
        2, "Experts each token is routed to (top-k; with model.num_experts).", min=1
    )
    expert_size: int | None = setting(
        None,
        "Width of one expert's MLP; unset: model.intermediate_size (Mixtral).",
        min=1,
    )
    shared_expert_size: int | None = setting(
        None,
        "Width of a shared expert every token also goes through, gated by a "
        "sigmoid (Qwen2-MoE); unset: none.",
        min=1,
    )
    norm_topk_prob: bool = setting(
        True,
        "Renormalise each token's top-k routing weights to sum to 1 (Mixtral: "
        "always; Qwen-MoE: its config's).",
    )
    router_aux_loss_coef: float | None = setting(
        None,
        "Coefficient of the load-balancing loss added to the LM loss (Switch/"
        "Mixtral form, as transformers computes it; 0: off); unset: the "
        "checkpoint's (model.init_from), else 0.001.",
        min=0,
    )
    router_z_loss_coef: float = setting(
        0.0, "Coefficient of the router z-loss (ST-MoE; 0: off).", min=0
    )
    capacity_factor: float | None = setting(
        None,
        "Each expert takes at most capacity_factor x its even share of a batch's "
        "assignments; the rest are dropped (counted in moe/dropped). Unset: "
        "dropless.",
        above=0,
    )
    moe_impl: str = setting(
        "auto",
        "How tokens reach their experts: `sorted` (grouped by expert, blocked "
        "products), `ragged` (jax.lax.ragged_dot), `dense` (every expert on "
        "every token: the reference); `auto`: ragged on TPU, else sorted.",
        choices=("auto", "sorted", "ragged", "dense"),
    )
    init_std: float = setting(0.02, "Standard deviation of the initial weights.", min=0)
    param_dtype: str = setting(
        "float32",
        "Dtype the parameters are stored and updated in. Not float16: training in "
        "it needs loss scaling, which eqtrain does not do (a float16 run went "
        "non-finite at step 2); use bfloat16 (or export.dtype = float16).",
        choices=TRAIN_DTYPES,
    )
    remat: str = setting(
        "none",
        "Activation checkpointing of each block: `none` keeps every activation; "
        "`full` keeps each block's input and recomputes the rest; `dots` / "
        "`dots_no_batch` keep matmul outputs (without: attention's); `save_qkv` "
        "keeps q/k/v; `save_out` keeps the attention output; `offload_layer_input` "
        "is `full` with the block inputs in host memory (GPU/TPU; the CPU backend "
        "drops the move); `custom`: model.remat_save / remat_offload.",
        choices=(
            "none",
            "full",
            "dots",
            "dots_no_batch",
            "save_qkv",
            "save_out",
            "offload_layer_input",
            "custom",
        ),
    )
    remat_save: str = setting(
        "",
        "With remat = `custom`: activations to keep, by name (a list or "
        "comma-separated): layer_input, query, key, value, attn_out, mlp_in, "
        "mlp_out.",
        kind="names",
    )
    remat_offload: str = setting(
        "",
        "With remat = `custom`: activations to move to host memory until the "
        'backward pass (names as remat_save; e.g. ["layer_input"]).',
        kind="names",
    )
    mlp_chunks: int | str = setting(
        1,
        "Tiled MLP: run each block's MLP over this many pieces of the sequence, "
        "each recomputed in the backward pass, so only [seq / chunks, "
        "intermediate] exists at a time; must divide data.seq_len; `auto`: "
        "ceil(seq_len / hidden_size); 1: off.",
        min=1,
        kind="auto_int",
    )
    attention_chunk: int = setting(
        0,
        "Blocked attention: queries go through in blocks of this many, so the "
        "[heads, seq_len, seq_len] scores never exist at once (each block is "
        "recomputed in the backward pass); for backends without a fused "
        "attention kernel, such as the CPU; 0: off.",
        min=0,
    )
    loss_chunk: int | str = setting(
        "auto",
        "Chunked LM head + loss: compute the output head and cross-entropy over "
        "this many tokens at a time, never holding the [tokens, vocab] logits; 0: "
        "off (full logits); `auto`: 256-token chunks when the vocabulary has "
        f"at least {LOSS_CHUNK_MIN_VOCAB} ids and mesh.sequence is 1, else off.",
        min=0,
        kind="auto_int",
    )
    scan_layers: bool | str = setting(
        "auto",
        "Run the blocks with `lax.scan` (compile time flat in depth) or unrolled "
        "(false); `auto`: unrolled on the CPU, where it trains 3-6% faster, "
        "scanned on GPUs and TPUs.",
        kind="auto_bool",
    )
    sequence_parallel: str | None = setting(
        None,
        "Attention over a sequence split on mesh.sequence devices: `ulysses` "
        "(all-to-all to heads; num_heads / mesh.tensor must divide by "
        "mesh.sequence), `ring` (K/V blocks round a ring) or `all_gather` "
        "(gathered K/V); unset: plain attention (mesh.sequence must be 1).",
        choices=SEQUENCE_SCHEMES,
    )
    sequence_layout: str = setting(
        "contiguous",
        "How each row's tokens lie on mesh.sequence: `contiguous`, or `zigzag` "
        "(device i holds chunks i and 2n-1-i of 2n: balanced causal work; "
        "data.seq_len must divide by 2 x mesh.sequence).",
        choices=SEQUENCE_LAYOUTS,
    )
    adapter_from: str | None = setting(
        None,
        "Continue training this PEFT LoRA adapter directory (adapter_config.json + "
        "adapter_model.safetensors) on `model.init_from`'s weights; its rank, "
        "alpha, targets and rsLoRA setting replace the [lora] ones.",
        kind="path",
    )


@dataclasses.dataclass(frozen=True)
class DataConfig:
    train: str = setting(
        "stdlib",
        "Training text: `stdlib` (the Python standard library's sources, built "
        "in), a directory of text files, or a file (.txt, .json/.jsonl, .parquet, "
        ".csv).",
        kind="path",
    )
    eval: str = setting(
        "auto",
        "Evaluation text, as `train`; `auto`: the standard library's held-out "
        "files when train = `stdlib`, else none; `none`: no evaluation.",
        kind="path",
    )
    format: str = setting(
        "auto",
        "What the data files hold: `text` (plain text, for task.kind = lm), "
        "`chat` (a `messages` column of role/content turns), `prompt_completion` "
        "(`prompt` and `completion` columns) or `preference` (`prompt`, `chosen`, "
        "`rejected`); strings or message lists. `auto`: text for lm, else read "
        "from the columns.",
        choices=DATA_FORMATS,
    )
    text_column: str = setting(
        "text", "Column holding the text in .json/.jsonl/.parquet/.csv files."
    )
    chat_template: str = setting(
        "auto",
        "How conversations become tokens: a `.jinja` file, `builtin` (eqtrain's "
        "own template), or `auto`: the tokenizer directory's template "
        "(chat_template.jinja, or tokenizer_config.json's chat_template) when it "
        "has one, else builtin.",
        kind="path",
    )
    max_prompt_len: int | None = setting(
        None,
        "Prompts longer than this many tokens keep only their end; a row whose "
        "prompt and completion still exceed seq_len + 1 tokens is skipped. Unset: "
        "data.seq_len // 2.",
        min=1,
    )
    pack: bool = setting(
        True,
        "SFT: pack several examples into each row (segment ids keep attention and "
        "loss within each); false: one example per row, padded.",
    )
    pattern: str = setting(
        "**/*.txt", "Glob of the files read from a directory of text files."
    )
    tokenizer: str = setting(
        "auto",
        "`byte` (UTF-8 bytes + 3 specials, 259 ids), a `tokenizer.json` file or a "
        "directory holding one; `auto`: init_from's tokenizer.json when it has "
        "one, else `byte`.",
        kind="path",
    )
    seq_len: int = setting(128, "Tokens per training row.", min=2)
    batch_size: int = setting(
        16,
        "Rows per optimizer step (the global batch; split into optim.accumulate "
        "micro-batches).",
        min=1,
    )
    eval_rows: int = setting(
        128, "At most this many rows of the eval text are evaluated.", min=1
    )
    sources: str = setting(
        "",
        "A mixture for task.kind = lm, in place of `train`: several sources with "
        "weights, as `[[data.sources]]` tables with `path` and `weight` (and an "
        'optional `name`), or `--set data.sources="web.jsonl=0.7,code=0.3"`. '
        "Each batch's rows follow the weights; each source repeats or is read "
        "partially as its weight asks.",
        kind="sources",
    )
    cache: str = setting(
        "auto",
        "Where tokenized stores are kept (one per source, named by the content of "
        "the files, the tokenizer and the settings; reused by later runs). `auto`: "
        "$EQTRAIN_DATA_CACHE, else ~/.cache/eqtrain/data. For task.kind = lm.",
        kind="path",
    )
    workers: int | str = setting(
        "auto",
        "Processes that tokenize when a store is prepared; `auto`: the CPU count.",
        min=1,
        kind="auto_int",
    )
    shuffle: bool = setting(True, "Shuffle the training rows every epoch.")
    prefetch: int = setting(2, "Batches prepared ahead in a background thread.", min=0)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: str = setting("adamw", "The optimizer.", choices=OPTIMIZERS)
    lr: float = setting(3e-3, "Peak learning rate.", min=0)
    schedule: str = setting("cosine", "Learning-rate schedule.", choices=SCHEDULES)
    warmup_steps: int | None = setting(
        None,
        "Linear warmup from 0 to lr over this many steps; unset: "
        f"{WARMUP_PERCENT}% of the steps.",
        min=0,
    )
    final_lr: float | None = setting(
        None,
        "Learning rate at the last step (linear, cosine, wsd); unset: "
        f"lr / {FINAL_LR_DIVISOR}.",
        min=0,
    )
    decay_steps: int | None = setting(
        None, "wsd only: length of the final decay; unset: 10% of the steps.", min=1
    )
    weight_decay: float = setting(
        0.1,
        "Decoupled weight decay; `adam` takes none (unset, it is 0 there: use "
        "adamw for Adam with weight decay).",
        min=0,
    )
    no_decay: str = setting(
        "(norm|bias|embed|wte|wpe|ln_)",
        "Regex of parameter paths without weight decay (norms, biases, "
        "embeddings); empty: decay all.",
    )
    clip_norm: float | None = setting(
        1.0, "Clip gradients to this global norm; unset or 0: no clipping.", min=0
    )
    b1: float | None = setting(
        None, "First-moment decay; unset: the optimizer's default.", min=0, below=1
    )
    b2: float | None = setting(
        None, "Second-moment decay; unset: the optimizer's default.", min=0, below=1
    )
    eps: float | None = setting(
        None, "Adam-style epsilon; unset: the optimizer's default.", min=0
    )
    momentum: float | None = setting(None, "sgd only: momentum.", min=0, below=1)
    nesterov: bool = setting(False, "sgd only: Nesterov momentum.")
    accumulate: int = setting(
        1, "Micro-batches per step (gradient accumulation).", min=1
    )

    def resolved(self, total_steps: int) -> "OptimConfig":
        """This section with the defaults of its unset keys that depend on others
        filled in: `warmup_steps` is `WARMUP_PERCENT`% of `total_steps` (rounded
        down), `final_lr` is `lr / FINAL_LR_DIVISOR` (0 for `constant`, which
        takes none). A run's config.toml keeps them unset, so that changing
        `loop.steps` or `optim.lr` on resume moves them along.
        """
        warmup, final_lr = self.warmup_steps, self.final_lr
        if warmup is None:
            warmup = total_steps * WARMUP_PERCENT // 100
        if final_lr is None:
            constant = self.schedule == "constant"
            final_lr = 0.0 if constant else self.lr / FINAL_LR_DIVISOR
        return dataclasses.replace(self, warmup_steps=warmup, final_lr=final_lr)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    steps: int = setting(300, "Train until this step (absolute: resume counts).", min=1)
    eval_every: int = setting(100, "Evaluate every this many steps; 0: never.", min=0)
    eval_at_end: bool = setting(True, "Evaluate once more when the run ends.")
    time_limit: float | None = setting(
        None,
        "Stop cleanly after this much wall-clock time (seconds or e.g. `2h30m`); "
        "unset or 0: no limit.",
        min=0,
        kind="duration",
    )
    kill_switch: str | None = setting(
        "STOP",
        "Stop cleanly when this file appears (relative to the run directory).",
        kind="path",
    )
    precision: str = setting(
        "float32",
        "Compute precision: `bf16` computes in bfloat16 with float32 parameters.",
        choices=("float32", "bf16"),
    )
    nonfinite: str = setting(
        "stop",
        "On a NaN/inf loss or gradient: `stop` (keep the last good state), "
        "`skip` the update, or `ignore`.",
        choices=("stop", "skip", "ignore"),
    )
    ema: float | None = setting(
        None,
        "Keep an exponential moving average of the weights with this decay.",
        min=0,
        below=1,
    )


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    every: int = setting(
        100,
        "Save every this many steps (and always once at the end); 0: only at the end.",
        min=0,
    )
    every_minutes: float | None = setting(
        None,
        "Also save when this many minutes passed since the last save; unset or "
        "0: no timed saves.",
        min=0,
    )
    keep_last: int = setting(3, "Keep the newest this many checkpoints.", min=1)
    keep_every: int | None = setting(
        None, "Also keep every checkpoint whose step is a multiple of this.", min=1
    )
    best: str | None = setting(
        None, "Also keep the best checkpoint by this metric, e.g. `eval/loss`."
    )
    best_mode: str = setting(
        "min",
        "Whether a lower or a higher `best` metric is better.",
        choices=("min", "max"),
    )
    resume: str = setting(
        "auto",
        "`auto`: continue from the run directory's latest checkpoint if any; "
        "`never`: start fresh (refused if checkpoints exist); or a path to a "
        "run, checkpoints or step directory to start from.",
        kind="path",
    )
    async_save: bool = setting(True, "Write checkpoints in the background.")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = setting(
        -1, "Data-parallel devices; -1: all devices the other axes leave.", min=-1
    )
    fsdp: int = setting(
        1, "Devices parameters and optimizer state are sharded over (FSDP).", min=-1
    )
    tensor: int = setting(1, "Tensor-parallel devices.", min=-1)
    expert: int = setting(
        1,
        "Devices a mixture-of-experts model's experts are split over (expert "
        "parallelism; the batch is split over them too); must divide "
        "model.num_experts.",
        min=1,
    )
    sequence: int = setting(
        1,
        "Devices each row's tokens are split over (sequence parallelism; needs "
        "model.sequence_parallel).",
        min=1,
    )


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    processes: int = setting(
        1,
        "Processes a launcher (`eqtrain fit --launcher ray`) starts, each with its "
        "own devices: one per host, or one per accelerator.",
        min=1,
    )
    ray_address: str | None = setting(
        None,
        "The Ray cluster to run on (`auto`, `HOST:PORT` or `ray://HOST:10001`); "
        "unset: start a local Ray on 127.0.0.1 for this run.",
    )
    resources_per_worker: str = setting(
        "CPU=1",
        "Ray resources each worker holds, `NAME=AMOUNT` separated by commas: "
        "`CPU=8,GPU=1`, `TPU=4`, or a custom resource of the cluster.",
    )
    placement: str = setting(
        "pack",
        "How Ray places the workers' bundles: `strict_spread`: each worker on its "
        "own node; `pack`/`spread`: as few/as many nodes as fit; `strict_pack`: one "
        "node.",
        choices=("pack", "spread", "strict_pack", "strict_spread"),
    )
    max_restarts: int = setting(
        3,
        "Restart the whole group this many times in all (from the last complete "
        "checkpoint, `--resume auto`) after a worker fails.",
        min=0,
    )
    restart_delay: float = setting(
        2.0,
        "Wait this long before the first restart; each further restart waits twice "
        "as long (at most 5 minutes).",
        min=0,
        kind="duration",
    )


@dataclasses.dataclass(frozen=True)
class LogConfig:
    every: int = setting(
        1, "Log metrics (JSONL, TensorBoard, W&B) every this many steps.", min=1
    )
    progress: str = setting(
        "auto",
        "`bar`: a live progress bar; `lines`: a line per log step; `none`; "
        "`auto`: a bar on a terminal, else a line about every 5% of the run and "
        "at evaluations (every log.every steps when that key is set).",
        choices=("auto", "bar", "lines", "none"),
    )
    tensorboard: bool = setting(
        False, "Write TensorBoard event files to <run_dir>/tb (needs tensorboardX)."
    )
    wandb_project: str | None = setting(
        None, "Log to this Weights & Biases project (needs wandb)."
    )
    wandb_mode: str = setting(
        "online", "W&B mode.", choices=("online", "offline", "disabled")
    )
    wandb_name: str | None = setting(None, "W&B run name; unset: W&B picks one.")
    peak_flops: float | None = setting(
        None,
        "Peak FLOP/s of one device, for MFU; unset: looked up for known "
        "accelerators (none on CPU).",
        above=0,
    )
    samples: str | None = setting(
        None,
        "Generate from the model during training: a .txt file (one prompt a "
        'line) or a .jsonl file ({"prompt": ...} or {"messages": [...]} a '
        "line; messages get the run's chat template). The completions are "
        "appended to <run_dir>/samples.jsonl (and TensorBoard's text tab); unset: "
        "none.",
        kind="path",
    )
    samples_every: int = setting(
        100, "Generate the samples every this many steps (and at the end).", min=1
    )
    samples_max_new_tokens: int = setting(64, "The most new tokens per sample.", min=1)
    samples_temperature: float = setting(
        0.0, "Sampling temperature of the samples; 0: greedy.", min=0
    )


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    kind: str = setting(
        "lm",
        "What the run learns: `lm` (next-token prediction on every token), `sft` "
        "(supervised fine-tuning: the loss on completion/assistant tokens only), "
        "or preference optimisation on prompt/chosen/rejected pairs: `dpo`, "
        "`ipo` (both against a reference model), `orpo`, `simpo` (none needed); "
        "or `grpo`: online RL on prompts, with completions sampled from the "
        "policy and scored by task.rewards.",
        choices=TASKS,
    )
    beta: float | None = setting(
        None,
        "dpo/ipo/simpo: the beta of the loss; unset: 0.1 (dpo, ipo), 2.0 (simpo). "
        "grpo: the weight of the KL penalty to the reference model; unset: 0 (no "
        "penalty, no reference).",
        min=0,
    )
    label_smoothing: float = setting(
        0.0,
        "dpo/simpo: the assumed fraction of flipped preference labels "
        "(conservative DPO); 0: off.",
        min=0,
        max=0.5,
    )
    orpo_lambda: float = setting(
        0.1, "orpo: weight of the odds-ratio term added to the chosen NLL.", min=0
    )
    simpo_gamma: float = setting(0.5, "simpo: the target reward margin.", min=0)
    reference: str = setting(
        "auto",
        "dpo/ipo: the reference model. `copy`: a frozen copy of the initial model "
        "in the state; `adapters_off`: the policy with its LoRA adapters off (no "
        "copy; needs [lora]); `precomputed`: its log-probs computed once before "
        "training and stored in <run_dir>/reference; `auto`: adapters_off with "
        "LoRA, else copy. grpo (with task.beta > 0): copy or adapters_off.",
        choices=REFERENCES,
    )
    group_size: int = setting(
        8,
        "grpo: completions sampled per prompt; advantages compare each with the "
        "others of its group (TRL's num_generations).",
        min=2,
    )
    max_completion_len: int = setting(
        64,
        "grpo: the most tokens sampled per completion; prompts get the rest of "
        "data.seq_len (longer ones are skipped).",
        min=1,
    )
    temperature: float = setting(
        1.0, "grpo: the sampling temperature; 0: greedy (no exploration).", min=0
    )
    top_k: int = setting(
        0, "grpo: sample among the top_k likeliest tokens only; 0: off.", min=0
    )
    top_p: float = setting(
        1.0,
        "grpo: sample from the top_p probability mass only; 1: off.",
        above=0,
        max=1,
    )
    min_p: float = setting(
        0.0,
        "grpo: drop tokens less likely than min_p times the likeliest; 0: off.",
        min=0,
        below=1,
    )
    rewards: str = setting(
        "exact_answer",
        "grpo: the reward functions, summed (a list or comma-separated): "
        "`exact_answer` (1 when the completion's final answer equals the data's "
        "`answer` column), `format` (1 when the completion matches "
        "task.format_regex), or `package.module:function`, called as "
        "function(prompts, completions, **columns) -> list of floats (or None).",
        kind="names",
    )
    reward_weights: str = setting(
        "",
        "grpo: a weight per reward function (a list or comma-separated, in "
        "task.rewards' order); empty: 1 each.",
        kind="names",
    )
    format_regex: str | None = setting(
        None,
        "grpo: the pattern of the `format` reward (the whole completion must "
        "match it, `.` matching newlines too).",
    )
    scale_rewards: str = setting(
        "group",
        "grpo: what advantages are divided by: the group's reward std (`group`), "
        "the batch's (`batch`), or nothing (`none`, as Dr. GRPO).",
        choices=REWARD_SCALES,
    )
    loss_type: str = setting(
        "dapo",
        "grpo: how per-token losses are averaged: over all tokens of the batch "
        "(`dapo`, `bnpo`), per sequence then over sequences (`grpo`), or over "
        "rows x task.max_completion_len (`dr_grpo`).",
        choices=GRPO_LOSSES,
    )
    epsilon: float = setting(
        0.2, "grpo: the ratio's lower clip (1 - epsilon).", above=0, below=1
    )
    epsilon_high: float | None = setting(
        None,
        "grpo: the ratio's upper clip (1 + epsilon_high; DAPO uses 0.28); "
        "unset: task.epsilon.",
        above=0,
    )
    passes: int = setting(
        1,
        "grpo: optimizer updates on each sampled batch (TRL's num_iterations); "
        "the learning-rate schedule counts updates.",
        min=1,
    )


LORA_TARGETS = r"(^|\.)((q|k|v|o|qkv|gate|up|down|gate_up)_proj|c_attn|c_proj|c_fc)$"


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int = setting(
        0,
        "Rank of the LoRA adapters; 0: no LoRA (every weight trains). With LoRA "
        "only the adapters (and `train_also`) train; the rest stays frozen.",
        min=0,
    )
    alpha: float | None = setting(
        None, "Updates are scaled by alpha / rank; unset: alpha = rank.", above=0
    )
    dropout: float = setting(
        0.0, "Dropout on the adapters' inputs in training steps.", min=0, below=1
    )
    targets: str = setting(
        LORA_TARGETS,
        "Regex searched in each linear layer's dotted path (e.g. "
        "`layers.self_attn.q_proj`); default: the attention and MLP projections.",
    )
    rslora: bool = setting(False, "Scale by alpha / sqrt(rank) (rsLoRA).")
    train_also: str | None = setting(
        None,
        "Regex of more parameters to train besides the adapters, searched in "
        "dotted paths (e.g. `norm` for the norms, `^lm_head` for the head).",
    )


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    hf: str | None = setting(
        "hf",
        "Export the final model in Hugging Face format to this directory "
        "(relative to the run directory); empty: no export.",
        kind="path",
    )
    dtype: str | None = setting(
        None, "Dtype of the exported tensors; unset: the parameters'.", choices=DTYPES
    )
    every: int = setting(
        0,
        "Also export every this many steps to <hf>-steps/step_<k>; 0: only at the end.",
        min=0,
    )
    max_shard_size: str = setting(
        "5GB", "Split the safetensors into shards above this size.", kind="size"
    )
    ema: bool = setting(False, "Export the EMA weights (needs loop.ema).")
    adapter: bool | None = setting(
        None,
        "With LoRA: write the adapter in PEFT's format (adapter_model.safetensors, "
        "adapter_config.json) to <hf>; unset: true when LoRA is on.",
    )
    merged: bool = setting(
        False,
        "With LoRA: also write the full model with the adapters merged, in Hugging "
        "Face format, to <hf>-merged (<hf> itself when export.adapter = false).",
    )


@dataclasses.dataclass(frozen=True)
class Config:
    run_dir: str = setting(
        "runs/default",
        "Where the run writes: config.toml, metrics.jsonl, checkpoints/, hf/, tb/.",
        kind="path",
    )
    seed: int = setting(
        0, "Seed of the initial weights, the step keys and the data order."
    )
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    loop: LoopConfig = dataclasses.field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(
        default_factory=DistributedConfig
    )
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    export: ExportConfig = dataclasses.field(default_factory=ExportConfig)
    # The dotted keys a file or `--set` gave (see `explicit`): not a config key,
    # and two configs with the same values are equal however they were written.
    _explicit: frozenset[str] = dataclasses.field(
        default=frozenset(), compare=False, repr=False
    )


SECTIONS: dict[str, type] = {
    f.name: f.type  # type: ignore[misc]
    for f in dataclasses.fields(Config)
    if dataclasses.is_dataclass(f.type)
}
