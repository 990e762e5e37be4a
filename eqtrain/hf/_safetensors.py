"""A small reader and writer of the safetensors format (8-byte little-endian
header length, a JSON header, raw little-endian tensor bytes), over NumPy.

Written here rather than with `safetensors.numpy` because that writer writes wrong
bytes for non-contiguous arrays and has no bfloat16; `ml_dtypes` (a JAX
dependency) gives NumPy its bfloat16.
"""

import json
import mmap
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np

from ._errors import HFFormatError


DTYPES: dict[str, Any] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("bool"),
}
_CODES = {dtype: code for code, dtype in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


def dtype_code(dtype: Any) -> str:
    """The safetensors name of a NumPy dtype (`"F32"`, `"BF16"`, ...)."""
    dtype = np.dtype(dtype)
    if dtype not in _CODES:
        raise HFFormatError(
            f"cannot write dtype {dtype} to safetensors; use one of float32, "
            "bfloat16, float16."
        )
    return _CODES[dtype]


def write(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write `tensors` to `path` (each made contiguous and little-endian first)."""
    arrays: dict[str, np.ndarray] = {}
    for name, value in tensors.items():
        value = np.asarray(value)
        arrays[name] = np.ascontiguousarray(value.astype(value.dtype.newbyteorder("<")))
    # Largest items first keeps every tensor aligned to its item size, as the
    # reference writer does; then by name.
    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        a = arrays[name]
        header[name] = {
            "dtype": dtype_code(a.dtype),
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            f.write(memoryview(arrays[name].reshape(-1).view(np.uint8)))


def read(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors of a safetensors file (read-only views of a memory map) and its
    metadata. Raises `HFFormatError` naming the file on a damaged header."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 8:
            _damaged(path, f"it is {size} bytes long")
        buffer: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (length,) = struct.unpack("<Q", buffer[:8])
    if length > min(size - 8, _MAX_HEADER):
        _damaged(path, f"its header length {length} exceeds the file")
    try:
        header = json.loads(bytes(buffer[8 : 8 + length]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        _damaged(path, f"its header is not JSON ({error})")
    if not isinstance(header, dict):
        _damaged(path, "its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    base, tensors = 8 + length, {}
    for name, info in header.items():
        tensors[name] = _tensor(buffer, base, size, path, name, info)
    return tensors, metadata


def read_header(path: str) -> dict[str, Any]:
    """Only the JSON header (names, dtypes, shapes) of a safetensors file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def _tensor(buffer: Any, base: int, size: int, path: str, name: str, info: Any) -> Any:
    try:
        dtype = DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        start, end = (int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError):
        _damaged(path, f"tensor {name!r} has an unreadable entry {info!r}")
    count = int(np.prod(shape, dtype=np.int64))
    if end - start != count * dtype.itemsize or base + end > size or start < 0:
        _damaged(
            path,
            f"tensor {name!r} ({info['dtype']}, shape {list(shape)}) has data "
            f"offsets {[start, end]} that do not fit its size or the file",
        )
    return np.frombuffer(buffer, dtype, count, base + start).reshape(shape)


def _damaged(path: str, why: str) -> Any:
    raise HFFormatError(
        f"{path} is not a valid safetensors file: {why}. Re-export or re-download it."
    )
