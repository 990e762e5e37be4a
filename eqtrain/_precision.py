"""Mixed-precision policy: parameters stay in their own dtype (f32), compute runs in
`compute_dtype`, results come back in `output_dtype`.

The cast happens *inside* the differentiated function, so gradients and optimizer
state keep the parameters' dtype.
"""

import dataclasses
from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._errors import ConfigError
from ._quant import QuantizedWeight


@dataclasses.dataclass(frozen=True)
class Precision:
    """A mixed-precision policy.

    Attributes:
        compute_dtype: dtype floating parameters (and, with `cast_batch`, floating
            batch leaves) are cast to for the forward and backward pass.
        output_dtype: dtype of the loss and the metrics.
        cast_batch: also cast floating batch leaves (images, features), so matmuls
            really run in `compute_dtype` rather than being promoted back to f32.
            Integer leaves (tokens, masks stored as ints) are never touched.
    """

    compute_dtype: Any = jnp.bfloat16
    output_dtype: Any = jnp.float32
    cast_batch: bool = True

    def cast_model(self, model: PyTree) -> PyTree:
        return cast_floating(model, self.compute_dtype)

    def cast_inputs(self, batch: PyTree) -> PyTree:
        return cast_floating(batch, self.compute_dtype) if self.cast_batch else batch

    def cast_output(self, tree: PyTree) -> PyTree:
        return cast_floating(tree, self.output_dtype)


_NAMED = {
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "float16": jnp.float16,
}


def as_precision(
    precision: "Precision | str | None", caller: str | None = None
) -> Precision | None:
    """Accept `None` (no policy), `"bf16"`/`"f16"` (compute dtype), or a `Precision`.
    An error names `caller`, the function the user passed `precision` to."""
    if precision is None or isinstance(precision, Precision):
        return precision
    if isinstance(precision, str) and precision.lower() in ("f32", "float32", "fp32"):
        return None
    if isinstance(precision, str) and precision.lower() in _NAMED:
        return Precision(compute_dtype=_NAMED[precision.lower()])
    where = f"{caller}: " if caller else ""
    raise ConfigError(
        f"{where}`precision` must be None, 'bf16', 'f16', 'f32' or a "
        f"`Precision(...)`; got {precision!r}."
    )


def cast_floating(tree: PyTree, dtype: Any) -> PyTree:
    """Cast every floating array leaf of `tree` to `dtype`; leave the rest alone.
    A quantized weight keeps its codes and scales and dequantizes to `dtype`."""

    def cast(x: Any) -> Any:
        if isinstance(x, QuantizedWeight):
            return x.astype(dtype)
        if eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jtu.tree_map(cast, tree, is_leaf=lambda x: isinstance(x, QuantizedWeight))
