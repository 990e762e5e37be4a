"""`[optim]`, `[loop]` and `[checkpoint]`: how the steps update the model, when
the run evaluates and stops, and what it saves."""

import dataclasses

from ._schema import (
    FINAL_LR_DIVISOR,
    OPTIMIZERS,
    SCHEDULES,
    WARMUP_PERCENT,
    setting,
)


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
        "auto",
        "Whether a lower or a higher `best` metric is better; `auto`: higher for "
        "a reward, an accuracy or a margin (`eval/reward`, "
        "`eval/rewards/{fn}/mean`, `eval/accuracy`, `eval/rewards/accuracies`, "
        "`eval/rewards/margins`), lower for any other (`eval/loss`).",
        choices=("auto", "min", "max"),
    )
    resume: str = setting(
        "auto",
        "`auto`: continue from the run directory's latest checkpoint if any; "
        "`never`: start fresh (refused if checkpoints exist); or a path to a "
        "run, checkpoints or step directory to start from.",
        kind="path",
    )
    async_save: bool = setting(True, "Write checkpoints in the background.")
