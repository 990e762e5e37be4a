"""oneDNN's products in `eqtrain.jit`'s steps: chosen by `tune_cpu`'s
measurement, applied per compilation (never process-wide), and checked before
a step runs, since this jaxlib aborts the process on oneDNN fusions it cannot
compile (`eqtrain.cpu._onednn`)."""

import dataclasses
import itertools
import textwrap

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqtrain
from eqtrain.cpu import _onednn, _tuning as _cpu_tuning, step_options
from eqtrain.losses import causal_lm_loss
from eqtrain.models import Llama, LlamaConfig
from eqtrain.models._attention import key_ranges


needs_onednn = pytest.mark.skipif(
    not _cpu_tuning.onednn_verified(_cpu_tuning.processor()),
    reason="oneDNN's products can be named with AVX-512 and a verified jaxlib only",
)


def _chain(n, branch=False):
    """`x @ y` followed by `n` additions: one oneDNN fusion of n + 1 operations
    in a chain; `branch`: the last addend computed in the fusion (`z * 2`), a
    side branch, not a link of the chain."""

    def fn(state, batch):
        out = batch["x"] @ batch["y"]
        for i in range(n):
            out = out + batch[f"z{i}"]
        if branch:
            out = out + batch["z0"] * 2.0
        return state, out.sum()

    return fn


def _batch():
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(64, 32)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(32, 48)), jnp.float32),
    }
    for i in range(5):
        batch[f"z{i}"] = jnp.asarray(rng.normal(size=(64, 48)), jnp.float32)
    return batch


def _jit(fn, **kwargs):
    """`eqtrain.jit` with the CPU setting's checked options
    (`eqtrain.cpu.step_options`), as `eqtrain fit` compiles its steps."""
    return eqtrain.jit(fn, compiler_options=step_options(), **kwargs)


def _plain(fn, batch):
    """`fn`'s output compiled by `jax.jit` without eqtrain's options."""
    return jax.jit(lambda b: fn(None, b)[1])(batch)


@pytest.fixture
def onednn(monkeypatch):
    """This process as after `tune_cpu` chose oneDNN's products."""
    name = "onednn_dots"
    choice = _cpu_tuning.Choice(name, _cpu_tuning.CANDIDATES[name], False, {}, "test")
    monkeypatch.setattr(_onednn, "_active", dict(choice.compiler_options))
    return choice


def test_the_choice_keeps_onednn_out_of_the_process_flags():
    """`onednn_dots` (named, never measured) gives a training process Eigen's
    products in `XLA_FLAGS` and oneDNN only as `eqtrain.jit`'s compilation
    options."""
    choice = _cpu_tuning.Choice(
        "onednn_dots", _cpu_tuning.CANDIDATES["onednn_dots"], False, {}, "pinned"
    )
    assert "onednn" in choice.flags
    assert choice.process_flags == _cpu_tuning.EIGEN_DOTS
    assert choice.compiler_options == _cpu_tuning.ONEDNN_OPTIONS
    eigen = _cpu_tuning.Choice(
        "eigen_dots", _cpu_tuning.EIGEN_DOTS, False, {}, "measured"
    )
    assert eigen.process_flags == eigen.flags and eigen.compiler_options == {}
    avx512 = {"cpu": "x", "family": "25", "model": "17", "isa": AVX512}
    avx2 = {"cpu": "x", "family": "23", "model": "49", "isa": ["avx2", "fma"]}
    arm = {"cpu": "y", "family": None, "model": None, "isa": []}
    assert _cpu_tuning.onednn_verified(avx512, jaxlib="0.10.2", environ={})
    assert not _cpu_tuning.onednn_verified(avx512, jaxlib="0.11.2", environ={})
    assert not _cpu_tuning.onednn_verified(avx2, jaxlib="0.10.2", environ={})
    assert not _cpu_tuning.onednn_verified(arm, jaxlib="0.10.2", environ={})
    # never measured (a known defect computes some fusions wrongly): named only
    for cpu in (avx512, avx2, arm):
        assert "onednn_dots" not in _cpu_tuning.candidates(cpu)
        assert "onednn_dots" not in _cpu_tuning.cache_key(cpu, cores=2)
    verified = _cpu_tuning.onednn_verified(avx512)
    if verified:
        assert _cpu_tuning.pinned("onednn_dots", avx512) == choice
    for cpu in (avx2, arm) if verified else (avx512, avx2, arm):
        with pytest.raises(ValueError, match="oneDNN's products run safely only"):
            _cpu_tuning.pinned("onednn_dots", cpu)


