"""`export_hook`: a training hook that exports the current (or EMA) model with
`export`, for `eqtrain.fit(hooks=[every(n, hook), at_end(hook)])`."""

import os
from typing import Any

from .._errors import ConfigError
from .._hooks import StepInfo
from ._export import export


_WHICH = ("model", "ema", "both")


class export_hook:  # noqa: N801 -- a hook factory, named like a function
    """A hook exporting `info.state.model` to `<out_dir>/step_<k>` (or to
    `out_dir` itself with `per_step=False`), replacing an earlier export there.

    Every export is atomic (`export` writes a temporary directory and renames it),
    so a crash mid-export never leaves a half-written directory under the name.

    Args:
        out_dir: where the exports go.
        per_step: one directory per step (`step_<k>`), or one directory replaced
            each time.
        which: `"model"`, `"ema"` (`info.state.ema_model`; the state must keep an
            EMA) or `"both"` (the EMA goes to `<target>_ema`).
        **export_kwargs: passed on to `eqtrain.hf.export` (`dtype`,
            `max_shard_size`, `tokenizer`, `model_type`, ...).

    Example:
        >>> from eqtrain import at_end, every
        >>> hook = export_hook("run/hf", dtype="bfloat16")
        >>> hooks = [every(1000, hook), at_end(hook)]
    """

    uses_state = True  # it exports the exact state of its steps

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        per_step: bool = True,
        which: str = "model",
        **export_kwargs: Any,
    ):
        if which not in _WHICH:
            raise ConfigError(f"`which` must be one of {_WHICH}; got {which!r}.")
        if "overwrite" in export_kwargs:
            raise ConfigError(
                "export_hook always replaces its own earlier export; drop `overwrite`."
            )
        self.out_dir = os.fspath(out_dir)
        self.per_step, self.which = per_step, which
        self.export_kwargs = export_kwargs
        self.last_step: int | None = None

    def target(self, step: int) -> str:
        """The directory the export of `step` goes to."""
        if self.per_step:
            return os.path.join(self.out_dir, f"step_{step}")
        return self.out_dir

    def __call__(self, info: StepInfo) -> None:
        if info.step == self.last_step:
            return  # e.g. `every(n)` and `at_end` firing on the same final step
        state, target = info.state, self.target(info.step)
        if self.which in ("model", "both"):
            export(state.model, None, target, overwrite=True, **self.export_kwargs)
        if self.which in ("ema", "both"):
            ema_target = target if self.which == "ema" else target + "_ema"
            export(
                state.ema_model, None, ema_target, overwrite=True, **self.export_kwargs
            )
        self.last_step = info.step
