"""Per-array checksums: computed on the device when a step is saved (written in the
manifest) and again on the restored arrays, so that a checkpoint that loads is the
checkpoint that was written.

The checksum of an array is two 32-bit sums over its bits seen as unsigned words
`w[i]` (i the flat index): `sum(w)` and `sum(w * (2 i + 1))`, both modulo 2**32.
Any single flipped bit changes the first sum; swapped or shifted blocks change the
second. Integer sums modulo 2**32 do not depend on the order of the additions, so
the value is the same however the array is sharded (it is computed where the array
lives, by one jitted reduction over all leaves, without gathering anything to the
host), and identical on every process of a multi-process run. It detects damage,
not tampering.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


ALGORITHM = "sum32x2"


def _words(x: jax.Array) -> jax.Array | None:
    """`x`'s bits as uint32 words (one per element for <= 4-byte dtypes)."""
    if not supported(x):
        return None
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_:
        return x.astype(jnp.uint32)
    size = dtype.itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size in (1, 2):
        unsigned = jnp.uint8 if size == 1 else jnp.uint16
        return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
    if size in (8, 16):  # bitcast adds a trailing dimension of 2 or 4 words
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return None


def _sums(x: jax.Array) -> jax.Array:
    words = _words(x)
    if words is None:
        return jnp.zeros((2,), jnp.uint32)
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
        index = index + iota * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    weight = index * jnp.uint32(2) + jnp.uint32(1)
    return jnp.stack(
        [jnp.sum(words, dtype=jnp.uint32), jnp.sum(words * weight, dtype=jnp.uint32)]
    )


@jax.jit
def _all_sums(leaves: list[jax.Array]) -> jax.Array:
    if not leaves:
        return jnp.zeros((0, 2), jnp.uint32)
    return jnp.stack([_sums(x) for x in leaves])


def supported(x: Any) -> bool:
    dtype = np.dtype(x.dtype)
    return dtype == np.bool_ or dtype.itemsize in (1, 2, 4, 8, 16)


def checksums(names: list[str], leaves: list[Any]) -> dict[str, str]:
    """`{name: "xxxxxxxxyyyyyyyy"}` for every array leaf (concrete arrays: device,
    sharded or host). Waits for the arrays; dispatches one small computation."""
    if not leaves:
        return {}
    sums = np.asarray(jax.device_get(_all_sums(list(leaves))))
    out = {}
    for name, leaf, (a, b) in zip(names, leaves, sums, strict=True):
        if supported(leaf):
            out[name] = f"{int(a):08x}{int(b):08x}"
    return out


def mismatches(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """The names whose recorded checksum differs from the computed one."""
    return [
        name
        for name, value in expected.items()
        if name in actual and actual[name] != value
    ]
