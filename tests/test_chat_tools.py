"""A record's `tools` reach the chat template as `transformers`'
`apply_chat_template(messages, tools=tools)` gives them (a list of function
definitions, or a JSON string of one, as Hugging Face datasets store the column
and TRL parses it), in every path that renders a chat: conversations, prompt /
completion records, preference pairs, GRPO prompts (in memory and from the
store) and `eqtrain generate`'s prompts. Checked token for token against
`transformers` with published templates that write tools (Qwen2.5's into the
system turn, Llama 3.1's into the first user turn; tests/chat_templates/) and
TRL's Qwen2.5 training template (`{% generation %}` markers: transformers'
assistant mask), on a tiny byte-level BPE built here. Each comparison also
checks that the tools changed the render, so dropping them fails it. The
built-in template refuses tools; malformed tools are refused (skipped in the
pipelines, with the reason counted)."""

import json
import pathlib

import numpy as np
import pytest

from eqtrain import data as data_lib
from eqtrain.data import (
    BuiltinChatTemplate,
    ByteTokenizer,
    DataError,
    HFTokenizer,
    JinjaChatTemplate,
    chat_examples,
    check_tools,
    preference_rows,
    sft_rows,
)
from eqtrain.data._errors import ChatTemplateError
from eqtrain.data.store import _post_parts, _post_store

from ._bpe import assert_same_rows, byte_bpe, chat_ids, learned_text as runs


transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
pytest.importorskip("tokenizers")

HERE = pathlib.Path(__file__).parent / "chat_templates"
TRL_TEMPLATES = pathlib.Path(trl.__file__).parent / "chat_templates"

