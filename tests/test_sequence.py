"""Sequence parallelism (`eqtrain.models.sequence_attention`): each scheme equals
unsharded attention (forward and gradients) on a `data=2, sequence=4` mesh, its
compiled HLO holds its collective and no gather of activations outside
attention, the data side (positions, zigzag) and the config checks; under
`slow`, `eqtrain fit` on that mesh gives the one-device loss curve and
checkpoints move between sequence sizes."""

import functools
import json
import os
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqtrain
from eqtrain import config as config_lib, job, losses, models
from eqtrain._rows import vmap_rows
from eqtrain.models._attention import attention
from eqtrain.models._masks import segment_positions
from eqtrain.sharding import make_mesh


S, H, K, D = 32, 4, 2, 8
SEGMENTS = np.array([[1] * 10 + [2] * 14 + [3] * 5 + [0] * 3, [1] * S], np.int32)
COLLECTIVE = {
    "ulysses": "all-to-all",
    "ring": "collective-permute",
    "all_gather": "all-gather",
}


def _close(a, b, rtol=1e-5):
    """Equal to `rtol` relative to the largest entry (f32)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        scale = float(jnp.max(jnp.abs(y)))
        assert float(jnp.max(jnp.abs(x - y))) <= rtol * scale + 1e-6


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"data": 2, "sequence": 4})


@pytest.fixture(scope="module")
def qkv():
    kq, kk, kv, kc = jr.split(jr.key(0), 4)
    q = jr.normal(kq, (2, S, H, D))
    k, v = jr.normal(kk, (2, S, K, D)), jr.normal(kv, (2, S, K, D))
    return q, k, v, jr.normal(kc, (2, S, H, D))


def _reference(q, k, v, cotangent, window):
    """Loss and gradients of plain attention on whole rows, one device."""
    segs = jnp.asarray(SEGMENTS)

    def loss(q, k, v):
        call = lambda q, k, v, s: attention(
            q, k, v, segment_ids=s, sliding_window=window, implementation=None
        )
        return jnp.sum(jax.vmap(call)(q, k, v, segs) * cotangent)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)


def _sharded(scheme, layout, window, mesh, q, k, v, cotangent):
    """The same on the mesh (rows permuted for the layout), and the compiled HLO."""
    order = models.zigzag_order(S, 4) if layout == "zigzag" else np.arange(S)
    segs = jnp.asarray(SEGMENTS)[:, order]
    pos = jax.vmap(segment_positions)(jnp.asarray(SEGMENTS))[:, order]

    def loss(q, k, v, pos, segs):
        call = lambda q, k, v, p, s: models.sequence_attention(
            q,
            k,
            v,
            scheme=scheme,
            positions=p,
            segment_ids=s,
            sliding_window=window,
            layout=layout,
        )
        out = vmap_rows(call)(q, k, v, pos, segs)
        return jnp.sum(out * cotangent[:, order])

    fn = jax.jit(models.under_mesh(jax.value_and_grad(loss, argnums=(0, 1, 2)), mesh))
    sh = NamedSharding(mesh, P("data", "sequence"))
    args = [jax.device_put(x[:, order], sh) for x in (q, k, v)]
    args += [jax.device_put(x, sh) for x in (pos, segs)]
    compiled = fn.lower(*args).compile()
    value, grads = compiled(*args)
    inverse = np.argsort(order)
    grads = tuple(g[:, inverse] for g in grads)
    return (value, grads), compiled.as_text()


# Each scheme with GQA (4 query, 2 kv heads; Ulysses repeats them for 4 devices),
# packed segments with padding and a sliding window; the ring in the zigzag
# layout. `slow` runs every scheme x layout x window.
LAYOUT = {"ulysses": "contiguous", "ring": "zigzag", "all_gather": "contiguous"}


@pytest.fixture(scope="module", params=sorted(COLLECTIVE))
def scheme_results(request, mesh, qkv):
    scheme = request.param
    q, k, v, ct = qkv
    got = _sharded(scheme, LAYOUT[scheme], 7, mesh, q, k, v, ct)
    return scheme, got, _reference(q, k, v, ct, 7)


@pytest.mark.tuned  # re-run under each CPU setting (test_tuned_settings.py)
def test_scheme_equals_unsharded_attention(scheme_results):
    _, (got, _), want = scheme_results
    _close(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", sorted(COLLECTIVE))
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("window", [None, 7])
def test_every_scheme_layout_and_window(scheme, layout, window, mesh, qkv):
    q, k, v, ct = qkv
    got, _ = _sharded(scheme, layout, window, mesh, q, k, v, ct)
    _close(got, _reference(q, k, v, ct, window))


def test_scheme_hlo_has_its_collective(scheme_results):
    scheme, (_, hlo), _ = scheme_results
    assert re.search(COLLECTIVE[scheme] + r"(-start)?\(", hlo)
    if scheme != "all_gather":  # only positions and segment ids are gathered
        for line in hlo.splitlines():
            if re.search(r"all-gather(-start)?\(", line):
                assert re.search(r"= \(?s32\[", line), line


def _attention_temp_bytes(scheme, mesh, seq=512, heads=4):
    """Per-device temp memory of one attention's loss and gradients (no run)."""

    def loss(q, k, v, pos, segs):
        call = lambda q, k, v, p, s: models.sequence_attention(
            q, k, v, scheme=scheme, positions=p, segment_ids=s
        )
        return jnp.sum(vmap_rows(call)(q, k, v, pos, segs))

    sh = NamedSharding(mesh, P("data", "sequence"))
    x = jax.ShapeDtypeStruct((2, seq, heads, 16), jnp.float32, sharding=sh)
    ints = jax.ShapeDtypeStruct((2, seq), jnp.int32, sharding=sh)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    compiled = jax.jit(models.under_mesh(grad, mesh)).lower(x, x, x, ints, ints)
    return compiled.compile().memory_analysis().temp_size_in_bytes


