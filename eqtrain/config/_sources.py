"""`data.sources`, a mixture of weighted sources: read from `[[data.sources]]`
tables or a `"path=weight, ..."` string, and written back as that string."""

import math
import re
from collections.abc import Mapping
from typing import Any


Source = tuple[str, float, str | None]  # (path, weight, name)
_NAMED_SOURCE = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*):(.+)")


def parse_sources(value: Any) -> list[Source]:
    """`data.sources` as `(path, weight, name)` entries, from TOML tables
    (`[[data.sources]]` with `path`, `weight` and an optional `name`) or a string
    `"path=weight, path=weight"` (a name may lead: `"web:path=0.7"`); ValueError
    when malformed."""
    if value in ("", None, []):
        return []
    if isinstance(value, str):
        entries = [
            _from_text(item.strip()) for item in value.split(",") if item.strip()
        ]
    elif isinstance(value, list):
        entries = [_from_table(i, item) for i, item in enumerate(value)]
    else:
        raise ValueError("expected `[[data.sources]]` tables or a string")
    for path, weight, _ in entries:
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"the weight of {path!r} must be a positive number")
        if "," in path or "=" in path:
            raise ValueError(f"the path {path!r} may not hold ',' or '='")
    return entries


def format_sources(entries: list[Source]) -> str:
    """The canonical string of `data.sources` entries (as `parse_sources` reads)."""
    return ", ".join(
        (f"{name}:" if name else "") + f"{path}={weight:g}"
        for path, weight, name in entries
    )


def _from_text(item: str) -> Source:
    """One `[name:]path=weight` entry of the string form."""
    path, sep, weight = item.rpartition("=")
    if not sep or not path.strip():
        raise ValueError(
            f"expected `path=weight` entries separated by commas, such as "
            f'"web.jsonl=0.7,code=0.3"; {item!r} has no weight'
        )
    name, path = _named(path.strip())
    try:
        return path.strip(), float(weight), name
    except ValueError:
        raise ValueError(
            f"the weight of {path.strip()!r} is {weight.strip()!r}, not a number"
        ) from None


def _named(path: str) -> tuple[str | None, str]:
    """`("web", "a.jsonl")` for `web:a.jsonl`; no name for `stdlib:...`."""
    named = _NAMED_SOURCE.match(path)
    if named and named.group(1) != "stdlib":
        return named.group(1), named.group(2)
    return None, path


def _from_table(i: int, item: Any) -> Source:
    """Entry `i` of the `[[data.sources]]` tables."""
    if not isinstance(item, Mapping) or "path" not in item:
        raise ValueError(
            f"entry {i} must be a table with `path` and `weight` (a "
            "`[[data.sources]]` section)"
        )
    unknown = sorted(set(item) - {"path", "weight", "name"})
    if unknown:
        raise ValueError(
            f"entry {i} has unknown keys {unknown}; a source has path, weight and name"
        )
    weight = item.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ValueError(f"the weight of entry {i} must be a number")
    return str(item["path"]), float(weight), item.get("name")
