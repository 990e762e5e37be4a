"""Writing a `Config` as TOML (the resolved config of a run) and as plain dicts
(for JSON manifests). Unset (`None`) values are written as comments, since TOML
has no null; where the default is not None, `""` (strings) or `"none"` stands for
unset. Reading the file back gives the same config, except that the architecture
of a `model.init_from` config is written as comments (it comes from there)."""

import dataclasses
import json
import math
import textwrap
from typing import Any

from ._config import SECTIONS, Config
from ._fields import Field, schema
from ._validate import ARCH_KEYS


def to_dict(config: Config) -> dict[str, Any]:
    """`{"run_dir": ..., "seed": ..., "model": {...}, ...}` with `None` for unset."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if f.name.startswith("_"):  # `_explicit`: how it was written, not a key
            continue
        value = getattr(config, f.name)
        out[f.name] = dataclasses.asdict(value) if f.name in SECTIONS else value
    return out


def toml_value(value: Any) -> str:
    """One value as TOML writes it (`true`, `1e-05`, `"text"`)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    # A JSON string is a TOML basic string, except that TOML also forbids a raw DEL.
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def to_toml(config: Config, *, comments: bool = True) -> str:
    """The config as a TOML document; with `comments`, each key's help text is
    written above it."""
    fields = schema()
    data = to_dict(config)
    # With init_from, the architecture comes from its config.json: a resolved
    # config states it as comments, so the file reads back (and validates).
    derived = {f"model.{k}" for k in ARCH_KEYS} if config.model.init_from else set()
    lines: list[str] = []
    for name, value in data.items():
        if name not in SECTIONS:
            lines += _entry(fields[name], name, value, comments, name in derived)
    for section in SECTIONS:
        lines += ["", f"[{section}]"]
        for name, value in data[section].items():
            field = fields[f"{section}.{name}"]
            lines += _entry(field, name, value, comments, field.key in derived)
    return "\n".join(lines) + "\n"


def _entry(
    field: Field, name: str, value: Any, comments: bool, derived: bool
) -> list[str]:
    """The lines of one key: its help (with `comments`) and its value."""
    return (_comment(field) if comments else []) + [
        _value_line(field, name, value, derived)
    ]


def _comment(field: Field) -> list[str]:
    """A key's help text (and its choices) as `# ` lines."""
    help_text = field.help
    if field.choices:
        help_text += " One of: " + ", ".join(map(str, field.choices))
    return ["# " + line for line in textwrap.wrap(help_text, 86)]


def _value_line(field: Field, name: str, value: Any, derived: bool) -> str:
    if derived:
        shown = "(unset)" if value is None else toml_value(value)
        return f"# {name} = {shown}  (from model.init_from)"
    if value is None and field.default is None:
        return f"# {name} =  (unset)"
    if value is None:  # TOML has no null; these read back as None
        unset = '""' if field.type is str else '"none"'
        return f"{name} = {unset}"
    return f"{name} = {toml_value(value)}"
