"""Reading a `Config`: TOML files, `--set a.b=value` overrides, human-friendly
values (`1e-4`, `10_000`, `"2h30m"`, `"5GB"`), and checks that name the field."""

import dataclasses
import difflib
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from ._schema import SECTIONS, Config
from ._units import parse_size


def _did_you_mean(name: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f" Did you mean `{close[0]}`?" if close else ""


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
        name = {
            "duration": "duration",
            "size": "size",
            "path": "path",
            "names": "names",
            "sources": "sources",
            "auto_int": "integer or 'auto'",
            "auto_bool": "boolean or 'auto'",
        }.get(self.kind or "", self.type.__name__)
        name = {"str": "string", "bool": "boolean", "int": "integer"}.get(name, name)
        return f"{name} (optional)" if self.optional else name


def _fields_of(cls: type, prefix: str) -> dict[str, Field]:
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or dataclasses.is_dataclass(hints[f.name]):
            continue
        tp = hints[f.name]
        args = typing.get_args(tp) if isinstance(tp, types.UnionType) else ()
        optional = type(None) in args
        base = next(a for a in args if a is not type(None)) if args else tp
        meta = f.metadata
        out[prefix + f.name] = Field(
            key=prefix + f.name,
            type=base,
            optional=optional,
            default=f.default,
            help=meta.get("help", ""),
            choices=meta.get("choices"),
            min=meta.get("min"),
            max=meta.get("max"),
            kind=meta.get("kind"),
            above=meta.get("above"),
            below=meta.get("below"),
        )
    return out


def schema() -> dict[str, Field]:
    """Every config key (`"seed"`, `"optim.lr"`, ...) with its type, default,
    help text and checks, in TOML order."""
    out = _fields_of(Config, "")
    for section, cls in SECTIONS.items():
        out.update(_fields_of(cls, section + "."))
    return out


# -- values -------------------------------------------------------------------
# Longer units first: `10min` and `500ms` are not `10m` or `500m` plus a rest.
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|min|sec|d|h|m|s)", re.IGNORECASE)
_UNITS = {"d": 86400, "h": 3600, "m": 60, "min": 60, "s": 1, "sec": 1, "ms": 1e-3}
_DURATION_HELP = "a duration like '90s', '10m', '1.5h', '2h30m' or '1d'"


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string like `"90"`, `"45s"`, `"10m"`, `"2h30m"`,
    `"1.5h"`, `"1d"`.

    Every part of a compound duration names its unit, larger units first, each
    once: `"2h30"`, `"3s2h"` and `"1.5.5m"` are errors (not 2h30s, 2h3s or
    1.5s + 0.5m).

    >>> parse_duration("2h30m")
    9000.0
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif not isinstance(value, str):
        raise ValueError("expected seconds or a duration like '2h30m'")
    else:
        seconds = _parse_duration_text(value)
    if not math.isfinite(seconds):
        raise ValueError(f"expected a finite number of seconds or {_DURATION_HELP}")
    return seconds


def _parse_duration_text(value: str) -> float:
    text = value.strip().replace(" ", "").replace("_", "")
    if not text:
        raise ValueError("empty duration")
    try:
        return float(text)  # plain seconds, also as `1e4` (as `--set` gives them)
    except ValueError:
        pass
    total, pos, last_unit = 0.0, 0, math.inf
    while pos < len(text):
        match = _DURATION.match(text, pos)
        if match is None:
            rest = text[pos:]
            why = (
                f"{rest!r} has no unit (write e.g. '2h30m', not '2h30')"
                if re.fullmatch(r"[\d.]+", rest)
                else f"cannot read {rest!r}"
            )
            raise ValueError(f"expected {_DURATION_HELP}: {why}")
        unit = _UNITS[match.group(2).lower()]
        if unit >= last_unit:
            raise ValueError(
                f"expected {_DURATION_HELP}: units must go from largest to smallest, "
                f"each once (e.g. '2h30m', not '30m2h')"
            )
        total += float(match.group(1)) * unit
        pos, last_unit = match.end(), unit
    return total


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")
_NONE = ("none", "null", "")


