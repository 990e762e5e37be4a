import os


# Must happen before JAX touches a device: 8 simulated CPU devices for sharding tests.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# The CLI's CPU settings without measuring them (tests/test_cpu.py measures):
# every test process, the `eqtrain` ones started by tests included, computes
# alike whatever this processor would choose. tests/test_tuned_settings.py runs
# the tests marked `tuned` again under each other setting tune_cpu can choose,
# named here (`EQTRAIN_CPU_TUNING=xla_default,scanned`): then this process
# applies it too, as `eqtrain fit` would, before JAX starts.
os.environ.setdefault("EQTRAIN_CPU_TUNING", "fixed")
if os.environ["EQTRAIN_CPU_TUNING"].strip().lower() != "fixed":
    import eqtrain

    eqtrain.cpu.tune_cpu(measure=False)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Nothing is downloaded at run time: bitsandbytes 0.50 (imported by peft) asks
# the Hub for a CPU kernel on processors with AVX512-BF16; offline it uses its own.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Tokenized stores go to one directory per test session (never ~/.cache); keyed
# by content, so the tests share the built-in corpus's store.
if "EQTRAIN_DATA_CACHE" not in os.environ:
    import tempfile

    os.environ["EQTRAIN_DATA_CACHE"] = tempfile.mkdtemp(prefix="eqtrain-data-")
# One persistent compilation cache per test session, shared with the `eqtrain`
# subprocesses the tests start (they inherit the environment): many tests compile
# the same small steps (the CLI's tiny runs above all). Every compilation is kept
# (no minimum time or size). It cut tests/test_cli.py + test_resume_workflows.py
# from 114 s to 90 s, starting empty (docs/testing.md). No maximum size: with one,
# JAX locks the directory and scans every entry at each write (the suite then ran
# slower than without the cache). Two processes that compile the same program at
# once may race on an entry; the loser reads a short file, warns and compiles.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="eqtrain-jax-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


jax.config.update("jax_numpy_rank_promotion", "raise")


# -- the extras are required in CI --------------------------------------------------
# A test that needs an optional extra (`hf`: torch, transformers, peft; `ray`; the
# `test` extra's tokenizers, tensorboard...) skips when it cannot import it. In CI
# (`CI` set to true, as CI services do) or with EQTRAIN_REQUIRE_EXTRAS=1, where
# the test command installed every extra, such a skip is a failure instead: a
# broken extra must fail CI, not silently skip every parity test. See
# docs/testing.md.
REQUIRE_EXTRAS = os.environ.get("EQTRAIN_REQUIRE_EXTRAS", "") not in ("", "0") or (
    os.environ.get("CI", "").lower() in ("true", "1")
)
MISSING_EXTRA = ("could not import ", "needs the `ray` extra")


def _missing_extra_fails(report):
    if not (REQUIRE_EXTRAS and report.skipped):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    if reason.startswith(MISSING_EXTRA):
        report.outcome = "failed"
        report.longrepr = (
            f"{reason}\n(a skip for a missing extra is a failure here: CI or "
            "EQTRAIN_REQUIRE_EXTRAS=1 is set, and the test command installs every "
            "extra; see docs/testing.md)"
        )


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    _missing_extra_fails(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _missing_extra_fails(report)
    return report


class Regressor(eqx.Module):
    """A tiny MLP with a frozen-able input scale, used across tests."""

    mlp: eqx.nn.MLP
    scale: jax.Array

    def __init__(self, key, width=16, dtype=jnp.float32):
        self.mlp = eqx.nn.MLP(4, 1, width, 2, key=key, dtype=dtype)
        self.scale = jnp.ones((4,), dtype)

    def __call__(self, x):
        return self.mlp(x * self.scale)[0]


def mse_loss(model, batch, key):
    pred = jax.vmap(model)(batch["x"])
    err = (pred - batch["y"]) ** 2
    if "loss_mask" in batch:
        mask = batch["loss_mask"]
        loss = jnp.sum(err * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    else:
        loss = jnp.mean(err)
    return loss, {"mae": jnp.mean(jnp.abs(pred - batch["y"]))}


def make_batches(n, batch_size=8, seed=0, mask=False):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.normal(size=(batch_size, 4)).astype(np.float32)
        b = {"x": x, "y": (x @ np.arange(1, 5, dtype=np.float32)).astype(np.float32)}
        if mask:
            b["loss_mask"] = (rng.random(batch_size) < 0.6).astype(np.float32)
        out.append(b)
    return out


@pytest.fixture
def model():
    return Regressor(jr.key(0))


@pytest.fixture
def batches():
    return make_batches(64)
