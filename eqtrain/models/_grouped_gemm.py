"""A grouped matrix product in Pallas (megablox-style) for the dropless experts:
rows sorted by group and padded to whole blocks of rows (`_experts.Blocks`),
each block times its group's matrix; compiled with Triton on GPUs, interpreted
on CPU.

Three kernels, each a grid of output tiles with an f32 accumulator carried
through a `fori_loop` over the contracted dimension in tiles:

- forward, `y[tile] = x[tile] @ w[g].T`: grid (row tiles, `d_out` tiles),
  contracting `d_in`;
- `dx[tile] = dy[tile] @ w[g]`: grid (row tiles, `d_in` tiles), contracting
  `d_out`;
- `dw[g] = sum over g's row tiles of dy_t.T @ x_t`: grid (groups, `d_out`
  tiles, `d_in` tiles), contracting rows over the group's tiles (contiguous in
  the layout: its first tile and tile count are metadata).

A row tile's group is read from a metadata array (`-1`: a tile past the last
group's, whose loop runs zero times and whose output is zeros); the metadata
is computed in plain JAX from the blocks' groups. Widths are padded to whole
tiles (powers of two, at least 16, as Triton's products want) and sliced back.
"""

import dataclasses
import functools

import jax
import jax.lax as lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Float, Int

from .._errors import ConfigError
from ._pallas import interpreted, matmul_precision


MOE_SETTING = 'moe_impl="ragged"'
"""What TPUs take instead of the Pallas grouped products."""


MIN_TILE = 16
"""The smallest tile side: Triton's products want at least 16 rows and columns."""


@dataclasses.dataclass(frozen=True)
class Tiles:
    """The most rows, output columns and contracted columns a kernel's program
    holds (powers of two, at least 16); a tile is smaller where the array is.
    The defaults are the usual shape of a Triton matrix product; untimed
    (docs/performance.md lists what remains to measure on a GPU)."""

    rows: int = 128
    out: int = 128
    inner: int = 64

    def __post_init__(self) -> None:
        for name, size in dataclasses.asdict(self).items():
            if size < MIN_TILE or size & (size - 1):
                raise ConfigError(
                    f"`Tiles.{name}` must be a power of two >= {MIN_TILE}; got {size}."
                )


def grouped_matmul(
    xp: Float[Array, "padded d_in"],
    w: Float[Array, "groups d_out d_in"],
    group: Int[Array, " blocks"],
    used: Bool[Array, " blocks"],
    *,
    block: int,
    tiles: Tiles = Tiles(),
    interpret: bool | None = None,
) -> Float[Array, "padded d_out"]:
    """`y[block b] = xp[block b] @ w[group[b]].T` (zeros where `not used[b]`),
    differentiable in `xp` and `w`, with f32 accumulation; the result in
    `xp`'s dtype (`w` is cast to it).

    Args:
        xp: `blocks * block` rows; each group's rows are whole, consecutive
            blocks, in group order (`Blocks.pad`).
        w: one `[d_out, d_in]` matrix per group (`torch.nn.Linear`'s layout).
        group, used: each block's group and whether it holds rows (the used
            blocks come first).
        block: rows per block: a power of two >= 16.
        tiles: the kernels' tile sizes.
        interpret: run interpreted (None: on CPU; Triton on GPUs).

    Raises:
        ConfigError: on a backend other than CPU and GPU, or a block Triton
            cannot take.
    """
    if block < MIN_TILE or block & (block - 1):
        raise ConfigError(f"`block` must be a power of two >= {MIN_TILE}; got {block}.")
    if xp.shape[0] != group.shape[0] * block:
        raise ConfigError(
            f"`xp` must hold `block` rows per block ({group.shape[0]} x {block}); "
            f"got {xp.shape[0]} rows."
        )
    if interpret is None:
        interpret = interpreted(jax.default_backend(), MOE_SETTING)
    d_in = xp.shape[1]
    d_out = w.shape[1]
    t_rows = min(block, tiles.rows)
    t_out, t_in = _tile(d_out, tiles.out), _tile(d_in, tiles.inner)
    tile_group = jnp.repeat(jnp.where(used, group, -1), block // t_rows)
    shape = _Shape(t_rows, t_out, t_in, interpret, matmul_precision())
    xw = _pad_to(xp, 1, t_in)
    ww = _pad_to(_pad_to(w.astype(xp.dtype), 1, t_out), 2, t_in)
    y = _grouped(shape, xw, ww, tile_group.astype(jnp.int32))
    return y[:, :d_out]


def _tile(size: int, most: int) -> int:
    return min(most, max(MIN_TILE, pl.next_power_of_2(size)))


def _pad_to(a: Array, axis: int, multiple: int) -> Array:
    extra = -a.shape[axis] % multiple
    if not extra:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, extra)
    return jnp.pad(a, widths)