AVX512 = ["avx2", "fma", "avx512f", "avx512bw", "avx512vl"]


@pytest.mark.parametrize(
    ("environ", "allowed"),
    [
        ({}, True),
        ({"ONEDNN_MAX_CPU_ISA": "ALL"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "avx512_core_bf16"}, True),
        ({"DNNL_MAX_CPU_ISA": "AVX10_1_512_AMX"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "avx2_vnni"}, False),
        ({"DNNL_MAX_CPU_ISA": "SSE41"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "AVX-512"}, False),  # not a oneDNN name: ignored by it
    ],
)
def test_onednn_is_no_candidate_where_it_would_run_its_avx2_kernels(environ, allowed):
    """oneDNN's AVX2 kernels (`gemm:jit:f32`) corrupt the heap in this
    jaxlib's fusions, so oneDNN is measured only where it runs its AVX-512
    ones: a processor with AVX-512 F, BW and VL (not one with F alone), and
    no `ONEDNN_MAX_CPU_ISA` / `DNNL_MAX_CPU_ISA` below that; elsewhere it
    cannot be named (`EQTRAIN_CPU_TUNING=onednn_dots`)."""
    cpu = {"cpu": "x", "family": "25", "model": "17", "isa": AVX512}
    assert _cpu_tuning.onednn_verified(cpu, "0.10.2", environ) is allowed
    assert (_cpu_tuning.onednn_isa_capped(environ) is None) is allowed
    knl = {**cpu, "isa": ["avx2", "fma", "avx512f"]}  # AVX-512 F alone (Xeon Phi)
    assert not _cpu_tuning.onednn_verified(knl, "0.10.2", {})


def test_a_capped_onednn_cannot_be_named(monkeypatch):
    """The process's `ONEDNN_MAX_CPU_ISA` below AVX-512 keeps oneDNN's
    products from being named (`EQTRAIN_CPU_TUNING=onednn_dots`), saying why."""
    cpu = {"cpu": "x", "family": "25", "model": "17", "isa": AVX512}
    for name in _cpu_tuning.ONEDNN_ISA_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    with pytest.raises(ValueError, match="not held below it"):
        _cpu_tuning.pinned("onednn_dots", cpu)


def test_a_candidate_whose_probe_fails_is_left_out():
    """A candidate's probe aborting (a jaxlib that cannot compile its fusions)
    leaves the other candidates' measurement standing; the default's failing
    fails it (and `choose` falls back)."""
    times = {"eigen_dots": 100.0, "xla_default": 90.0, "eigen_dots_512": 99.0}

    def run(flags):
        name = next(n for n, f in _cpu_tuning.CANDIDATES.items() if f == flags)
        if name == "eigen_dots_512":
            raise RuntimeError("partition compile failed")
        return {"scanned_ms": times[name] + 1, "unrolled_ms": times[name]}

    cpu = {"cpu": "x", "family": "25", "model": "17", "isa": AVX512}
    choice = _cpu_tuning.measure(cpu, run)
    assert choice.name == "xla_default" and "eigen_dots_512" not in choice.measured

    def broken(flags):
        raise RuntimeError("no CPU backend")

    with pytest.raises(RuntimeError):
        _cpu_tuning.measure(cpu, broken)