def _from_string(text: str, field: Field) -> Any:
    """A `--set` value: a string read by the field's type."""
    stripped = text.strip()
    if (
        stripped[:1] in ('"', "'")
        and stripped[-1:] == stripped[:1]
        and len(stripped) > 1
    ):
        return stripped[1:-1]  # a quoted string stays a string
    if field.optional and stripped.lower() in _NONE:
        return None
    if field.kind == "names" and stripped.startswith("["):
        return _toml_list(stripped)  # as a file writes it: ["layer_input"]
    if field.kind in ("auto_int", "auto_bool") and stripped.lower() == "auto":
        return "auto"
    if field.type is bool:
        if stripped.lower() in _TRUE + _FALSE:
            return stripped.lower() in _TRUE
        raise ValueError("expected true or false")
    if field.type in (int, float) and field.kind != "duration":
        try:
            return int(stripped, 10)
        except ValueError:
            pass
        try:
            return float(stripped)
        except ValueError:
            raise ValueError(
                "expected an integer" if field.type is int else "expected a number"
            ) from None
    return stripped


def _toml_list(text: str) -> list[Any]:
    """A `--set` value written as a TOML array (`["layer_input", "query"]`)."""
    try:
        value = tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError as e:
        raise ValueError(
            f'expected a TOML list such as ["layer_input", "query"] ({e})'
        ) from None
    if not isinstance(value, list):
        raise ValueError('expected a TOML list such as ["layer_input", "query"]')
    return value


def _unset(value: Any, field: Field) -> bool:
    """Whether a TOML value means None (TOML has no null): `""`, or for
    non-string keys also `"none"` or `"null"`, as `to_toml` writes them."""
    if field.type is str:
        return value == ""
    return isinstance(value, str) and value.strip().lower() in _NONE


def _coerce(value: Any, field: Field) -> Any:
    """A TOML (or `--set`) value converted to the field's type, or ValueError."""
    if value is None or (field.optional and _unset(value, field)):
        if field.optional:
            return None
        raise ValueError("a value is required")
    if field.kind == "duration":
        return parse_duration(value)
    if field.kind == "auto_int" and isinstance(value, str):
        if value.strip().lower() != "auto":
            raise ValueError("expected an integer or 'auto'")
        return "auto"
    if field.kind == "auto_bool" and isinstance(value, str):
        if value.strip().lower() != "auto":
            raise ValueError("expected true, false or 'auto'")
        return "auto"
    if field.kind == "sources":
        return format_sources(parse_sources(value))
    if field.kind == "names":
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not all(
            isinstance(n, str) for n in items
        ):
            raise ValueError("expected a list of names or a comma-separated string")
        return ",".join(n.strip() for n in items if n.strip())
    if field.kind == "size":
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError("expected bytes or a size like '5GB'")
        value = str(value)  # the field is a string; `1000` (bytes) reads as "1000"
        try:
            parse_size(value)
        except ConfigError as e:
            raise ValueError("expected bytes or a size like '5GB' or '500MB'") from e
        return value
    if field.type is bool:
        if not isinstance(value, bool):
            raise ValueError("expected true or false")
        return value
    if field.type is int:
        if isinstance(value, bool):
            raise ValueError("expected an integer")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int):
            raise ValueError("expected an integer")
        return value
    if field.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("expected a number")
        return float(value)
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return value


_NAMED_SOURCE = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*):(.+)")


