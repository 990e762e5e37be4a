"""Moved: `eqtrain.grpo` is `eqtrain.post_training.grpo`.
This path works for one release: importing it warns and gives the new module itself."""

import sys
import warnings

from .post_training import grpo as _moved


warnings.warn(
    "`eqtrain.grpo` moved to `eqtrain.post_training.grpo`; import it from "
    "there (the old path goes in the next release).",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
