"""`eqtrain.tune_cpu`: the CPU settings the CLI applies to itself, and the hint."""

import subprocess
import sys
import warnings

import pytest

import eqtrain
from eqtrain import _cpu


@pytest.fixture
def fresh(monkeypatch):
    """A process state in which nothing was applied or hinted yet."""
    monkeypatch.setattr(_cpu, "_state", {"allocator": False, "hinted": False})
    monkeypatch.setattr(_cpu, "_backends_started", lambda: False)
    for name in (*_cpu.ALLOCATOR_ENV, _cpu.OPT_OUT):
        monkeypatch.delenv(name, raising=False)


def test_applies_both_settings_once(fresh):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert eqtrain.tune_cpu(env) == ["allocator", "xla_flags"]
    assert env["XLA_FLAGS"].split() == [
        "--xla_force_host_platform_device_count=8",
        "--xla_cpu_experimental_ynn_fusion_type=",
    ]
    assert _cpu.allocator_tuned(env)
    assert eqtrain.tune_cpu(env) == []  # idempotent: nothing twice
    assert env["XLA_FLAGS"].count("ynn_fusion_type") == 1


def test_user_choices_stand(fresh):
    env = {
        "MALLOC_TRIM_THRESHOLD_": "1000",
        "XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=individual_dot",
    }
    before = dict(env)
    assert eqtrain.tune_cpu(env) == []
    assert env == before


def test_opt_out_and_started_backend(fresh, monkeypatch):
    env = {_cpu.OPT_OUT: "0"}
    assert eqtrain.tune_cpu(env) == [] and env == {_cpu.OPT_OUT: "0"}
    monkeypatch.setattr(_cpu, "_backends_started", lambda: True)
    env = {}
    assert eqtrain.tune_cpu(env) == ["allocator"]  # too late for XLA_FLAGS
    assert "XLA_FLAGS" not in env


def test_hint_once_on_cpu(fresh, monkeypatch):
    with pytest.warns(eqtrain.CPUPerformanceWarning, match="tune_cpu"):
        _cpu.hint_cpu_settings()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _cpu.hint_cpu_settings()  # once per process
        monkeypatch.setattr(_cpu, "_state", {"allocator": False, "hinted": False})
        monkeypatch.setenv(_cpu.OPT_OUT, "0")
        _cpu.hint_cpu_settings()  # the user opted out: no hint
        monkeypatch.delenv(_cpu.OPT_OUT)
        for name in _cpu.ALLOCATOR_ENV:
            monkeypatch.setenv(name, "4000000000")
        _cpu.hint_cpu_settings()  # set in the environment: no hint


def test_the_cli_tunes_its_process_before_jax_starts():
    """`eqtrain` (the console entry point) applies the settings, and JAX then runs
    with the flag (an unknown or malformed flag would abort the backend)."""
    code = (
        "import os, sys\n"
        "sys.argv = ['eqtrain', '--help']\n"
        "import eqtrain.cli, eqtrain._cpu as c\n"
        "try:\n"
        "    eqtrain.cli.main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "import jax.numpy as jnp\n"
        "print('FLAGS', os.environ['XLA_FLAGS'], c.allocator_tuned())\n"
        "print('SUM', float((jnp.ones((64, 64)) @ jnp.ones((64, 64))).sum()))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines["FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type= True"
    assert lines["SUM"] == str(64.0**3)


def test_scan_layers_auto_unrolls_on_the_cpu():
    """`model.scan_layers = "auto"` (the default) is unrolled on the CPU; true,
    false and "auto" parse from TOML and `--set`, anything else is refused."""
    from eqtrain import ConfigError, config, models

    section = config.load(None, []).model
    assert section.scan_layers == "auto"
    assert models.runtime_options(section)["scan_layers"] is False  # CPU backend
    for text, want in (("true", True), ("false", False), ("auto", "auto")):
        assert (
            config.load(None, [f"model.scan_layers={text}"]).model.scan_layers == want
        )
    with pytest.raises(ConfigError, match="scan_layers"):
        config.load(None, ["model.scan_layers=maybe"])
