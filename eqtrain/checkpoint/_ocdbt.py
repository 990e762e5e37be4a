"""A step's array files checked against its OCDBT index, without reading any
array data: the index (a small manifest and B-tree nodes) names the data file,
offset and length of every stored chunk, so a missing or cut-short file is found
by reading the index and the files' sizes only. Flipped bits are the checksums'
job (`_integrity`), at restore."""

import os
from pathlib import Path

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


def _extents(state_dir: Path) -> dict[str, tuple[int, list[str]]]:
    """`{file: (bytes needed, arrays stored there)}` from the index. Raises what
    TensorStore raises when the index itself is unreadable."""
    base = ts.KvStore.open(f"file://{os.fspath(state_dir)}/").result()
    manifest = ts.ocdbt.dump(base).result()
    versions = manifest.get("versions") or []
    needed: dict[str, tuple[int, list[str]]] = {}

    def need(location: str, array: str | None) -> None:
        path, offset, length = _parse(location)
        end, arrays = needed.get(path, (0, []))
        if array is not None and array not in arrays:
            arrays.append(array)
        needed[path] = (max(end, offset + length), arrays)

    if not versions or "location" not in versions[-1].get("root", {}):
        return needed  # an empty database (or one this check cannot follow)
    level = [(versions[-1]["root"]["location"], b"")]
    while level:
        for location, _ in level:
            need(location, None)
        nodes = [ts.ocdbt.dump(base, loc) for loc, _ in level]
        below = []
        for (_, prefix), future in zip(level, nodes, strict=True):
            for entry in future.result()["entries"]:
                if "location" in entry:  # an interior node: a subtree
                    common = prefix + entry.get("subtree_common_prefix", b"")
                    below.append((entry["location"], common))
                elif "indirect_value" in entry:
                    need(entry["indirect_value"], _array(prefix + entry["key"]))
        level = below
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
