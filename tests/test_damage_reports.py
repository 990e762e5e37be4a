"""Damaged checkpoints off the happy path (issue 26): `eqtrain info` finds what a
restore would find (array files cut short or deleted), the warning for a damaged
step names the step, the file or array and a readable cause, and falling back
past it prints nothing else (no Orbax tracebacks)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from eqtrain.checkpoint import _ocdbt
from eqtrain.cli import app


TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run trained once (checkpoints at steps 1 and 2); tests damage copies."""
    root = tmp_path_factory.mktemp("damage")
    (root / "train.txt").write_text(TEXT)
    config = root / "tiny.toml"
    config.write_text(
        f"""
run_dir = "{root / "run"}"

[model]
hidden_size = 16
intermediate_size = 32
num_layers = 1
num_heads = 2

[data]
train = "{root / "train.txt"}"
eval = "none"
seq_len = 16
batch_size = 8

[loop]
steps = 2
eval_every = 0

[checkpoint]
every = 1

[export]
hf = ""

[log]
progress = "lines"
"""
    )
    result = CliRunner().invoke(app, ["fit", str(config)])
    assert result.exit_code == 0, result.output
    return root / "run"


def _copy(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run


def _biggest_array_file(step_dir):
    """The data file holding the most arrays (as the step's OCDBT index says),
    and how many of its bytes the index refers to. A data file can hold more
    than that (the per-process B-tree nodes Orbax merged away), and which bytes
    sit where varies from run to run: damage aimed at the file's own length
    can miss every indexed byte, so the tests aim at the indexed ones."""
    needed = _ocdbt._extents(step_dir / "state")
    relative = max(needed, key=lambda f: len(needed[f][1]))
    return step_dir / "state" / relative, needed[relative][0]


def _info(run, *args):
    result = CliRunner().invoke(app, ["info", str(run), *args])
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_info_marks_a_step_with_a_damaged_array_file(trained, tmp_path, damage):
    run = _copy(trained, tmp_path)
    # A checkpoint written before checksums existed is still described.
    manifest = run / "checkpoints" / "1" / "manifest" / "manifest.json"
    record = json.loads(manifest.read_text())
    record.pop("checksums", None)
    manifest.write_text(json.dumps(record))
    victim, indexed = _biggest_array_file(run / "checkpoints" / "2")
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[: indexed // 2])
    else:
        victim.unlink()

    text = _info(run)
    assert "trained:      1 / 2 steps" in text, text
    steps = {
        int(ln.split()[1]): ln for ln in text.splitlines() if ln.startswith("  step ")
    }
    assert "DAMAGED" not in steps[1], text
    assert "DAMAGED" in steps[2] and victim.name in steps[2], text
    assert ("cut short" if damage == "truncated" else "is missing") in steps[2]
    assert "it holds array " in steps[2]

    data = json.loads(_info(run, "--json"))
    assert data["steps_trained"] == 1
    by_step = {c["step"]: c for c in data["checkpoints"]}
    assert "error" not in by_step[1]
    assert victim.name in by_step[2]["error"]


SLOW_READS = """
# Slow storage, as for any checkpoint of real size: a chunk read that succeeds
# takes another half second, so the other reads are still in flight when the read of
# a damaged chunk fails and Orbax gives up on them.
import asyncio, importlib.abc, importlib.machinery, sys

TARGET = "orbax.checkpoint._src.serialization.serialization"


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            original = module._read_shard

            async def slow(*args, **kwargs):
                result = await original(*args, **kwargs)
                await asyncio.sleep(0.5)
                return result

            module._read_shard = slow

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
"""


def test_falling_back_past_a_damaged_step_is_one_warning(trained, tmp_path):
    run = _copy(trained, tmp_path)
    # Bytes changed inside an array file (same size): only reading it finds out.
    victim, indexed = _biggest_array_file(run / "checkpoints" / "2")
    data = bytearray(victim.read_bytes())
    for i in range(3 * indexed // 4, indexed):  # the last chunk is indexed
        data[i] ^= 0x5A
    victim.write_bytes(bytes(data))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_READS)
    config = tmp_path / "tiny.toml"
    source = (trained.parent / "tiny.toml").read_text()
    config.write_text(source.replace(str(trained), str(run)))
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "eqtrain.cli", "fit", str(config)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": path, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert "never retrieved" not in err and "destroyed" not in err, err
    warned = [ln for ln in err.splitlines() if "damaged checkpoint" in ln]
    assert len(warned) == 1, err
    warning = warned[0]
    assert str(run / "checkpoints" / "2") in warning
    assert "array " in warning and "resuming from step 1" in warning
    assert "bound method" not in warning and "TensorStore(" not in warning
    assert len(warning) < 600, warning
    names = os.listdir(run / "checkpoints")
    assert "2" in names and any(n.startswith("2.damaged-") for n in names)
