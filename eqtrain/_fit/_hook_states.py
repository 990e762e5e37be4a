"""Hooks that keep state across a resume. A hook that defines `state_dict()` (a dict
of plain JSON values: counters, best values) and `load_state_dict(state)` keeps it
under its `state_key` (an attribute; default: its class's name). `fit` hands every
such state to the checkpointer with each save (`StepInfo.hook_states`; the Orbax
checkpointer writes them into the step's manifest, as JSON, never pickled), and
loads those it is given back (`fit(hook_states=resume_run(...).hook_states)`).
A stateful hook whose `stopped` is a message has ended the run already (an early
stop): `fit` then trains nothing and says so."""

import copy
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from .._errors import ConfigError, EqtrainWarning
from .._hooks import Scheduled


def state_key(hook: Any) -> str:
    """The name a hook's state is kept under: its `state_key`, or its class's name."""
    key = getattr(hook, "state_key", None)
    if key is None:
        return type(hook).__name__
    if not isinstance(key, str) or not key:
        raise ConfigError(
            f"a hook's `state_key` must be a non-empty string; {hook!r} has {key!r}."
        )
    return key


def stateful(hooks: Iterable[Scheduled]) -> dict[str, Any]:
    """The hooks that keep state, by key (a hook scheduled twice counts once);
    `ConfigError` for two hooks under one key, or a half-defined protocol."""
    out: dict[str, Any] = {}
    for hook in _unique(h.hook for h in hooks):
        if not callable(getattr(hook, "state_dict", None)):
            continue
        key = state_key(hook)
        if not callable(getattr(hook, "load_state_dict", None)):
            raise ConfigError(
                f"the hook {key} defines `state_dict()` but not "
                "`load_state_dict(state)`: both are needed for its state to come "
                "back on a resume."
            )
        if key in out:
            raise ConfigError(
                f"two hooks keep their state under the key {key!r}, so one would "
                "be restored into the other on a resume: give each a distinct "
                "`state_key` attribute (e.g. `hook.state_key = 'best-val'`)."
            )
        out[key] = hook
    return out


def _unique(hooks: Iterable[Any]) -> list[Any]:
    seen: dict[int, Any] = {}
    for hook in hooks:
        seen.setdefault(id(hook), hook)
    return list(seen.values())


def collect(hooks: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each stateful hook's `state_dict()`, checked to be plain JSON and copied
    (a save may be written after the hook moved on)."""
    out = {}
    for key, hook in hooks.items():
        state = hook.state_dict()
        if not isinstance(state, Mapping):
            raise ConfigError(
                f"the hook {key}'s `state_dict()` must return a dict; got "
                f"{type(state).__name__}."
            )
        for where, problem in _problems(state, "state_dict()"):
            raise ConfigError(
                f"the hook {key}'s state is kept in the checkpoint's manifest as "
                f"plain JSON, but {where} {problem}. Return Python numbers "
                "(`float(x)`, `int(x)`), strings, booleans, None, lists and dicts "
                "with string keys (None for a value not known yet)."
            )
        out[key] = copy.deepcopy(dict(state))
    return out


def _problems(value: Any, where: str) -> Iterable[tuple[str, str]]:
    """Where `value` is not plain JSON, and why (the first problem suffices)."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            yield where, f"is {value} (JSON has no NaN or infinity)"
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                yield where, f"has the key {k!r}, not a string"
            yield from _problems(v, f"{where}[{k!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _problems(v, f"{where}[{i}]")
        return
    yield where, f"is a {type(value).__module__}.{type(value).__name__}"


def load(hooks: Mapping[str, Any], states: Mapping[str, Any]) -> None:
    """Give each stateful hook its saved state; a state no hook claims is
    ignored, with a warning (a hook dropped or renamed since the save)."""
    unclaimed = sorted(k for k in states if k not in hooks)
    if unclaimed:
        warnings.warn(
            f"the saved state of hook(s) {unclaimed} matches no hook of this run "
            f"(hooks keeping state here: {sorted(hooks) or 'none'}); it is "
            "ignored. A hook's `state_key` names its state.",
            EqtrainWarning,
            stacklevel=3,  # the caller of `fit`
        )
    for key, hook in hooks.items():
        if key in states:
            hook.load_state_dict(copy.deepcopy(dict(states[key])))


def ended(hooks: Mapping[str, Any]) -> tuple[str, str] | None:
    """`(key, message)` of the first stateful hook that says the run has ended
    (its `stopped` is a message), else None."""
    for key, hook in hooks.items():
        message = getattr(hook, "stopped", None)
        if isinstance(message, str) and message:
            return key, message
    return None