@needs_onednn
@pytest.mark.filterwarnings("ignore:.*thunk kind. onednn")  # JAX's persistent cache
def test_the_check_reads_onednn_fusions_from_compiled_hlo():
    """Compiling runs nothing, so even the fusion that would abort the
    process can be read: one product and five additions is refused, one
    product and two is kept."""

    def compiled(n, branch=False):
        fn = jax.jit(lambda b: _chain(n, branch)(None, b)[1])
        options = _cpu_tuning.ONEDNN_OPTIONS
        return fn.lower(_batch()).compile(compiler_options=options).as_text()

    small, large, branched = compiled(2), compiled(5), compiled(1, branch=True)
    assert _onednn.uses_onednn(small) and _onednn.unsafe_fusion(small) is None
    bad = _onednn.unsafe_fusion(large)
    assert bad is not None and bad.count("add") == 5 and "at most 3" in bad
    bad = _onednn.unsafe_fusion(branched)
    assert bad is not None and "multiply is not a link" in bad
    assert not _onednn.uses_onednn(
        jax.jit(lambda x: x @ x).lower(jnp.ones((4, 4))).as_text()
    )


@needs_onednn
def test_a_step_oneDNN_cannot_run_goes_back_to_eigen_before_it_runs(onednn):
    """Five additions after a product, or a side branch after one: run with
    oneDNN, this jaxlib would abort the whole process (SIGILL; both measured).
    `eqtrain.jit` compiles the step again without oneDNN first, and it
    computes what Eigen's products compute."""
    batch, state = _batch(), jnp.zeros(())
    for fn in (_chain(5), _chain(1, branch=True)):
        step = _jit(fn, donate=False)
        _, got = step(state, batch)
        assert step.compile_note.startswith("eigen: a oneDNN fusion jaxlib cannot run")
        np.testing.assert_allclose(got, _plain(fn, batch), rtol=1e-5)
        _, again = step(state, batch)
        assert float(again) == float(got) and step.num_traces == 2  # once per build
    # a short chain runs in oneDNN, to rounding what Eigen computes
    short = _jit(_chain(2), donate=False)
    _, got = short(state, batch)
    assert short.compile_note == "onednn" and short.num_traces == 1
    np.testing.assert_allclose(got, _plain(_chain(2), batch), rtol=1e-5)


def _scaled_by_a_temporary(state, batch):
    """`(x @ y) * sin(z)`: `sin(z)` dies in the product's fusion, so XLA gives
    the fusion's result its memory."""
    return state, (batch["x"] @ batch["y"]) * jnp.sin(batch["z"])


