"""A step's array files checked against its OCDBT index, without reading any
array data: the index (a small manifest and B-tree nodes) names the data file,
offset and length of every stored chunk, so a missing or cut-short file is found
by reading the index and the files' sizes only. Flipped bits are the checksums'
job (`_integrity`), at restore."""

import os
from pathlib import Path
from typing import Any

import tensorstore as ts


def _parse(location: str) -> tuple[str, int, int]:
    """`("<base>/<relative path>", offset, length)` of a location string
    `"<kind>:<base>:<relative path>:<offset>:<length>"` (as `ts.ocdbt.dump` shows)."""
    head, offset, length = location.rsplit(":", 2)
    _, base, relative = head.split(":", 2)
    return base + relative, int(offset), int(length)


def _array(key: bytes) -> str:
    """The array a chunk key belongs to: `b"model.w/0.0"` -> `"model.w"`."""
    return key.decode(errors="replace").rpartition("/")[0] or "(metadata)"


def _short(e: BaseException) -> str:
    """TensorStore's message, first line, without its source locations."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else type(e).__name__
    text = text.split(" [source locations=")[0]
    return text[:200] + ("..." if len(text) > 200 else "")


Extents = dict[str, tuple[int, list[str]]]  # {file: (bytes needed, arrays in it)}


def _need(needed: Extents, location: str, array: str | None) -> None:
    """Note that the file of `location` must reach its end (and holds `array`)."""
    path, offset, length = _parse(location)
    end, arrays = needed.get(path, (0, []))
    if array is not None and array not in arrays:
        arrays.append(array)
    needed[path] = (max(end, offset + length), arrays)


def _below(
    base: Any, level: list[tuple[str, bytes]], needed: Extents
) -> list[tuple[str, bytes]]:
    """The B-tree nodes below `level` (with their key prefixes); the values
    stored in `level`'s leaf entries are noted in `needed`."""
    nodes = [ts.ocdbt.dump(base, location) for location, _ in level]
    below = []
    for (_, prefix), future in zip(level, nodes, strict=True):
        for entry in future.result()["entries"]:
            if "location" in entry:  # an interior node: a subtree
                common = prefix + entry.get("subtree_common_prefix", b"")
                below.append((entry["location"], common))
            elif "indirect_value" in entry:
                _need(needed, entry["indirect_value"], _array(prefix + entry["key"]))
    return below


def _extents(state_dir: Path) -> Extents:
    """`{file: (bytes needed, arrays stored there)}` from the index. Raises what
    TensorStore raises when the index itself is unreadable."""
    base = ts.KvStore.open(f"file://{os.fspath(state_dir)}/").result()
    versions = ts.ocdbt.dump(base).result().get("versions") or []
    needed: Extents = {}
    if not versions or "location" not in versions[-1].get("root", {}):
        return needed  # an empty database (or one this check cannot follow)
    level = [(versions[-1]["root"]["location"], b"")]
    while level:
        for location, _ in level:
            _need(needed, location, None)
        level = _below(base, level, needed)
    return needed


def _named(arrays: list[str]) -> str:
    if not arrays:
        return "the array index"
    more = f" and {len(arrays) - 1} more" if len(arrays) > 1 else ""
    return f"array {arrays[0]}{more}"


def problems(state_dir: Path) -> str | None:
    """None if every file the OCDBT index at `state_dir` (a step's `state/`)
    refers to exists and is long enough; else one short sentence naming the
    first bad file (relative to the step directory) and the arrays stored in it."""
    try:
        needed = _extents(state_dir)
    except Exception as e:  # TensorStore reports damage as ValueError and others
        return f"its array index (state/manifest.ocdbt) is unreadable ({_short(e)})"
    for relative, (end, arrays) in sorted(needed.items()):
        problem = _file_problem(state_dir, relative, end, arrays)
        if problem is not None:
            return problem
    return None


def _file_problem(
    state_dir: Path, relative: str, end: int, arrays: list[str]
) -> str | None:
    """Why the array file `relative` cannot hold its `end` bytes, or None."""
    path = state_dir / relative
    shown = path.relative_to(state_dir.parent)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"the array file {shown} is missing (it holds {_named(arrays)})"
    except OSError as e:
        return f"the array file {shown} cannot be read ({e.strerror})"
    if size < end:
        return (
            f"the array file {shown} is cut short: {size} bytes where the "
            f"index needs {end} (it holds {_named(arrays)})"
        )
    return None
