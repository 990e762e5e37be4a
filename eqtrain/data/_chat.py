"""Chat templates: conversations -> token ids and the mask of the tokens to learn,
with a model's own Jinja template (rendered as `transformers` renders it) or the
built-in one of `encode_chat`.

    template = chat_template(tokenizer.directory)   # its Jinja template, or built-in
    ids, mask = template.encode(messages, tokenizer)
    ids, mask = template.encode(messages, tokenizer, tools=tools)   # a record's tools

A record's `tools` (function definitions, or a JSON string of them) reach the
template as `transformers`' `apply_chat_template(messages, tools=tools)` gives
them; the built-in template cannot write them and refuses a record that has some.
A model with several named templates (a `default` and a `tool_use` one) renders a
record with tools with its `tool_use` template, as transformers picks it. A
record's `chat_template_kwargs` (and a template's own `kwargs`, e.g.
`data.chat_template_kwargs`) reach a Jinja template as extra variables, as
`apply_chat_template(messages, **kwargs)` gives them; the built-in template reads
no variables and ignores them.
"""

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
from jaxtyping import Float, Int

from ._errors import ChatTemplateError, DataError, PathLike, check_exists
from ._jinja import compile_template, has_generation_blocks, plain, render_marked
from ._template_kwargs import check_template_kwargs
from ._text import ROLES, encode_chat
from ._tokenizers import Tokenizer, read_config, token_content
from ._tools import Tools, check_tools, refuse_tools
from ._turns import Render, Turn, located_turns, prompt_end


Ids = Int[np.ndarray, " n"]
Mask = Float[np.ndarray, " n"]
PromptIds = Int[np.ndarray, " prompt"]
CompletionIds = Int[np.ndarray, " completion"]
CompletionMask = Float[np.ndarray, " completion"]
# Lists of {role, content} mappings; annotated loosely so that a malformed one
# reaches `check_messages` (and its clear error) rather than a type checker.
Messages = Sequence[Any]
# A record's `chat_template_kwargs`: a mapping, a JSON string of one, or None;
# loose for the same reason (`check_template_kwargs` says what is wrong).
TemplateKwargs = Any

# Roles a message may have under a Jinja template; the template itself may accept
# fewer (and say so with `raise_exception`).
JINJA_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
# The special tokens transformers passes to templates (`special_tokens_map`).
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
TEMPLATE_FILE = "chat_template.jinja"
# transformers 5's folder of named templates beside `TEMPLATE_FILE` (the default):
# `additional_chat_templates/<name>.jinja`.
TEMPLATE_DIR = "additional_chat_templates"
# The named template transformers renders a conversation with tools with.
TOOL_USE = "tool_use"
# The version of the rule that turns a record into its render and mask (3: the
# record's `tools` reach the template; 4: its `chat_template_kwargs` too): part of
# the key of every cached or stored chat row (`template_identity`), so a change of
# rule re-makes them.
MASK_RULE = 4


@runtime_checkable
class ChatTemplate(Protocol):
    """Conversations -> `(ids, mask)`: int32 ids and a float32 mask that is 1 on
    the tokens to learn (assistant answers and their end-of-turn text).

    `tools` is a record's `tools` field (see `check_tools`) and
    `chat_template_kwargs` its `chat_template_kwargs` field (see
    `check_template_kwargs`); the pipelines pass each only to a record that has
    one, so a template of your own that takes neither keeps working on records
    without them."""

    def encode(
        self,
        messages: Messages,
        tokenizer: Tokenizer,
        *,
        tools: Tools = None,
        chat_template_kwargs: TemplateKwargs = None,
    ) -> tuple[Ids, Mask]:
        """One conversation; the mask covers every assistant turn."""
        ...

    def encode_prompt_completion(
        self,
        prompt: Messages,
        completion: Messages,
        tokenizer: Tokenizer,
        *,
        tools: Tools = None,
        chat_template_kwargs: TemplateKwargs = None,
    ) -> tuple[PromptIds, CompletionIds, CompletionMask]:
        """`(prompt_ids, completion_ids, completion_mask)`: `prompt_ids` ends where
        the assistant's answer starts, and `prompt_ids + completion_ids` is the
        conversation `prompt + completion`; the mask covers the completion's
        assistant turns."""
        ...


