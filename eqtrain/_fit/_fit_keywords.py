"""`fit`'s flat keywords of the previous release (`eval_every=`, `time_limit=`,
`read_every=`, ...), regrouped into `Evaluation`, `StopConditions` and `Reading`.
Each still works for one release, with a `DeprecationWarning` that names its
replacement; an unknown keyword is a `TypeError`, as for any function."""

import warnings
from collections.abc import Mapping
from typing import Any

from .._errors import ConfigError
from ._evaluation import Evaluation, check_every
from ._reading import Reading
from ._stops import StopConditions


# flat keyword -> (fit's keyword, its type, the field)
FLAT = {
    "eval_step": ("evaluation", "Evaluation", "step"),
    "eval_data": ("evaluation", "Evaluation", "data"),
    "eval_every": ("evaluation", "Evaluation", "every"),
    "eval_at_end": ("evaluation", "Evaluation", "at_end"),
    "time_limit": ("stop", "StopConditions", "time_limit"),
    "kill_switch": ("stop", "StopConditions", "kill_switch"),
    "handle_signals": ("stop", "StopConditions", "handle_signals"),
    "agree_every": ("stop", "StopConditions", "agree_every"),
    "history": ("reading", "Reading", "history"),
    "read_every": ("reading", "Reading", "every"),
    "read_seconds": ("reading", "Reading", "seconds"),
}


def regroup(
    flat: Mapping[str, Any],
    evaluation: Evaluation | None,
    stop: StopConditions | None,
    reading: Reading | None,
) -> tuple[Evaluation | None, StopConditions, Reading]:
    """`fit`'s three groups, with the flat keywords `flat` (if any) moved in."""
    for name in flat:
        _warn(name)
    return (
        _evaluation(evaluation, flat),
        _group(stop, _fields(flat, "stop"), StopConditions, _STOP_MIXED),
        _group(reading, _fields(flat, "reading"), Reading, _READING_MIXED),
    )


def _warn(name: str) -> None:
    """Refuse an unknown keyword; warn that a known one moved to its group."""
    if name not in FLAT:
        raise TypeError(f"fit() got an unexpected keyword argument {name!r}")
    group, kind, field = FLAT[name]
    warnings.warn(
        f"`fit({name}=...)` is deprecated: pass `{group}=eqtrain.{kind}("
        f"{field}=...)` instead (the flat keyword goes in the next release).",
        DeprecationWarning,
        stacklevel=4,  # the caller of `fit`
    )


def _fields(flat: Mapping[str, Any], group: str) -> dict[str, Any]:
    """The flat keywords of `group`, by their field names."""
    return {FLAT[k][2]: v for k, v in flat.items() if FLAT[k][0] == group}


_STOP_MIXED = (
    "give `stop=StopConditions(...)` or the `time_limit`, `kill_switch`, "
    "`handle_signals`, `agree_every` keywords, not both."
)
_READING_MIXED = (
    "give `reading=Reading(...)` or the `history`, `read_every`, `read_seconds` "
    "keywords, not both."
)


def _group(given: Any, fields: dict[str, Any], kind: type, mixed: str) -> Any:
    """`given`, or a `kind` built from the flat `fields` (not both)."""
    if given is not None and fields:
        raise ConfigError(mixed)
    return given if given is not None else kind(**fields)


def _evaluation(
    evaluation: Evaluation | None, flat: Mapping[str, Any]
) -> Evaluation | None:
    """`evaluation`, or one from the `eval_*` keywords (not both)."""
    fields = _fields(flat, "evaluation")
    if evaluation is not None and fields:
        raise ConfigError(
            "give `evaluation=Evaluation(...)` or the `eval_*` keywords, not both."
        )
    if evaluation is not None or not fields:
        return evaluation
    _check_complete(fields.get("step"), fields.get("data"), fields.get("every"))
    if fields.get("step") is None:
        return None
    return Evaluation(**fields)


def _check_complete(step: Any, data: Any, every: Any) -> None:
    """An evaluation from keywords needs both its step and its data."""
    check_every(every)
    if every is not None and (step is None or data is None):
        raise ConfigError(
            "`eval_every` needs both `eval_step=` and `eval_data=` (a re-iterable "
            "of batches, e.g. a list or a loader)."
        )
    if (step is None) != (data is None):
        raise ConfigError(
            "evaluation needs both `eval_step=` and `eval_data=`; got only "
            f"`{'eval_step' if data is None else 'eval_data'}`."
        )