def parse_sources(value: Any) -> list[tuple[str, float, str | None]]:
    """`data.sources` as `(path, weight, name)` entries, from TOML tables
    (`[[data.sources]]` with `path`, `weight` and an optional `name`) or a string
    `"path=weight, path=weight"` (a name may lead: `"web:path=0.7"`); ValueError
    when malformed."""
    if value in ("", None, []):
        return []
    entries: list[tuple[str, float, str | None]] = []
    if isinstance(value, str):
        for item in value.split(","):
            if not item.strip():
                continue
            path, sep, weight = item.strip().rpartition("=")
            if not sep or not path.strip():
                raise ValueError(
                    f"expected `path=weight` entries separated by commas, such as "
                    f'"web.jsonl=0.7,code=0.3"; {item.strip()!r} has no weight'
                )
            name = None
            named = _NAMED_SOURCE.match(path.strip())
            if named and named.group(1) != "stdlib":
                name, path = named.group(1), named.group(2)
            try:
                entries.append((path.strip(), float(weight), name))
            except ValueError:
                raise ValueError(
                    f"the weight of {path.strip()!r} is {weight.strip()!r}, not a "
                    "number"
                ) from None
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, Mapping) or "path" not in item:
                raise ValueError(
                    f"entry {i} must be a table with `path` and `weight` (a "
                    "`[[data.sources]]` section)"
                )
            unknown = sorted(set(item) - {"path", "weight", "name"})
            if unknown:
                raise ValueError(
                    f"entry {i} has unknown keys {unknown}; a source has path, weight "
                    "and name"
                )
            weight = item.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)):
                raise ValueError(f"the weight of entry {i} must be a number")
            name = item.get("name")
            entries.append((str(item["path"]), float(weight), name))
    else:
        raise ValueError("expected `[[data.sources]]` tables or a string")
    for path, weight, _ in entries:
        if not math.isfinite(weight) or weight <= 0:
            raise ValueError(f"the weight of {path!r} must be a positive number")
        if "," in path or "=" in path:
            raise ValueError(f"the path {path!r} may not hold ',' or '='")
    return entries


def format_sources(entries: list[tuple[str, float, str | None]]) -> str:
    """The canonical string of `data.sources` entries (as `parse_sources` reads)."""
    return ", ".join(
        (f"{name}:" if name else "") + f"{path}={weight:g}"
        for path, weight, name in entries
    )


def _check(value: Any, field: Field) -> None:
    if value is None:
        return
    if field.choices is not None and value not in field.choices:
        allowed = ", ".join(repr(c) for c in field.choices)
        raise ConfigError(
            f"`{field.key}` must be one of {allowed}; got {value!r}."
            + _did_you_mean(str(value), [str(c) for c in field.choices])
        )
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(
                f"`{field.key}` must be a finite number; got {value!r}. {field.help}"
            )
        if field.min is not None and value < field.min:
            raise ConfigError(f"`{field.key}` must be >= {field.min}; got {value!r}.")
        if field.max is not None and value > field.max:
            raise ConfigError(f"`{field.key}` must be <= {field.max}; got {value!r}.")
        if field.above is not None and value <= field.above:
            raise ConfigError(f"`{field.key}` must be > {field.above}; got {value!r}.")
        if field.below is not None and value >= field.below:
            raise ConfigError(f"`{field.key}` must be < {field.below}; got {value!r}.")


def convert(value: Any, field: Field, source: str) -> Any:
    """`value` for `field`, checked; errors name the field, the source and what
    is expected."""
    try:
        converted = _coerce(value, field)
    except ValueError as e:
        raise ConfigError(
            f"`{field.key}` in {source}: {e}; got {value!r}. It is a "
            f"{field.type_name}: {field.help}"
        ) from None
    _check(converted, field)
    return converted


# -- assembling a Config --------------------------------------------------------
def from_dict(data: Mapping[str, Any], *, source: str = "the config") -> Config:
    """A `Config` from nested dicts (a parsed TOML file): unknown sections and
    keys are errors with a suggestion; values are converted and checked."""
    fields = schema()
    values: dict[str, Any] = {}
    for key, value in _flatten(data, source):
        if key not in fields:
            raise ConfigError(_unknown_key(key, fields, source))
        values[key] = convert(value, fields[key], source)
    return build(values)


def build(values: Mapping[str, Any], base: Config | None = None) -> Config:
    """A `Config` with the given already-converted `{dotted key: value}` applied
    on top of `base` (default: all defaults); remembers which keys were set."""
    base = base if base is not None else Config()
    top = {k: v for k, v in values.items() if "." not in k}
    sections = {}
    for name in SECTIONS:
        changes = {
            k.split(".", 1)[1]: v for k, v in values.items() if k.startswith(name + ".")
        }
        sections[name] = dataclasses.replace(getattr(base, name), **changes)
    given = explicit(base) | frozenset(values)
    return dataclasses.replace(base, **top, **sections, _explicit=given)


