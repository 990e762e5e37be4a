"""The Pallas grouped matrix product (`eqtrain.models._grouped_gemm`, interpreted
on CPU) against per-row products in NumPy and the scanned blocks: values and
gradients in f32 and bf16, with empty groups, a group with every row, widths
that are not whole tiles and blocks past the last group's; its Triton lowering
(without a GPU: `jax.export` for CUDA); and `moe_impl="pallas"` in a decoder
against `"sorted"` and `"dense"`.
"""

import equinox as eqx
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from eqtrain._errors import ConfigError
from eqtrain._quant import quantize
from eqtrain.models import Decoder, DecoderConfig, load_balancing_loss
from eqtrain.models._experts import (
    Blocks,
    Experts,
    MoEOptions,
    blocked_matmul,
    grouped_ffn,
)
from eqtrain.models._grouped_gemm import MOE_SETTING, Tiles, grouped_matmul
from eqtrain.models._pallas import interpreted


ROWS, GROUPS, D_IN, D_OUT = 60, 4, 40, 24  # widths: not whole tiles of 16 or more
SIZES = {
    "uneven": [5, 0, 38, 17],  # an empty group between others
    "one_group_has_all": [0, 0, ROWS, 0],
    "first_and_last": [31, 0, 0, 29],
}
# (block, tiles): the default tiles (one tile per block and width) and small ones
# (two row tiles per block, several tiles over each width)
LAYOUTS = {"default": (16, Tiles()), "small_tiles": (32, Tiles(16, 16, 16))}


def _product(block, tiles, interpret=None):
    """`(x, w, sizes, dy) -> (y, dx, dw)` through the kernels, compiled once."""

    def f(x, w, sizes, dy):
        blocks = Blocks.of(sizes, x.shape[0], block)

        def mm(x, w):
            xp = blocks.pad(x)
            yp = grouped_matmul(
                xp,
                w,
                blocks.group,
                blocks.used,
                block=block,
                tiles=tiles,
                interpret=interpret,
            )
            return blocks.unpad(yp)

        y, vjp = jax.vjp(mm, x, w)
        return y, *vjp(dy)

    return jax.jit(f)


def _reference(x, w, sizes, dy):
    """Per-row products and their gradients in float64."""
    x, w, dy = (np.asarray(a, np.float64) for a in (x, w, dy))
    group = np.repeat(np.arange(len(sizes)), sizes)
    dw = np.zeros_like(w)
    np.add.at(dw, group, np.einsum("rn,rk->rnk", dy, x))
    return (
        np.einsum("rk,rnk->rn", x, w[group]),
        np.einsum("rn,rnk->rk", dy, w[group]),
        dw,
    )


def _close(got, want, rtol=1e-5):
    """Equal to f32 rounding of chained products summed in other orders (tiles):
    the error follows the size of the terms, so `atol` is relative to the
    array's largest entry (a wrong expert or row is off by O(that))."""
    want = np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.abs(want).max())


def _operands(dtype, seed=0):
    rng = np.random.default_rng(seed)
    draw = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    return draw(ROWS, D_IN), draw(GROUPS, D_OUT, D_IN), draw(ROWS, D_OUT)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_values_and_gradients_equal_per_row_products_in_f32(layout):
    block, tiles = LAYOUTS[layout]
    run = _product(block, tiles)
    x, w, dy = _operands(jnp.float32)
    for name, sizes in SIZES.items():
        sizes = np.asarray(sizes, np.int32)
        got = run(x, w, jnp.asarray(sizes), dy)
        for part, g, want in zip(
            ("y", "dx", "dw"), got, _reference(x, w, sizes, dy), strict=True
        ):
            assert g.dtype == jnp.float32
            np.testing.assert_allclose(
                g, want, rtol=1e-5, atol=1e-5, err_msg=f"{name}: {part}"
            )
        if name == "uneven":  # the empty group's weight gets no gradient
            assert not np.asarray(got[2][1]).any()


def test_values_and_gradients_follow_blocked_matmul_in_bf16():
    block, tiles = LAYOUTS["default"]
    run = _product(block, tiles)
    x, w, dy = _operands(jnp.bfloat16)
    sizes = jnp.asarray(SIZES["uneven"], jnp.int32)

    @jax.jit
    def scanned(x, w, sizes, dy):
        y, vjp = jax.vjp(lambda x, w: blocked_matmul(x, w, sizes, block), x, w)
        return y, *vjp(dy)

    got, ref = run(x, w, sizes, dy), scanned(x, w, sizes, dy)
    exact = _reference(x, w, np.asarray(sizes), dy)
    for part, g, r, e in zip(("y", "dx", "dw"), got, ref, exact, strict=True):
        assert g.dtype == jnp.bfloat16
        # f32 accumulation, one rounding to bf16 at the end (as XLA's product)
        scale = np.abs(e).max()
        g32 = np.asarray(g, np.float32)
        np.testing.assert_allclose(g32, r.astype(np.float32), atol=2e-2 * scale)
        np.testing.assert_allclose(g32, e, atol=1e-2 * scale, err_msg=part)