class BuiltinChatTemplate:
    """The template of `encode_chat` (`<|role|>` headers, EOS after answers), for
    tokenizers without a chat template of their own. It has no way to write tool
    definitions: a record with tools is refused (`refuse_tools`). It reads no
    template variables, so `chat_template_kwargs` changes nothing (as a Jinja
    template that does not read a variable ignores it); a malformed one is still
    refused (`check_template_kwargs`)."""

    def encode(
        self,
        messages: Messages,
        tokenizer: Tokenizer,
        *,
        tools: Tools = None,
        chat_template_kwargs: TemplateKwargs = None,
    ) -> tuple[Ids, Mask]:
        messages = check_messages(messages, ROLES)
        refuse_tools(tools)
        check_template_kwargs(chat_template_kwargs)
        return encode_chat(messages, tokenizer)

    def encode_prompt_completion(
        self,
        prompt: Messages,
        completion: Messages,
        tokenizer: Tokenizer,
        *,
        tools: Tools = None,
        chat_template_kwargs: TemplateKwargs = None,
    ) -> tuple[PromptIds, CompletionIds, CompletionMask]:
        refuse_tools(tools)
        check_template_kwargs(chat_template_kwargs)
        if not completion:
            raise ChatTemplateError(
                "the completion has no messages.", reason="with an empty completion"
            )
        prompt_ids, _ = self.encode(prompt, tokenizer)
        ids, mask = self.encode([*prompt, *completion], tokenizer)
        # encode_chat concatenates per-message pieces, so the prompt is a prefix
        cut = len(prompt_ids)
        return prompt_ids, ids[cut:], mask[cut:]

    def __repr__(self) -> str:
        return "BuiltinChatTemplate()"


class _Compiled:
    """One Jinja source, compiled, and whether it marks the text to learn with
    `{% generation %}` blocks."""

    def __init__(self, source: str):
        self.template = compile_template(source)
        self.marked = has_generation_blocks(source)