@dataclasses.dataclass(frozen=True)
class _Shape:
    """The static part of a call: tile sizes and how it runs."""

    rows: int
    out: int
    inner: int
    interpret: bool
    precision: lax.Precision | None

    def compiler_params(self, acc: tuple[int, int], dtype):
        """Triton's launch parameters (none when interpreted): more warps for
        a larger accumulator, fewer pipeline stages for wider elements."""
        if self.interpret:
            return None
        from jax.experimental.pallas import triton as plgpu

        return plgpu.CompilerParams(
            num_warps=8 if acc[0] * acc[1] >= 128 * 128 else 4,
            num_stages=3 if jnp.dtype(dtype).itemsize <= 2 else 2,
        )

    def call(self, kernel, name: str, acc: tuple[int, int], out_shape, grid, *args):
        """`pl.pallas_call` of `kernel` over `grid`, every operand whole (the
        kernels index them); `acc`: the shape of a program's accumulator."""
        return pl.pallas_call(
            kernel,
            out_shape=out_shape,
            grid=grid,
            compiler_params=self.compiler_params(acc, out_shape.dtype),
            interpret=self.interpret,
            name=name,
        )(*args)


# -- the differentiable product on padded operands -----------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _grouped(shape: _Shape, x: Array, w: Array, tile_group: Array) -> Array:
    return _forward(shape, x, w, tile_group)


def _grouped_fwd(shape: _Shape, x: Array, w: Array, tile_group: Array):
    return _forward(shape, x, w, tile_group), (x, w, tile_group)


def _grouped_bwd(shape: _Shape, residuals, dy: Array):
    x, w, tile_group = residuals
    dy = dy.astype(x.dtype)
    dx = _rows_product(shape, dy, w, tile_group, transposed=False)
    dw = _weights_product(shape, dy, x, tile_group, w.shape[0])
    return dx, dw, None


_grouped.defvjp(_grouped_fwd, _grouped_bwd)


def _forward(shape: _Shape, x: Array, w: Array, tile_group: Array) -> Array:
    return _rows_product(shape, x, w, tile_group, transposed=True)