def test_blocks_past_the_last_group_are_zeros_even_over_garbage():
    """Unused blocks are written (zeros), whatever the padded rows hold."""
    block, tiles = LAYOUTS["small_tiles"]
    x, w, _ = _operands(jnp.float32)
    blocks = Blocks.of(jnp.asarray([3, 0, 10, 2], jnp.int32), 15, block)
    xp = jnp.ones((blocks.bound * block, D_IN), jnp.float32)
    y = jax.jit(
        lambda xp: grouped_matmul(
            xp, w, blocks.group, blocks.used, block=block, tiles=tiles
        )
    )(xp)
    used = np.repeat(np.asarray(blocks.used), block)
    assert used.sum() == 3 * block and not used[-1]  # three used blocks
    assert not np.asarray(y)[~used].any()
    group = np.repeat(np.asarray(blocks.group), block)[used]
    want = np.einsum("k,rnk->rn", np.ones(D_IN), np.asarray(w)[group])
    np.testing.assert_allclose(np.asarray(y)[used], want, rtol=1e-5, atol=1e-5)


def test_the_kernels_lower_with_triton():
    """The forward and both gradients lower to Triton kernels for CUDA (the
    Triton IR is built here; compiling it to PTX needs a GPU)."""
    block, tiles = LAYOUTS["default"]
    run = _product(block, tiles, interpret=False)
    shapes = [
        jax.ShapeDtypeStruct((ROWS, D_IN), jnp.bfloat16),
        jax.ShapeDtypeStruct((GROUPS, D_OUT, D_IN), jnp.bfloat16),
        jax.ShapeDtypeStruct((GROUPS,), jnp.int32),
        jax.ShapeDtypeStruct((ROWS, D_OUT), jnp.bfloat16),
    ]
    triton = "__gpu$xla.gpu.triton"
    unchecked = [export.DisabledSafetyCheck.custom_call(triton)]
    exported = export.export(run, platforms=["cuda"], disabled_checks=unchecked)
    text = exported(*shapes).mlir_module()
    names = ("grouped_matmul", "grouped_matmul_dx", "grouped_matmul_dw")
    for name in names:
        assert f'name = "{name}"' in text, name
    assert text.count(f"@{triton}(") == 3


@pytest.mark.parametrize(
    ("backend", "want"), [("cpu", True), ("gpu", False), ("cuda", False)]
)
def test_interpreted_on_cpu_compiled_on_gpu(backend, want):
    assert interpreted(backend, MOE_SETTING) is want


def test_tpu_and_bad_tiles_are_refused():
    with pytest.raises(ConfigError, match='moe_impl="ragged"'):
        interpreted("tpu", MOE_SETTING)
    with pytest.raises(ConfigError, match="power of two"):
        Tiles(rows=24)
    x = jnp.zeros((4 * 8, D_IN))
    with pytest.raises(ConfigError, match="`block` must be"):
        grouped_matmul(
            x,
            jnp.zeros((2, 3, D_IN)),
            jnp.zeros(4, jnp.int32),
            jnp.ones(4, bool),
            block=8,
        )


# -- in the experts and in a decoder -------------------------------------------------
def test_grouped_ffn_with_rows_of_no_expert_equals_sorted():
    """The expert-parallel path: rows with `ids == num` go to no expert (0)."""
    experts = Experts(
        GROUPS, 32, 24, act="silu", std=0.3, dtype=jnp.float32, key=jax.random.key(0)
    )
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(50, 32)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, GROUPS + 1, 50), jnp.int32)
    assert int((ids == GROUPS).sum()) > 0

    @eqx.filter_jit
    def both(experts, x, impl):
        def loss(experts, x):
            y = grouped_ffn(experts, x, ids, GROUPS, MoEOptions(impl))
            return jnp.sum(jnp.sin(y)), y

        return eqx.filter_value_and_grad(loss, has_aux=True)(experts, x)

    (_, y), grads = both(experts, x, "pallas")
    (_, y_ref), grads_ref = both(experts, x, "sorted")
    _close(y, y_ref)
    assert not np.asarray(y)[np.asarray(ids) == GROUPS].any()
    for got, want in zip(
        jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True
    ):
        _close(got, want)


