"""Benchmarks stay runnable: each runs in its quick mode and prints its JSON lines."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def _quick(script: str, *args: str) -> tuple[list[dict], str]:
    """Run `benchmarks/<script> --quick [args]` on CPU; its JSON records and its
    stderr."""
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    records = [json.loads(line) for line in lines]
    # every benchmark names its machine first: figures hold per processor
    assert records and set(records[0]) == {"machine"}, lines[:1]
    machine = records[0]["machine"]
    assert machine["cpu"] and machine["cores"] and "jax" in machine["versions"]
    return records[1:], proc.stderr


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_overhead_quick():
    records, stderr = _quick("overhead.py")
    assert [r["config"] for r in records] == ["base", "many_small_leaves"]
    for r in records:
        assert r["raw_tokens_per_s"] > 0 and r["leaves"] > 0
        for key in ("default", "plain_hook", "state_hook", "guard"):
            low, high = r[f"{key}_range"]
            assert r[key] > 0 and low <= r[key] <= high
    assert "warning" not in stderr  # same losses, a single trace


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_models_quick():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    records, _ = _quick("models.py")
    assert records[-1]["config"] == "quick" and records[-1]["ratio"] > 0


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_models_family_quick():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    # Phi-3: fused qkv/gate_up, a window on every layer; Gemma 2: four norms per
    # block, soft-capped scores and logits, windows on alternate layers
    records, _ = _quick("models.py", "--family", "phi3,gemma2", "--steps", "2")
    assert [r["family"] for r in records] == ["phi3", "gemma2"]
    assert [r["architecture"] for r in records] == [
        "Phi3ForCausalLM",
        "Gemma2ForCausalLM",
    ]
    for r in records:
        assert r["eqtrain_step_ms"] > 0 and r["torch_step_ms"] > 0
        low, high = r["ratio_range"]
        assert 0 < low <= r["ratio"] <= high
        assert r["first_loss_diff"] < 1e-4  # the same weights on both sides


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_cli_quick():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    (record,), stderr = _quick("cli.py")
    assert record["eqtrain_set"] == [] and record["batch"] == 4
    assert record["eqtrain_tokens_per_s"] > 0 and record["trainer_tokens_per_s"] > 0
    low, high = record["ratio_range"]
    assert 0 < low <= record["ratio"] <= high
    assert record["eqtrain_defaults"]["eval_every"] > record["steps"]  # none timed
    assert "warning" not in stderr  # both models have the same parameter count


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_lora_quick():
    (record,), _ = _quick("lora.py")
    assert record["config"] == "tiny"
    assert 0 < record["trainable"] < 1 and 0 < record["checkpoint"] < 1
    low, high = record["step_range"]
    assert low <= record["step"] <= high


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_preference_quick():
    (record,), _ = _quick("preference.py")
    assert record["config"] == "tiny" and record["rounds"] == 2
    for key in ("copy", "precomputed", "adapters_off"):
        low, high = record[f"{key}_range"]
        assert 0 < low <= record[key] <= high
    variants = ("sft", "copy", "precomputed", "lora_sft", "adapters_off")
    assert all(record["ms"][key] > 0 for key in variants)
    assert record["targets"] == {"precomputed": 1.1, "copy": 1.5}


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_hf_load_quick():
    (record,), _ = _quick("hf_load.py")
    assert record["config"] == "quick" and record["shards"] > 1
    for kind in ("before", "after", "sharded"):
        assert record[f"{kind}_peak_mb"] >= record["import_mb"] > 0
        assert record[f"{kind}_s"] > 0


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_memory_quick():
    records, _ = _quick("memory.py")
    parts = {r["part"] for r in records}
    assert parts == {"loss", "mlp", "vocab", "budget"}
    loss = [r for r in records if r["part"] == "loss"]
    assert all(r["temp_bytes"]["chunked"] < r["temp_bytes"]["plain"] for r in loss)
    assert records[-1]["on_over_off"] >= 1


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_sequence_quick():
    records, _ = _quick("sequence.py")
    assert [(r["scheme"], r["layout"]) for r in records] == [
        ("none", "contiguous"),
        ("ulysses", "contiguous"),
        ("ring", "contiguous"),
        ("ring", "zigzag"),
        ("all_gather", "contiguous"),
    ]
    for r in records[1:]:
        assert r["tokens_per_device"] == 64 and r["temp_vs_sequence_1"] > 2


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_mfu_quick():
    (record,), stderr = _quick("mfu.py")
    assert record["model"] == "quick" and record["devices"] >= 1
    assert record["params"] > 0 and record["flops_per_token"] > 0
    assert record["tokens_per_s"] > 0 and record["step_ms"] > 0
    assert record["dtype"] == "bfloat16" and record["attention"] == "xla"
    assert record["remat"] == "none" and record["loss_chunk"] > 0
    assert record["peak_tflops_per_device"] is None and record["mfu"] is None
    assert "loss" in stderr


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_step_profile_quick():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    records, _ = _quick("step_profile.py")
    xla, torch = records
    assert xla["side"] == "xla" and torch["side"] == "torch"
    assert xla["step_ms"] > 0 and len(xla["concurrency_ms"]) == 3
    parts = {row[2] for row in xla["top"]}
    assert parts & {"attention", "mlp", "optimizer"}  # the named scopes are read
    assert {"forward", "backward", "optimizer"} <= set(torch["phases"])


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_cpu_settings_quick():
    records, _ = _quick("cpu_settings.py")
    assert [r["workload"] for r in records] == ["llama", "many_small_leaves"]
    for r in records:
        assert set(r["ratio"]) == {
            "default",
            "thresholds",
            "allocator",
            "allocator_env",
            "xla_flag",
            "tune_cpu",
        }
        assert all(v > 0 for v in r["tokens_per_s"].values())


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_generate_quick():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    (record,), _ = _quick("generate.py")
    assert record["config"] == "quick" and record["rounds"] == 1
    assert record["machine"]["cpu"] and record["torch_threads"] >= 1
    assert record["tokens_match"] >= 0.5  # the same weights on both sides
    for side in ("eqtrain", "transformers"):
        assert record[side]["prefill_tokens_per_s"] > 0 and record[side]["total_s"] > 0
    assert set(record["ratio"]) == {"prefill", "decode", "total"}
    assert record["device"] == "cpu" and record["dtype"] == "float32"
    assert record["device_kind"]["eqtrain"] == "cpu" and record["date"]
    # keys and values per row: eqtrain's prompt + new slots, transformers' one fewer
    cache = record["cache_bytes_per_row"]
    assert cache["eqtrain"] > cache["transformers"] > 0
    assert record["peak_device_bytes"] == {"eqtrain": None, "transformers": None}


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_rollout_quick():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    (record,), _ = _quick("rollout.py")
    assert record["batch"] == 8 and record["rounds"] == 1
    assert set(record["tokens_per_s"]) == {"shrink", "generate", "transformers"}
    assert all(v > 0 for v in record["tokens_per_s"].values())
    assert 1 <= record["mean_length"] <= record["max_length"] <= record["new"]


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_job_walk():
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    script = BENCHMARKS / "job_walk.py"
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.splitlines()[-1])
    assert (
        record["rooms"] > 5 and record["visits"] == record["rooms"] + record["returns"]
    )
    assert proc.stdout.startswith("_run -> _prepare -> _resumable -> _plan")
    # the phases never walk back into one another (a return into a phase's own
    # module is a call of a frozen value's method), and the phases after the
    # plan read the Job's fields: none calls into job/_build.py
    assert record["returns_into_phases"] == 0, proc.stdout
    assert record["build_after_plan"] == 0, proc.stdout


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_attention_quick():
    (record,), _ = _quick("attention.py")
    assert record["seq"] == 160
    assert all(record[f"{k}_ms"] > 0 for k in ("blocks", "flash", "one_call"))
    assert record["flash_vs_blocks"] > 0 and record["one_call_vs_blocks"] > 0


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_step_ab_quick():
    """Variants of the model's code compiled side by side: the attention of an
    older revision, a fixed block size, the gate by autodiff, the rotary tables
    recomputed, the reductions whole and the mask hoisted (alone and joined by
    `+`), the MLP's hidden layer kept, the norms' outputs kept (scanned
    layers); all compute the same first loss (they differ in speed and memory,
    not in what they compute), and keeping the norms' outputs takes more
    temporary memory."""
    variants = (
        "current,rev:HEAD,block8,autodiff_gate,recomputed_rope,windowed_reductions,"
        "hoisted_mask+windowed_reductions,kept_activation,kept_norms"
    )
    records, _ = _quick("step_ab.py", "--variants", variants, "--scan-layers")
    assert [r["variant"] for r in records] == variants.split(",")
    assert records[0]["ratio"] == 1.0
    losses = [r["first_loss"] for r in records]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
    assert all(r["step_ms"] > 0 and r["pairs"] == 4 for r in records)
    assert records[-1]["temp_mib"] > records[0]["temp_mib"] > 0


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_page_faults_quick():
    records, _ = _quick("page_faults.py")
    assert [r["variant"] for r in records] == [
        "default", "thresholds", "arena", "both", "tune_cpu",
    ]  # fmt: skip
    assert all(r["step_ms"] > 0 and r["faults_per_step"] >= 0 for r in records)


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_grpo_size_quick():
    """A few GRPO steps of a tiny Qwen2-shaped model through `eqtrain fit`: the
    step splits into generation, reward and update, with the run's peak memory
    and the dry run's estimate beside it."""
    (record,), _ = _quick("grpo_size.py")
    assert record["config"] == "quick" and record["rows"] == 8
    assert record["params"] > 0 and record["timed_steps"] == 1
    assert record["step_s"] > 0 and record["generate_s"] > 0 and record["reward_s"] >= 0
    assert record["peak_rss_process_gib"] >= record["peak_rss_steps_gib"] > 0
    assert record["dry_run_peak_gib"] > 0


