"""Reading a `Config`: defaults, then a TOML file, then `--set a.b=value`
overrides, each value converted and checked (`_values`), unknown keys named with
a suggestion, and the whole checked across fields (`_validate`)."""

import dataclasses
import os
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from .._names import did_you_mean
from ._config import SECTIONS, Config, explicit
from ._fields import Field, schema
from ._validate import validate
from ._values import convert, from_string


def load(
    path: str | os.PathLike[str] | None = None, overrides: Iterable[str] = ()
) -> Config:
    """The config of a run: defaults, then the TOML file at `path` (if any), then
    `overrides` (`"optim.lr=1e-4"`), checked as a whole (`validate`).

    Raises:
        ConfigError: a missing or malformed file, an unknown key (with a
            suggestion), a wrong type or an out-of-range value, naming the key.
    """
    config = Config()
    if path is not None:
        config = from_dict(read_toml(path), source=str(path))
    config = apply_overrides(config, overrides)
    validate(config)
    return config


def from_dict(data: Mapping[str, Any], *, source: str = "the config") -> Config:
    """A `Config` from nested dicts (a parsed TOML file): unknown sections and
    keys are errors with a suggestion; values are converted and checked."""
    fields = schema()
    values: dict[str, Any] = {}
    for key, value in _flatten(data, source):
        values[key] = convert(value, _field(key, fields, source), source)
    return build(values)


def apply_overrides(config: Config, overrides: Iterable[str]) -> Config:
    """`config` with `--set key=value` overrides applied (typed by the schema)."""
    fields = schema()
    values = {}
    for text in overrides:
        key, raw = parse_override(text)
        field = _field(key, fields, "--set")
        values[key] = convert(_override_value(raw, field), field, "--set")
    return build(values, config)


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


# -- files ------------------------------------------------------------------------
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


def _flatten(data: Mapping[str, Any], source: str) -> list[tuple[str, Any]]:
    """A file's `{section: {key: value}}` as `(dotted key, value)` pairs."""
    out = []
    for key, value in data.items():
        out += _section_items(key, value, source) if key in SECTIONS else [(key, value)]
    return out


# The keys whose value may be a table of their own (`[data.chat_template_kwargs]`).
_TABLE_KEYS = {("data", "sources"), ("data", "chat_template_kwargs")}


def _section_items(key: str, value: Any, source: str) -> list[tuple[str, Any]]:
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"`{key}` in {source} must be a table (a `[{key}]` section); got {value!r}."
        )
    for sub, v in value.items():
        if isinstance(v, Mapping) and (key, sub) not in _TABLE_KEYS:
            raise ConfigError(
                f"`{key}.{sub}` in {source} is a table, but [{key}] has no "
                "sub-sections; write its keys directly under it."
            )
    return [(f"{key}.{sub}", v) for sub, v in value.items()]


# -- `--set` ----------------------------------------------------------------------
def parse_override(text: str) -> tuple[str, str]:
    """`"a.b=value"` -> `("a.b", "value")`."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(
            f"--set takes `key=value` (e.g. `--set optim.lr=1e-4`); got {text!r}."
        )
    return key, value


def _override_value(raw: str, field: Field) -> Any:
    """A `--set` string read by its key's type (still to be converted)."""
    try:
        return from_string(raw, field)
    except ValueError as e:
        raise ConfigError(
            f"`{field.key}` in --set: {e}; got {raw!r}. It is a {field.type_name}: "
            f"{field.help}"
        ) from None


# -- unknown keys -----------------------------------------------------------------
def _field(key: str, fields: Mapping[str, Field], source: str) -> Field:
    """The `Field` of `key`; an unknown key is an error with a suggestion."""
    if key in fields:
        return fields[key]
    section = key.split(".", 1)[0] if "." in key else None
    if section is None:
        raise ConfigError(_unknown_top_key(key, fields, source))
    if section not in SECTIONS:
        raise ConfigError(
            f"unknown section `[{section}]` in {source}; the sections are "
            f"{', '.join(SECTIONS)}." + did_you_mean(section, SECTIONS, code=True)
        )
    raise ConfigError(_unknown_section_key(section, key, fields, source))


def _unknown_top_key(key: str, fields: Mapping[str, Field], source: str) -> str:
    known = [k for k in fields if "." not in k] + list(SECTIONS)
    hint = did_you_mean(key, known, code=True)
    nested = [k for k in fields if k.split(".")[-1] == key]
    if nested:
        hint = f" Did you mean `{nested[0]}`?"
    return (
        f"unknown key `{key}` in {source}; top-level keys are "
        f"{', '.join(known)}." + hint
    )


def _unknown_section_key(
    section: str, key: str, fields: Mapping[str, Field], source: str
) -> str:
    keys = [k.split(".", 1)[1] for k in fields if k.startswith(section + ".")]
    name = key.split(".", 1)[1]
    hint = did_you_mean(name, keys, code=True) or _other_section(key, name, fields)
    return (
        f"unknown key `{name}` in [{section}] of {source}; its keys are "
        f"{', '.join(keys)}." + hint
    )


def _other_section(key: str, name: str, fields: Mapping[str, Field]) -> str:
    """The hint for a key that may belong to another section."""
    other = [k for k in fields if k.split(".")[-1] == name]
    if other:
        return f" Did you mean `{other[0]}`?"
    return did_you_mean(key, list(fields), code=True) or did_you_mean(
        name, [k for k in fields if k.endswith("." + name)], code=True
    )
