"""The package layering, read from the source with `ast` (nothing is imported).

- No import cycle between eqtrain's top-level pieces. A node is the first name
  after `eqtrain` (`eqtrain.hf._load` is `hf`), so the root package's private
  modules (`eqtrain._step`, `eqtrain._loop`) are nodes of their own, and
  `eqtrain` itself (its `__init__`) is one more.
- No module imports another package's private module (`eqtrain.models._layers`
  from `eqtrain.hf`): what packages share is re-exported by the owner's facade.
  The root package's private modules (`eqtrain/_*.py`) sit below every package,
  so any module may import them.

Imports inside functions count too: a lazy import still ties the layers.
"""

import ast
import dataclasses
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent / "eqtrain"


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
