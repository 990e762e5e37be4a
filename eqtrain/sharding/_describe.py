"""A table of how a state lies on a mesh: each array's spec and bytes per device,
for `--dry-run` output and for checking rules before a long run."""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.tree_util as jtu
from jax.sharding import NamedSharding, Sharding

from ._place import _flat_shardings, is_arraylike, path_name


@dataclasses.dataclass(frozen=True)
class LeafRow:
    """One array of a state and its placement.

    Attributes:
        path: the dotted path (`model.layers.mlp.up_proj.weight`).
        shape: the global shape.
        dtype: the dtype's name.
        spec: the `PartitionSpec` as text (`P(None, 'tensor', 'fsdp')`), or the
            sharding's repr when it is not a `NamedSharding`.
        bytes: the global size in bytes.
        bytes_per_device: the size of one device's shard in bytes.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    bytes: int
    bytes_per_device: int


def _itemsize(dtype: Any) -> int:
    return int(getattr(dtype, "itemsize", 0))  # PRNG keys: their raw data's size


def _spec_text(sharding: Sharding) -> str:
    if isinstance(sharding, NamedSharding):
        entries = ", ".join(repr(e) for e in sharding.spec)
        return f"P({entries})"
    return type(sharding).__name__


def describe(state: Any, shardings: Any) -> list[LeafRow]:
    """One `LeafRow` per array leaf of `state` (concrete or abstract), in order.

    Args:
        state: a `TrainState` or any pytree; nothing is computed or moved.
        shardings: as for `shard` (from `state_shardings`, or one `Sharding`).
    """
    flat, _ = jtu.tree_flatten_with_path(state)
    targets = _flat_shardings(state, shardings)
    return [
        _row(path_name(path), x, sharding)
        for (path, x), sharding in zip(flat, targets, strict=True)
        if is_arraylike(x) and sharding is not None
    ]


def _row(path: str, x: Any, sharding: Sharding) -> LeafRow:
    shape = tuple(int(n) for n in x.shape)
    itemsize = _itemsize(x.dtype)
    return LeafRow(
        path=path,
        shape=shape,
        dtype=str(x.dtype),
        spec=_spec_text(sharding),
        bytes=math.prod(shape) * itemsize,
        bytes_per_device=math.prod(sharding.shard_shape(shape)) * itemsize,
    )


def format_bytes(n: int | float) -> str:
    """`1536` -> `"1.5 KiB"`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _aligned(table: list[tuple[str, ...]]) -> list[str]:
    """The rows of `table` as lines, each column padded to its widest cell."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in table
    ]


def format_table(rows: Sequence[LeafRow]) -> str:
    """`describe`'s rows as a fixed-width text table with a total line.

    Example output::

        path                       shape     dtype    spec                 per device
        model.embed_tokens.weight  (64, 32)  float32  P('tensor', 'fsdp')  2.0 KiB
        ...
        total: 1.2 MiB; per device: 312.5 KiB
    """
    header = ("path", "shape", "dtype", "spec", "per device")
    body = [
        (r.path, str(r.shape), r.dtype, r.spec, format_bytes(r.bytes_per_device))
        for r in rows
    ]
    lines = _aligned([header, *body])
    total = sum(r.bytes for r in rows)
    per_device = sum(r.bytes_per_device for r in rows)
    lines.append(
        f"total: {format_bytes(total)}; per device: {format_bytes(per_device)}"
    )
    return "\n".join(lines)
