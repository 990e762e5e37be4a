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
from .._quant import Filler, QuantizedWeight, is_quantized
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
    quantized: QuantizedWeight | None = None  # its template, to quantize on read

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

    def tensors(self) -> Any:
        """Each stored tensor, read whole, with its index over `stack`: one at a
        time (what quantizing on read holds)."""
        inner = self.shape[len(self.stack) :]
        full = tuple(slice(None) for _ in inner)
        for flat, at in enumerate(np.ndindex(*self.stack)):
            out = np.empty(inner, self.dtype)
            self._read_into(self.entries[flat], full, out)
            yield at, out


_CHUNK = 16 * 2**20


def _rows_per_read(entry: Entry) -> int:
    """How many of `entry`'s rows make at most `_CHUNK` bytes (at least one)."""
    itemsize = _safetensors.DTYPES.get(entry.dtype, np.dtype("f8")).itemsize
    row_bytes = itemsize * int(np.prod(entry.shape[1:], dtype=np.int64))
    return max(1, _CHUNK // max(1, row_bytes))


def _block_shape(shape: tuple[int, ...], index: _safetensors.Index) -> tuple[int, ...]:
    return tuple(len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True))


def targets(template: Any, shardings: Shardings) -> list[Any]:
    """One sharding (or None) per leaf of `template` (a quantized weight is one
    leaf, with a `QuantizedWeight` of shardings, one per array, or one
    `Sharding` for them all)."""
    leaves = jtu.tree_leaves(template, is_leaf=is_quantized)
    if callable(shardings) and not isinstance(shardings, eqx.Module | Sharding):
        shardings = shardings(template)
    if shardings is None or isinstance(shardings, Sharding):
        return [shardings if _maps.is_struct(x) else None for x in leaves]
    flat = _shardings_in(shardings)
    sizes = [_arrays(x) for x in leaves]
    if len(flat) != sum(sizes):
        raise StructureError(
            f"`shardings` has {len(flat)} shardings but the model has {sum(sizes)} "
            "arrays. Build them from the abstract model, e.g. "
            "`shardings=lambda m: eqtrain.sharding.state_shardings(m, mesh, rules)`."
        )
    it = iter(flat)
    out: list[Any] = []
    for x, n in zip(leaves, sizes, strict=True):
        if is_quantized(x):
            out.append(
                jtu.tree_unflatten(jtu.tree_structure(x), [next(it) for _ in range(n)])
            )
        else:
            out.append(next(it) if n else None)
    return out


def _arrays(x: Any) -> int:
    """How many arrays a template leaf stands for."""
    if is_quantized(x):
        return len(jtu.tree_leaves(x))
    return int(_maps.is_struct(x))


def _shardings_in(tree: Any) -> list[Sharding]:
    """The `Sharding` leaves of `tree`, in order."""
    is_sharding = lambda x: isinstance(x, Sharding)
    return [s for s in jtu.tree_leaves(tree, is_leaf=is_sharding) if is_sharding(s)]


def place(leaf: Leaf, sharding: Any) -> Any:
    """`leaf` read and placed: whole on the default device, or block by block,
    each local device's block read (once per distinct block) and put there. A
    leaf to quantize is read one stored tensor at a time, each quantized into
    host buffers of the quantized size, and placed once complete."""
    if leaf.quantized is not None:
        return _place_quantized(leaf, sharding)
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


def _place_quantized(leaf: Leaf, sharding: Any) -> QuantizedWeight:
    """`leaf` quantized as its template says, tensor by tensor, then placed:
    each array on its own sharding (a `QuantizedWeight` of them), all on one,
    or on the default device."""
    filler = Filler(leaf.quantized)
    for at, tensor in leaf.tensors():
        filler.put(at, tensor)
    if sharding is None or isinstance(sharding, Sharding):
        return filler.weight(lambda _, a: _put(a, sharding))
    targets = {
        name: getattr(sharding, name)
        for name in ("codes", "scales", "scales2", "offset")
    }
    return filler.weight(lambda name, a: _put(a, targets[name]))