CHATML = {"eos_token": "<|im_end|>", "pad_token": "<pad>"}
LLAMA = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
SPECIALS = [
    "<pad>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "description": "The first number."},
                "b": {"type": "integer", "description": "The second number."},
            },
            "required": ["a", "b"],
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
TOOLS = [ADD, WEATHER]
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
CHAT = [
    {"role": "system", "content": "You are nice."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "name": "add", "content": "4"},
    {"role": "assistant", "content": "It is four."},
]
# a conversation's tools as a list of dicts, and as a JSON string
FORMS = {"list": TOOLS, "json": json.dumps(TOOLS)}
# name: (file, special tokens); TRL's training template has `{% generation %}`
TEMPLATES = {
    "qwen2_5": (HERE / "qwen2_5.jinja", CHATML),
    "llama3_1": (HERE / "llama3_1.jinja", LLAMA),
    "qwen2_5_training": (TRL_TEMPLATES / "qwen2_5_training.jinja", CHATML),
}
# What each answer of CHAT learns (the tool call, then the answer), with or without
# tools: Qwen2.5's as TRL's training template learns it (less the "\n" its
# generation block takes from the generation prompt), Llama 3.1's written out.
LEARNED = {
    "qwen2_5": [
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
        "<|im_end|>\n",
        "It is four.<|im_end|>\n",
    ],
    "llama3_1": [
        '{"name": "add", "parameters": {"a": 2, "b": 2}}<|eot_id|>',
        "It is four.<|eot_id|>",
    ],
}


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A tiny byte-level BPE (lossless: learned text reads back) with the
    templates' special tokens, trained on the chat and the tools' JSON."""
    text = " ".join(str(m.get("content")) for m in CHAT) + json.dumps(TOOLS)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    return byte_bpe(path, [text] * 5, SPECIALS, 500)


@pytest.fixture(scope="module")
def tok(tokenizer_file):
    return HFTokenizer.from_file(tokenizer_file)


def hf_tokenizer(tokenizer_file, name):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file), **TEMPLATES[name][1]
    )


def template_of(name):
    path, specials = TEMPLATES[name]
    return JinjaChatTemplate(path.read_text(encoding="utf-8"), specials)


def hf_render(hf, template, messages, tools, **kwargs):
    return hf.apply_chat_template(
        messages, tools=tools, chat_template=template.source, tokenize=False, **kwargs
    )


def hf_ids(hf, template, messages, tools, **kwargs):
    return chat_ids(hf, template, messages, tools=tools, **kwargs)


# -- conversations ------------------------------------------------------------------
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", ["qwen2_5", "llama3_1"])
def test_a_conversations_tools_render_and_tokenize_as_transformers(
    tokenizer_file, tok, name, form
):
    hf, template = hf_tokenizer(tokenizer_file, name), template_of(name)
    text = hf_render(hf, template, CHAT, TOOLS)
    assert "Add two integers." in text and "get_weather" in text
    assert text != hf_render(hf, template, CHAT, None)  # the tools are written
    assert template.render(CHAT, tools=FORMS[form]) == text
    ids, mask = template.encode(CHAT, tok, tools=FORMS[form])
    assert ids.tolist() == hf_ids(hf, template, CHAT, TOOLS)
    # the answers are found in a render with tools: the same learned text
    assert runs(ids, mask, hf) == LEARNED[name]
    assert runs(*template.encode(CHAT, tok), hf) == LEARNED[name]


@pytest.mark.parametrize("form", list(FORMS))
def test_generation_markers_give_transformers_mask_with_tools(
    tokenizer_file, tok, form
):
    hf, template = (
        hf_tokenizer(tokenizer_file, "qwen2_5"),
        template_of("qwen2_5_training"),
    )
    assert template.marked
    out = hf.apply_chat_template(
        CHAT,
        tools=TOOLS,
        chat_template=template.source,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    ids, mask = template.encode(CHAT, tok, tools=FORMS[form])
    assert ids.tolist() == list(out["input_ids"])
    assert mask.astype(int).tolist() == list(out["assistant_masks"])
    assert ids.tolist() != hf_ids(hf, template, CHAT, None)
    # and the original template learns the same answers, less the "\n" TRL's
    # generation block takes from the generation prompt
    expected = [r.removeprefix("\n") for r in runs(ids, mask, hf)]
    assert expected == LEARNED["qwen2_5"]


@pytest.mark.parametrize("form", list(FORMS))
def test_sft_rows_of_conversations_with_tools(tokenizer_file, tok, form):
    hf, template = hf_tokenizer(tokenizer_file, "llama3_1"), template_of("llama3_1")
    rows, report = sft_rows(
        [{"messages": CHAT, "tools": FORMS[form]}],
        tok,
        format="chat",
        template=template,
        seq_len=4096,
        pack=False,
    )
    assert report.skipped == 0
    expected = hf_ids(hf, template, CHAT, TOOLS)
    n = len(expected) - 1
    assert rows["tokens"][0, :n].tolist() == expected[:-1]
    assert rows["targets"][0, :n].tolist() == expected[1:]
    learned = rows["loss_mask"][0, :n]
    assert runs(expected[1:], learned, hf) == LEARNED["llama3_1"]


# -- prompt/completion and preference pairs -----------------------------------------
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", ["qwen2_5", "llama3_1", "qwen2_5_training"])
def test_a_prompt_completion_pair_with_tools(tokenizer_file, tok, name, form):
    """TRL's split: the prompt is `apply_chat_template(prompt, tools=tools,
    add_generation_prompt=True)`, prompt + completion the whole conversation's
    ids, both with the tools."""
    hf = hf_tokenizer(tokenizer_file, "qwen2_5" if "qwen" in name else name)
    template = template_of(name)
    prompt, completion = CHAT[:2], CHAT[2:]
    want_prompt = hf_ids(hf, template, prompt, TOOLS, add_generation_prompt=True)
    assert want_prompt != hf_ids(hf, template, prompt, None, add_generation_prompt=True)
    p, c, m = template.encode_prompt_completion(
        prompt, completion, tok, tools=FORMS[form]
    )
    assert p.tolist() == want_prompt
    assert p.tolist() + c.tolist() == hf_ids(hf, template, CHAT, TOOLS)
    if name != "qwen2_5_training":
        assert runs(c, m, hf) == LEARNED[name]
    # sft_rows of the record: the same ids, the prompt not learned
    rows, report = sft_rows(
        [{"prompt": prompt, "completion": completion, "tools": FORMS[form]}],
        tok,
        format="prompt_completion",
        template=template,
        seq_len=4096,
        max_prompt_len=4096,
        pack=False,
    )
    assert report.skipped == 0
    ids = p.tolist() + c.tolist()
    assert rows["tokens"][0, : len(ids) - 1].tolist() == ids[:-1]
    learned = rows["loss_mask"][0, : len(ids) - 1]
    assert not learned[: len(p) - 1].any()
    assert learned[len(p) - 1 :].tolist() == m[: len(ids) - len(p)].tolist()


@pytest.mark.parametrize("form", list(FORMS))
def test_a_preference_pair_with_tools(tokenizer_file, tok, form):
    """Both completions follow the prompt's ids with the tools (TRL's DPO
    tokenization), explicit prompt or implicit (shared leading messages)."""
    hf, template = hf_tokenizer(tokenizer_file, "qwen2_5"), template_of("qwen2_5")
    prompt = CHAT[:4]
    chosen = [{"role": "assistant", "content": "It is four."}]
    rejected = [{"role": "assistant", "content": "It is five."}]
    records = [
        {
            "prompt": prompt,
            "chosen": chosen,
            "rejected": rejected,
            "tools": FORMS[form],
        },
        {"chosen": prompt + chosen, "rejected": prompt + rejected, "tools": TOOLS},
    ]
    rows, report = preference_rows(
        records, tok, template=template, seq_len=1024, max_prompt_len=1024
    )
    assert report.skipped == 0
    for side, answer in (("chosen", chosen), ("rejected", rejected)):
        want = hf_ids(hf, template, prompt + answer, TOOLS)
        n = len(want) - 1
        for i in range(2):
            assert rows[f"{side}_tokens"][i, :n].tolist() == want[:-1]
            learned = rows[f"{side}_mask"][i, :n]
            assert runs(want[1:], learned, hf) == [
                answer[0]["content"] + "<|im_end|>\n"
            ]


# -- GRPO prompts and generation ----------------------------------------------------
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("name", ["qwen2_5", "llama3_1"])
def test_a_grpo_prompt_renders_with_its_tools(tokenizer_file, tok, name, form):
    hf, template = hf_tokenizer(tokenizer_file, name), template_of(name)
    messages = CHAT[:2]
    want = hf_ids(hf, template, messages, TOOLS, add_generation_prompt=True)
    assert want != hf_ids(hf, template, messages, None, add_generation_prompt=True)
    record = {"messages": messages, "tools": FORMS[form], "answer": "4"}
    ids = _post_parts.prompt_ids(record, True, tok, template)
    assert ids.tolist() == want


def test_the_grpo_store_holds_the_tools_prompts_and_follows_a_change_of_them(
    tokenizer_file, tok, tmp_path
):
    """The store's prompt rows carry the tools; its key covers the file's
    content, so new tools give a new store, never the stale one."""
    hf, template = hf_tokenizer(tokenizer_file, "qwen2_5"), template_of("qwen2_5")
    path = tmp_path / "prompts.jsonl"
    messages = CHAT[:2]
    width = 2048

    def prompts(tools):
        records = [{"messages": messages, "tools": tools, "answer": "4"}] * 2
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        rows = data_lib.prepare_post(
            path,
            tok,
            kind="prompt",
            seq_len=4096,
            width=width,
            template=template,
            cache_dir=tmp_path / "cache",
            executor="inline",
            say=lambda line: None,
        )
        got = rows.take(np.arange(rows.num_rows))
        n = int(got["prompt_len"][0])
        assert rows.column("tools")[0] == tools  # the rewards see the column
        return rows.directory, got["prompt"][0, width - n :].tolist()

    first, ids = prompts(json.dumps(TOOLS))
    # a store made before tools reached the template is not reused either
    identity = _post_store._identity(path, tok, template)
    assert data_lib.MASK_RULE in identity["template"]
    assert ids == hf_ids(hf, template, messages, TOOLS, add_generation_prompt=True)
    second, ids = prompts(json.dumps([WEATHER]))
    assert second != first
    assert ids == hf_ids(hf, template, messages, [WEATHER], add_generation_prompt=True)


@pytest.mark.parametrize("form", list(FORMS))
def test_generate_chat_prompts_render_with_their_tools(tokenizer_file, tok, form):
    from eqtrain import job
    from eqtrain._errors import ConfigError
    from eqtrain.job._generate import Generator

    hf, template = hf_tokenizer(tokenizer_file, "llama3_1"), template_of("llama3_1")
    m = Generator(None, tok, (), pathlib.Path("model"), template, None)
    messages = CHAT[:2]
    ids = job.prompt_tokens(m, messages, chat=True, tools=FORMS[form])
    assert ids.tolist() == hf_ids(
        hf, template, messages, TOOLS, add_generation_prompt=True
    )
    with pytest.raises(ConfigError, match="'tools' needs --chat"):
        job.prompt_tokens(m, "2 + 2?", chat=False, tools=FORMS[form])
    builtin = Generator(
        None, ByteTokenizer(), (), pathlib.Path("m"), BuiltinChatTemplate(), None
    )
    with pytest.raises(ConfigError, match="Jinja chat template"):
        job.prompt_tokens(builtin, "2 + 2?", chat=True, tools=FORMS[form])


def test_sample_prompts_carry_their_tools(tmp_path):
    from eqtrain.job import _samples

    path = tmp_path / "prompts.jsonl"
    lines = [
        {"messages": CHAT[:2], "tools": TOOLS},
        {"prompt": "2 + 2?", "tools": json.dumps(TOOLS)},
        {"prompt": "no tools"},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    prompts, extras = _samples.read_prompts(path)
    assert prompts == [CHAT[:2], "2 + 2?", "no tools"]
    assert [e["tools"] for e in extras] == [TOOLS, json.dumps(TOOLS), None]


# -- no tools, and refusals ---------------------------------------------------------
@pytest.mark.parametrize("none", [None, [], "", "  ", "[]", "null"])
def test_no_tools_is_as_before(tokenizer_file, tok, none):
    template = template_of("llama3_1")
    assert check_tools(none) is None
    chat = [m for m in CHAT if m["role"] != "tool" and "tool_calls" not in m]
    assert_same_rows(tok, template, chat, tools=none)
    builtin = BuiltinChatTemplate()
    ids, mask = builtin.encode(chat, ByteTokenizer(), tools=none)
    np.testing.assert_array_equal(ids, builtin.encode(chat, ByteTokenizer())[0])


BAD = {
    "bad json": ('[{"type": "function"', "not valid JSON"),
    "an object": (ADD, "is an object"),
    "a json object": (json.dumps(ADD), "is a JSON string of an object"),
    "strings": (["add"], "item 0 is a string"),
    "a number": (3, "is a number"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_tools_are_refused(tok, case):
    value, said = BAD[case]
    template = template_of("qwen2_5")
    with pytest.raises(ChatTemplateError, match=said) as error:
        template.encode(CHAT, tok, tools=value)
    assert "'tools' must be a list of function definitions" in str(error.value)
    assert "'tools'" in error.value.reason
    # in a pipeline: the record is skipped, its reason counted
    records = [{"messages": CHAT, "tools": TOOLS}, {"messages": CHAT, "tools": value}]
    _, report = sft_rows(records, tok, format="chat", template=template, seq_len=1024)
    assert report.kept == 1 and report.reasons == {error.value.reason: 1}
    assert report.first == {error.value.reason: 1}


def test_the_builtin_template_refuses_tools():
    tok, builtin = ByteTokenizer(), BuiltinChatTemplate()
    chat = [CHAT[1], {"role": "assistant", "content": "It is four."}]
    for tools in FORMS.values():
        with pytest.raises(DataError, match="model's own Jinja chat template") as e:
            builtin.encode(chat, tok, tools=tools)
        assert "cannot render tools" in str(e.value)
        assert not isinstance(e.value, ChatTemplateError)  # not a quiet skip
        with pytest.raises(DataError, match="Jinja chat template"):
            builtin.encode_prompt_completion(chat[:1], chat[1:], tok, tools=tools)
    # every pipeline stops on it: none trains without the tools
    with pytest.raises(DataError, match="cannot render tools"):
        sft_rows([{"messages": chat, "tools": TOOLS}], tok, format="chat", seq_len=64)
    with pytest.raises(DataError, match="cannot render tools"):
        pair = {"prompt": chat[:1], "completion": chat[1:], "tools": TOOLS}
        sft_rows([pair], tok, format="prompt_completion", seq_len=64)
    with pytest.raises(DataError, match="record 1: .*cannot render tools"):
        chat_examples([{"messages": chat}, {"messages": chat, "tools": TOOLS}], tok)
    with pytest.raises(DataError, match="cannot render tools"):
        _post_parts.prompt_ids(
            {"messages": chat[:1], "tools": TOOLS}, True, tok, builtin
        )