@pytest.mark.slow  # the default suite's time: `nox -s slow`
def test_qlora_quick():
    """QLoRA at tiny sizes: bytes per parameter of each kind (a real tensor's
    bytes as the abstract count says), the dry run of a Qwen3-MoE-shaped model
    with a bf16 and an nf4 base, the nf4 against the bf16-base LoRA step, and a
    quantizing load's peak memory."""
    records, _ = _quick("qlora.py")
    parts = [r["part"] for r in records]
    assert parts == ["bytes"] * 10 + ["bytes-real"] * 5 + [
        "dry-run", "dry-run", "dry-run-ratio", "step", "import-rss", "codes",
    ]  # fmt: skip
    per = {(r["model"], r["kind"], r["double"]): r for r in records[:10]}
    for model in ("llama8b", "qwen3_30b_a3b"):
        nf4 = per[model, "nf4", True]["bytes_per_param"]
        assert 0.5 < nf4 < per[model, "nf4", False]["bytes_per_param"] == 0.5625
        assert 1 < per[model, "int8", False]["bytes_per_param"] < 1.1
    assert all(r["matches_abstract"] for r in records[10:15])
    bf16, nf4, ratio = records[15:18]
    assert bf16["ok"] and nf4["ok"], (bf16.get("error"), nf4.get("error"))
    assert (bf16["quantize"], nf4["quantize"]) == ("bf16", "nf4")
    assert nf4["parameters_bytes"] < bf16["parameters_bytes"]
    assert 0 < ratio["nf4_over_bf16_peak"] and "model.quantize=nf4" in nf4["command"]
    step, load, codes = records[18:]
    assert step["bf16_ms"] > 0 and step["nf4_ms"] > 0 and step["ratio"] > 0
    assert abs(step["first_loss"]["nf4"] - step["first_loss"]["bf16"]) < 0.05
    assert load["quantized_mb"] < load["bf16_mb"] and load["load_s"] > 0
    assert codes["ratio"] > 0 and codes["llama8b_linear_s"] > 0