class JinjaChatTemplate:
    """A model's Jinja chat template, rendered as `transformers`'
    `apply_chat_template` renders it, and tokenized without added special tokens.

    `source` is the default template. `tool_use` is the model's template named
    `"tool_use"`, where it has one (Hermes, Command-R): as transformers'
    `get_chat_template` picks it, a record with tools (`check_tools` not None: a
    non-empty list) is rendered with it, every partial render that locates the
    record's turns and the prompt's end included; a record without tools is
    rendered with `source`, as if there were no `tool_use` template. `others`
    are the model's further named templates (e.g. `"rag"`): never rendered here,
    only carried, so that `templates` (every one by name) is what an export of a
    model trained with this template writes.

    The template runs in jinja2's immutable sandbox (templates are data, never
    code), with transformers' environment: `trim_blocks`, `lstrip_blocks`, the
    `loopcontrols` extension, a `tojson` filter that does not escape HTML, the
    globals `raise_exception` (raises `DataError` with the template's message) and
    `strftime_now`, and the variables `messages`, `add_generation_prompt`, the
    special tokens (`bos_token`, `eos_token`, ...), `tools` (the record's, as
    `check_tools` reads them: a list of function definitions, or None),
    `documents` (always None), and extra variables: the template's `kwargs`
    (e.g. `data.chat_template_kwargs`) and a record's `chat_template_kwargs`
    over them (`check_template_kwargs`), which replace a special token of the
    same name, as `apply_chat_template(messages, **kwargs)` gives them. A
    `{% generation %}` block renders its body. Every render made to locate a
    record's turns and the prompt's end is given the record's tools and
    variables too.

    The mask: a template with `{% generation %}` blocks (each of `source` and
    `tool_use` on its own; `marked` is `source`'s) marks the text to learn
    itself, and the mask is transformers' `return_assistant_tokens_mask`, token
    for token. Any other template is masked from its render of the whole
    conversation (`eqtrain.data._turns`): each assistant turn runs from the end
    of the generation prompt to the end of the text the template writes after
    the answer before the next message (`answer<|im_end|>\\n`, `answer<|eot_id|>`,
    `answer<|end|>\\n`, and Phi-3's EOS after the last turn). So templates that
    write a turn differently once the conversation goes on are masked too: what
    the template writes for an assistant turn is learned (Qwen3's empty `<think>`
    block on the last answer), what it drops is not (Qwen3's and DeepSeek-R1's
    earlier reasoning). A chat is refused (`ChatTemplateError`, whose `reason`
    names the template behaviour) only when an answer cannot be found in the
    render. A token is learned when its character span overlaps a turn
    (transformers' rule): a token straddling a boundary, e.g. `" Hi"` after a
    template's `"Assistant:"`, carries answer text and is learned.

    `encode_prompt_completion` tokenizes the prompt's render (with the generation
    prompt) and the rest of the conversation's render separately, as TRL does, so
    the two completions of a preference pair share the prompt's ids exactly; where
    special tokens separate the turns this equals tokenizing the whole render.
    Message roles must be among `JINJA_ROLES` (the template may accept fewer); an
    assistant message may carry `tool_calls` without `content`.

    Needs a tokenizer with `encode_with_offsets` (`HFTokenizer`, `ByteTokenizer`).
    """

    def __init__(
        self,
        source: str,
        special_tokens: Mapping[str, str] | None = None,
        *,
        tool_use: str | None = None,
        others: Mapping[str, str] | None = None,
        kwargs: TemplateKwargs = None,
    ):
        self.source = source
        self.tool_use = tool_use
        self.others = dict(others or {})
        self.special_tokens = dict(special_tokens or {})
        self.kwargs = check_template_kwargs(kwargs, field="kwargs")
        self._default = _Compiled(source)
        self._tool_use = None if tool_use is None else _Compiled(tool_use)
        self.marked = self._default.marked

    @property
    def templates(self) -> dict[str, str]:
        """Every template by name, as `read_chat_templates` gives them:
        `"default"` (`source`), `"tool_use"` where there is one, and `others`."""
        named = {**self.others, "default": self.source}
        if self.tool_use is not None:
            named[TOOL_USE] = self.tool_use
        return named

    def with_kwargs(self, kwargs: TemplateKwargs) -> "JinjaChatTemplate":
        """This template with `kwargs` given to every render (over its own
        `kwargs`; a record's `chat_template_kwargs` still win), as a trainer's
        `chat_template_kwargs` are (`data.chat_template_kwargs`).

        Raises:
            ChatTemplateError: `kwargs` is malformed (`check_template_kwargs`).
        """
        return JinjaChatTemplate(
            self.source,
            self.special_tokens,
            tool_use=self.tool_use,
            others=self.others,
            kwargs={**self.kwargs, **check_template_kwargs(kwargs, field="kwargs")},
        )

    def _extra(self, chat_template_kwargs: TemplateKwargs) -> dict[str, Any]:
        """The variables a record's renders are given besides the conversation:
        the template's `kwargs`, and the record's own over them."""
        return {**self.kwargs, **check_template_kwargs(chat_template_kwargs)}

    def _for(self, tools: list[dict[str, Any]] | None) -> _Compiled:
        """The template a record with these (checked) `tools` is rendered with:
        transformers' choice, `tool_use` when there are tools and one exists."""
        if tools is not None and self._tool_use is not None:
            return self._tool_use
        return self._default

    def _variables(
        self,
        messages: Messages,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """What the template is given, as transformers gives it (`tools` checked
        by `check_tools`; `extra` by `check_template_kwargs`, over the special
        tokens)."""
        return dict(
            self.special_tokens,
            **(extra or {}),
            messages=plain(list(messages)),
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=None,
        )

    def render(
        self,
        messages: Messages,
        *,
        add_generation_prompt: bool = False,
        tools: Tools = None,
        chat_template_kwargs: TemplateKwargs = None,
    ) -> str:
        """The template's text for `messages` (as `apply_chat_template(...,
        tools=tools, tokenize=False, **kwargs)`, `kwargs` being the template's
        `kwargs` with `chat_template_kwargs` over them).

        Raises:
            ChatTemplateError: the template raised (e.g. `raise_exception` on a
                bad role order), or failed on these messages, or `tools` or
                `chat_template_kwargs` is malformed.
        """
        tools = check_tools(tools)
        extra = self._extra(chat_template_kwargs)
        return self._text(messages, add_generation_prompt, tools, extra)

    def _text(
        self,
        messages: Messages,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        extra: Mapping[str, Any],
    ) -> str:
        try:
            return self._for(tools).template.render(
                **self._variables(messages, add_generation_prompt, tools, extra)
            )
        except ChatTemplateError:
            raise
        except Exception as error:  # jinja errors, and the template's own bugs
            message = f"{type(error).__name__}: {error}"
            raise ChatTemplateError(
                f"the chat template failed on this conversation: {message}",
                reason=f"rejected by the chat template ({message})",
            ) from error

    def encode(
        self,
        messages: Messages,
        tokenizer: Tokenizer,
        *,
        tools: Tools = None,
        chat_template_kwargs: TemplateKwargs = None,
    ) -> tuple[Ids, Mask]:
        messages = check_messages(messages, JINJA_ROLES)
        tools, extra = check_tools(tools), self._extra(chat_template_kwargs)
        text, turns = self._turns(messages, tools, extra, start=0)
        return _tokens_and_mask(text, turns, tokenizer)

    def encode_prompt_completion(
        self,
        prompt: Messages,
        completion: Messages,
        tokenizer: Tokenizer,
        *,
        tools: Tools = None,
        chat_template_kwargs: TemplateKwargs = None,
    ) -> tuple[PromptIds, CompletionIds, CompletionMask]:
        prompt = check_messages(prompt, JINJA_ROLES)
        completion = check_messages(completion, JINJA_ROLES, first=len(prompt))
        tools, extra = check_tools(tools), self._extra(chat_template_kwargs)
        if not completion:
            raise ChatTemplateError(
                "the completion has no messages.", reason="with an empty completion"
            )
        text, turns = self._turns(prompt + completion, tools, extra, start=len(prompt))
        answer = completion[0]["role"] == "assistant"
        head = prompt_end(self._renderer(tools, extra), prompt, text, answer=answer)
        if answer and turns and not self._for(tools).marked:
            # an answer can start inside the generation prompt (a `<think>` the
            # template also writes as the prompt's end): it is the completion's
            head = min(head, turns[0].begin)
        prompt_ids, _ = _tokens_and_mask(text[:head], [], tokenizer)
        shifted = [
            Turn(max(t.begin, head) - head, t.end - head, max(t.floor, head) - head)
            for t in turns
            if t.end > head
        ]
        ids, mask = _tokens_and_mask(text[head:], shifted, tokenizer)
        return prompt_ids, ids, mask

    def _turns(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        extra: Mapping[str, Any],
        *,
        start: int,
    ) -> tuple[str, list[Turn]]:
        """The conversation's render and its assistant turns from `start` on: the
        template's `{% generation %}` blocks, or else the located turns (every
        render of a part of the conversation given the same `tools`, so made by
        the same template, and the same `extra` variables)."""
        chosen = self._for(tools)
        if chosen.marked:
            variables = self._variables(messages, False, tools, extra)
            text, spans = render_marked(chosen.template, **variables)
            return text, [Turn(a, b, b) for a, b in spans]
        render = self._renderer(tools, extra)
        text = render(messages, False)
        return text, located_turns(render, messages, text, start=start)

    def _renderer(
        self, tools: list[dict[str, Any]] | None, extra: Mapping[str, Any]
    ) -> Render:
        """`(messages, add_generation_prompt) -> text`, with a record's `tools`
        and `extra` variables."""
        return lambda messages, gen: self._text(messages, gen, tools, extra)

    def __repr__(self) -> str:
        extra = "" if self.tool_use is None else f", tool_use: {len(self.tool_use)}"
        if self.kwargs:
            extra += f", kwargs: {self.kwargs}"
        return f"JinjaChatTemplate({len(self.source)} characters{extra})"


def template_identity(template: Any) -> list[Any]:
    """What chat rows depend on of `template` (None: plain text), for the keys
    of cached and stored rows: its class, `MASK_RULE`, its source and special
    tokens, its `tool_use` template where it has one, and its `kwargs` where it
    has some (each only then, so that the key of a template without one is what
    it was before there were any)."""
    key = [
        type(template).__name__,
        MASK_RULE,
        getattr(template, "source", None),
        getattr(template, "special_tokens", None),
    ]
    tool_use = getattr(template, "tool_use", None)
    if tool_use is not None:
        key.append({TOOL_USE: tool_use})
    kwargs = getattr(template, "kwargs", None)
    if kwargs:
        key.append({"kwargs": kwargs})
    return key


def chat_template(source: PathLike | None = None) -> ChatTemplate:
    """The chat template of a tokenizer directory or a `.jinja` file; the built-in
    one (`encode_chat`'s) for None or a directory without a template.

    A directory's templates are read as transformers reads them
    (`read_chat_templates`): its `"default"` one renders records without tools,
    and its `"tool_use"` one, where it has one, records with tools (see
    `JinjaChatTemplate`). A `.jinja` file is the one template, for every record.
    The special tokens (`bos_token`, ...) passed to the template come from the
    `tokenizer_config.json` (and a legacy `special_tokens_map.json`) next to it.
    A file other than a `.jinja` one (e.g. a `tokenizer.json`) stands for its
    directory.

    Raises:
        DataFileNotFoundError: `source` does not exist.
        DataError: a file there does not parse, or its templates have no default.
    """
    if source is None:
        return BuiltinChatTemplate()
    path = os.fspath(source)
    check_exists(path, "chat template")
    if os.path.isfile(path) and path.endswith(".jinja"):
        text = _read(path)
        return JinjaChatTemplate(text, read_special_tokens(os.path.dirname(path)))
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    templates = read_chat_templates(directory)
    if not templates:
        return BuiltinChatTemplate()
    return JinjaChatTemplate(
        templates["default"],
        read_special_tokens(directory),
        tool_use=templates.get(TOOL_USE),
        others={k: v for k, v in templates.items() if k not in ("default", TOOL_USE)},
    )


def read_chat_template(directory: PathLike) -> str | None:
    """The Jinja source of `directory`'s default chat template (the one records
    without tools are rendered with), or None if it has none (see
    `read_chat_templates` for where it is looked for).

    Raises:
        DataError: `tokenizer_config.json` does not parse, or the directory's
            templates have none named `"default"`.
    """
    return read_chat_templates(directory).get("default")


def read_chat_templates(directory: PathLike) -> dict[str, str]:
    """`directory`'s chat templates by name (`"default"`, and e.g. `"tool_use"`,
    `"rag"`); `{}` if it has none. As transformers 5 loads them: the `.jinja`
    files, `chat_template.jinja` (the default, as `save_pretrained` writes it) and
    `additional_chat_templates/<name>.jinja`; only without any of those,
    `tokenizer_config.json`'s `chat_template` (a string: the default; a list of
    `{"name", "template"}`, or a mapping of names to templates).

    Raises:
        DataError: `tokenizer_config.json` does not parse, a template there is
            not a string, or the templates have none named `"default"`.
    """
    templates, where = named_templates(directory)
    if templates is None:
        return {}
    if "default" not in templates:
        fix = (
            f"Add {TEMPLATE_FILE} (the default) beside {TEMPLATE_DIR}/"
            if where == os.fspath(directory)
            else "Name one 'default'"
        )
        raise DataError(
            f"{where} has chat templates named {sorted(templates)} but none named "
            f"'default', the one for records without tools. {fix}, or pass the "
            "`.jinja` file of the one to use."
        )
    return templates


def named_templates(directory: PathLike) -> tuple[dict[str, str] | None, str]:
    """`directory`'s chat templates by name (None: it has none), read as
    `read_chat_templates` reads them but without asking for a `"default"` one
    (transformers loads such a directory too), and where they were read (the
    directory, for its `.jinja` files, or its `tokenizer_config.json`)."""
    directory = os.fspath(directory)
    templates = _file_templates(directory)
    if templates:
        return templates, directory
    where = os.path.join(directory, "tokenizer_config.json")
    return _config_templates(where), where


def _file_templates(directory: str) -> dict[str, str]:
    """The `.jinja` templates of `directory`: `chat_template.jinja` as
    `"default"`, then each `additional_chat_templates/<name>.jinja` (which, as in
    transformers, wins over the first for a file named `default.jinja`)."""
    templates = {}
    default = os.path.join(directory, TEMPLATE_FILE)
    if os.path.isfile(default):
        templates["default"] = _read(default)
    folder = os.path.join(directory, TEMPLATE_DIR)
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if name.endswith(".jinja") and os.path.isfile(path):
                templates[name.removesuffix(".jinja")] = _read(path)
    return templates


def _config_templates(config_path: str) -> dict[str, str] | None:
    """`tokenizer_config.json`'s `chat_template` by name: a string is the
    `"default"`, a list of `{"name", "template"}` (or a mapping) names its own;
    None without one."""
    value = read_config(config_path, "Fix or remove it.").get("chat_template")
    if value is None:
        return None
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        value = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
    if not isinstance(value, dict):
        raise DataError(
            f"{config_path}'s chat_template must be a string or a list of "
            f"{{name, template}}; got {type(value).__name__}. Fix the file."
        )
    for name, template in value.items():
        if not isinstance(name, str) or not isinstance(template, str):
            raise DataError(
                f"{config_path}'s chat_template lists {name!r} with a template of "
                f"type {type(template).__name__}; each must be a name and a string. "
                "Fix the file."
            )
    return value


def read_special_tokens(directory: PathLike) -> dict[str, str]:
    """The special token strings (`bos_token`, `eos_token`, ...) that transformers
    passes to chat templates, from `tokenizer_config.json` (which wins) and
    `special_tokens_map.json` in `directory`; `{}` if there are none."""
    tokens: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        config = read_config(os.path.join(directory, name), "Fix or remove it.")
        found = {key: token_content(config.get(key)) for key in SPECIAL_TOKENS}
        tokens.update({k: v for k, v in found.items() if v is not None})
    return tokens


def check_messages(
    messages: Any, roles: Sequence[str], *, first: int = 0
) -> list[dict[str, Any]]:
    """`messages` as plain dicts without None-valued keys (as transformers
    normalizes them), each checked to have a role among `roles` and a string
    content.

    Raises:
        ChatTemplateError: a message is malformed (the error names it).
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(
        messages, Sequence
    ):
        raise ChatTemplateError(
            f"messages must be a list of {{role, content}} mappings; got "
            f"{type(messages).__name__}.",
            reason="with messages that are not a list",
        )
    return [_check_message(m, i, roles) for i, m in enumerate(messages, start=first)]


def _check_message(message: Any, i: int, roles: Sequence[str]) -> dict[str, Any]:
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise _not_a_message(message, i)
    clean = {k: v for k, v in message.items() if v is not None}
    _check_role_and_content(clean, i, roles)
    return clean


def _not_a_message(message: Any, i: int) -> ChatTemplateError:
    got = sorted(message) if isinstance(message, Mapping) else type(message)
    return ChatTemplateError(
        f"message {i} must be a mapping with a string 'role' and 'content'; got "
        f"{got}. Write messages as {{'role': 'user', 'content': '...'}}.",
        reason="with a message that is not a {role, content} mapping",
    )


def _check_role_and_content(
    clean: Mapping[str, Any], i: int, roles: Sequence[str]
) -> None:
    if clean["role"] not in roles:
        raise ChatTemplateError(
            f"message {i} has role {clean['role']!r}; the chat template knows "
            f"{list(roles)}.",
            reason="with a message role the template does not know",
        )
    if "content" not in clean and clean.get("tool_calls"):
        return  # an assistant's tool calls without text, as the OpenAI format has it
    if not isinstance(clean.get("content"), str):
        got = type(clean.get("content")).__name__
        raise ChatTemplateError(
            f"message {i} ({clean['role']}) has content of type {got}; it must be a "
            "string.",
            reason="with a message content that is not a string",
        )


def _tokens_and_mask(
    text: str, turns: list[Turn], tokenizer: Tokenizer
) -> tuple[Ids, Mask]:
    """Tokens of `text` and 1 on those overlapping a turn (transformers' rule for
    `return_assistant_tokens_mask`); a turn's end falls back to a token boundary
    (see `Turn`)."""
    encode = getattr(tokenizer, "encode_with_offsets", None)
    if encode is None:
        raise DataError(
            f"a Jinja chat template needs a tokenizer with `encode_with_offsets` "
            f"(HFTokenizer or ByteTokenizer); got {tokenizer!r}. Use one of those, "
            "or the built-in template (data.chat_template = 'builtin'; "
            "template=None in Python)."
        )
    ids, offsets = encode(text)
    mask = np.zeros(len(ids), np.float32)
    ends = offsets[:, 1]
    for turn in turns:
        end = turn.end
        if end < len(text) and not (ends == end).any():
            below = ends[(ends <= end) & (ends >= turn.floor)]
            end = int(below.max()) if below.size else turn.floor
        mask[(ends > turn.begin) & (offsets[:, 0] < end)] = 1.0
    return np.asarray(ids, np.int32), mask


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()
