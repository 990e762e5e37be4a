"""Tests for the logging hooks (`TensorBoardWriter`, `WandbLogger`), the peak FLOP/s
table (`peak_flops`), and MFU/tokens in the built-in loggers. TensorBoard's events
are read back with TensorBoard's own reader, W&B's offline run with `wandb leet
inspect` (wandb's reader of its `.wandb` transaction log)."""

import io
import json
import math
import subprocess
import sys

import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqtrain
from eqtrain import ConfigError, StepInfo, StopKind, StopReason, TrainState, at_end
from eqtrain.hooks import (
    JsonlWriter,
    ProgressBar,
    TensorBoardWriter,
    WandbLogger,
    format_line,
    peak_flops,
    total_peak_flops,
)

from .conftest import Regressor, make_batches, mse_loss


OPT = optax.adam(1e-2)
FLOPS_PER_TOKEN = 6.0
PEAK = 1e9


def fresh_state():
    return TrainState.create(Regressor(jr.key(0)), OPT, key=0)


def tokens_batches(n):
    # a `tokens` entry makes the loop report tokens/s, tokens seen and MFU
    return [dict(b, tokens=np.zeros((8, 16), np.int32)) for b in make_batches(n)]


@pytest.fixture(scope="module")
def step():
    return eqtrain.jit(eqtrain.train_step(mse_loss, OPT))


@pytest.fixture(scope="module")
def evaluate():
    return eqtrain.jit(eqtrain.eval_step(mse_loss), donate=False)


def fit(state, step, data, num_steps, hooks, **kwargs):
    return eqtrain.fit(
        state,
        step,
        data,
        num_steps=num_steps,
        hooks=hooks,
        flops_per_token=FLOPS_PER_TOKEN,
        peak_flops=PEAK,
        **kwargs,
    )


# --- TensorBoard --------------------------------------------------------------------


def read_events(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return acc


def test_tensorboard_round_trip_eval_perf_and_resume(step, evaluate, tmp_path):
    log_dir = tmp_path / "tb"
    writer = TensorBoardWriter(log_dir, flush_secs=1)
    data = tokens_batches(12)
    result = fit(
        fresh_state(),
        step,
        data,
        5,
        [writer, at_end(writer)],
        evaluation=eqtrain.Evaluation(evaluate, make_batches(2, seed=1)),
    )
    acc = read_events(log_dir)
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(
        [e.value for e in loss], [h["loss"] for h in result.history], rtol=1e-6
    )
    for tag in ("train/grad_norm", "train/mae"):
        assert [e.step for e in acc.Scalars(tag)] == [1, 2, 3, 4, 5], tag
    # the end-of-run evaluation reaches the writer through `at_end`, once; the
    # final call does not repeat the last step's values
    (evaluated,) = acc.Scalars("eval/loss")
    assert evaluated.step == 5
    assert evaluated.value == pytest.approx(result.history[-1]["eval/loss"], rel=1e-6)
    perf = {
        name: acc.Scalars(f"perf/{name}")
        for name in (
            "step_time",
            "data_time",
            "tokens_per_second",
            "tokens_seen",
            "mfu",
        )
    }
    assert all([e.step for e in v] == [1, 2, 3, 4, 5] for v in perf.values())
    assert [e.value for e in perf["tokens_seen"]] == [128, 256, 384, 512, 640]
    np.testing.assert_allclose(
        [e.value for e in perf["mfu"]],
        [e.value * FLOPS_PER_TOKEN / PEAK for e in perf["tokens_per_second"]],
        rtol=1e-5,
    )

    # A resumed run writing to the same directory (within the same second, which
    # tensorboardX alone would truncate) adds a file; both are read back.
    writer2 = TensorBoardWriter(log_dir)
    resumed = fit(result.state, step, data[5:], 8, [writer2], tokens_seen=640)
    assert len(list(log_dir.glob("events.out.tfevents.*"))) == 2
    loss = read_events(log_dir).Scalars("train/loss")
    assert [e.step for e in loss] == list(range(1, 9))
    np.testing.assert_allclose(
        [e.value for e in loss][5:], [h["loss"] for h in resumed.history], rtol=1e-6
    )


def test_tensorboard_skips_non_numeric_and_keeps_nonfinite(tmp_path):
    writer = TensorBoardWriter(tmp_path)
    metrics = {
        "loss": float("nan"),
        "grad_norm": float("inf"),
        "skipped": True,
        "count": 3,
        "note": "text",
        "per_layer": [1.0, 2.0],
        "group/x": 0.5,
    }
    writer(StepInfo(step=1, metrics=metrics, num_steps=2, step_time=0.1))
    # final call: no perf values again, and nothing the step already wrote
    end = StopReason(StopKind.MAX_STEPS, 1)
    writer(StepInfo(step=1, metrics=metrics, num_steps=2, stop_reason=end))
    writer.close()
    writer.close()  # idempotent: `fit` closes a hook given twice twice
    acc = read_events(tmp_path)
    tags = set(acc.Tags()["scalars"])
    assert tags == {
        "train/loss",
        "train/grad_norm",
        "train/skipped",
        "train/count",
        "group/x",
        "perf/step_time",
        "perf/data_time",
    }
    assert all(len(acc.Scalars(t)) == 1 for t in tags)
    assert math.isnan(acc.Scalars("train/loss")[0].value)
    assert acc.Scalars("train/grad_norm")[0].value == math.inf
    assert acc.Scalars("train/skipped")[0].value == 1.0


def test_tensorboard_writer_creates_nothing_before_the_first_step(tmp_path):
    writer = TensorBoardWriter(tmp_path / "tb")
    assert writer.uses_state is False
    writer.close()
    assert not (tmp_path / "tb").exists()


def test_missing_extras_raise_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"eqtrain\[tensorboard\]"):
        TensorBoardWriter("tb")
    with pytest.raises(ConfigError, match=r"eqtrain\[wandb\]"):
        WandbLogger(project="p")


