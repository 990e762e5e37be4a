"""The tests marked `tuned` (numerics- and compile-sensitive: GRPO, generation,
resume bit for bit, two processes equal two devices, Ray's two workers equal
two devices, LoRA,
mixture of experts, sequence parallelism) again, under each CPU setting
`tune_cpu` can choose other than the default the rest of the suite runs
(`EQTRAIN_CPU_TUNING=fixed`: Eigen's products, unrolled layers).

A setting is named through `EQTRAIN_CPU_TUNING`, which every process of the
run then applies without measuring: the pytest process (tests/conftest.py
calls `tune_cpu`), the `eqtrain` commands and workers the tests start. Issue
51: on a processor whose probe chose Eigen's products at 512 bits, GRPO crashed
at step 1 (generation compiled with options of its own inside the GRPO step)
and no test saw it, because every test ran the one fixed setting.

Together the runs cover each flag set `tune_cpu` measures (Eigen's products
in the default suite's `eqtrain` commands, XLA's own, Eigen's at 512 bits),
scanned and unrolled layers, and a thread count below the CPUs'
(`PJRT_NPROC`). oneDNN's products are never chosen by measurement (a known
defect can make them silently wrong); named, every step is checked
(tests/test_onednn.py).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eqtrain.cpu import _tune as _cpu, _tuning as _cpu_tuning


ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ["xla_default,scanned,threads=1", "eigen_dots_512,scanned"]


@pytest.mark.tuned
def test_the_named_setting_is_applied_in_this_process():
    """Under a named setting (not the suite's `fixed`), this process applied
    it before JAX started, as `eqtrain fit` would."""
    value = os.environ.get(_cpu.OPT_OUT, "fixed")
    choice = _cpu_tuning.pinned(value)
    if choice is None or choice.source == "fixed":
        pytest.skip("the suite's own setting (fixed): nothing named")
    assert _cpu.cpu_settings().endswith(f"({_cpu.OPT_OUT}={choice.spec})")
    assert choice.process_flags in os.environ["XLA_FLAGS"]
    if choice.threads:
        assert os.environ["PJRT_NPROC"] == str(choice.threads)
    assert _cpu.layers_scanned() == choice.scan_layers


def _files_with_marked_tests():
    """The test files that mark tests `tuned` (collecting only them saves each
    run a minute of imports)."""
    here = Path(__file__).parent
    files = [f for f in sorted(here.glob("test_*.py")) if MARK in f.read_text()]
    return [str(f.relative_to(ROOT)) for f in files]


MARK = "@pytest.mark." + "tuned"


RAY_EQUALS_DEVICES = "two_ray_workers_equal_one_process_with_two_devices"
"""Slow in the suite's own setting, but among the default suite's tuned runs:
"processes equal devices" is what a setting can break (issue 51)."""


def _run_marked(setting, marks, names, least):
    env = {**os.environ, _cpu.OPT_OUT: setting}
    for name in ("PJRT_NPROC", "PYTEST_XDIST_WORKER", "PYTEST_CURRENT_TEST"):
        env.pop(name, None)
    argv = [sys.executable, "-m", "pytest", "-m", marks, "-k", names, "-n", "0", "-q"]
    argv += ["-p", "no:cacheprovider", "-x", *_files_with_marked_tests()]
    done = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400
    )
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, tail
    passed = re.search(r"(\d+) passed", done.stdout)
    assert passed and int(passed.group(1)) >= least, tail  # the marked set ran
    assert "skipped" not in done.stdout.splitlines()[-1], tail


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_tuned_tests_pass_under(setting):
    """The default suite's share of the marked tests, under `setting`: those
    not slow, and Ray's two workers equal to two devices."""
    _run_marked(setting, "tuned", f"not slow or {RAY_EQUALS_DEVICES}", 13)


@pytest.mark.slow
@pytest.mark.parametrize("setting", SETTINGS)
def test_the_slow_tuned_tests_pass_under(setting):
    """The slow suite's share (GRPO's exact resume, the other mixture-of-
    experts meshes, generation of the MoE and GPT-2), under `setting`."""
    _run_marked(setting, "tuned and slow", f"not {RAY_EQUALS_DEVICES}", 5)
