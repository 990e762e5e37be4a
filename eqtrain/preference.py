"""Moved: `eqtrain.preference` is `eqtrain.post_training.preference`.
This path works for one release: importing it warns and gives the new module itself."""

import sys
import warnings

from .post_training import preference as _moved


warnings.warn(
    "`eqtrain.preference` moved to `eqtrain.post_training.preference`; import it from "
    "there (the old path goes in the next release).",
    DeprecationWarning,
    stacklevel=2,
)
sys.modules[__name__] = _moved
