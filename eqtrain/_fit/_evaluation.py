"""Evaluation during and after training: `Evaluation` (what `fit` evaluates on, and
when) and `evaluate` (one pass over the eval data, averaged by weight). Builds on
`_jit` (a plain eval step is compiled without donation) and `_reading`."""

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from .._errors import ConfigError
from .._jit import Jitted, jit
from .._state import TrainState
from .._types import Batch
from ._reading import to_host


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What `fit` evaluates on, and when.

    Attributes:
        step: `eval_step(loss_fn)`, plain or compiled with `eqtrain.jit(...,
            donate=False)` (a plain one is compiled by `fit`).
        data: a re-iterable of eval batches (a list, or a loader), read in full at
            every evaluation.
        every: evaluate after every `every` steps (None: only at the end);
            metrics are averaged over `data` weighted by `weight` and reported as
            `eval/<name>`.
        at_end: also evaluate when the run ends by reaching `num_steps` or running
            out of data (if it did not just evaluate).
    """

    step: Callable[..., Any] | Jitted
    data: Iterable[Batch]
    every: int | None = None
    at_end: bool = True

    def __post_init__(self) -> None:
        check_every(self.every)
        if iter(self.data) is self.data:
            raise ConfigError(
                "`eval_data` must be re-iterable (it is read at every evaluation), "
                "but an iterator was given. Pass a list or a loader object instead."
            )

    def due(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0


def check_every(every: Any) -> None:
    if every is not None and (not isinstance(every, int) or every < 1):
        raise ConfigError(f"`eval_every` must be an int >= 1; got {every!r}.")


def compiled_eval(eval_step: Callable[..., Any] | Jitted) -> Jitted:
    """`eval_step` compiled without donation (as given, when it already is)."""
    if isinstance(eval_step, Jitted):
        return eval_step
    return jit(eval_step, donate=False)


def evaluate(
    state: TrainState,
    eval_step: Callable[..., Any] | Jitted,
    data: Iterable[Batch],
    *,
    prefix: str = "eval/",
) -> dict[str, float]:
    """Evaluate `state` on every batch of `data`; average weighted by `weight`.

    This is what `fit` does at each evaluation, available on its own (e.g. to
    evaluate a restored state).

    Args:
        state: the state to evaluate (not consumed).
        eval_step: from `eval_step(loss_fn)`, plain or compiled with
            `eqtrain.jit(..., donate=False)` (plain ones are compiled here).
        data: an iterable of batches (read once, in full).
        prefix: put before every metric name.

    Returns:
        `{prefix + name: mean}` for each metric, the mean weighted by each batch's
        `weight` (tokens or examples), and `prefix + "weight"`: the total weight.
        A metric whose name's last part starts with `min_` or `max_` (e.g.
        `completions/max_length`) is the least or greatest over the batches.
    """
    compiled = compiled_eval(eval_step)
    if compiled.donate:
        raise ConfigError(
            "`evaluate` needs an evaluation step compiled with donate=False: a "
            "donating one would consume the state."
        )
    arrays, _ = compiled.prepare(state)
    outputs = [compiled.call_flat(arrays, batch) for batch in data]
    if not outputs:
        raise ConfigError("the eval data yielded no batches; evaluation needs one.")
    return _weighted_means(to_host(outputs), prefix)


def _weighted_means(host: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    """Each metric's mean over the batches, weighted by their `weight` (equal
    weights when they sum to zero), and the total weight."""
    weights = np.array([m.get("weight", 1.0) for m in host], np.float64)
    total = float(weights.sum())
    scale = weights / total if total > 0 else np.full(len(host), 1.0 / len(host))
    averaged = {
        f"{prefix}{name}": _reduced(name, [m[name] for m in host], scale)
        for name in host[0]
        if name != "weight"
    }
    averaged[f"{prefix}weight"] = total
    return averaged


def _reduced(name: str, values: list[Any], scale: np.ndarray) -> float:
    """One metric over the batches: a `min_...` or `max_...` one (the last part
    of its name, e.g. `completions/max_length`) is the least or greatest value,
    any other the weighted mean."""
    last = name.rsplit("/", 1)[-1]
    if last.startswith(("min_", "max_")):
        pick = min if last.startswith("min_") else max
        return float(pick(float(v) for v in values))
    return float(sum(s * v for s, v in zip(scale, values, strict=True)))
