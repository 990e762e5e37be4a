"""Rewards for online RL (`eqtrain.post_training.grpo`): plain Python
callables, run on the host after sampling.

A reward is `reward(prompts, completions, **columns) -> list[float | None]`, one
value per row (None: this function cannot score that completion). It is called
with keyword arguments, so TRL's reward functions (`def f(completions,
**kwargs)`) work too; `columns` are the dataset's other columns, each a list
aligned with the rows (e.g. `answer`).

    funcs = [("correct", rewards.load_reward("exact_answer"), 1.0),
             ("format", rewards.format_regex(r"<think>.*</think>.*"), 0.2)]
    total, per_function = rewards.score(funcs, prompts, completions,
                                        {"answer": answers})
"""

import contextlib
import contextvars
import importlib
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import ConfigError


Reward = Callable[..., Sequence[float | None]]

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_MARKERS = ("####", "answer:")


def _last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return text[i:]


def final_answer(text: str) -> str:
    """The final answer of a completion, by the first rule that applies:

    1. the contents of the last `\\boxed{...}`;
    2. the rest of the line after the last `####` (GSM8K's marker);
    3. the rest of the line after the last `answer:` (any case);
    4. the last number (`-1,234.5`, `$12`, `.5`);
    5. the last non-empty line ("" if none).
    """
    for rule in (_last_boxed, _after_marker, _last_number):
        answer = rule(text)
        if answer is not None:
            return answer
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _after_marker(text: str) -> str | None:
    """The rest of the line after the last `####`, else after the last
    `answer:` (any case); None without either."""
    lower = text.lower()
    for marker in _MARKERS:
        at = lower.rfind(marker)
        if at >= 0:
            lines = text[at + len(marker) :].strip().splitlines()
            return lines[0] if lines else ""
    return None


def _last_number(text: str) -> str | None:
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalise(text: str) -> str | float:
    """Whitespace collapsed, lower case, a trailing period dropped; a number
    (after removing `,` and `$`) as a float, so that `1,000` equals `1000.0`."""
    text = " ".join(text.split()).lower().rstrip(".").strip()
    try:
        return float(text.replace(",", "").replace("$", ""))
    except ValueError:
        return text


def _reference_answer(answer: Any) -> str:
    """The `answer` column's value; a GSM8K solution ("... #### 72") gives the
    text after its last `####`."""
    text = str(answer)
    return text.rsplit("####", 1)[1] if "####" in text else text


def exact_answer(
    prompts: Sequence[Any],
    completions: Sequence[str],
    answer: Sequence[Any] | None = None,
    **columns: Any,
) -> list[float]:
    """1.0 where the completion's `final_answer` equals the row's `answer` after
    normalising both (whitespace, case, a trailing period; numbers compared as
    numbers: `1,000` = `1000.0`), else 0.0. Needs an `answer` column."""
    if answer is None:
        raise ConfigError(
            "the `exact_answer` reward compares with the `answer` column, which "
            f"the data lacks (columns: {sorted(columns)}); add it, or use "
            "another reward."
        )
    return [
        float(_normalise(final_answer(c)) == _normalise(_reference_answer(a)))
        for c, a in zip(completions, answer, strict=True)
    ]


def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ConfigError(f"format_regex: bad pattern {pattern!r}: {e}.") from None


def format_regex(pattern: str) -> Reward:
    """A reward: 1.0 where the whole completion matches `pattern`
    (`re.fullmatch` with `re.DOTALL`: `.` matches newlines too), else 0.0."""
    compiled = _compile(pattern)

    def format_reward(
        prompts: Sequence[Any], completions: Sequence[str], **columns: Any
    ) -> list[float]:
        return [float(compiled.fullmatch(c) is not None) for c in completions]

    format_reward.__name__ = f"format_regex({pattern!r})"
    return format_reward


BUILTINS: dict[str, Reward] = {"exact_answer": exact_answer}
"""Rewards `load_reward` finds by name alone."""


def _import(spec: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only the module named, not one it imports itself, is "not found" here.
        if e.name is None or not (module_name + ".").startswith(e.name + "."):
            raise
        raise ConfigError(
            f"reward {spec!r}: no module {module_name!r} (is it installed, or on "
            "PYTHONPATH?)."
        ) from None


def _attribute(spec: str, module: Any, module_name: str, attr: str) -> Any:
    """`module`'s attribute `attr` (dotted: `Class.f`)."""
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"reward {spec!r}: {module_name!r} has no {attr!r}.")
        obj = getattr(obj, part)
    return obj


def load_reward(spec: str) -> Reward:
    """A reward function by name: a built-in (`"exact_answer"`) or
    `"package.module:function"` (the attribute may be dotted, `"mod:Class.f"`).
    Inside `imports_deferred()`, a `"module:function"` name is checked only for
    its form, and gives a stand-in that imports the function when called.

    Raises:
        ConfigError: the name is neither, the module or attribute is missing, or
            the object is not callable.
    """
    if spec in BUILTINS:
        return BUILTINS[spec]
    module_name, attr = _parse(spec)
    if _deferred.get():
        return _Deferred(spec)
    obj = _attribute(spec, _import(spec, module_name), module_name, attr)
    return _callable(spec, obj)


_deferred = contextvars.ContextVar("eqtrain_rewards_deferred", default=False)


