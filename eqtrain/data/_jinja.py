"""The sandbox a Jinja chat template runs in: transformers' chat-template
environment (its `generation` tag, `tojson`, `raise_exception`, `strftime_now`
and a `namespace` without underscore attributes) inside jinja2's immutable
sandbox, and the plain JSON values a template is given.
"""

import json
import re
from collections.abc import Mapping
from contextvars import ContextVar
from datetime import datetime
from typing import Any

import numpy as np

from ._errors import ChatTemplateError, DataError


def compile_template(source: str) -> Any:
    """`source` compiled in transformers' sandboxed chat-template environment."""
    import jinja2

    try:
        return _environment(jinja2).from_string(source)
    except jinja2.TemplateError as error:
        raise DataError(
            f"the chat template does not parse: {error}. Fix the template, or use the "
            "built-in one (data.chat_template = 'builtin'; template=None in "
            "Python)."
        ) from error


def _environment(jinja2: Any) -> Any:
    """A sandboxed environment with transformers' chat-template settings."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    extensions = [_generation_extension(jinja2), loopcontrols]
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=extensions
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    env.globals["namespace"] = _namespace_class(jinja2)
    return env


# The `(blocks, spans)` of the render in progress that records its `{% generation %}`
# blocks (None: no render is recording).
_TRACKED: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar(
    "eqtrain_generation_blocks", default=None
)


def _generation_extension(jinja2: Any) -> type:
    """transformers' `{% generation %}` tag (its AssistantTracker): the body
    renders as it is, and a render run by `render_marked` records the body's
    character span."""

    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            text = caller()
            tracked = _TRACKED.get()
            if tracked is not None:
                # as transformers: the span starts where the text streamed so far ends
                start = sum(len(block) for block in tracked[0])
                tracked[1].append((start, start + len(text)))
            return text

    return Generation


def has_generation_blocks(source: str) -> bool:
    """Whether a template marks what the model generates with `{% generation %}`."""
    return _GENERATION_TAG.search(source) is not None


_GENERATION_TAG = re.compile(r"\{%[-+]?\s*generation\s*[-+]?%\}")


def render_marked(compiled: Any, **variables: Any) -> tuple[str, list[tuple[int, int]]]:
    """`compiled`'s render of `variables` and the character spans of its
    `{% generation %}` blocks, located as transformers'
    `return_assistant_tokens_mask` locates them (the render is streamed, and a
    block starts where the text streamed before it ends)."""
    blocks: list[str] = []
    spans: list[tuple[int, int]] = []
    token = _TRACKED.set((blocks, spans))
    try:
        for block in compiled.generate(**variables):
            blocks.append(block)
    finally:
        _TRACKED.reset(token)
    return "".join(blocks), spans


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes HTML characters; chat templates want plain JSON
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
    )


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(
        f"the chat template refused this conversation: {message}",
        reason=f"rejected by the chat template ({message})",
    )


def _namespace_class(jinja2: Any) -> type:
    """jinja's `namespace`, refusing underscore-prefixed attributes (a way out of
    the sandbox), as transformers does."""

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                _check_attribute(jinja2, name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _check_attribute(jinja2, name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return Namespace


def _check_attribute(jinja2: Any, name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot set underscore-prefixed attributes on a "
            f"namespace; got {name!r}."
        )


def plain(value: Any) -> Any:
    """`value` rebuilt from plain JSON types, so a template sees no object with
    methods of its own (anything else becomes a placeholder such as `<ndarray>`)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, np.generic):
        return plain(value.item())
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    # subclasses (e.g. str enums) can carry methods: strip them to the base type
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"
