"""What eqtrain's Pallas kernels (`_pallas_attention`, `_grouped_gemm`) share:
where they run (compiled by Triton on GPUs, interpreted on the CPU, refused on
TPUs) and the precision of their f32 products."""

import jax
import jax.lax as lax

from .._errors import ConfigError


def interpreted(backend: str, setting: str) -> bool:
    """Whether the kernels run interpreted (the CPU: correct and slow, what the
    tests check) or compiled by Triton (CUDA and ROCm GPUs) on `backend`
    (`jax.default_backend()`). Other backends are refused, naming the
    `setting` to use there instead."""
    if backend == "cpu":
        return True
    if backend in ("gpu", "cuda", "rocm"):
        return False
    raise ConfigError(
        f"eqtrain's Pallas kernels are written for GPUs (Triton) and run "
        f"interpreted on the CPU; this backend is {backend!r} (a TPU has no "
        f"Triton). Use {setting} there."
    )


def matmul_precision() -> lax.Precision | None:
    """The tiles' products' precision: `HIGHEST` where the process asks for
    exact f32 products (`jax_default_matmul_precision = "highest"`), else the
    backend's default (f32 through TF32 on GPUs, as XLA's products)."""
    chosen = str(jax.config.jax_default_matmul_precision or "").lower()
    exact = chosen in ("highest", "float32", "fp32")
    return lax.Precision.HIGHEST if exact else None


def split_over_devices() -> bool:
    """Whether the mesh in context spreads the computation over several
    devices that XLA partitions (axes not manual: outside a `shard_map`).
    XLA's partitioner cannot split a Pallas call (a custom call): its inputs
    would be gathered onto every device, so the kernels run inside a
    `shard_map` there (`_attention.pallas_on_devices`,
    `_expert_parallel.on_own_tokens`)."""
    return any(size > 1 for size in free_axes().values())


def free_axes() -> dict[str, int]:
    """The axes of the mesh in context that XLA partitions (not manual: outside
    a `shard_map`), and their sizes."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(getattr(mesh, "manual_axes", ()))
    sizes = zip(mesh.axis_names, mesh.axis_sizes, strict=True)
    return {name: size for name, size in sizes if name not in manual}