# --- Weights & Biases ---------------------------------------------------------------


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """Offline, silent W&B whose every file lands under tmp_path."""
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var, sub in (
        ("WANDB_DIR", "wandb_dir"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_DATA_DIR", "data"),
    ):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(var, str(tmp_path / sub))
    yield wandb
    wandb.teardown()  # stop the service process this test started


def inspect_run(run_dir, *args):
    """Records of an offline run, read by wandb's own CLI (`wandb leet inspect`)."""
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", *args, run_dir],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    if "--summary" in args:
        return json.loads(out)
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_wandb_offline_run_round_trip(step, evaluate, tmp_path, wandb_offline):
    wandb = wandb_offline
    config = {"lr": 1e-2, "model": {"width": 16}, "seed": 0}
    runs = tmp_path / "runs"
    # a run the caller started stays the global run, unfinished
    mine = wandb.init(project="mine", dir=str(tmp_path), settings={"console": "off"})
    logger = WandbLogger(
        project="eqtrain-test",
        name="first",
        dir=runs,
        mode="offline",
        config=config,
        tags=("a", "b"),
        settings={"console": "off"},
    )
    result = fit(
        fresh_state(),
        step,
        tokens_batches(8),
        4,
        [logger, at_end(logger)],
        evaluation=eqtrain.Evaluation(evaluate, make_batches(2, seed=1)),
    )
    assert logger.run is not None and wandb.run is mine
    first = logger.run
    # a second logger in the same process starts a second run
    logger2 = WandbLogger(project="eqtrain-test", name="second", dir=runs)
    fit(result.state, step, tokens_batches(8)[4:], 6, [logger2])
    assert logger2.run.id != first.id and wandb.run is mine
    mine.finish()

    (run_dir,) = runs.glob(f"wandb/offline-run-*-{first.id}")
    summary = inspect_run(run_dir, "--summary")
    assert summary["name"] == "first" and summary["tags"] == ["a", "b"]
    assert summary["state"] == "finished"
    assert {k: summary["config"][k] for k in config} == config
    final = result.history[-1]
    assert summary["summary"]["train/loss"] == pytest.approx(final["loss"], rel=1e-6)
    assert summary["summary"]["eval/loss"] == pytest.approx(
        final["eval/loss"], rel=1e-6
    )
    history = [r["history"] for r in inspect_run(run_dir) if r["type"] == "history"]
    rows = {int(h["step"]["num"]): h["item"] for h in history}
    assert sorted(rows) == [1, 2, 3, 4]
    for h in result.history:
        row = rows[h["step"]]
        assert row["train/loss"] == pytest.approx(h["loss"], rel=1e-6)
        assert row["perf/tokens_seen"] == 128 * h["step"]
        assert row["perf/mfu"] == pytest.approx(
            row["perf/tokens_per_second"] * FLOPS_PER_TOKEN / PEAK, rel=1e-6
        )
    assert "eval/loss" in rows[4] and "eval/loss" not in rows[3]
    (second_dir,) = runs.glob(f"wandb/offline-run-*-{logger2.run.id}")
    steps = [
        int(r["history"]["step"]["num"])
        for r in inspect_run(second_dir)
        if r["type"] == "history"
    ]
    assert steps == [5, 6]


# --- Peak FLOP/s --------------------------------------------------------------------


class FakeDevice:
    def __init__(self, device_kind, platform="gpu"):
        self.device_kind = device_kind
        self.platform = platform


@pytest.mark.parametrize(
    ("kind", "platform", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "gpu", "bfloat16", 989.5),
        ("NVIDIA H100 80GB HBM3", "gpu", "tfloat32", 494.5),
        ("NVIDIA H100 80GB HBM3", "gpu", "float32", 67),
        ("NVIDIA H100 PCIe", "gpu", "bfloat16", 756.5),
        ("NVIDIA H100 NVL", "gpu", "float16", 835.5),
        ("NVIDIA H200", "gpu", "bfloat16", 989.5),
        ("NVIDIA GH200 480GB", "gpu", "bfloat16", 989.5),
        ("NVIDIA A100-SXM4-80GB", "gpu", "bfloat16", 312),
        ("NVIDIA A100 80GB PCIe", "gpu", "tf32", 156),
        ("NVIDIA A10G", "gpu", "bf16", 70),
        ("NVIDIA L4", "gpu", "float16", 121),
        ("NVIDIA L40S", "gpu", "bfloat16", None),  # not an L4
        ("Tesla V100-SXM2-16GB", "gpu", "float16", 125),
        ("Tesla V100-PCIE-32GB", "gpu", "float16", 112),
        ("Tesla V100-SXM2-16GB", "gpu", "bfloat16", None),  # no bf16 on Volta
        ("TPU v4", "tpu", "bfloat16", 275),
        ("TPU v5 lite", "tpu", "bfloat16", 197),
        ("TPU v5e", "tpu", "bfloat16", 197),
        ("TPU v5", "tpu", "bfloat16", 459),
        ("TPU v5p", "tpu", "bfloat16", 459),
        ("TPU v6 lite", "tpu", "bfloat16", 918),
        ("TPU v6e", "tpu", "bfloat16", 918),
        ("TPU v6 lite", "tpu", "float32", None),
        ("cpu", "cpu", "bfloat16", None),
        ("Some Future Accelerator", "gpu", "bfloat16", None),
    ],
)
def test_peak_flops_table(kind, platform, dtype, tflops):
    got = peak_flops(FakeDevice(kind, platform), dtype)
    assert got == (None if tflops is None else pytest.approx(tflops * 1e12))