def explicit(config: Config) -> frozenset[str]:
    """The dotted keys a file or an override set (as opposed to defaults); kept
    by `dataclasses.replace` and ignored by `==`."""
    return config._explicit


def _flatten(data: Mapping[str, Any], source: str) -> list[tuple[str, Any]]:
    out = []
    for key, value in data.items():
        if key in SECTIONS:
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"`{key}` in {source} must be a table (a `[{key}]` section); "
                    f"got {value!r}."
                )
            for sub, v in value.items():
                if isinstance(v, Mapping) and not (key, sub) == ("data", "sources"):
                    raise ConfigError(
                        f"`{key}.{sub}` in {source} is a table, but [{key}] has no "
                        "sub-sections; write its keys directly under it."
                    )
                out.append((f"{key}.{sub}", v))
        else:
            out.append((key, value))
    return out


def _unknown_key(key: str, fields: Mapping[str, Field], source: str) -> str:
    section = key.split(".", 1)[0] if "." in key else None
    if section is not None and section not in SECTIONS:
        return (
            f"unknown section `[{section}]` in {source}; the sections are "
            f"{', '.join(SECTIONS)}." + _did_you_mean(section, SECTIONS)
        )
    if section is None:
        known = [k for k in fields if "." not in k] + list(SECTIONS)
        hint = _did_you_mean(key, known)
        nested = [k for k in fields if k.split(".")[-1] == key]
        if nested:
            hint = f" Did you mean `{nested[0]}`?"
        return (
            f"unknown key `{key}` in {source}; top-level keys are "
            f"{', '.join(known)}." + hint
        )
    keys = [k.split(".", 1)[1] for k in fields if k.startswith(section + ".")]
    name = key.split(".", 1)[1]
    hint = _did_you_mean(name, keys)
    if not hint:  # maybe it belongs to another section
        hint = _did_you_mean(key, list(fields)) or _did_you_mean(
            name, [k for k in fields if k.endswith("." + name)]
        )
        other = [k for k in fields if k.split(".")[-1] == name]
        if other:
            hint = f" Did you mean `{other[0]}`?"
    return (
        f"unknown key `{name}` in [{section}] of {source}; its keys are "
        f"{', '.join(keys)}." + hint
    )


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A TOML file as dicts; a missing or malformed file is a `ConfigError`."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(
            f"config file {path} does not exist. Pass the path of a TOML file, or "
            "run `eqtrain fit` without one to use the built-in default."
        )
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory; pass a TOML file.")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(
            f"{path} is not valid TOML: {e}. Check the quoting and brackets there."
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text; a TOML file is.") from None


def parse_override(text: str) -> tuple[str, str]:
    """`"a.b=value"` -> `("a.b", "value")`."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"--set takes `key=value` (e.g. `--set optim.lr=1e-4`); got {text!r}."
        )
    return key, value


def apply_overrides(config: Config, overrides: Iterable[str]) -> Config:
    """`config` with `--set key=value` overrides applied (typed by the schema)."""
    fields = schema()
    values = {}
    for text in overrides:
        key, raw = parse_override(text)
        if key not in fields:
            raise ConfigError(_unknown_key(key, fields, "--set"))
        field = fields[key]
        try:
            value = _from_string(raw, field)
        except ValueError as e:
            raise ConfigError(
                f"`{key}` in --set: {e}; got {raw!r}. It is a {field.type_name}: "
                f"{field.help}"
            ) from None
        values[key] = convert(value, field, "--set")
    return build(values, config)


def load(
    path: str | os.PathLike[str] | None = None, overrides: Iterable[str] = ()
) -> Config:
    """The config of a run: defaults, then the TOML file at `path` (if any), then
    `overrides` (`"optim.lr=1e-4"`), checked as a whole (`validate`).

    Raises:
        ConfigError: a missing or malformed file, an unknown key (with a
            suggestion), a wrong type or an out-of-range value, naming the key.
    """
    from ._validate import validate

    config = Config()
    if path is not None:
        config = from_dict(read_toml(path), source=str(path))
    config = apply_overrides(config, overrides)
    validate(config)
    return config
