"""The one "Did you mean ...?" hint of eqtrain's error messages (config keys,
choices, remat names, optimizers), so that every suggestion reads alike."""

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, options: Iterable[str], *, code: bool = False) -> str:
    """` Did you mean 'x'?` for the closest of `options` (`` `x` `` with `code`,
    as config keys are quoted), or `""` when none is close."""
    close = difflib.get_close_matches(name, list(options), n=1)
    if not close:
        return ""
    shown = f"`{close[0]}`" if code else repr(close[0])
    return f" Did you mean {shown}?"
