"""Per-array checksums: computed on the device when a step is saved (written in the
manifest) and again on the restored arrays, so that a checkpoint that loads is the
checkpoint that was written.

The checksum of an array is two 32-bit sums over its bits seen as unsigned words
`w[i, j]` (i the index over the leading axes, j over the last): `sum(w)` and
`sum(w * (2i + 1) * (2j + 1))`, both modulo 2**32.
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


def _odd(n: int) -> jax.Array:
    """The weights 1, 3, 5, ...: `2i + 1` for position i, as uint32."""
    return jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(1)


def _sums(x: jax.Array) -> jax.Array:
    words = _words(x)
    if words is None:
        return jnp.zeros((2,), jnp.uint32)
    if words.ndim == 0:
        words = words[None]
    # The weight of word (i, j) (i over the leading axes, j the last) is
    # (2i + 1)(2j + 1): odd, so a flipped bit changes both sums, and it depends on
    # the position. Computed as one multiply by a row vector and a reduction over
    # the last axis, then the same over the (small) rest: memory-bound.
    cols = words.shape[-1]
    col_weight = _odd(cols).reshape((1,) * (words.ndim - 1) + (cols,))
    rows = jnp.sum(words * col_weight, axis=-1, dtype=jnp.uint32).reshape(-1)
    weighted = jnp.sum(rows * _odd(rows.shape[0]), dtype=jnp.uint32)
    return jnp.stack([jnp.sum(words, dtype=jnp.uint32), weighted])


@jax.jit
def _all_sums(leaves: list[jax.Array]) -> jax.Array:
    if not leaves:
        return jnp.zeros((0, 2), jnp.uint32)
    return jnp.stack([_sums(x) for x in leaves])


def supported(x: Any) -> bool:
    dtype = np.dtype(x.dtype)
    return dtype == np.bool_ or dtype.itemsize in (1, 2, 4, 8, 16)


def _host_words(x: np.ndarray) -> np.ndarray:
    """`_words` on the host: the same words in the same layout."""
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        return x.astype(np.uint32)
    size = x.dtype.itemsize
    if size == 4:
        return x.view(np.uint32)
    if size in (1, 2):
        return x.view(np.uint8 if size == 1 else np.uint16).astype(np.uint32)
    return x.reshape(*x.shape, 1).view(np.uint32)  # (..., 2) or (..., 4)


def host_sums(x: np.ndarray) -> tuple[int, int]:
    """`_sums` in numpy (for arrays already in host memory: on CPU devices
    `np.asarray` is a view, and numpy's reductions are faster than XLA's here)."""
    words = _host_words(np.asarray(x))
    if words.ndim == 0:
        words = words[None]
    col_weight = np.arange(words.shape[-1], dtype=np.uint32) * np.uint32(2) + 1
    with np.errstate(over="ignore"):
        per_row = np.sum(words * col_weight, axis=-1, dtype=np.uint32).reshape(-1)
        row_weight = np.arange(per_row.shape[0], dtype=np.uint32) * np.uint32(2) + 1
        first = np.sum(words, dtype=np.uint32)
        second = np.sum(per_row * row_weight, dtype=np.uint32)
    return int(first), int(second)


def _on_host(x: Any) -> bool:
    if isinstance(x, np.ndarray):
        return True
    try:
        return x.is_fully_addressable and all(
            d.platform == "cpu" for d in x.sharding.device_set
        )
    except AttributeError:
        return False


def checksums(names: list[str], leaves: list[Any]) -> dict[str, str]:
    """`{name: "xxxxxxxxyyyyyyyy"}` for every array leaf (concrete arrays: device,
    sharded or host). Waits for the arrays. Arrays on CPU devices are hashed in
    place with numpy; others by one jitted reduction where they live (no gather:
    the result does not depend on the sharding)."""
    out: dict[str, str] = {}
    device = [(n, x) for n, x in zip(names, leaves, strict=True) if not _on_host(x)]
    for name, x in zip(names, leaves, strict=True):
        if _on_host(x) and supported(x):
            a, b = host_sums(np.asarray(x))
            out[name] = f"{a:08x}{b:08x}"
    if device:
        sums = np.asarray(jax.device_get(_all_sums([x for _, x in device])))
        for (name, leaf), (a, b) in zip(device, sums, strict=True):
            if supported(leaf):
                out[name] = f"{int(a):08x}{int(b):08x}"
    return {name: out[name] for name in names if name in out}


def mismatches(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """The names whose recorded checksum differs from the computed one."""
    return [
        name
        for name, value in expected.items()
        if name in actual and actual[name] != value
    ]
