"""The repository keeps its promises: CI runs the README's test command."""

import re
from pathlib import Path


ROOT = Path(__file__).parent.parent


def _bash_blocks(text):
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_ci_runs_exactly_the_readme_test_command():
    blocks = _bash_blocks((ROOT / "README.md").read_text())
    test_command = blocks[1].strip()
    ci_lines = [
        line.strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert test_command in ci_lines


def test_readme_first_command_runs_the_main_job():
    first = _bash_blocks((ROOT / "README.md").read_text())[0].strip()
    # `eqtrain fit` with no config: the embedded default run (run, shortened, by
    # tests/test_cli.py::test_fit_with_no_config_runs_the_default).
    assert first.endswith(".venv/bin/eqtrain fit"), first
    assert 'eqtrain = "eqtrain.cli:main"' in (ROOT / "pyproject.toml").read_text()


def test_docs_build_strict(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-q",
            "-d",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr


def test_docstring_examples_run():
    import doctest
    import importlib
    import pkgutil

    import eqtrain

    failed = 0
    for mod in pkgutil.iter_modules(eqtrain.__path__):
        module = importlib.import_module(f"eqtrain.{mod.name}")
        failed += doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed
    assert failed == 0
