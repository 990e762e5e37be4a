"""A model's chat templates written as files in transformers 5's layout: the
default as `chat_template.jinja`, each other named one as
`additional_chat_templates/<name>.jinja`, which `transformers` and
`read_chat_templates` (`_chat`) both read back by name, whichever layout the
templates were read from (a list in `tokenizer_config.json` included)."""

import os
from collections.abc import Mapping

from ._chat import TEMPLATE_DIR, TEMPLATE_FILE, named_templates
from ._errors import DataError, PathLike


def copy_chat_templates(source: PathLike, directory: PathLike) -> dict[str, str]:
    """Write the chat templates of the tokenizer directory `source` (read as
    transformers reads them: its `.jinja` files, else `tokenizer_config.json`'s)
    into `directory` with `write_chat_templates`, and return them by name (`{}`:
    it has none, and nothing is written).

    Raises:
        DataError: `source`'s `tokenizer_config.json` does not parse, or a
            template's name cannot be a file name (nothing is written then).
    """
    templates, where = named_templates(source)
    write_chat_templates(directory, templates or {}, where=where)
    return templates or {}


def write_chat_templates(
    directory: PathLike,
    templates: str | Mapping[str, str],
    *,
    where: str | None = None,
) -> list[str]:
    """Write `templates` (by name; a string is the default alone) into
    `directory` as transformers 5's `save_pretrained` writes them, and return
    the paths written. `directory` is one being made, renamed into place once
    complete (an import, an export, a run's `init_from/` record), so no file
    anyone reads is overwritten; `where` names the templates' origin in errors.

    Raises:
        DataError: a name is empty, or holds a path separator (or NUL), so
            that its file could land outside `additional_chat_templates/`
            (`<name>.jinja`: the suffix keeps `..` a file name). Every name is
            checked before anything is written.
    """
    named = {"default": templates} if isinstance(templates, str) else dict(templates)
    paths = {name: _path(os.fspath(directory), name, where) for name in named}
    for name, path in paths.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(named[name])
    return list(paths.values())


def _path(directory: str, name: str, where: str | None) -> str:
    """Where the template `name` goes in `directory`; an unsafe name refused."""
    if not isinstance(name, str) or not name or _unsafe(name):
        origin = f" (in {where})" if where else ""
        raise DataError(
            f"the chat template named {name!r}{origin} cannot be written as a file: "
            f"it would be {TEMPLATE_DIR}/{name}.jinja, and a name must not be empty "
            "or hold a path separator. Rename the template."
        )
    if name == "default":
        return os.path.join(directory, TEMPLATE_FILE)
    return os.path.join(directory, TEMPLATE_DIR, f"{name}.jinja")


def _unsafe(name: str) -> bool:
    separators = {"/", "\\", os.sep, os.altsep or "/"}
    return "\0" in name or any(s in name for s in separators)
