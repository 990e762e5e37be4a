"""The JSON files of a Hugging Face directory: one reader of a directory's JSON
object (config.json, adapter_config.json) with the errors both give, and the
writer `save_pretrained`'s layout uses."""

import json
import os
from typing import Any

from ._errors import HFFileNotFoundError, HFFormatError


def read_object(
    directory: str, name: str, *, kind: str, missing: str
) -> dict[str, Any]:
    """The JSON object in `directory/name`.

    Args:
        directory: the directory to read from.
        name: the file's name in it.
        kind: what `directory` should be, for the message when it is no directory
            (`"a PEFT adapter directory (...)"`).
        missing: what the file's absence means, after `"<dir> has no <name>, "`.

    Raises:
        HFFileNotFoundError: `directory` is not a directory or has no `name`.
        HFFormatError: the file is not valid JSON, or holds no JSON object.
    """
    if not os.path.isdir(directory):
        raise HFFileNotFoundError(f"{directory} is not a directory; pass {kind}.")
    file = os.path.join(directory, name)
    if not os.path.isfile(file):
        raise HFFileNotFoundError(f"{directory} has no {name}, {missing}")
    try:
        with open(file, encoding="utf-8") as f:
            content = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise HFFormatError(f"{file} is not valid JSON: {error}.") from None
    if not isinstance(content, dict):
        raise HFFormatError(f"{file} must hold a JSON object.")
    return content


def write_json(path: str, content: Any) -> None:
    """`content` as indented JSON with a final newline, as `save_pretrained` writes."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(content, f, indent=2, sort_keys=False)
        f.write("\n")
