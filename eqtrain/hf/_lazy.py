"""Reading a checkpoint's tensors lazily and placing them: a stored tensor
(`Entry`), a parameter made of stored tensors (`Leaf`), read block by block and
put on its devices (`place`). `_load` plans the leaves from the headers.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import Sharding

from .._errors import StructureError
from . import _maps, _safetensors


Shardings = Sharding | Any | Callable[[Any], Any] | None


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one stored tensor is: its file, its name there, dtype and shape."""

    file: str
    key: str
    dtype: str  # the safetensors code: "F32", "BF16", ...
    shape: tuple[int, ...]

    def read(self, index: _safetensors.Index | None = None) -> np.ndarray:
        return _safetensors.read_slice(self.file, self.key, index)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter of the model and the stored tensors it is made of: one per
    index over its leading `stack` axes (`()`: one tensor; `(layers,)` when the
    layers are stacked; `(layers, experts)` for experts' weights), row-major;
    GPT-2's Conv1D weights stored transposed."""

    entries: tuple[Entry, ...]
    stack: tuple[int, ...]
    conv1d: bool
    shape: tuple[int, ...]
    dtype: Any

    def block(self, index: _safetensors.Index) -> np.ndarray:
        """The values at `index` (slices over the parameter), read from the files:
        each stored tensor the block covers once, and only its part."""
        out = np.empty(_block_shape(self.shape, index), self.dtype)
        k = len(self.stack)
        outer = [
            range(*s.indices(n)) for s, n in zip(index[:k], self.stack, strict=True)
        ]
        for at in np.ndindex(*map(len, outer)):
            which = tuple(r[j] for r, j in zip(outer, at, strict=True))
            flat = int(np.ravel_multi_index(which, self.stack)) if k else 0
            self._read_into(self.entries[flat], index[k:], out[(*at, ...)])
        return out

    def _read_into(
        self, entry: Entry, index: _safetensors.Index, out: np.ndarray
    ) -> None:
        """`out[...] = entry[index]`, cast, read in runs of rows of at most
        `_CHUNK` bytes: each read maps pages of the file, and they count in
        resident memory until the file is closed again."""
        if self.conv1d:
            index, out = index[::-1], out.T
        if not index:
            out[...] = entry.read()
            return
        rows = range(*index[0].indices(entry.shape[0]))
        step = _rows_per_read(entry)
        for k in range(0, len(rows), step):
            part = rows[k : k + step]
            chunk = (slice(part.start, part.stop, part.step), *index[1:])
            out[k : k + step] = entry.read(chunk)


_CHUNK = 16 * 2**20


def _rows_per_read(entry: Entry) -> int:
    """How many of `entry`'s rows make at most `_CHUNK` bytes (at least one)."""
    itemsize = _safetensors.DTYPES.get(entry.dtype, np.dtype("f8")).itemsize
    row_bytes = itemsize * int(np.prod(entry.shape[1:], dtype=np.int64))
    return max(1, _CHUNK // max(1, row_bytes))


def _block_shape(shape: tuple[int, ...], index: _safetensors.Index) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))


def targets(template: Any, shardings: Shardings) -> list[Sharding | None]:
    """One sharding (or None) per leaf of `template`."""
    leaves = jtu.tree_leaves(template)
    if callable(shardings) and not isinstance(shardings, eqx.Module | Sharding):
        shardings = shardings(template)
    if shardings is None or isinstance(shardings, Sharding):
        return [shardings if _maps.is_struct(x) else None for x in leaves]
    flat = _shardings_in(shardings)
    params = sum(map(_maps.is_struct, leaves))
    if len(flat) != params:
        raise StructureError(
            f"`shardings` has {len(flat)} shardings but the model has {params} "
            "parameters. Build them from the abstract model, e.g. "
            "`shardings=lambda m: eqtrain.sharding.state_shardings(m, mesh, rules)`."
        )
    it = iter(flat)
    return [next(it) if _maps.is_struct(x) else None for x in leaves]


def _shardings_in(tree: Any) -> list[Sharding]:
    """The `Sharding` leaves of `tree`, in order."""
    is_sharding = lambda x: isinstance(x, Sharding)
    return [s for s in jtu.tree_leaves(tree, is_leaf=is_sharding) if is_sharding(s)]


def place(leaf: Leaf, sharding: Sharding | None) -> Any:
    """`leaf` read and placed: whole on the default device, or block by block,
    each local device's block read (once per distinct block) and put there."""
    if sharding is None:
        return _put(leaf.block(tuple(slice(None) for _ in leaf.shape)), None)
    sharding.shard_shape(leaf.shape)  # raises if the shape does not divide
    arrays = _device_blocks(leaf, sharding)
    return jax.make_array_from_single_device_arrays(leaf.shape, sharding, arrays)


def _device_blocks(leaf: Leaf, sharding: Sharding) -> list[Any]:
    """Each local device's block of `leaf` on that device (a distinct block is
    read once)."""
    placed: dict[Any, Any] = {}
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
        key = tuple((s.start, s.stop, s.step) for s in index)
        if key in placed:  # a replica: copied between devices, not read again
            arrays.append(_put(placed[key], device))
            continue
        placed[key] = _put(leaf.block(index), device)
        arrays.append(placed[key])
    return arrays


def _put(value: Any, device: Any) -> Any:
    """`value` copied to `device`, waited for. `None` is the default device,
    uncommitted, as `jnp.asarray` places arrays (which also makes a second,
    transient host copy). Waiting frees the host block before the next one is
    read; otherwise several asynchronous transfers hold their blocks at once."""
    return jax.device_put(value, device).block_until_ready()