def test_all_gather_memory_is_at_most_ulysses(mesh):
    # XLA's figure for the partitioned program (deterministic, no step run). The
    # all-gather scheme once held the `[heads, S/n, S]` scores of one attention
    # over all keys, causally masked half, for the backward: 2x Ulysses' memory
    # (5.2 against 2.5 MiB here; block by block it measured 2.5).
    ulysses = _attention_temp_bytes("ulysses", mesh)
    assert _attention_temp_bytes("all_gather", mesh) <= 1.25 * ulysses


def _llama(**options):
    config = models.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=24,
        scan_layers=False,
        **options,
    )
    return models.Llama(config, jr.key(0))


def _lm_rows(seq=32, rows=4):
    tokens = np.asarray(jr.randint(jr.key(1), (rows, seq + 1), 0, 64))
    seg = np.ones((rows, seq), np.int32)
    seg[0, seq // 3 :] = 2  # packed: 10 + 22 tokens
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg}


@functools.cache
def _one_device_grads():
    rows = _lm_rows()
    grad = eqx.filter_value_and_grad(lambda m: losses.causal_lm_loss(m, rows)[0])
    return eqx.filter_jit(grad)(_llama())


def _model_grads(scheme, layout, mesh):
    rows = models.sequence_rows(_lm_rows(), layout=layout, ways=4)
    sh = NamedSharding(mesh, P("data", "sequence"))
    batch = {k: jax.device_put(v, sh) for k, v in rows.items()}
    model = _llama(sequence_parallel=scheme, sequence_layout=layout)
    grad = eqx.filter_value_and_grad(lambda m, b: losses.causal_lm_loss(m, b)[0])
    compiled = jax.jit(models.under_mesh(grad, mesh)).lower(model, batch).compile()
    return compiled(model, batch), compiled.as_text()


def test_llama_ring_zigzag_equals_one_device(mesh):
    (loss, grads), hlo = _model_grads("ring", "zigzag", mesh)
    want = _one_device_grads()
    _close((loss, grads), want)
    # No activation is gathered across the sequence: the ring only permutes.
    assert "collective-permute" in hlo and not re.search(r"all-gather(-start)?\(", hlo)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", sorted(COLLECTIVE))
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_llama_equals_one_device(scheme, layout, mesh):
    (loss, grads), hlo = _model_grads(scheme, layout, mesh)
    want = _one_device_grads()
    _close((loss, grads), want)
    # Outside attention (the shard_map), no float activation is gathered.
    for line in hlo.splitlines():
        if re.search(r"all-gather(-start)?\(", line) and not re.search(
            r"= \(?s32\[", line
        ):
            assert "shard_map" in line, line


