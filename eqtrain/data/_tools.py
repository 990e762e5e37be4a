"""A record's `tools`: the function definitions (JSON-schema objects) of a
function-calling conversation, read as `transformers`' `apply_chat_template(...,
tools=tools)` gives them to a chat template, and as TRL reads a dataset's `tools`
column (a JSON string parsed, no tools as None).
"""

import json
from collections.abc import Mapping
from typing import Any

from ._errors import ChatTemplateError, DataError
from ._jinja import plain


# A list of function definitions (mappings), a JSON string of one, or None;
# annotated loosely so that a malformed one reaches `check_tools` (and its clear
# error) rather than a type checker.
Tools = Any


def check_tools(tools: Tools) -> list[dict[str, Any]] | None:
    """A record's `tools` as `transformers`' `apply_chat_template(...,
    tools=tools)` gives them to a chat template: a list of function definitions
    (JSON-schema mappings, e.g. `{"type": "function", "function": {"name", ...}}`),
    rebuilt from plain JSON values. A JSON string of such a list (as Hugging Face
    datasets often store the column) is parsed first, as TRL parses it. None,
    an empty list and a blank string are no tools (None: TRL passes
    `tools or None`, since some templates write tool boilerplate for `[]`).

    Raises:
        ChatTemplateError: `tools` is a string that is not JSON, or is neither a
            list of mappings nor a JSON string of one (the error says which).
    """
    value = tools
    if isinstance(tools, str):
        if not tools.strip():
            return None
        try:
            value = json.loads(tools)
        except ValueError as error:
            raise ChatTemplateError(
                f"the record's 'tools' is a string that is not valid JSON ({error}). "
                f"{_TOOLS_EXPECTED}",
                reason="with a 'tools' string that is not valid JSON",
            ) from None
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return None
    if isinstance(value, (list, tuple)):
        bad = [i for i, tool in enumerate(value) if not isinstance(tool, Mapping)]
        if not bad:
            return [plain(tool) for tool in value]
        got = f"a list whose item {bad[0]} is {_kind_of(value[bad[0]])}"
    else:
        got = _kind_of(value)
    source = "a JSON string of " if isinstance(tools, str) else ""
    raise ChatTemplateError(
        f"the record's 'tools' is {source}{got}. {_TOOLS_EXPECTED}",
        reason="with a 'tools' field that is not a list of function definitions",
    )


_TOOLS_EXPECTED = (
    "'tools' must be a list of function definitions (JSON-schema objects such as "
    '{"type": "function", "function": {"name": ..., "parameters": ...}}, as '
    "transformers' apply_chat_template(..., tools=...) takes them), a JSON string "
    "of such a list, or null."
)


def _kind_of(value: Any) -> str:
    """`value`'s kind in JSON words, for an error."""
    if isinstance(value, Mapping):
        return "an object (one mapping, not a list of them)"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if value is None:
        return "null"
    return f"a {type(value).__name__}"


def refuse_tools(tools: Tools) -> None:
    """Refuse a record with tools under the built-in template, which cannot write
    them (None, empty or blank tools pass).

    Raises:
        ChatTemplateError: `tools` is malformed (`check_tools`).
        DataError: there are tools (not a per-record skip: every record with
            tools would be trained without them).
    """
    checked = check_tools(tools)
    if checked is None:
        return
    raise DataError(
        f"a record has 'tools' ({len(checked)} function definition(s)), but "
        "eqtrain's built-in chat template cannot render tools: it writes only "
        "each message's role and content, so the model would learn the tool calls "
        "without ever seeing the tools they call. Use the model's own Jinja chat "
        "template, one that renders `tools` (data.chat_template = 'auto' with a "
        "tokenizer directory that has chat_template.jinja or a chat_template in "
        "tokenizer_config.json, or the path of a .jinja file; in Python "
        "`template=chat_template(path)`), or remove the 'tools' field from the "
        "records."
    )
