"""The package layering, read from the source with `ast` (nothing is imported).

- No import cycle between eqtrain's top-level pieces. A node is the first name
  after `eqtrain` (`eqtrain.hf._load` is `hf`), so the root package's private
  modules (`eqtrain._step`, `eqtrain._fit._loop`) are nodes of their own, and
  `eqtrain` itself (its `__init__`) is one more.
- No module imports another package's private module (`eqtrain.models._layers`
  from `eqtrain.hf`): what packages share is re-exported by the owner's facade.
  The root package's private modules (`eqtrain/_*.py`) sit below every package,
  so any module may import them.

- No import cycle between modules either (`eqtrain.config._parse` and
  `eqtrain.config._validate` may not import each other, even lazily).
- Every top-level piece sits on the floor docs/architecture.md gives it, and
  imports only pieces on lower floors: the page is the plan, this is its check.
- The root holds the core: every module at the root sits below the facade,
  except the old paths kept for one release (each hands over its new module).
- The core takes its options from its caller: no piece below the job reaches
  `eqtrain.cpu`, directly or through another piece.

The function-size targets of issue 31 (and its 500-line file limit) were met
and retired: a function is split at a seam that can be named, not at a count.

Imports inside functions count too: a lazy import still ties the layers.
"""

import ast
import dataclasses
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent / "eqtrain"
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # the importing module, `eqtrain.hf._load`
    target: str  # the imported module, `eqtrain.models._layers`
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    """Whether `eqtrain.a.b` is a module or package in the tree."""
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> list[Import]:
    source = _module_name(path)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            # `from .. import hooks` imports the module `eqtrain.hooks`;
            # `from .._errors import ConfigError` imports `eqtrain._errors`.
            names = [
                f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base
                for a in node.names
            ]
        else:
            continue
        out += [
            Import(source, name, node.lineno)
            for name in names
            if name == "eqtrain" or name.startswith("eqtrain.")
        ]
    return out


def _all_imports() -> list[Import]:
    return [imp for p in sorted(ROOT.rglob("*.py")) for imp in _imports(p)]