def test_sequence_rows_positions_and_zigzag():
    rows = {
        "tokens": np.arange(16).reshape(2, 8),
        "segment_ids": np.array([[1, 1, 1, 2, 2, 2, 2, 0], [1] * 8]),
    }
    out = models.sequence_rows(rows, layout="contiguous", ways=2)
    assert out["positions"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], list(range(8))]
    zig = models.sequence_rows(rows, layout="zigzag", ways=2)
    order = models.zigzag_order(8, 2)
    assert order.tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    for name in ("tokens", "segment_ids", "positions"):
        assert (zig[name] == out[name][:, order]).all()


def test_config_checks_name_the_fields():
    check = models.check_sequence
    with pytest.raises(eqtrain.ConfigError, match=r"data.seq_len 30 .* mesh.sequence"):
        check(seq_len=30, ways=4, scheme="ring")
    with pytest.raises(eqtrain.ConfigError, match=r"twice mesh.sequence"):
        check(seq_len=36, ways=4, scheme="ring", layout="zigzag")
    with pytest.raises(eqtrain.ConfigError, match=r"model.num_heads 6"):
        check(seq_len=32, ways=4, scheme="ulysses", heads=6)
    with pytest.raises(eqtrain.ConfigError, match=r"model.sequence_parallel is unset"):
        check(seq_len=32, ways=4, scheme=None)
    with pytest.raises(eqtrain.ConfigError, match="`sequence_parallel`"):
        _llama(sequence_parallel="stripes")
    check(seq_len=32, ways=4, scheme="ulysses", heads=8, tensor=2)


# -- the job ------------------------------------------------------------------------
TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 60


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    (root / "0.txt").write_text(TEXT * 3)
    return root


def _overrides(text_dir, run_dir, *extra):
    return [
        f"run_dir={run_dir}",
        f"data.train={text_dir}",
        "data.eval=none",
        "model.hidden_size=32",
        "model.num_layers=2",
        "data.seq_len=32",
        "data.batch_size=4",
        "loop.steps=10",
        "loop.eval_every=0",
        "checkpoint.every=5",
        "log.progress=none",
        "optim.schedule=constant",
        "optim.warmup_steps=0",
        "mesh.data=2",
        *extra,
    ]


def test_sequence_keys_reach_the_run(text_dir, tmp_path):
    extra = [
        "mesh.sequence=4",
        "model.sequence_parallel=ring",
        "model.sequence_layout=zigzag",
    ]
    config = config_lib.load(overrides=_overrides(text_dir, tmp_path / "r", *extra))
    report = job.report(config)
    assert "sequence=4" in report and "4 devices x 8 tokens per device" in report
    p = job.prepare(config)
    p.close()
    p.fit_kwargs["checkpointer"].close()
    assert p.placement.mesh.shape["sequence"] == 4
    assert p.placement.batch_sharding.spec == P(("data", "fsdp", "expert"), "sequence")
    config = p.state.model.config
    assert (config.sequence_parallel, config.sequence_layout) == ("ring", "zigzag")
    batch = next(iter(p.loader))
    assert batch["positions"][0, :8].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["data.seq_len=30"], r"data.seq_len 30 does not split"),
        (
            ["model.sequence_parallel=ulysses", "model.num_heads=2"],
            r"model.num_heads 2",
        ),
        (["model.sequence_parallel=null"], r"model.sequence_parallel is unset"),
    ],
)
def test_job_refuses_before_compiling(text_dir, tmp_path, extra, match):
    base = ["mesh.sequence=4", "model.sequence_parallel=ring"]
    overrides = _overrides(text_dir, tmp_path / "r", *base, *extra)
    with pytest.raises(eqtrain.ConfigError, match=match):
        job.report(config_lib.load(overrides=overrides))


