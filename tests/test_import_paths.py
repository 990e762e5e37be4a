"""Every public import path of the release before the walls (issue 53) still
works: each module imports and each name is there. A path that moved warns
(`DeprecationWarning`) and gives the new home's object; the others import
silently.

`public_api_2026-12-07.json` is that release's public surface, read from its
source with `ast` (every module without an underscore in its path, and every
public name it defines or re-exports with `x as x`), kept as data so that a
later rename cannot quietly shrink it.
"""

import importlib
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest


API = json.loads((Path(__file__).parent / "public_api_2026-12-07.json").read_text())

MOVED_MODULES = {
    f"eqtrain.{m}": f"eqtrain.post_training.{m}"
    for m in ("grpo", "preference", "rewards", "rollout")
}
MOVED_NAMES = {
    ("eqtrain", "tune_cpu"): "eqtrain.cpu.tune_cpu",
    ("eqtrain", "cpu_settings"): "eqtrain.cpu.cpu_settings",
    ("eqtrain", "CPUPerformanceWarning"): "eqtrain.cpu.CPUPerformanceWarning",
    ("eqtrain", "Checkpointer"): "eqtrain.CheckpointerProtocol",
    ("eqtrain.config", "rewards_of"): "eqtrain.job._grpo.rewards_of",
}


def _object(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_the_surface_is_read():
    assert len(API) > 30 and sum(map(len, API.values())) > 400
    assert "fit" in API["eqtrain"] and "grpo_loss_fn" in API["eqtrain.grpo"]


@pytest.mark.parametrize("module", sorted(API))
def test_every_public_name_still_imports(module):
    moved = MOVED_MODULES.get(module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if moved:  # an old path warns when it is imported: import it anew
            sys.modules.pop(module, None)
        got = importlib.import_module(module)
    said = [str(w.message) for w in caught if w.category is DeprecationWarning]
    if moved:
        assert got is importlib.import_module(moved)
        assert any(moved in s for s in said), said
    else:
        assert not [s for s in said if "eqtrain" in s], said
    for name in API[module]:
        new = MOVED_NAMES.get((module, name))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(got, name)
        said = [str(w.message) for w in caught if w.category is DeprecationWarning]
        if new is None:
            assert not said, (module, name, said)
        else:
            assert value is _object(new), (module, name)
            assert any(new.rpartition(".")[2] in s for s in said), (module, name)


def test_import_eqtrain_reaches_every_subpackage_and_not_the_cpu_tuner():
    """`import eqtrain` gives the sub-packages a user reaches for (imported on
    first use) and imports neither them nor `eqtrain.cpu` by itself."""
    code = (
        "import sys, eqtrain\n"
        "before = {m for m in sys.modules if m.startswith('eqtrain.')}\n"
        "assert 'eqtrain.cpu' not in before, sorted(before)\n"
        "assert 'eqtrain.checkpoint' not in before and 'eqtrain.data' not in before\n"
        "for name in ('data', 'checkpoint', 'hf', 'config', 'models', 'losses',\n"
        "             'generate', 'post_training', 'cpu', 'distributed', 'plot'):\n"
        "    assert getattr(eqtrain, name).__name__ == 'eqtrain.' + name\n"
        "assert 'data' in dir(eqtrain)\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
