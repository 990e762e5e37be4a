"""Moved: `eqtrain.rollout` is `eqtrain.post_training.rollout`.
This path works for one release: importing it warns and gives the new module itself."""

import sys
import warnings

from .post_training import rollout as _moved


warnings.warn(
    "`eqtrain.rollout` moved to `eqtrain.post_training.rollout`; import it from "
    "there (the old path goes in the next release).",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