@needs_onednn
@pytest.mark.filterwarnings("ignore:.*thunk kind. onednn")  # JAX's persistent cache
def test_a_fusion_sharing_memory_with_its_input_goes_back_to_eigen(onednn):
    """oneDNN overwrites a fusion's input that shares the result's memory
    before reading it: `(x @ y) * sin(z)` over 1,024-long products came out
    about 100x wrong in this jaxlib (measured). The buffer assignment says
    which fusions share; `eqtrain.jit` refuses them before anything runs, and
    the step computes what Eigen's products compute."""
    rng = np.random.default_rng(0)
    batch = {
        "x": jnp.asarray(rng.normal(size=(64, 1024)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(1024, 64)), jnp.float32),
        "z": jnp.asarray(rng.normal(size=(64, 64)), jnp.float32),
    }
    options, dump = _onednn.dump_options(_cpu_tuning.ONEDNN_OPTIONS)
    raw = jax.jit(
        lambda b: _scaled_by_a_temporary(None, b)[1], compiler_options=options
    )
    hlo, why = _onednn.compile_checked(raw, dump, batch)
    assert _onednn.uses_onednn(hlo) and _onednn.unsafe_fusion(hlo) is None
    assert why is not None and "shares memory with its input" in why, why
    step = _jit(_scaled_by_a_temporary, donate=False)
    _, got = step(jnp.zeros(()), batch)
    assert (
        step.compile_note.startswith("eigen: ") and "shares memory" in step.compile_note
    )
    np.testing.assert_allclose(
        got, _plain(_scaled_by_a_temporary, batch), rtol=1e-5, atol=1e-4
    )
    # its inputs as the step's own arrays share nothing: oneDNN runs it
    direct = _jit(lambda s, b: (s, (b["x"] @ b["y"]) * b["z"]), donate=False)
    _, got = direct(jnp.zeros(()), batch)
    assert direct.compile_note == "onednn"
    want = (
        np.asarray(batch["x"], np.float64) @ np.asarray(batch["y"], np.float64)
    ) * np.asarray(batch["z"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_shared_buffer_reads_xla_buffer_assignment():
    """The parser on a dump of the shape above: the fusion's result and its
    input 2 in the same allocation and range, input 2 multiplied (refused) or
    added (kept); values in other ranges, other fusions, and tuple values'
    names (`cond.45{8} (phi)`) read right."""
    hlo = textwrap.dedent("""\
        %fused_computation (param_0: f32[8,4], param_1: f32[4,8], param_2: f32[8]) {
          %param_0 = f32[8,4]{1,0} parameter(0)
          %param_1 = f32[4,8]{1,0} parameter(1)
          %dot.1 = f32[8]{0} dot(%param_0, %param_1), lhs_contracting_dims={1}
          %param_2 = f32[8]{0} parameter(2)
          ROOT %multiply.1 = f32[8]{0} multiply(%dot.1, %param_2)
        }

        ENTRY %main (a: f32[8,4]) -> f32[8] {
          ROOT %onednn_fusion = f32[8]{0} fusion(%a, %b, %wrapped_sine), \
        calls=%fused_computation, backend_config={"fusion_config":\
        {"kind":"__onednn_fusion"}}
        }
        """)
    uses = "\n positions:\n  {0}\n uses:\n  onednn_fusion, operand {1}\n"
    assignment = (
        "allocation 0: size 32, parameter 0:\n"
        " value: <1 a @0> (size=32,offset=0): f32[8]{0}\n"
        "allocation 1: size 64, preallocated-temp:\n"
        " value: <2 cond.45{8} (phi) @0> (size=32,offset=0): f32[8]{0}\n"
        " value: <3 wrapped_sine @0> (size=32,offset=32): f32[8]{0}\n"
        " value: <4 onednn_fusion @0> (size=32,offset=OUT): f32[8]{0}\n"
        "\nUsed values:\n"
        + "<1 a @0>" + uses.format("a", 0)
        + "<2 cond.45{8} (phi) @0>" + uses.format("cond.45", 1)
        + "<3 wrapped_sine @0>" + uses.format("wrapped_sine", 2)
        + "<4 onednn_fusion @0>\n positions:\n  onednn_fusion\n uses:\n  (none)\n"
    )  # fmt: skip
    shared = _onednn.shared_buffer(hlo, assignment.replace("OUT", "32"))
    assert shared == (
        "onednn_fusion: its result shares memory with its input 2, which multiply reads"
    )
    shared = _onednn.shared_buffer(hlo, assignment.replace("OUT", "0"))
    assert shared == (
        "onednn_fusion: its result shares memory with its input 1, which dot reads"
    )
    # an input only added to the product may share (oneDNN accumulates into it)
    added = hlo.replace("multiply(%dot.1", "add(%dot.1")
    assert _onednn.shared_buffer(added, assignment.replace("OUT", "32")) is None
    # a result in the parameter's allocation but not the temporaries' ranges
    apart = assignment.replace("allocation 1: size 64", "allocation 1: size 96")
    assert _onednn.shared_buffer(hlo, apart.replace("OUT", "64")) is None
    assert (
        _onednn.shared_buffer(hlo.replace("__onednn_fusion", "other"), assignment)
        is None
    )


OPS = {
    "add": jnp.add,
    "subtract": jnp.subtract,
    "multiply": jnp.multiply,
    "maximum": jnp.maximum,
    "minimum": jnp.minimum,
    "divide": jnp.divide,
}


def _grid(dtype, batched, ops, length):
    """Every chain of `ops` up to `length` after a product (plain or batched)
    that the check admits runs in oneDNN, as Eigen computes it."""
    rng = np.random.default_rng(0)
    shapes = ((16, 8), (8, 12), (16, 12))
    if batched:
        shapes = tuple((4, *s) for s in shapes)
    names = ("x", "y", "z", "w", "u")
    batch = {
        k: jnp.asarray(rng.uniform(1, 2, shapes[min(i, 2)]), dtype)
        for i, k in enumerate(names)
    }
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for n in range(1, length + 1):
        for chain in itertools.product(ops, repeat=n):

            def fn(state, b, chain=chain):
                out = jnp.matmul(b["x"], b["y"])
                for op, k in zip(chain, names[2:], strict=False):
                    out = OPS[op](out, b[k])
                return state, out

            step = _jit(fn, donate=False)
            _, got = step(jnp.zeros(()), batch)
            assert step.compile_note == "onednn", (chain, step.compile_note)
            want = np.asarray(_plain(fn, batch), np.float32)
            np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol)


@needs_onednn
@pytest.mark.parametrize("batched", [False, True])
def test_the_chains_the_check_admits_run(onednn, batched):
    """A product followed by one or two of add, multiply and maximum, in f32:
    each runs in oneDNN (a shape the check admits that aborted would take
    this test's process down). The slow variant runs all of them."""
    _grid(jnp.float32, batched, ("add", "multiply", "maximum"), 2)


@pytest.mark.slow
@needs_onednn
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batched", [False, True])
def test_every_chain_the_check_admits_runs(onednn, dtype, batched):
    """Every chain of up to `MAX_FUSED` of six elementwise operations after a
    product, f32 and bf16, plain and batched (258 steps each)."""
    _grid(jnp.dtype(dtype), batched, tuple(OPS), _onednn.MAX_FUSED)


def _shared_grid(ops, length, depth):
    """Every chain of `ops` up to `length` after a product `depth` long, each
    operand computed in the step (`sin`), so that it dies in the product's
    fusion and XLA may give the fusion's result its memory: each step either
    runs in oneDNN or was refused for sharing memory, and computes what
    Eigen's products compute. Returns the refused chains."""
    rng = np.random.default_rng(1)
    batch = {
        "x": jnp.asarray(rng.normal(size=(32, depth)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(depth, 32)), jnp.float32),
        "z": jnp.asarray(rng.uniform(1, 2, (32, 32)), jnp.float32),
        "w": jnp.asarray(rng.uniform(1, 2, (32, 32)), jnp.float32),
    }
    refused = []
    for n in range(1, length + 1):
        for chain in itertools.product(ops, repeat=n):

            def fn(state, b, chain=chain):
                out = b["x"] @ b["y"]
                for op, k in zip(chain, ("z", "w"), strict=False):
                    out = OPS[op](out, jnp.sin(b[k]))
                return state, out

            step = _jit(fn, donate=False)
            _, got = step(jnp.zeros(()), batch)
            products = step.compile_note
            assert products == "onednn" or "shares memory" in products, products
            if products != "onednn":
                refused.append(chain)
            want = _plain(fn, batch)
            scale = float(jnp.abs(want).max())
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * scale)
    return refused