def test_fit_on_a_sequence_mesh_and_its_checkpoint_on_one_without(text_dir, tmp_path):
    """The default suite's whole runs (in this process, 8 devices; the slow ones
    below run `eqtrain fit` itself on every scheme): the ring on mesh.sequence =
    4 trains like the run without sequence parallelism, and its step-2
    checkpoint continues on mesh.sequence = 1 along that run's curve."""

    def fit(run, *extra):
        sets = _overrides(text_dir, run, "loop.steps=4", "checkpoint.every=2")
        sets += ["mesh.fsdp=-1", "data.batch_size=8", *extra]  # 2 x 4 devices
        result = job.run(config_lib.load(overrides=sets), echo=lambda s: None)
        return [h["loss"] for h in result.fit.history if "loss" in h], result

    plain, _ = fit(tmp_path / "plain")
    ring = ["model.sequence_parallel=ring", "mesh.sequence=4"]
    first, _ = fit(tmp_path / "moved", *ring, "loop.steps=2")
    np.testing.assert_allclose(first, plain[:2], rtol=1e-4, atol=1e-4)
    then, resumed = fit(tmp_path / "moved", "mesh.sequence=1")
    assert resumed.resumed_from == 2 and len(then) == 2
    np.testing.assert_allclose(then, plain[2:], rtol=1e-4, atol=1e-4)


# -- slow: whole runs ---------------------------------------------------------------
def _fit(text_dir, run_dir, *extra, devices=8):
    """`eqtrain fit` in a subprocess with `devices` simulated CPU devices; the
    losses it logged."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    args = [sys.executable, "-m", "eqtrain.cli", "fit"]
    for o in _overrides(text_dir, run_dir, *extra):
        args += ["--set", o]
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


@pytest.fixture(scope="module")
def one_device_losses(text_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("one") / "run"
    return _fit(text_dir, run, "mesh.data=1", devices=1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [["model.sequence_parallel=" + s] for s in sorted(COLLECTIVE)]
    + [["model.sequence_parallel=ring", "model.sequence_layout=zigzag"]]
    # heads on tensor too: 4 heads / tensor 2 / sequence 2, kv heads repeated
    + [["model.sequence_parallel=ulysses", "mesh.sequence=2", "mesh.tensor=2"]],
    ids=lambda o: "-".join(x.split("=")[1] for x in o),
)
def test_fit_on_sequence_mesh_gives_the_one_device_curve(
    text_dir, tmp_path, one_device_losses, options
):
    losses_ = _fit(text_dir, tmp_path / "run", "mesh.sequence=4", *options)
    assert len(losses_) == len(one_device_losses) >= 10
    np.testing.assert_allclose(losses_, one_device_losses, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("first,then", [(4, 1), (1, 4)])
def test_checkpoints_move_between_sequence_sizes(
    text_dir, tmp_path, one_device_losses, first, then
):
    run = tmp_path / "run"
    ring = ["model.sequence_parallel=ring"]
    # data=2 throughout: 2 devices for sequence=1, 8 for sequence=4.
    _fit(
        text_dir,
        run,
        "loop.steps=5",
        f"mesh.sequence={first}",
        *ring,
        devices=2 * first,
    )
    resumed = _fit(
        text_dir,
        run,
        "checkpoint.resume=auto",
        f"mesh.sequence={then}",
        *ring,
        devices=2 * then,
    )
    # The resumed run logs steps 6..10; they continue the uninterrupted curve.
    np.testing.assert_allclose(
        resumed[-5:], one_device_losses[-5:], rtol=1e-4, atol=1e-4
    )


@pytest.mark.slow
def test_gpt2_ulysses_equals_one_device(mesh):
    config = models.GPT2Config(
        vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=4
    )
    rows = models.sequence_rows(_lm_rows(), ways=4)
    model = models.GPT2(config, jr.key(0))
    sp = model.with_options(sequence_parallel="ulysses")
    sh = NamedSharding(mesh, P("data", "sequence"))
    batch = {k: jax.device_put(v, sh) for k, v in rows.items()}
    loss = lambda m, b: losses.causal_lm_loss(m, b)[0]
    got = jax.jit(models.under_mesh(loss, mesh))(sp, batch)
    _close(got, jax.jit(loss)(model, _lm_rows()))


def test_sequence_options_change_no_array():
    model = _llama()
    changed = model.with_options(sequence_parallel="ring", sequence_layout="zigzag")
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(changed), strict=True):
        assert a is b
    assert changed.config.sequence_parallel == "ring"
