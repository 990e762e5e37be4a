"""A multilayer-perceptron classifier for non-text examples: features in, class
logits out, with optional dropout.

Builds on `eqtrain.models._layers.Linear`.
"""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.random as jr
from jaxtyping import Array, Float, PRNGKeyArray

from .._errors import ConfigError
from ._layers import Linear, as_dtype


ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
    "tanh": jax.nn.tanh,
}


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Shape and options of an `MLPClassifier`.

    Attributes:
        in_features: size of one input vector.
        num_classes: number of output logits.
        hidden_sizes: widths of the hidden layers, in order (may be empty: a
            linear classifier).
        activation: `"relu"`, `"gelu"`, `"silu"` or `"tanh"`.
        dropout: dropout rate after every hidden activation (0 disables it).
        param_dtype: dtype of the parameters.
    """

    in_features: int
    num_classes: int
    hidden_sizes: tuple[int, ...] | list[int] = (128,)
    activation: str = "relu"
    dropout: float | int = 0.0
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ConfigError(
                f"`activation` must be one of {list(ACTIVATIONS)}; got "
                f"{self.activation!r}."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"`dropout` must be in [0, 1); got {self.dropout!r}.")
        # A list from a TOML/JSON config is accepted and frozen (hashable config).
        object.__setattr__(self, "hidden_sizes", tuple(self.hidden_sizes))
        as_dtype(self.param_dtype)


class MLPClassifier(eqx.Module):
    """`x: [features] -> logits: [classes]` through `hidden_sizes` hidden layers.

    Dropout runs when a `key` is given and the model is not in inference mode
    (`eqx.nn.inference_mode`, which `eqtrain.eval_step` applies); without a key the
    model is deterministic.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from eqtrain.models import MLPClassifier, MLPConfig
        >>> model = MLPClassifier(MLPConfig(4, 3, hidden_sizes=(8,)), jax.random.key(0))
        >>> model(jnp.ones(4)).shape
        (3,)
    """

    layers: tuple[Linear, ...]
    dropout: eqx.nn.Dropout
    config: MLPConfig = eqx.field(static=True)

    def __init__(self, config: MLPConfig, key: PRNGKeyArray):
        sizes = (config.in_features, *config.hidden_sizes, config.num_classes)
        keys = jr.split(key, len(sizes) - 1)
        dtype = as_dtype(config.param_dtype)
        self.layers = tuple(
            Linear(i, o, use_bias=True, std=i**-0.5, dtype=dtype, key=k)
            for i, o, k in zip(sizes[:-1], sizes[1:], keys, strict=True)
        )
        self.dropout = eqx.nn.Dropout(config.dropout)
        self.config = config

    def __call__(
        self, x: Float[Array, " features"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " classes"]:
        activation = ACTIVATIONS[self.config.activation]
        keys: Any = [None] * len(self.layers)
        if key is not None:
            keys = jr.split(key, len(self.layers))
        for layer, k in zip(self.layers[:-1], keys, strict=False):
            x = activation(layer(x))
            if self.config.dropout > 0:
                x = self.dropout(x, key=k, inference=True if k is None else None)
        return self.layers[-1](x)


def flops_per_token(config: MLPConfig, seq_len: int = 1) -> float:
    """Training FLOPs per example (a "token" here): `6 * N`, `N` the weights of
    every layer (`seq_len` is accepted for a uniform signature and ignored)."""
    del seq_len
    sizes = (config.in_features, *config.hidden_sizes, config.num_classes)
    return float(6 * sum(i * o for i, o in zip(sizes[:-1], sizes[1:], strict=True)))
