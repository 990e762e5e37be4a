"""Chat template keyword arguments: extra variables a Jinja chat template is
given (`{"enable_thinking": false}` for Qwen3), as `transformers`'
`apply_chat_template(messages, **kwargs)` passes them and as TRL reads a record's
`chat_template_kwargs` field or a trainer's `chat_template_kwargs`.
"""

import json
from collections.abc import Mapping
from typing import Any

from ._errors import ChatTemplateError
from ._jinja import plain
from ._tools import _kind_of


# The variables every render is given: a keyword of the same name would replace
# them (transformers fails on these with a TypeError: a repeated keyword).
RESERVED = ("messages", "tools", "documents", "add_generation_prompt")
FIELD = "chat_template_kwargs"


def check_template_kwargs(value: Any, *, field: str = FIELD) -> dict[str, Any]:
    """`value` as the variables it gives a chat template: a mapping of names to
    JSON values, rebuilt from plain JSON types; a JSON string of one is parsed
    first (as TRL reads `chat_template_kwargs` given as a string). None, `{}` and
    a blank string give none (`{}`).

    Raises:
        ChatTemplateError: `value` is not a mapping (nor a JSON string of one), or
            one of its names is `messages`, `tools`, `documents` or
            `add_generation_prompt`, which every render sets itself; the error
            names `field` (and the name).
    """
    mapping = value
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            mapping = json.loads(value)
        except ValueError as error:
            raise ChatTemplateError(
                f"{field!r} is a string that is not valid JSON ({error}). "
                f"{_expected(field)}",
                reason=f"with a {field!r} string that is not valid JSON",
            ) from None
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping):
        source = "a JSON string of " if isinstance(value, str) else ""
        raise ChatTemplateError(
            f"{field!r} is {source}{_kind_of(mapping)}. {_expected(field)}",
            reason=f"with a {field!r} field that is not a mapping",
        )
    for name in mapping:
        if not isinstance(name, str):
            raise ChatTemplateError(
                f"{field!r} has the key {name!r}, which is not a string. "
                f"{_expected(field)}",
                reason=f"with a {field!r} key that is not a string",
            )
        if name in RESERVED:
            raise ChatTemplateError(
                f"{field!r} sets {name!r}, which the chat template is always given "
                f"({', '.join(RESERVED)}: the conversation, the record's tools and "
                "the generation prompt are given by eqtrain, and transformers' "
                "apply_chat_template refuses them as keyword arguments). Remove "
                f"{name!r} from {field!r}.",
                reason=f"with {name!r} in its {field!r}",
            )
    return {name: plain(v) for name, v in mapping.items()}


def _expected(field: str) -> str:
    return (
        f"{field!r} must be a mapping of names to values given to the chat template "
        'as variables (e.g. {"enable_thinking": false}), a JSON string of one, or '
        "null."
    )
