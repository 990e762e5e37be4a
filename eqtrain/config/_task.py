"""`[task]` and `[lora]`: what the run learns (language modelling, SFT,
preference optimisation, GRPO, distillation) and which parameters train."""

import dataclasses

from ._schema import (
    GRPO_LOSSES,
    IMPORTANCE_LEVELS,
    LORA_TARGETS,
    REFERENCES,
    REWARD_SCALES,
    TASKS,
    setting,
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
        "policy and scored by task.rewards; or `distill`: the student learns a "
        "frozen teacher's (task.teacher) token distributions on SFT data's "
        "completions (GKD).",
        choices=TASKS,
    )
    beta: float | None = setting(
        None,
        "dpo/ipo/simpo: the beta of the loss; unset: 0.1 (dpo, ipo), 2.0 (simpo). "
        "grpo: the weight of the KL penalty to the reference model; unset: 0 (no "
        "penalty, no reference). distill: the generalised JSD's beta, in [0, 1] "
        "(0: forward KL(teacher || student), 1: reverse KL); unset: 0.5.",
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
        "data.seq_len (longer ones are skipped). distill: the most tokens of a "
        "sampled completion (cut to data.seq_len with its prompt).",
        min=1,
    )
    temperature: float = setting(
        1.0,
        "grpo, distill: the sampling temperature; 0: greedy (no exploration). "
        "distill samples at it only (its loss uses 1, as TRL's; TRL's GKD "
        "samples at 0.9).",
        min=0,
    )
    eval_temperature: float = setting(
        0.0,
        "grpo: the temperature at which data.eval's prompts are completed at each "
        "evaluation; 0: greedy, one completion per prompt; above 0: "
        "task.group_size completions per prompt (with task.top_k/top_p/min_p).",
        min=0,
    )
    top_k: int = setting(
        0, "grpo, distill: sample among the top_k likeliest tokens only; 0: off.", min=0
    )
    top_p: float = setting(
        1.0,
        "grpo, distill: sample from the top_p probability mass only; 1: off.",
        above=0,
        max=1,
    )
    min_p: float = setting(
        0.0,
        "grpo, distill: drop tokens less likely than min_p times the likeliest; "
        "0: off.",
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
    kl_bias_correction: bool = setting(
        True,
        "grpo (with task.beta > 0): multiply the k3 KL term by the importance "
        "ratio (TRL 1.16's default use_bias_correction_kl, DeepSeek-V3.2's form); "
        "false: the plain k3 estimate.",
    )
    importance_sampling_level: str = setting(
        "token",
        "grpo: the importance ratio per completion token (`token`, PPO's), or one "
        "per completion, the exponential of its tokens' mean log-ratio "
        "(`sequence`: GSPO, arXiv:2507.18071; TRL's importance_sampling_level).",
        choices=IMPORTANCE_LEVELS,
    )
    prompt_buckets: int = setting(
        4,
        "grpo: prompts are cut to the narrowest of this many widths that holds "
        "each batch's longest (the prompt width, then halves of it, the "
        "narrowest at least 64 tokens), and an epoch's batches group prompts of "
        "one width; one compiled step per width. 1: every prompt at the full "
        "width.",
        min=1,
    )
    passes: int = setting(
        1,
        "grpo: optimizer updates on each sampled batch (TRL's num_iterations); "
        "the learning-rate schedule counts updates.",
        min=1,
    )
    teacher: str | None = setting(
        None,
        "distill: the frozen teacher: a Hugging Face directory, or an eqtrain "
        "run directory with its export (<run>/hf). Its vocabulary must be the "
        "student's; it is read at the start and never checkpointed (the run "
        "records its content hash).",
        kind="path",
    )
    lmbda: float = setting(
        0.5,
        "distill: the fraction of steps whose completions are sampled from the "
        "student (on-policy, GKD's lambda); the others train on the data's "
        "completions (or the teacher's, with task.seq_kd).",
        min=0,
        max=1,
    )
    seq_kd: bool = setting(
        False,
        "distill: the steps that do not sample from the student sample their "
        "completions from the teacher (sequence-level KD) instead of using the "
        "data's.",
    )


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