@needs_onednn
@pytest.mark.filterwarnings("ignore:.*thunk kind. onednn")  # JAX's persistent cache
def test_fusions_whose_inputs_share_memory_compute_right(onednn):
    """Add and multiply, one or two of them after a 1,024-long product, each
    on an operand computed in the step: what oneDNN runs is right, and a
    multiplication of a shared input is refused (run, it came out wrong).
    The slow variant runs all six operations at two depths."""
    refused = _shared_grid(("add", "multiply"), 2, 1024)
    assert ("multiply",) in refused and ("add",) not in refused


@pytest.mark.slow
@needs_onednn
@pytest.mark.filterwarnings("ignore:.*thunk kind. onednn")
@pytest.mark.parametrize("depth", [64, 1024])
def test_every_chain_on_shared_inputs_computes_right(onednn, depth):
    _shared_grid(tuple(OPS), 2, depth)


def _llama(seq):
    return LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        scan_layers=False,
    )


def _train(seq, steps=3):
    config = _llama(seq)
    optimizer = optax.adamw(1e-3)
    state = eqtrain.TrainState.create(Llama(config, jr.key(0)), optimizer, key=0)
    step = _jit(eqtrain.train_step(causal_lm_loss, optimizer), donate=True)
    tokens = np.random.default_rng(1).integers(0, 128, (2, seq + 1), np.int32)
    batch = {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "loss_mask": np.ones((2, seq), np.float32),
    }
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return step, losses