def _rows_product(
    shape: _Shape, x: Array, w: Array, tile_group: Array, *, transposed: bool
) -> Array:
    """Each row tile of `x` times its group's `w[g].T` (`transposed`: `w` is
    `[groups, out, inner]`, the forward) or `w[g]` (`w` is `[groups, inner,
    out]`, the gradient of the rows)."""
    rows = x.shape[0]
    width = w.shape[1] if transposed else w.shape[2]
    t_out, t_inner = (
        (shape.out, shape.inner) if transposed else (shape.inner, shape.out)
    )
    kernel = functools.partial(
        _rows_kernel,
        t_rows=shape.rows,
        t_out=t_out,
        t_inner=t_inner,
        steps=x.shape[1] // t_inner,
        transposed=transposed,
        precision=shape.precision,
    )
    out = jax.ShapeDtypeStruct((rows, width), x.dtype)
    grid = (rows // shape.rows, width // t_out)
    name = "grouped_matmul" if transposed else "grouped_matmul_dx"
    acc = (shape.rows, t_out)
    return shape.call(kernel, name, acc, out, grid, tile_group, x, w)


def _weights_product(
    shape: _Shape, dy: Array, x: Array, tile_group: Array, groups: int
) -> Array:
    """`dw[g] = dy_g.T @ x_g` over each group's row tiles."""
    # the tiles of no group (-1) count in a bin past the groups'
    owner = jnp.where(tile_group < 0, groups, tile_group)
    count = jnp.bincount(owner, length=groups + 1)[:groups].astype(jnp.int32)
    first = jnp.cumsum(count) - count
    d_out, d_in = dy.shape[1], x.shape[1]
    kernel = functools.partial(
        _weights_kernel,
        t_rows=shape.rows,
        t_out=shape.out,
        t_in=shape.inner,
        precision=shape.precision,
    )
    out = jax.ShapeDtypeStruct((groups, d_out, d_in), x.dtype)
    grid = (groups, d_out // shape.out, d_in // shape.inner)
    acc = (shape.out, shape.inner)
    return shape.call(kernel, "grouped_matmul_dw", acc, out, grid, first, count, dy, x)


# -- kernels ---------------------------------------------------------------------------
def _rows_kernel(
    group_ref,
    x_ref,
    w_ref,
    y_ref,
    *,
    t_rows: int,
    t_out: int,
    t_inner: int,
    steps: int,
    transposed: bool,
    precision: lax.Precision | None,
):
    """One `[t_rows, t_out]` tile of a row product (`_rows_product`)."""
    tile, col = pl.program_id(0), pl.program_id(1)
    g = group_ref[tile]
    rows = pl.ds(tile * t_rows, t_rows)
    out = pl.ds(col * t_out, t_out)
    expert = jnp.maximum(g, 0)

    def step(k: Array, acc: Array) -> Array:
        inner = pl.ds(k * t_inner, t_inner)
        if transposed:
            w = w_ref[expert, out, inner]  # [t_out, t_inner]
        else:
            w = w_ref[expert, inner, out]  # [t_inner, t_out]
        dims = (1, 1 if transposed else 0)
        return acc + _dot(x_ref[rows, inner], w, dims, precision)

    # a tile past the last group's sums nothing: its output is zeros
    n = jnp.where(g >= 0, steps, 0)
    acc = lax.fori_loop(0, n, step, jnp.zeros((t_rows, t_out), jnp.float32))
    y_ref[rows, out] = acc.astype(y_ref.dtype)


def _weights_kernel(
    first_ref,
    count_ref,
    dy_ref,
    x_ref,
    dw_ref,
    *,
    t_rows: int,
    t_out: int,
    t_in: int,
    precision: lax.Precision | None,
):
    """One `[t_out, t_in]` tile of a group's weight gradient (`_weights_product`)."""
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first = first_ref[g]
    out, inner = pl.ds(i * t_out, t_out), pl.ds(j * t_in, t_in)

    def step(t: Array, acc: Array) -> Array:
        rows = pl.ds((first + t) * t_rows, t_rows)
        return acc + _dot(dy_ref[rows, out], x_ref[rows, inner], (0, 0), precision)

    zeros = jnp.zeros((t_out, t_in), jnp.float32)
    acc = lax.fori_loop(0, count_ref[g], step, zeros)  # an empty group: zeros
    dw_ref[g, out, inner] = acc.astype(dw_ref.dtype)


def _dot(
    a: Array, b: Array, dims: tuple[int, int], precision: lax.Precision | None
) -> Array:
    """`a` and `b` contracted over `dims` (one of each), accumulated in f32."""
    numbers = (((dims[0],), (dims[1],)), ((), ()))
    return lax.dot_general(
        a, b, numbers, precision=precision, preferred_element_type=jnp.float32
    )
