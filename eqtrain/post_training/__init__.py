"""Post-training: one family of algorithms on a trained model, each a module
as Optax keeps its sub-packages.

- `preference`: DPO-style losses on chosen/rejected pairs, and the policy
  with its frozen reference (`WithReference`).
- `grpo`: GRPO's (and GSPO's) formulas on a group of completions.
- `rollout`: GRPO's step, sampling and scoring inside the compiled step.
- `rewards`: reward functions, plain Python callables run on the host.
- `distill`: knowledge distillation from a frozen teacher (GKD's generalised
  JSD, on-policy completions).

The previous paths (`eqtrain.preference`, `eqtrain.grpo`, `eqtrain.rollout`,
`eqtrain.rewards`) still work for one release, with a `DeprecationWarning`.

Example:
    >>> from eqtrain.post_training import preference
    >>> loss = preference.dpo  # a loss of chosen/rejected log-probs
"""

from . import (
    distill as distill,
    grpo as grpo,
    preference as preference,
    rewards as rewards,
    rollout as rollout,
)