def _node(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "eqtrain"


def _private_owner(module: str) -> str | None:
    """The package whose private module `module` is (`eqtrain.models` for
    `eqtrain.models._layers`), or None for a public path or a root private module."""
    parts = module.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and not part.startswith("__"):
            return None if i == 1 else ".".join(parts[:i])
    return None


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as `[a, b, ..., a]`, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _graph(imports: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for imp in imports:
        a, b = _node(imp.source), _node(imp.target)
        if a != b:
            graph.setdefault(a, set()).add(b)
    return graph


def test_the_walk_sees_the_tree():
    imports = _all_imports()
    assert len({imp.source for imp in imports}) > 30
    edges = {(_node(i.source), _node(i.target)) for i in imports}
    assert ("job", "models") in edges and ("hf", "models") in edges
    assert _private_owner("eqtrain.models._layers") == "eqtrain.models"
    assert _private_owner("eqtrain._errors") is None
    assert _private_owner("eqtrain.models.llama") is None


def test_no_cycle_between_packages():
    graph = _graph(_all_imports())
    cycle = _cycle(graph)
    if cycle:
        pairs = list(zip(cycle, cycle[1:], strict=False))
        lines = [
            f"  {i.source} (line {i.line}) imports {i.target}"
            for a, b in pairs
            for i in _all_imports()
            if (_node(i.source), _node(i.target)) == (a, b)
        ]
        pytest.fail(
            f"import cycle between packages: {' -> '.join(cycle)}\n" + "\n".join(lines)
        )


def test_cycle_finder():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_of_another_packages_private_module():
    bad = [
        f"{i.source} (line {i.line}) imports {i.target}"
        for i in _all_imports()
        if (owner := _private_owner(i.target)) is not None
        and i.source != owner
        and not i.source.startswith(owner + ".")
    ]
    assert not bad, (
        "modules import another package's private module; re-export the name "
        "from that package's facade and import it from there:\n  " + "\n  ".join(bad)
    )


def _module_graph(imports: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for imp in imports:
        if imp.source != imp.target:
            graph.setdefault(imp.source, set()).add(imp.target)
    return graph


def test_no_cycle_between_modules():
    imports = _all_imports()
    cycle = _cycle(_module_graph(imports))
    if cycle:
        pairs = set(zip(cycle, cycle[1:], strict=False))
        lines = sorted(
            {
                f"  {i.source} (line {i.line}) imports {i.target}"
                for i in imports
                if (i.source, i.target) in pairs
            }
        )
        pytest.fail(
            f"import cycle between modules: {' -> '.join(cycle)}\n" + "\n".join(lines)
        )


def _floors() -> dict[str, int]:
    """`piece -> floor` from the architecture page's rows `| N | `a`, `b` | ...`."""
    floors = {}
    for line in ARCHITECTURE.read_text(encoding="utf-8").splitlines():
        row = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if row:
            for name in re.findall(r"`([\w.]+)`", row.group(2)):
                floors[name.removeprefix("eqtrain.") or "eqtrain"] = int(row.group(1))
    return floors


def test_every_piece_imports_only_lower_floors():
    floors = _floors()
    assert len(floors) > 20, f"no floor table read from {ARCHITECTURE}"
    graph = _graph(_all_imports())
    pieces = set(graph) | {b for targets in graph.values() for b in targets}
    missing = sorted(pieces - set(floors))
    assert not missing, (
        f"pieces with no floor in {ARCHITECTURE.name}'s table: {missing}; "
        "add each to the floor it belongs on"
    )
    stale = sorted(set(floors) - pieces)
    assert not stale, f"{ARCHITECTURE.name} names pieces that do not exist: {stale}"
    upward = [
        f"  {a} (floor {floors[a]}) imports {b} (floor {floors[b]})"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if floors[b] >= floors[a]
    ]
    assert not upward, (
        "imports that do not go down a floor (move the code, or the piece, "
        f"and keep {ARCHITECTURE.name} true):\n" + "\n".join(upward)
    )


SHIM = "sys.modules[__name__] = _moved"
"""The line that makes a root module an old path (see eqtrain/grpo.py)."""


def _root_modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(ROOT.glob("*.py")) if p.name != "__init__.py"}


def test_the_root_holds_the_core():
    floors = _floors()
    facade = floors["eqtrain"]
    shims = [n for n, p in _root_modules().items() if SHIM in p.read_text()]
    assert shims, "no old-path module found: has the shim's line changed?"
    above = [
        f"eqtrain/{n}.py (floor {floors.get(n)})"
        for n in _root_modules()
        if n not in shims and floors.get(n, facade) >= facade
    ]
    assert not above, (
        "modules at the root that sit on or above the facade: move each into "
        "the subsystem's folder (the root holds the core):\n  " + "\n  ".join(above)
    )
    for name in shims:
        imports = {i.target for i in _imports(_root_modules()[name])}
        assert len(imports) == 1, (
            f"eqtrain/{name}.py is an old path: it imports its new module only"
        )


def _reaches(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every piece `start` reaches, each with the piece it was reached from."""
    seen, todo = {start: start}, [start]
    while todo:
        node = todo.pop()
        for nxt in sorted(graph.get(node, ())):
            if nxt not in seen:
                seen[nxt] = node
                todo.append(nxt)
    return seen


def test_the_core_never_reaches_the_cpu_package():
    floors = _floors()
    graph = _graph(_all_imports())
    outside = {"cpu", "job", "ray", "cli"}
    bad = []
    for piece in sorted(set(floors) - outside):
        reached = _reaches(graph, piece)
        if "cpu" in reached:
            path, node = ["cpu"], "cpu"
            while node != piece:
                node = reached[node]
                path.append(node)
            bad.append(" -> ".join(reversed(path)))
    assert not bad, (
        "pieces below the job that import eqtrain.cpu (take the options as "
        "an argument, and let the job pass them):\n  " + "\n  ".join(bad)
    )


def _one_use_chains(path: Path) -> list[list[str]]:
    """The longest chain under each module-level function of `path` through
    private helpers that are used exactly once, each by the one before."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    uses = {name: 0 for name in funcs}
    callers: dict[str, set[str]] = {name: set() for name in funcs}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in funcs:
            uses[node.id] += 1
    for name, f in funcs.items():
        for node in ast.walk(f):
            if isinstance(node, ast.Name) and node.id in funcs and node.id != name:
                callers[node.id].add(name)
    one_use = {
        n for n in funcs if n.startswith("_") and uses[n] == 1 and len(callers[n]) == 1
    }

    def chain(name: str) -> list[str]:
        below = [chain(m) for m in sorted(one_use) if callers[m] == {name}]
        return [name, *max(below, key=len, default=[])]

    return [chain(n) for n in funcs if n not in one_use]


MAX_ONE_USE_CHAIN = 3
"""Levels of one-use private helpers under a function: a split is made at a
seam that can be named, and five levels of one use each are one idea cut up
(issue 53)."""


def test_no_deep_chains_of_one_use_helpers():
    deep = [
        f"{path.relative_to(ROOT.parent)}: {' -> '.join(c)}"
        for path in sorted(ROOT.rglob("*.py"))
        for c in _one_use_chains(path)
        if len(c) - 1 > MAX_ONE_USE_CHAIN
    ]
    assert not deep, (
        f"chains of more than {MAX_ONE_USE_CHAIN} one-use helpers; merge the "
        "levels no seam separates back into their caller:\n  " + "\n  ".join(deep)
    )


def test_the_chain_finder(tmp_path):
    import textwrap

    source = textwrap.dedent(
        """
        def public():
            return _a()
        def _a():
            return _b() + _c()
        def _b():
            return _d()
        def _c():
            return 1
        def _d():
            return 2
        """
    )
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert _one_use_chains(path) == [["public", "_a", "_b", "_d"]]