@needs_onednn
@pytest.mark.parametrize(
    "seq",  # the default suite: 64; `nox -s slow`: 1024 (the causal blocks) too
    [64, pytest.param(1024, marks=pytest.mark.slow)],
)
def test_a_llama_step_trains_with_onednn_as_with_eigen(onednn, monkeypatch, seq):
    """The Llama's step runs every product in oneDNN, at 1,024 tokens too
    (eight causal blocks, whose key and value gradients `key_ranges` adds
    range by range rather than as one chain after a product), traced once,
    and trains as the same step without oneDNN does, to f32 rounding."""
    step, losses = _train(seq)
    assert step.compile_note == "onednn" and step.num_traces == 1
    if seq == 64:  # a run is repeatable bit for bit (resume depends on it)
        assert _train(seq)[1] == losses
    monkeypatch.setattr(_onednn, "_active", {})
    plain, want = _train(seq)
    assert plain.compile_note is None
    np.testing.assert_allclose(losses, want, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 160])
def test_key_ranges_gradient_is_the_slices_gradient(window):
    """`key_ranges`' own gradient equals autodiff's through plain slices,
    with and without a sliding window's ranges (which start past 0)."""
    x = jr.normal(jr.key(0), (2, 512, 8))
    size = 128
    ranges = tuple(
        (0 if window is None else max(0, s - window + 1), s + size)
        for s in range(0, 512, size)
    )
    weights = [
        jr.normal(jr.key(i + 1), (2, b - a, 8)) for i, (a, b) in enumerate(ranges)
    ]

    def loss(fn):
        return lambda x: sum(
            jnp.sum(w * jnp.sin(p)) for w, p in zip(weights, fn(x), strict=True)
        )

    ours = jax.value_and_grad(loss(lambda x: key_ranges(x, ranges)))(x)
    plain = jax.value_and_grad(loss(lambda x: [x[:, a:b] for a, b in ranges]))(x)
    np.testing.assert_allclose(ours[0], plain[0], rtol=1e-6)
    np.testing.assert_allclose(ours[1], plain[1], rtol=1e-5, atol=1e-6)


def test_no_onednn_unless_tune_cpu_chose_it():
    """The default (`EQTRAIN_CPU_TUNING=fixed`, the tests' setting; a user's
    own XLA flags) compiles with no options of eqtrain's."""
    assert _onednn.compiler_options() == {}
    step = _jit(_chain(1), donate=False)
    step(jnp.zeros(()), _batch())
    assert step.compile_note is None and step._options == {}


def test_a_dataclass_choice_round_trips_through_the_cache():
    entry = dataclasses.asdict(
        _cpu_tuning.Choice(
            "onednn_dots", _cpu_tuning.CANDIDATES["onednn_dots"], True,
            {"onednn_dots": {"scanned_ms": [1.0], "unrolled_ms": [2.0]}}, "pinned",
        )
    )  # fmt: skip
    back = _cpu_tuning.from_entry(entry, "cached")
    assert back is not None and back.compiler_options == _cpu_tuning.ONEDNN_OPTIONS


