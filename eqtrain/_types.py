"""Shared type aliases for eqtrain's public signatures."""

from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

from jaxtyping import Array, ArrayLike, PRNGKeyArray, PyTree


Batch: TypeAlias = PyTree[ArrayLike]
"""One batch: any pytree of arrays. A mapping may carry a `loss_mask` or `weights`."""

Metrics: TypeAlias = Mapping[str, Array]
"""Scalar device arrays produced inside a step, keyed by name."""

HostMetrics: TypeAlias = Mapping[str, float]
"""Metrics fetched to the host as Python floats."""

LossFn: TypeAlias = Callable[..., tuple[Array, Mapping[str, Array]]]
"""`loss_fn(model, batch, key) -> (loss, aux)`; with a model state,
`loss_fn(model, batch, key, *, model_state) -> (loss, aux, model_state)`."""

Key: TypeAlias = PRNGKeyArray

Model: TypeAlias = Any
