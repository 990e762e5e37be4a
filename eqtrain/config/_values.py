"""One config value read and checked for its `Field`: a TOML value or a `--set`
string becomes the key's type (`1e-4`, `10_000`, `"2h30m"`, `"5GB"`, a list of
names, `data.sources`), then its choices and bounds are checked."""

import json
import math
import operator
import tomllib
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import ConfigError
from .._names import did_you_mean
from ._fields import Field
from ._sources import format_sources, parse_sources
from ._units import parse_duration, parse_size


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")
_NONE = ("none", "null", "")
_AUTO_KINDS = ("auto_int", "auto_bool")


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


# -- `--set` strings ------------------------------------------------------------
def from_string(text: str, field: Field) -> Any:
    """A `--set` value: a string read by the field's type."""
    stripped = text.strip()
    if _is_quoted(stripped):
        return stripped[1:-1]  # a quoted string stays a string
    if field.optional and stripped.lower() in _NONE:
        return None
    if field.kind == "names" and stripped.startswith("["):
        return _toml_list(stripped)  # as a file writes it: ["layer_input"]
    if field.kind in _AUTO_KINDS and stripped.lower() == "auto":
        return "auto"
    if field.type is bool:
        return _bool_text(stripped)
    if field.type in (int, float) and field.kind != "duration":
        return _number_text(stripped, field.type)
    return stripped


def _is_quoted(text: str) -> bool:
    return len(text) > 1 and text[:1] in ('"', "'") and text[-1:] == text[:1]


def _bool_text(text: str) -> bool:
    if text.lower() in _TRUE + _FALSE:
        return text.lower() in _TRUE
    raise ValueError("expected true or false")


def _number_text(text: str, kind: type) -> int | float:
    """An integer when it reads as one, else a float (`1e4`, `3e-3`)."""
    try:
        return int(text, 10)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise ValueError(
            "expected an integer" if kind is int else "expected a number"
        ) from None


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


# -- converting to the field's type ---------------------------------------------
def _coerce(value: Any, field: Field) -> Any:
    """A TOML (or `--set`) value converted to the field's type, or ValueError."""
    if value is None or (field.optional and _unset(value, field)):
        if field.optional:
            return None
        raise ValueError("a value is required")
    read = _BY_KIND.get(field.kind or "")
    if field.kind in _AUTO_KINDS and not isinstance(value, str):
        read = None  # a number or a boolean: read by the type
    return (read or _BY_TYPE.get(field.type, _string))(value)


def _unset(value: Any, field: Field) -> bool:
    """Whether a TOML value means None (TOML has no null): `""`, or for
    non-string keys also `"none"` or `"null"`, as `to_toml` writes them."""
    if field.type is str:
        return value == ""
    return isinstance(value, str) and value.strip().lower() in _NONE


def _auto(expected: str) -> Callable[[str], str]:
    """The reader of the string of an `auto_int` / `auto_bool` key: `auto`."""

    def read(value: str) -> str:
        if value.strip().lower() != "auto":
            raise ValueError(expected)
        return "auto"

    return read


def _names(value: Any) -> str:
    """A list of names, or a comma-separated string, as a canonical string."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(
        isinstance(n, str) for n in items
    ):
        raise ValueError("expected a list of names or a comma-separated string")
    return ",".join(n.strip() for n in items if n.strip())


def _sources(value: Any) -> str:
    return format_sources(parse_sources(value))


def _table(value: Any) -> str:
    """A table of template variables (`data.chat_template_kwargs`), or a JSON
    object string of one, as its canonical JSON string (`""`: none)."""
    from ..data import check_template_kwargs

    _check_json(value)
    try:  # its errors name the key and what is wrong
        table = check_template_kwargs(value, field="data.chat_template_kwargs")
        return json.dumps(table, sort_keys=True, allow_nan=False) if table else ""
    except ValueError as e:  # a ChatTemplateError, or NaN
        raise ValueError(str(e).rstrip(".")) from None


def _check_json(value: Any) -> None:
    """`value` holds only what JSON holds (TOML's dates and times do not)."""
    if isinstance(value, Mapping):
        for v in value.values():
            _check_json(v)
    elif isinstance(value, list):
        for v in value:
            _check_json(v)
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise ValueError(
            f"expected strings, numbers, booleans, arrays and tables; got "
            f"{value!r} (a TOML {type(value).__name__}: write it as a string)"
        )


def _size(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError("expected bytes or a size like '5GB'")
    value = str(value)  # the field is a string; `1000` (bytes) reads as "1000"
    try:
        parse_size(value)
    except ConfigError as e:
        raise ValueError("expected bytes or a size like '5GB' or '500MB'") from e
    return value


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("expected true or false")
    return value


def _int(value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("expected an integer")
    return value


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("expected a number")
    return float(value)


def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("expected a string")
    return value


_BY_KIND: dict[str, Callable[[Any], Any]] = {
    "duration": parse_duration,
    "auto_int": _auto("expected an integer or 'auto'"),
    "auto_bool": _auto("expected true, false or 'auto'"),
    "sources": _sources,
    "table": _table,
    "names": _names,
    "size": _size,
}
_BY_TYPE: dict[type, Callable[[Any], Any]] = {bool: _bool, int: _int, float: _float}


# -- checks ---------------------------------------------------------------------
# Each bound of a `Field`: its sign in messages and the comparison that breaks it.
_BOUNDS = (
    ("min", ">=", operator.lt),
    ("max", "<=", operator.gt),
    ("above", ">", operator.le),
    ("below", "<", operator.ge),
)


def _check(value: Any, field: Field) -> None:
    if value is None:
        return
    if field.choices is not None and value not in field.choices:
        allowed = ", ".join(repr(c) for c in field.choices)
        raise ConfigError(
            f"`{field.key}` must be one of {allowed}; got {value!r}."
            + did_you_mean(str(value), [str(c) for c in field.choices], code=True)
        )
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_number(value, field)


def _check_number(value: int | float, field: Field) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(
            f"`{field.key}` must be a finite number; got {value!r}. {field.help}"
        )
    for name, sign, breaks in _BOUNDS:
        bound = getattr(field, name)
        if bound is not None and breaks(value, bound):
            raise ConfigError(f"`{field.key}` must be {sign} {bound}; got {value!r}.")