def _family_losses(config, steps=2):
    optimizer = optax.adamw(1e-3)
    state = eqtrain.TrainState.create(Llama(config, jr.key(0)), optimizer, key=0)
    step = _jit(eqtrain.train_step(causal_lm_loss, optimizer), donate=True)
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, (2, 41), np.int32)
    batch = {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "loss_mask": np.ones((2, 40), np.float32),
    }
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return step.compile_note, losses


MOE = ("mixtral", "qwen2_moe", "qwen3_moe")
SCALED_HEADS = ("gemma2", "granite")
"""Families whose head scales its product's result (Gemma 2's final soft-cap,
Granite's `logits_scaling`): XLA fuses the scale into the product and gives
the fusion's result the broadcast scale's memory, which oneDNN computes
wrongly, so their steps go back to Eigen's products."""


@pytest.mark.slow
@needs_onednn
def test_every_family_trains_with_onednn_or_goes_back_to_eigen(monkeypatch):
    """Each Hugging Face family eqtrain imports, one variant each: the dense
    decoders' steps run in oneDNN (their fused projections never add two
    products), the mixtures of experts' go back to Eigen's products (a fusion
    of two products, refused), and so do those with a scaled head (a fusion
    sharing memory with its scale, refused); either way they train as without
    oneDNN."""
    transformers = pytest.importorskip("transformers")
    from eqtrain.models.archs import ARCHS, Reader

    from . import _hf_families as fam
    from .test_hf_moe import VARIANTS as MOE_VARIANTS

    seen = {}
    for model_type, kwargs in [*fam.VARIANTS.values(), *MOE_VARIANTS.values()]:
        if model_type in seen or model_type not in ARCHS:
            continue
        hf_config = transformers.AutoConfig.for_model(model_type, **kwargs)
        reader = Reader(hf_config.to_dict(), model_type)
        config = ARCHS[model_type].from_hf(reader, "float32")
        config = dataclasses.replace(config, scan_layers=False)
        monkeypatch.setattr(_onednn, "_active", dict(_cpu_tuning.ONEDNN_OPTIONS))
        products, losses = _family_losses(config)
        monkeypatch.setattr(_onednn, "_active", {})
        _, want = _family_losses(config)
        np.testing.assert_allclose(losses, want, rtol=2e-5, err_msg=model_type)
        seen[model_type] = products
    assert set(seen) == set(ARCHS), set(ARCHS) - set(seen)
    for model_type, products in seen.items():
        if model_type in MOE:
            refused = products.startswith("eigen: a oneDNN fusion")
            assert refused and "shares memory" not in products, (model_type, products)
        elif model_type in SCALED_HEADS:
            assert "shares memory" in products, (model_type, products)
        else:
            assert products == "onednn", (model_type, products)


@needs_onednn
def test_a_data_parallel_step_runs_onednn_as_one_device(onednn, monkeypatch):
    """Over 8 devices (`NamedSharding`, the batch split on `data`) each
    device's program runs oneDNN's products, and trains as one device does."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (simulated) devices")
    config, optimizer = _llama(128), optax.adamw(1e-3)
    tokens = np.random.default_rng(1).integers(0, 128, (8, 129), np.int32)
    batch = {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "loss_mask": np.ones((8, 128), np.float32),
    }
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    whole, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

    def losses(shardings):
        state = eqtrain.TrainState.create(Llama(config, jr.key(0)), optimizer, key=0)
        data = batch
        if shardings is not None:
            state, data = jax.device_put(state, whole), jax.device_put(batch, rows)
        step = eqtrain.train_step(causal_lm_loss, optimizer)
        step = _jit(step, shardings=shardings)
        out = []
        for _ in range(2):
            state, metrics = step(state, data)
            out.append(float(metrics["loss"]))
        return step.compile_note, out

    products, sharded = losses((whole, rows))
    assert products == "onednn"
    one_device = losses(None)[1]
    np.testing.assert_allclose(sharded, one_device, rtol=2e-5)