def test_quantized_experts_are_dequantized_for_the_kernels():
    experts = Experts(
        GROUPS, 64, 64, act="silu", std=0.3, dtype=jnp.float32, key=jax.random.key(1)
    )
    quantized = eqx.tree_at(
        lambda e: (e.gate_proj, e.up_proj, e.down_proj),
        experts,
        replace_fn=lambda w: jax.device_put(quantize(w, "nf4")),
    )
    x = jnp.asarray(np.random.default_rng(0).normal(size=(30, 64)), jnp.float32)
    ids = jnp.asarray(np.arange(30) % GROUPS, jnp.int32)
    ffn = eqx.filter_jit(
        lambda e, impl: grouped_ffn(e, x, ids, GROUPS, MoEOptions(impl))
    )
    got, want = ffn(quantized, "pallas"), ffn(quantized, "sorted")
    _close(got, want)
    assert np.abs(np.asarray(got) - np.asarray(ffn(experts, "sorted"))).max() > 1e-3


@pytest.fixture(scope="module")
def decoder():
    config = DecoderConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=24,
        moe_intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        scan_layers=False,
    )
    # the shapes only, then every parameter drawn in NumPy (routing far from
    # uniform; eager initialisation would compile an op per shape)
    shapes = eqx.filter_eval_shape(Decoder, config, jax.random.key(0))
    rng = np.random.default_rng(1)
    draw = lambda a: jnp.asarray(rng.normal(0, 0.3, a.shape), a.dtype)
    is_shape = lambda a: isinstance(a, jax.ShapeDtypeStruct)
    return jax.tree.map(lambda a: draw(a) if is_shape(a) else a, shapes)


def test_decoder_with_pallas_equals_sorted_and_dense(decoder):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 12)))

    @eqx.filter_jit
    @eqx.filter_value_and_grad
    def loss(model, impl):
        hidden, aux = model.with_options(moe_impl=impl).batch_features(tokens)
        return jnp.mean(hidden**2) + load_balancing_loss(aux)

    value, grads = loss(decoder, "pallas")
    assert float(jnp.abs(grads.layers.mlp.experts.gate_proj).max()) > 0
    for ref in ("sorted", "dense"):
        ref_value, ref_grads = loss(decoder, ref)
        np.testing.assert_allclose(value, ref_value, rtol=1e-5)
        for got, want in zip(
            jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True
        ):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, err_msg=ref)


def _kernel_calls(jaxpr, mapped=False):
    """`(outside, inside)`: the `pallas_call`s of `jaxpr` outside and inside a
    `shard_map`."""
    outside = inside = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            inside, outside = (inside + 1, outside) if mapped else (inside, outside + 1)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            o, i = _kernel_calls(sub, mapped or eqn.primitive.name == "shard_map")
            outside, inside = outside + o, inside + i
    return outside, inside


@pytest.mark.skipif(
    jax.device_count() < 8, reason="a mesh of 8 (the CPU's simulated devices)"
)
def test_on_a_mesh_each_device_runs_its_own_tokens(decoder):
    """Under a `data x fsdp x tensor` mesh (XLA cannot split a Pallas call) the
    layer runs inside a `shard_map`: each of the 8 devices routes an eighth of
    the tokens through every expert, and the router statistics are summed; the
    loss and gradients are one device's `sorted` ones. Tokens that do not
    divide over every axis split over the batch axes alone, or not at all."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from eqtrain.models import under_mesh
    from eqtrain.models._expert_parallel import kernel_token_axes
    from eqtrain.models._experts import MoEOptions
    from eqtrain.sharding import make_mesh

    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (4, 12)))

    def loss(model, tokens, impl):
        hidden, aux = model.with_options(moe_impl=impl).batch_features(tokens)
        return jnp.mean(hidden**2) + load_balancing_loss(aux)

    grad = eqx.filter_value_and_grad(loss)
    want = eqx.filter_jit(grad)(decoder, tokens, "sorted")
    placed = jax.device_put(tokens, NamedSharding(mesh, P(("data", "fsdp"))))
    step = under_mesh(grad, mesh)
    jaxpr = jax.make_jaxpr(step, static_argnums=2)(decoder, placed, "pallas")
    assert _kernel_calls(jaxpr.jaxpr) == (0, 9)  # 3 products: forward, dx, dw
    got = eqx.filter_jit(lambda m, t: step(m, t, "pallas"))(decoder, placed)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

    pallas = MoEOptions(impl="pallas")
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        assert kernel_token_axes(pallas, 48) == ("data", "fsdp", "tensor")
        assert kernel_token_axes(pallas, 12) == ("data", "fsdp")  # 12 over 8: no
        assert kernel_token_axes(pallas, 10) == ()
        assert kernel_token_axes(MoEOptions(impl="sorted"), 48) == ()
        assert kernel_token_axes(MoEOptions("pallas", capacity_factor=1.0), 48) == ()
    assert kernel_token_axes(pallas, 48) == ()  # no mesh
