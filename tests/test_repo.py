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

    failed, seen = 0, 0
    for mod in pkgutil.walk_packages(eqtrain.__path__, "eqtrain."):
        path = Path(mod.module_finder.path) / (mod.name.rpartition(".")[2] + ".py")
        if mod.name.endswith("__main__") or (
            path.is_file() and "sys.modules[__name__] = _moved" in path.read_text()
        ):
            continue  # runs the CLI; an old path (it warns, then is the new module)
        module = importlib.import_module(mod.name)
        failed += doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed
        seen += 1
    assert seen > 150, seen  # every module, in the sub-packages too
    assert failed == 0


# A measured figure or a machine's name in the code: how much, on which machine.
# The code says why; docs/performance.md holds the figures with their commands.
_FIGURES = re.compile(
    r"processors? [A-D]\b|this jaxlib|\b(?:H100|H200|A100|EPYC|Xeon)\b"
    r"|\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?:x|%) (?:faster|slower|ahead|the time)"
    r"|~?\d+(?:\.\d+)? ?(?:ms|s|GB|MB) (?:measured|whole|in pieces)"
    r"|\(measured\)|\bmeasured ~?\d"
)
_FIGURES_ALLOWED = {"eqtrain/hooks/_devices.py"}  # the GPUs' published peak rates


def test_no_measured_figures_or_machine_names_in_the_code():
    root = Path(__file__).resolve().parent.parent
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()}"
        for path in sorted((root / "eqtrain").rglob("*.py"))
        if str(path.relative_to(root)) not in _FIGURES_ALLOWED
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if _FIGURES.search(line)
    ]
    assert not found, (
        "measured figures or machine names in eqtrain/ (say why in the code, "
        "and put the figure in docs/performance.md with its command):\n  "
        + "\n  ".join(found)
    )
    assert _FIGURES.search("on processor B it ran 3x faster")  # the pattern bites
    assert _FIGURES.search("a step 10-15% faster than Eigen's")
