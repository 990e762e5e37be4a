"""`export_hook`: a training hook that exports the current (or EMA) model with
`export`, for `eqtrain.fit(hooks=[every(n, hook), at_end(hook)])`."""

import os
from typing import Any

from .. import lora
from .._errors import ConfigError
from .._hooks import StepInfo
from ._export import export
from ._peft import export_adapter


_WHICH = ("model", "ema", "both")
_FORMS = ("full", "adapter", "merged")


def _check_options(which: str, form: str, export_kwargs: dict[str, Any]) -> None:
    if which not in _WHICH:
        raise ConfigError(f"`which` must be one of {_WHICH}; got {which!r}.")
    if form not in _FORMS:
        raise ConfigError(f"`form` must be one of {_FORMS}; got {form!r}.")
    if "overwrite" in export_kwargs:
        raise ConfigError(
            "export_hook always replaces its own earlier export; drop `overwrite`."
        )


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
        form: `"full"` (a Hugging Face model), or for a model with LoRA adapters
            `"adapter"` (PEFT's adapter files, `export_adapter`) or `"merged"`
            (a Hugging Face model with the adapters folded in).
        pick: the part of the state's model to export (applied to the trainable
            filter too), e.g. `lambda m: m.policy` for a
            `preference.WithReference`; default: the whole model.
        **export_kwargs: passed on to `eqtrain.hf.export` (`dtype`,
            `max_shard_size`, `tokenizer`, `model_type`, ...); an adapter export
            uses `model_type`, `spec` (the `lora.LoRA`, to record its alpha
            and rsLoRA as written), `base_model_name_or_path`, `tokenizer` and
            `chat_template` only, and writes the state's other trained leaves
            as PEFT's `modules_to_save`.

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
        form: str = "full",
        pick: Any = None,
        **export_kwargs: Any,
    ):
        _check_options(which, form, export_kwargs)
        self.form = form
        self.pick = pick if pick is not None else (lambda model: model)
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
        trained = self._trained(state)
        if self.which in ("model", "both"):
            self._write(self.pick(state.model), target, trained)
        if self.which in ("ema", "both"):
            ema_target = target if self.which == "ema" else target + "_ema"
            self._write(self.pick(state.ema_model), ema_target, trained)
        self.last_step = info.step

    def _trained(self, state: Any) -> Any:
        """The picked part of the state's trainable filter (None: it has none)."""
        trained = getattr(state, "trainable", None)
        if trained is not None and trained is not True:
            return self.pick(trained)
        return trained

    def _write(self, model: Any, target: str, trained: Any) -> None:
        if self.form == "adapter":
            export_adapter(
                model,
                target,
                model_type=self.export_kwargs.get("model_type"),
                spec=self.export_kwargs.get("spec"),
                base_model_name_or_path=self.export_kwargs.get(
                    "base_model_name_or_path"
                ),
                trained=None if trained is True else trained,
                tokenizer=self.export_kwargs.get("tokenizer"),
                chat_template=self.export_kwargs.get("chat_template"),
                overwrite=True,
            )
            return
        adapter_only = ("spec", "base_model_name_or_path")
        kwargs = {k: v for k, v in self.export_kwargs.items() if k not in adapter_only}
        if self.form == "merged":
            model = lora.merge(model)
        export(model, None, target, overwrite=True, **kwargs)