@contextlib.contextmanager
def imports_deferred() -> Iterator[None]:
    """Within the block, `load_reward` imports no reward module (see there).
    For what opens a finished run without scoring anything (`eqtrain export`,
    `info`, `generate`): a GRPO run's config names its reward functions, and
    these commands must work where their module cannot be imported."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


class _Deferred:
    """A reward named `"module:function"`, imported when first called."""

    def __init__(self, spec: str):
        self.spec = self.__name__ = spec

    def __call__(self, *args: Any, **kwargs: Any) -> Sequence[float | None]:
        token = _deferred.set(False)
        try:
            fn = load_reward(self.spec)
        finally:
            _deferred.reset(token)
        return fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"load_reward({self.spec!r}) (not imported yet)"


def _parse(spec: str) -> tuple[str, str]:
    """`(module, attribute)` of `"package.module:function"`."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"reward {spec!r} is neither a built-in ({sorted(BUILTINS)}) nor "
            "'package.module:function'."
        )
    return module_name, attr


def _callable(spec: str, obj: Any) -> Reward:
    if not callable(obj):
        raise ConfigError(
            f"reward {spec!r} is a {type(obj).__name__}, not a callable "
            "`reward(prompts, completions, **columns) -> list[float]`."
        )
    return obj


def _value(name: str, row: int, v: Any) -> float:
    """One returned value as a float: NaN for None, else a finite number."""
    if v is None:
        return math.nan
    if isinstance(v, str | bytes) or not hasattr(v, "__float__"):
        raise ConfigError(
            f"reward {name!r} returned {v!r} for row {row}; expected a float or None."
        )
    x = float(v)
    if not math.isfinite(x):
        raise ConfigError(
            f"reward {name!r} returned {x} for row {row}; rewards must be finite "
            "(return None for a completion it cannot score)."
        )
    return x


class RewardError(ConfigError):
    """A reward function raised (or called `sys.exit`): the message names it and
    what it raised (the original exception is the `__cause__`)."""

    def __init__(self, name: str, error: BaseException):
        self.name, self.error = name, error
        what = f"raised {type(error).__name__}: {error}"
        if isinstance(error, SystemExit):
            what = (
                f"called sys.exit({error.code!r}); a reward function returns its "
                "scores and never ends the process"
            )
        super().__init__(
            f"reward {name!r} {what}. It is called as reward(prompts=..., "
            "completions=..., **columns), one list entry per completion, and must "
            "return one float (or None) per completion."
        )


def _call(
    name: str,
    fn: Reward,
    prompts: list[Any],
    completions: list[str],
    columns: Mapping[str, list[Any]],
) -> np.ndarray:
    try:
        out = fn(prompts=prompts, completions=completions, **columns)
    except (Exception, SystemExit) as e:  # sys.exit inside a reward is its error
        raise RewardError(name, e) from e
    _check_returned(name, out, len(completions))
    return np.array([_value(name, i, v) for i, v in enumerate(out)], np.float32)


def _check_returned(name: str, out: Any, rows: int) -> None:
    """A reward must return a sequence of one value per completion."""
    if isinstance(out, str | bytes | Mapping) or not hasattr(out, "__len__"):
        raise ConfigError(
            f"reward {name!r} returned a {type(out).__name__}; expected a list "
            "with one float (or None) per completion."
        )
    if len(out) != rows:
        raise ConfigError(
            f"reward {name!r} returned {len(out)} values for {rows} "
            "completions; it must return one per completion."
        )


def _check_rows(
    prompts: Sequence[Any], completions: Sequence[str], columns: Mapping[str, Any]
) -> None:
    rows = len(completions)
    for label, values in (("prompts", prompts), *columns.items()):
        if len(values) != rows:
            raise ConfigError(
                f"{label!r} has {len(values)} entries for {rows} completions; "
                "every column must have one per completion."
            )


def score(
    rewards: Sequence[tuple[str, Reward, float]],
    prompts: Sequence[Any],
    completions: Sequence[str],
    columns: Mapping[str, Sequence[Any]] | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Every reward function on a batch, and their weighted sum.

    Args:
        rewards: `(name, function, weight)` triples; names must differ.
        prompts, completions: one per row (a prompt repeated for each of its
            completions).
        columns: other data columns, each with one entry per row.

    Returns:
        `(total [rows] float32, {name: [rows] float32})`. A None reward is NaN
        in its function's array and left out of the total (TRL's `nansum`); a row
        where every function returned None is NaN in the total, which
        `grpo.group_advantages` leaves out of its group and gives advantage 0.

    Raises:
        ConfigError: naming the function, when one returns the wrong number of
            values, a value that is not a number or None, or a non-finite one.
    """
    _check_names(rewards)
    columns = {k: list(v) for k, v in (columns or {}).items()}
    _check_rows(prompts, completions, columns)
    p, c = list(prompts), list(completions)
    per = {name: _call(name, fn, p, c, columns) for name, fn, _ in rewards}
    return _weighted_total(per, rewards), per


def _check_names(rewards: Sequence[tuple[str, Reward, float]]) -> None:
    if not rewards:
        raise ConfigError("`score` needs at least one reward function.")
    names = [name for name, _, _ in rewards]
    if len(set(names)) != len(names):
        raise ConfigError(f"reward names must differ; got {names}.")


def _weighted_total(
    per: dict[str, np.ndarray], rewards: Sequence[tuple[str, Reward, float]]
) -> np.ndarray:
    """The weighted sum over the functions, NaN where every one is NaN."""
    values = np.stack([per[name] for name, _, _ in rewards], axis=1)
    weights = np.array([w for _, _, w in rewards], np.float32)
    total = np.nansum(values * weights, axis=1).astype(np.float32)
    total[np.isnan(values).all(axis=1)] = np.nan
    return total
