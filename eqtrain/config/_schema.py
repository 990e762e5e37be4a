"""How a config key is declared (`setting`: its default, help text and checks)
and the vocabularies the sections' keys choose from.

Each field's metadata carries its help text and its checks (`choices`, `min`,
`max`, `kind`), which drive parsing, validation, `eqtrain config --show` and the
generated CLI reference alike, so they cannot drift apart. The sections
themselves are dataclasses in `_model`, `_data`, `_training`, `_task` and `_run`;
`_config.Config` gathers them.
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
TASKS = ("lm", "sft", "dpo", "ipo", "orpo", "simpo", "grpo", "distill")
PREFERENCE_TASKS = ("dpo", "ipo", "orpo", "simpo")
DATA_FORMATS = ("auto", "text", "chat", "prompt_completion", "preference")
REFERENCES = ("auto", "copy", "adapters_off", "precomputed")
GRPO_LOSSES = (
    "dapo",
    "grpo",
    "dr_grpo",
    "bnpo",
)  # = eqtrain.post_training.grpo.LOSS_TYPES
REWARD_SCALES = ("group", "batch", "none")  # = eqtrain.post_training.grpo.SCALES
IMPORTANCE_LEVELS = ("token", "sequence")  # = eqtrain.post_training.grpo.LEVELS
OPTIMIZERS = ("adamw", "adam", "lion", "sgd", "adafactor")
SCHEDULES = ("constant", "linear", "cosine", "wsd")
DTYPES = ("float32", "bfloat16", "float16")
TRAIN_DTYPES = ("float32", "bfloat16")  # float16 would need loss scaling
# `model.loss_chunk = "auto"` chunks the loss from this vocabulary size on: below
# it the chunks' overhead outweighs the logits they never hold (docs/performance.md,
# "Memory", measures it).
LOSS_CHUNK_MIN_VOCAB = 2048
AUTO_LOSS_CHUNK = 256
SEQUENCE_SCHEMES = ("ulysses", "ring", "all_gather")  # = eqtrain.models.SCHEMES
SEQUENCE_LAYOUTS = ("contiguous", "zigzag")
# The defaults of unset `optim.warmup_steps` and `optim.final_lr`, which depend on
# other keys: see `OptimConfig.resolved`.
WARMUP_PERCENT = 5  # of loop.steps
FINAL_LR_DIVISOR = 10  # of optim.lr (0 for the constant schedule)
# The default `model.quantize_skip` (= eqtrain.quantize.DEFAULT_SKIP): the head and
# the mixture-of-experts routers stay in full precision.
QUANTIZE_SKIP = r"(^|\.)(lm_head|mlp\.gate|mlp\.shared_expert_gate)$"
QUANTIZE_KINDS = ("nf4", "fp4", "int8")  # = eqtrain.quantize.KINDS
# The default `lora.targets`: the attention and MLP projections of every family.
LORA_TARGETS = r"(^|\.)((q|k|v|o|qkv|gate|up|down|gate_up)_proj|c_attn|c_proj|c_fc)$"
