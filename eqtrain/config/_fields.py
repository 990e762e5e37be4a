"""The config's keys as data: one `Field` per dotted key, read from the sections'
dataclass fields and their `setting` metadata (`_schema`)."""

import dataclasses
import types
import typing
from typing import Any

from ._config import SECTIONS, Config


# The `setting` metadata a `Field` carries, under the same names.
_CHECKS = ("help", "choices", "min", "max", "kind", "above", "below")
# How the reference and error messages name a key's type, by kind, then by type.
_KIND_NAMES = {
    "duration": "duration",
    "size": "size",
    "path": "path",
    "names": "names",
    "sources": "sources",
    "table": "table",
    "auto_int": "integer or 'auto'",
    "auto_bool": "boolean or 'auto'",
}
_TYPE_NAMES = {"str": "string", "bool": "boolean", "int": "integer"}


@dataclasses.dataclass(frozen=True)
class Field:
    """One config key: its dotted name, Python type and checks."""

    key: str
    type: type
    optional: bool
    default: Any
    help: str
    choices: tuple[Any, ...] | None
    min: float | int | None
    max: float | int | None
    kind: str | None
    above: float | int | None = None  # exclusive bounds
    below: float | int | None = None

    @property
    def type_name(self) -> str:
        name = _KIND_NAMES.get(self.kind or "", self.type.__name__)
        name = _TYPE_NAMES.get(name, name)
        return f"{name} (optional)" if self.optional else name


def schema() -> dict[str, Field]:
    """Every config key (`"seed"`, `"optim.lr"`, ...) with its type, default,
    help text and checks, in TOML order."""
    out = _fields_of(Config, "")
    for section, cls in SECTIONS.items():
        out.update(_fields_of(cls, section + "."))
    return out


def _fields_of(cls: type, prefix: str) -> dict[str, Field]:
    """The keys of one dataclass (a section, or `Config`'s top level: not the
    sections, nor the private `_explicit`)."""
    hints = typing.get_type_hints(cls)
    return {
        prefix + f.name: _field(prefix + f.name, f, hints[f.name])
        for f in dataclasses.fields(cls)
        if not f.name.startswith("_") and not dataclasses.is_dataclass(hints[f.name])
    }


def _field(key: str, f: dataclasses.Field[Any], hint: Any) -> Field:
    """The `Field` of a dataclass field: `X | None` is an optional `X`."""
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else ()
    base = next(a for a in args if a is not type(None)) if args else hint
    checks = {name: f.metadata.get(name) for name in _CHECKS}
    checks["help"] = checks["help"] or ""
    return Field(
        key=key, type=base, optional=type(None) in args, default=f.default, **checks
    )
