"""Where a chat template puts each assistant turn in its render of the whole
conversation: the text a model is trained to write.

A template with `{% generation %}` blocks says so itself (`_jinja.render_marked`,
transformers' rule). For any other template, `located_turns` finds each assistant
message j in the render `text` of the conversation:

    begin  the end of the prompt: the render of the messages before j with the
           generation prompt, laid over `text` from the end of message j - 1's
           content, as far as the two agree (what the model is given ends there).
    end    the end of j's own text (found by rendering the conversation with j's
           content replaced by a marker string, so a template that rewrites or
           drops part of it, e.g. earlier reasoning, is followed), then the text
           the template writes after it both when j is the last message and when
           the conversation goes on: its end-of-turn text (`<|im_end|>\n`,
           `<|eot_id|>`, `<|end|>\n` but not Phi-3's end-of-conversation EOS, which
           is learned after the last turn only).

`render` renders a list of messages with everything else the whole
conversation's render was given (the record's tools above all: Qwen2.5 writes
them into the system turn, Llama 3.1 into the first user turn), so that the
renders of its parts line up with it.

No prefix of the conversation has to render as the conversation does: Qwen3
(the empty `<think>` block on the last answer only), Phi-3 (EOS after the last
turn only) and DeepSeek-R1 distills (earlier reasoning dropped) are all located.
What the template writes for an assistant turn is learned; what it drops is not.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

from ._errors import ChatTemplateError


Render = Callable[[list[dict[str, Any]], bool], str]


@dataclasses.dataclass(frozen=True)
class Turn:
    """An assistant turn's characters `[begin, end)` in the render. `end` falls
    back to the last token boundary at or before it, but not below `floor` (the
    end of the message's own text): the common start of two renders can stop
    inside a token (`<|end|>\\n<|` of `<|end|>\\n<|user|>` and
    `<|end|>\\n<|endoftext|>`)."""

    begin: int
    end: int
    floor: int


def located_turns(
    render: Render, messages: list[dict[str, Any]], text: str, *, start: int = 0
) -> list[Turn]:
    """The assistant turns of `messages[start:]` in `text`, their render.

    Raises:
        ChatTemplateError: an assistant message cannot be found in `text` (the
            error's reason names the template behaviour).
    """
    turns: list[Turn] = []
    previous = 0
    for j in range(start, len(messages)):
        if messages[j]["role"] == "assistant":
            turns.append(_turn(render, messages, j, text, previous))
            previous = turns[-1].end
    return turns


def prompt_end(
    render: Render, prompt: list[dict[str, Any]], text: str, *, answer: bool
) -> int:
    """Where the prompt `prompt` ends in `text`, the render of a conversation
    that continues it: after the generation prompt when an answer follows."""
    return _common_prefix(_render_or_empty(render, prompt, answer), text)


def _turn(
    render: Render, messages: list[dict[str, Any]], j: int, text: str, previous: int
) -> Turn:
    own = _own_text(render, messages, j, text)
    begin = max(previous, _prompt_end(render, messages, j, text))
    if own is None:
        # the template writes no content for j (e.g. only its tool calls): its
        # turn runs as far as its render as the last message agrees with `text`
        end = _common_prefix(render(messages[: j + 1], False), text)
        if end <= begin:
            raise _not_found(j)
        return Turn(begin, end, begin)
    first, floor, end = own
    return Turn(max(previous, min(begin, first)), end, floor)


def _prompt_end(
    render: Render, messages: list[dict[str, Any]], j: int, text: str
) -> int:
    """Where the prompt of assistant message j ends in `text`: the render of the
    messages before j with the generation prompt, laid over `text` from the end
    of message j - 1's content (so a template that writes earlier turns
    differently when they end the prompt, e.g. Mistral's system prompt in the
    last user turn, is followed), as far as the two agree."""
    if j == 0:
        return _common_prefix(_render_or_empty(render, [], True), text)
    marker = _marker(messages, text)
    marked = _with_content(messages, j - 1, marker)
    whole = render(marked, False)
    prompt = render(marked[:j], True)
    at, at_prompt = whole.find(marker), prompt.find(marker)
    end = at + len(marker)
    if at < 0 or at_prompt < 0 or not text.endswith(whole[end:]):
        # message j - 1 has no content of its own in the render: from the start
        return _common_prefix(render(messages[:j], True), text)
    cut = len(text) - (len(whole) - end)  # the end of message j - 1 in `text`
    return cut + _common_prefix(prompt[at_prompt + len(marker) :], text[cut:])


def _own_text(
    render: Render, messages: list[dict[str, Any]], j: int, text: str
) -> tuple[int, int, int] | None:
    """`(first, floor, end)` of assistant message j in `text`: where the
    characters that depend on its content start and end, and where its
    end-of-turn text ends; None if the template does not write its content."""
    marker = _marker(messages, text)
    marked = _with_content(messages, j, marker)
    whole = render(marked, False)
    at = whole.find(marker)
    if at < 0:
        return None
    after = at + len(marker)
    if not text.endswith(whole[after:]):
        raise ChatTemplateError(
            f"assistant message {j} cannot be located: the chat template writes "
            "the rest of the conversation differently depending on that answer's "
            "content, so where its turn ends is unclear. Mark the answer with "
            "{% generation %} ... {% endgeneration %}, or use another template.",
            reason="with a chat template that rewrites later turns by an "
            "answer's content",
        )
    alone = render(marked[: j + 1], False)
    rest = alone[alone.find(marker) + len(marker) :]
    # positions after the marker map to `text` by their distance from its end
    floor = len(text) - (len(whole) - after)
    first = _common_prefix(whole, text)
    end = floor + _common_prefix(whole[after:], rest)
    # an empty content: the shared end can reach back before where it starts
    return first, max(floor, first), end


def _with_content(
    messages: list[dict[str, Any]], j: int, content: str
) -> list[dict[str, Any]]:
    return [*messages[:j], {**messages[j], "content": content}, *messages[j + 1 :]]


def _marker(messages: list[dict[str, Any]], text: str) -> str:
    """A string that occurs in no message and nowhere in the render `text` (e.g.
    in the tool definitions it holds): private-use characters."""
    seen = "".join(str(m.get("content", "")) for m in messages) + text
    for code in range(0xE000, 0xF8FF):
        marker = chr(code) + "eqtrain" + chr(code + 1)
        if marker not in seen:
            return marker
    raise AssertionError("every private-use marker occurs in the conversation")


def _render_or_empty(render: Render, messages: list[dict[str, Any]], gen: bool) -> str:
    """The render of `messages`; "" for no messages where the template needs one."""
    if messages:
        return render(messages, gen)
    try:
        return render(messages, gen)
    except ChatTemplateError:
        return ""


def _not_found(j: int) -> ChatTemplateError:
    return ChatTemplateError(
        f"assistant message {j} is not in the chat template's render of the "
        "conversation: the template writes nothing for it, so there is nothing to "
        "learn from it. Check the data's roles against the template, or use "
        "another template.",
        reason="with a chat template that does not render an assistant message",
    )


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low
