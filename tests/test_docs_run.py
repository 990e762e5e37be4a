"""Every Python block of README.md and docs/*.md runs (issue 58, point 6).

Each page's ```python blocks run in order in one namespace, in a fresh temporary
working directory, as a reader would paste them. The markers (docs/testing.md,
"Docs that run"):

- fill-ins, the reader's own things (data, a model, a run directory), are visible
  lines on the page under a `# fill in: ...` comment, usually a block of their own
  before the page's first example; they run as written;
- a line ending in `# docs-test: VALUE` (or `# its comment; docs-test: VALUE`)
  runs with VALUE in place of the literal after the line's last `=`: `num_steps
  = 1_000  # docs-test: 5` runs `num_steps = 5` (the page shows both numbers);
- `<!-- docs-test: skip (REASON) -->` on the line before a block: not run, and
  listed in `SKIPPED` below with its reason;
- `<!-- docs-test: requires MODULE, ... -->` on the line before a block: run
  when those modules import, else skipped as a missing extra (a failure in CI:
  tests/conftest.py).

A block fails on a `DeprecationWarning` from eqtrain (an old path or name).
"""

import dataclasses
import importlib
import os
import re
import sys
import time
import warnings
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in ROOT.glob("docs/*.md"))]

# Every skipped block, by page, with the reason its marker gives: a new skip is
# added here too, so that skips stay few and deliberate.
SKIPPED: dict[str, list[str]] = {}

MARKER = re.compile(
    r"^<!--\s*docs-test:\s*(?P<what>skip|requires)\b\s*(?P<arg>.*?)\s*-->$"
)
VALUE = re.compile(  # the literal after the line's last `=`, then the marker
    r"^(?P<lhs>[^#]*=\s*)(?P<rhs>[^=#,()\[\]]+?)(?P<tail>[,)\]]*)\s*"
    r"#(?:[^#]*;)?\s*docs-test:\s*(?P<value>.+?)\s*$"
)
OPEN = re.compile(r"^```python\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int  # the page's line of the block's first code line (1-based)
    source: str  # with the `# docs-test:` values in place
    skip: str | None = None  # the reason
    requires: tuple[str, ...] = ()


def blocks(page: str) -> list[Block]:
    """The ```python blocks of `page`, with their markers read and applied."""
    lines = (ROOT / page).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if not OPEN.match(lines[i]):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        source = "\n".join(_filled(line) for line in lines[i + 1 : end])
        out.append(Block(page, i + 2, source, *_marker(lines[i - 1] if i else "")))
        i = end + 1
    return out


def _marker(line: str) -> tuple[str | None, tuple[str, ...]]:
    """`(skip reason, required modules)` from the line before a block."""
    m = MARKER.match(line.strip())
    if m is None:
        if "docs-test" in line:
            raise ValueError(f"not a docs-test marker: {line!r}")
        return None, ()
    if m["what"] == "skip":
        return m["arg"].strip("() ") or "no reason given", ()
    return None, tuple(name.strip() for name in m["arg"].split(","))


def _filled(line: str) -> str:
    if "docs-test:" not in line:
        return line
    m = VALUE.match(line)
    if m is None:
        raise ValueError(f"not `name = value  # docs-test: VALUE`: {line!r}")
    return f"{m['lhs']}{m['value']}{m['tail']}"


def _run(block: Block, namespace: dict) -> None:
    # Padded so that a traceback shows the page's own line numbers.
    source = "\n" * (block.line - 1) + block.source
    code = compile(source, str(ROOT / block.page), "exec")
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message=r"(?s).*\beqtrain\b", category=DeprecationWarning
        )
        exec(code, namespace)


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


@pytest.fixture
def reader(tmp_path, monkeypatch):
    """A reader's fresh directory and environment: a block may set variables
    (the sharding page sets XLA_FLAGS, as a script would); W&B runs offline with
    its files under the directory, and its service process is stopped after."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / ".wandb"))
    environ = dict(os.environ)
    yield tmp_path
    os.environ.clear()
    os.environ.update(environ)
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()


@pytest.mark.parametrize("page", [page for page in PAGES if blocks(page)])
def test_page_runs(page, reader):
    namespace = {"__name__": "__docs__"}
    skipped, missing = [], []
    for block in blocks(page):
        if block.skip:
            skipped.append(block.skip)
            continue
        absent = [name for name in block.requires if not _importable(name)]
        if absent:
            missing.append(f"{page}:{block.line} needs {', '.join(absent)}")
            continue
        start, cpu = time.perf_counter(), time.process_time()
        try:
            _run(block, namespace)
        except Exception as e:
            raise AssertionError(f"{page}:{block.line}: {type(e).__name__}: {e}") from e
        took, cpu = time.perf_counter() - start, time.process_time() - cpu
        print(f"{page}:{block.line} ran in {took:.1f} s ({cpu:.1f} s of CPU time)")
    assert skipped == SKIPPED.get(page, []), "skip markers and SKIPPED disagree"
    if missing:
        pytest.skip(f"could not import what these blocks need: {'; '.join(missing)}")


def test_every_page_is_counted_and_skips_are_few():
    every = [b for page in PAGES for b in blocks(page)]
    skips = [b for b in every if b.skip]
    print(f"{len(every)} Python blocks in {len(PAGES)} pages, {len(skips)} skipped")
    for b in skips:
        print(f"  {b.page}:{b.line}: {b.skip}")
    assert len(every) >= 60
    assert len(skips) <= len(every) // 20
    assert sum(map(len, SKIPPED.values())) == len(skips)


def test_markers_are_read_as_documented(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n```python\nn = 1_000  # docs-test: 5\nkw = f(a=1,  # its; docs-test: 2\n"
        "  steps=10)  # docs-test: 3\n```\n<!-- docs-test: skip (needs a GPU) -->\n"
        "```python\n1 / 0\n```\n<!-- docs-test: requires json, csv -->\n```python\n"
        "x = 1\n```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    first, second, third = blocks("page.md")
    assert first.line == 3 and first.source.splitlines() == [
        "n = 5",
        "kw = f(a=2,",
        "  steps=3)",
    ]
    assert second.skip == "needs a GPU" and third.requires == ("json", "csv")
    page.write_text("```python\nx = g(1).y  # docs-test: 2\n```\n")
    with pytest.raises(ValueError, match="docs-test"):
        blocks("page.md")


def test_an_eqtrain_deprecation_fails_the_block():
    block = Block("README.md", 1, "import eqtrain\neqtrain.tune_cpu")
    with pytest.raises(DeprecationWarning, match="eqtrain.cpu"):
        _run(block, {})
