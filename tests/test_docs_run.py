"""Every Python block of README.md and docs/*.md runs (issue 58, point 6).

Each page's ```python blocks run in order in one namespace, in a fresh temporary
working directory, as a reader would paste them. The markers (docs/testing.md,
"Docs that run"):

- a line ending in `# docs-test: VALUE` (or `# its comment; docs-test: VALUE`)
  runs with VALUE as its value: `num_steps = 1_000  # docs-test: 5` runs
  `num_steps = 5` (only `name = value` and `name=value,` lines; the page shows
  both numbers);
- `<!-- docs-test: skip (REASON) -->` on the line before a block: not run, and
  listed in `SKIPPED` below with its reason;
- `<!-- docs-test: requires MODULE, ... -->` on the line before a block: run
  when those modules import, else skipped as a missing extra (a failure in CI:
  tests/conftest.py).

Fill-ins the reader replaces with their own (data, a model, a hook) are plain
visible lines marked `# fill in:` on the page: they run as written. A block
fails on a `DeprecationWarning` from eqtrain (an old path or name).
"""

import dataclasses
import importlib
import re
import time
import warnings
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("docs/*.md"))]

# Every skipped block, by page: the reasons the markers give (a new skip must be
# added here, so skips stay few and deliberate).
SKIPPED: dict[str, list[str]] = {}

MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<what>skip|requires)\b\s*(?P<arg>.*?)\s*-->$")
VALUE = re.compile(  # the literal after the line's last `=`, then the marker
    r"^(?P<lhs>[^#]*=\s*)(?P<rhs>[^=#]+?)(?P<tail>[,)\]]*)\s*"
    r"#(?:[^#]*;)?\s*docs-test:\s*(?P<value>.+?)\s*$"
)
OPEN = re.compile(r"^```python\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based line of the first code line
    source: str
    skip: str | None = None  # the reason
    requires: tuple[str, ...] = ()


def blocks(page: str) -> list[Block]:
    """The ```python blocks of `page`, with their markers and fill-ins applied."""
    lines = (ROOT / page).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        if not OPEN.match(lines[i]):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marker = MARKER.match(lines[i - 1].strip()) if i else None
        skip = requires = None
        if marker and marker["what"] == "skip":
            skip = marker["arg"].strip("() ") or "no reason given"
        elif marker:
            requires = tuple(m.strip() for m in marker["arg"].split(","))
        source = "\n".join(_filled(line) for line in lines[i + 1 : end])
        out.append(Block(page, i + 2, source, skip, requires or ()))
        i = end + 1
    return out


def _filled(line: str) -> str:
    if "docs-test:" not in line:
        return line
    m = VALUE.match(line)
    if m is None:
        raise ValueError(f"not `name = value  # docs-test: VALUE`: {line!r}")
    return f"{m['lhs']}{m['value']}{m['tail']}"


def _run(block: Block, namespace: dict) -> None:
    # Padded so that a traceback shows the page's own line numbers.
    code = compile("\n" * (block.line - 1) + block.source, str(ROOT / block.page), "exec")
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", message=r"(?s).*\beqtrain\b", category=DeprecationWarning
        )
        exec(code, namespace)


@pytest.mark.parametrize("page", PAGES)
def test_page_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    skipped, missing = [], []
    for block in blocks(page):
        if block.skip:
            skipped.append(block.skip)
            continue
        absent = [m for m in block.requires if not _importable(m)]
        if absent:
            missing.append(f"{page}:{block.line} needs {', '.join(absent)}")
            continue
        start = time.perf_counter()
        try:
            _run(block, namespace)
        except Exception as e:
            raise AssertionError(f"{page}:{block.line}: {type(e).__name__}: {e}") from e
        print(f"{page}:{block.line} ran in {time.perf_counter() - start:.1f} s")
    assert skipped == SKIPPED.get(page, []), "a skip marker not listed in SKIPPED"
    if missing:
        pytest.skip(f"could not import what these blocks need: {'; '.join(missing)}")


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def test_the_pages_have_python_blocks_and_few_skips():
    every = [b for page in PAGES for b in blocks(page)]
    skips = [b for b in every if b.skip]
    print(f"{len(every)} blocks, {len(skips)} skipped:")
    for b in skips:
        print(f"  {b.page}:{b.line}: {b.skip}")
    assert len(every) >= 50 and len(skips) <= len(every) // 10
