"""Peak FLOP/s of known accelerators, the denominator of MFU (`fit(peak_flops=...)`).

A table keyed by `jax.Device.device_kind`; CPUs and unknown devices give `None`.
"""

import dataclasses
import re
from collections.abc import Iterable
from typing import Any

import numpy as np

from .._errors import ConfigError


@dataclasses.dataclass(frozen=True)
class _Peak:
    """Dense peak TFLOP/s of one device per matmul precision (`None`: unsupported or
    not published)."""

    bf16: float | int | None
    fp16: float | int | None
    tf32: float | int | None = None
    fp32: float | int | None = None


def _sparse(tflops: float | int) -> float:
    # NVIDIA's datasheets (Ampere and later) headline tensor throughput "with
    # sparsity"; dense matmuls, what training runs, get half of it.
    return tflops / 2


# Sources: the vendors' datasheets and spec pages.
#   H100 (SXM, PCIe, NVL) and H200 (SXM, NVL): NVIDIA H100 / H200 Tensor Core GPU
#     datasheets (BF16/FP16/TF32 given with sparsity; FP32 is the non-tensor rate).
#   GH200: NVIDIA GH200 Grace Hopper Superchip datasheet (the H100 SXM rates).
#   A100: NVIDIA A100 datasheet (312 TFLOPS BF16 dense, 156 TF32, 19.5 FP32).
#   L4: NVIDIA L4 datasheet.
#   A10G: AWS's variant of the A10 (G5 instances). NVIDIA publishes no datasheet for
#     it; these are the commonly cited rates (about 70 TFLOPS 16-bit tensor, 35
#     FP32), lower tensor throughput than the A10's 125. Treat them as approximate.
#   V100 (SXM2, PCIe, V100S): NVIDIA V100 datasheet. Volta has FP16 tensor cores
#     only: no BF16 or TF32.
#   TPU v4, v5e, v5p, v6e (Trillium): Google Cloud TPU system architecture pages,
#     BF16 peak per chip (one JAX device per chip). f32 matmuls run as bf16 passes
#     on the MXU; Google publishes no f32 peak, hence `None`.
_TABLE: tuple[tuple[str, _Peak], ...] = (
    (r"gh200", _Peak(_sparse(1979), _sparse(1979), _sparse(989), 67)),
    (r"h200 nvl", _Peak(_sparse(1671), _sparse(1671), _sparse(835), 60)),
    (r"h200", _Peak(_sparse(1979), _sparse(1979), _sparse(989), 67)),
    (r"h100 nvl", _Peak(_sparse(1671), _sparse(1671), _sparse(835), 60)),
    (r"h100 pcie", _Peak(_sparse(1513), _sparse(1513), _sparse(756), 51)),
    (r"h100", _Peak(_sparse(1979), _sparse(1979), _sparse(989), 67)),  # SXM
    (r"a100", _Peak(312, 312, 156, 19.5)),
    (r"a10g", _Peak(70, 70, 35, 35)),
    (r"\bl4\b", _Peak(_sparse(242), _sparse(242), _sparse(120), 30.3)),
    (r"v100s", _Peak(None, 130, None, 16.4)),
    (r"v100[- ]pcie", _Peak(None, 112, None, 14)),
    (r"v100", _Peak(None, 125, None, 15.7)),  # SXM2
    (r"^tpu v4$", _Peak(275, None)),
    (r"^tpu v5 ?(lite|e)$", _Peak(197, None)),
    (r"^tpu v5p?$", _Peak(459, None)),
    (r"^tpu v6 ?(lite|e)$", _Peak(918, None)),
)

_DTYPES = {
    "bfloat16": "bf16",
    "bf16": "bf16",
    "float16": "fp16",
    "fp16": "fp16",
    "half": "fp16",
    "tfloat32": "tf32",
    "tf32": "tf32",
    "float32": "fp32",
    "fp32": "fp32",
}


def _dtype_name(dtype: Any) -> str:
    if isinstance(dtype, str):
        return dtype
    try:
        return np.dtype(dtype).name  # jnp.bfloat16, np.float32, np.dtype(...)
    except TypeError:
        return repr(dtype)


def _precision(dtype: Any) -> str:
    key = _DTYPES.get(_dtype_name(dtype).lower())
    if key is None:
        raise ConfigError(
            "`peak_flops` knows the matmul precisions bfloat16, float16, tfloat32 "
            f"and float32; got dtype={dtype!r}. Pass one of those (e.g. "
            "`dtype='bfloat16'` or `dtype=jnp.bfloat16`)."
        )
    return key


def _lookup(kind: str) -> _Peak | None:
    kind = " ".join(kind.lower().split())
    for pattern, peak in _TABLE:
        if re.search(pattern, kind):
            return peak
    return None


def _all_devices() -> list[Any]:
    import jax

    return jax.devices()


def _peak_of(device: Any) -> _Peak | None:
    """The device's peak rates (None: a CPU, or a device the table lacks)."""
    if getattr(device, "platform", None) == "cpu":
        return None
    return _lookup(str(getattr(device, "device_kind", "")))


def peak_flops(device: Any = None, dtype: Any = "bfloat16") -> float | None:
    """The dense peak FLOP/s of one device at `dtype`, or `None` when unknown.

    Known: NVIDIA H100 (SXM, PCIe, NVL), H200 (SXM, NVL), GH200, A100, L4, A10G,
    V100 (SXM2, PCIe, V100S), and TPU v4, v5e ("v5 lite"), v5p, v6e ("v6 lite"),
    matched on `device.device_kind`. Rates are the vendors' dense (no sparsity)
    numbers. CPUs, unknown devices, and precisions a device lacks or whose rate is
    not published (bfloat16 on V100, float32 on TPUs) give `None`.

    Args:
        device: a `jax.Device` (anything with `platform` and `device_kind`); the
            default is `jax.devices()[0]`.
        dtype: the matmul precision: `"bfloat16"`, `"float16"`, `"float32"` (the
            non-tensor-core rate), or `"tfloat32"` (tensor cores on Ampere and
            later: what float32 matmuls use under JAX's default precision on those
            GPUs); a NumPy/JAX dtype works too.

    Returns:
        FLOP/s (e.g. `989.5e12` for bfloat16 on an H100 SXM), or `None`.

    For a step that runs on several devices, `fit(peak_flops=...)` wants their
    sum: `total_peak_flops(devices)`.
    """
    precision = _precision(dtype)
    peak = _peak_of(_all_devices()[0] if device is None else device)
    tflops = None if peak is None else getattr(peak, precision)
    return None if tflops is None else float(tflops) * 1e12


def total_peak_flops(
    devices: Iterable[Any] | None = None, dtype: Any = "bfloat16"
) -> float | None:
    """The summed peak FLOP/s of `devices` (default: `jax.devices()`), the value
    `fit(peak_flops=...)` wants for a step that runs on all of them; `None` when any
    is unknown (see `peak_flops`) or there are none.
    """
    devices = _all_devices() if devices is None else devices
    peaks = [peak_flops(d, dtype) for d in devices]
    if not peaks or any(p is None for p in peaks):
        return None
    return float(sum(p for p in peaks if p is not None))
