"""safetensors files through the `safetensors` package (0.8): its NumPy writer and
its lazy reader (`safe_open`), with the package's errors turned into
`HFFormatError`s that name the file. `ml_dtypes` (a JAX dependency) gives NumPy its
bfloat16, which the package reads and writes as `BF16`.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from .._files import set_default_mode
from ._errors import HFFileNotFoundError, HFFormatError


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
Index = tuple[slice, ...]


def dtype_code(dtype: Any) -> str:
    """The safetensors name of a NumPy dtype (`"F32"`, `"BF16"`, ...)."""
    dtype = np.dtype(dtype)
    if dtype not in _CODES:
        raise HFFormatError(
            f"cannot write dtype {dtype} to safetensors; use one of float32, "
            "bfloat16, float16."
        )
    return _CODES[dtype]


def _prepared(value: Any) -> np.ndarray:
    """`value` C-contiguous and little-endian, of a dtype safetensors holds."""
    value = np.asarray(value)
    value = np.asarray(value, dtype=value.dtype.newbyteorder("<"), order="C")
    dtype_code(value.dtype)  # our message for a dtype we do not write
    return value


def write(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write `tensors` to `path` (each made C-contiguous and little-endian first).

    The package writes a non-contiguous array's buffer in memory order (a
    transpose would come back untransposed), hence `order="C"`; unlike
    `np.ascontiguousarray` it keeps a 0-d array 0-d.
    """
    arrays = {name: _prepared(value) for name, value in tensors.items()}
    try:
        save_file(arrays, path, metadata=dict(metadata))
    except SafetensorError as error:
        raise HFFormatError(f"could not write {path}: {error}.") from None
    set_default_mode(path)  # the package writes a 0600 temporary and renames it


@contextlib.contextmanager
def opened(path: str) -> Iterator[Any]:
    """`safe_open(path, framework="np")`: tensors are read only when asked for.

    Keep it open briefly: the package maps the file, and every page a read
    touches counts in the process's resident memory until the file is closed.

    Raises:
        HFFormatError: a damaged file (truncated, header not JSON or too long,
            offsets that do not fit), naming it.
    """
    try:
        handle = safe_open(path, framework="np")  # reads and checks the header
    except SafetensorError as error:
        raise _damaged(path, error) from None
    except FileNotFoundError:
        raise HFFileNotFoundError(f"{path} does not exist.") from None
    with handle as f:
        yield f


def _damaged(path: str, error: SafetensorError) -> HFFormatError:
    why = str(error).removeprefix("Error while deserializing header: ")
    return HFFormatError(
        f"{path} is not a valid safetensors file ({why}); it is damaged or "
        "was cut short. Re-export or re-download it."
    )


def read_header(path: str) -> dict[str, Any]:
    """The header of a safetensors file, without its data: `{"__metadata__":
    {...}, name: {"dtype": "F32", "shape": [...]}, ...}`."""
    with opened(path) as f:
        header: dict[str, Any] = {"__metadata__": f.metadata() or {}}
        for name in f.keys():
            info = f.get_slice(name)
            header[name] = {"dtype": info.get_dtype(), "shape": info.get_shape()}
    return header


def read(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every tensor of a safetensors file (NumPy copies) and its metadata."""
    with opened(path) as f:
        names = list(f.keys())
        for name in names:
            _check_dtype(path, name, f.get_slice(name).get_dtype())
        return {name: f.get_tensor(name) for name in names}, f.metadata() or {}


def read_slice(path: str, name: str, index: Index | None = None) -> np.ndarray:
    """The tensor `name` of `path`, or only its block `index` (a tuple of
    slices, one per dimension): only that block's bytes are read."""
    with opened(path) as f:
        if name not in f.keys():
            raise HFFormatError(f"{path} has no tensor {name!r}; re-export it.")
        tensor = f.get_slice(name)
        _check_dtype(path, name, tensor.get_dtype())
        if index is None or not index:
            return f.get_tensor(name)
        return tensor[index]


def _check_dtype(path: str, name: str, code: str) -> None:
    if code not in DTYPES:
        raise HFFormatError(
            f"{path} stores tensor {name!r} as {code}, which eqtrain cannot read "
            f"(it reads {', '.join(DTYPES)}). Convert the checkpoint to float32, "
            "bfloat16 or float16."
        )