def test_peak_flops_dtypes_defaults_and_errors():
    h100 = FakeDevice("NVIDIA H100 80GB HBM3")
    assert peak_flops(h100) == peak_flops(h100, jnp.bfloat16) == 989.5e12
    assert peak_flops(h100, np.float32) == peak_flops(h100, "fp32") == 67e12
    assert peak_flops(h100, np.dtype("float16")) == 989.5e12
    assert peak_flops() is None  # the tests run on CPU
    with pytest.raises(ConfigError, match="bfloat16, float16, tfloat32"):
        peak_flops(h100, "int8")


def test_total_peak_flops():
    a100 = FakeDevice("NVIDIA A100-SXM4-40GB")
    assert total_peak_flops([a100] * 8) == pytest.approx(8 * 312e12)
    assert total_peak_flops([a100, FakeDevice("mystery")]) is None
    assert total_peak_flops([]) is None
    assert total_peak_flops() is None  # CPU devices


# --- MFU and tokens in the built-in loggers ----------------------------------------


def test_format_line_and_progress_bar_show_mfu():
    info = StepInfo(
        step=10,
        metrics={"loss": 2.34119},
        num_steps=100,
        tokens_per_second=12345.0,
        mfu=0.4123,
        elapsed=5.0,
    )
    assert format_line(info) == "step 10/100 | loss 2.3412 | 12.3k tok/s | mfu 41.2%"
    no_mfu = StepInfo(step=10, metrics={"loss": 2.34119}, num_steps=100)
    assert format_line(no_mfu) == "step 10/100 | loss 2.3412"

    out = io.StringIO()
    plain = ProgressBar(stream=out, plain_every=10)
    plain(info)
    line = "step 10/100 | loss 2.3412 | 12.3k tok/s | mfu 41.2% | eta 45s\n"
    assert out.getvalue() == line

    bar = ProgressBar(stream=io.StringIO(), force_terminal=True)
    bar(info)
    status = bar._progress.tasks[0].fields["status"]
    bar.close()
    assert status == "loss 2.3412  12.3k tok/s  mfu 41.2%"


def test_jsonl_writer_records_tokens_seen_and_mfu(step, tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = JsonlWriter(path)
    fit(fresh_state(), step, tokens_batches(3), 3, [writer, at_end(writer)])
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["tokens_seen"] for line in lines[:3]] == [128, 256, 384]
    for line in lines[:3]:
        assert line["mfu"] == pytest.approx(
            line["tokens_per_second"] * FLOPS_PER_TOKEN / PEAK
        )
    assert len(lines) == 3 and lines[-1]["stop_reason"] == "max_steps"

    plain = tmp_path / "plain.jsonl"
    writer = JsonlWriter(plain)
    eqtrain.fit(fresh_state(), step, make_batches(2), num_steps=2, hooks=[writer])
    for line in map(json.loads, plain.read_text().splitlines()):
        assert "tokens_seen" not in line and "mfu" not in line
