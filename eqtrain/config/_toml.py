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

from ._parse import schema
from ._schema import SECTIONS, Config


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
    from ._validate import ARCH_KEYS

    fields = schema()
    data = to_dict(config)
    lines: list[str] = []
    # With init_from, the architecture comes from its config.json: a resolved
    # config states it as comments, so the file reads back (and validates).
    derived = {f"model.{k}" for k in ARCH_KEYS} if config.model.init_from else set()

    def emit(key: str, name: str, value: Any) -> None:
        if comments:
            help_text = fields[key].help
            if fields[key].choices:
                help_text += " One of: " + ", ".join(map(str, fields[key].choices))
            wrapped = textwrap.wrap(help_text, 86)
            lines.extend("# " + line for line in wrapped)
        if key in derived:
            shown = "(unset)" if value is None else toml_value(value)
            lines.append(f"# {name} = {shown}  (from model.init_from)")
        elif value is None and fields[key].default is None:
            lines.append(f"# {name} =  (unset)")
        elif value is None:  # TOML has no null; these read back as None
            unset = '""' if fields[key].type is str else '"none"'
            lines.append(f"{name} = {unset}")
        else:
            lines.append(f"{name} = {toml_value(value)}")

    for name, value in data.items():
        if name not in SECTIONS:
            emit(name, name, value)
    for section in SECTIONS:
        lines.append("")
        lines.append(f"[{section}]")
        for name, value in data[section].items():
            emit(f"{section}.{name}", name, value)
    return "\n".join(lines) + "\n"
