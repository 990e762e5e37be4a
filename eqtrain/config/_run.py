"""`[mesh]`, `[distributed]`, `[log]` and `[export]`: where the run's devices
and processes are, and what it writes besides checkpoints."""

import dataclasses

from ._schema import (
    DTYPES,
    setting,
)


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
