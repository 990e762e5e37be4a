"""Models with several named chat templates (a `default` and a `tool_use` one, as
Hermes and Command-R ship them): read from a tokenizer directory as `transformers`
reads them (`tokenizer_config.json`'s list of `{name, template}`, or transformers
5's `chat_template.jinja` with `additional_chat_templates/<name>.jinja`), and
picked as `apply_chat_template(messages, tools=tools)` picks them: `tool_use` for a
record with tools, `default` otherwise. Checked token for token (ids and masks)
against `transformers` loaded from the same directory, on a tiny byte-level BPE
built here. The `tool_use` template writes the tools as a system block and the
default ignores them, so a record rendered with the wrong one fails the
comparison; the two mark their answers differently, so does a mask made by the
other one's rule."""

import json
import shutil

import numpy as np
import pytest

from eqtrain import data as data_lib
from eqtrain.data import (
    DataError,
    HFTokenizer,
    JinjaChatTemplate,
    chat_template,
    read_chat_template,
    read_chat_templates,
    sft_rows,
    template_identity,
)
from eqtrain.data.store import _post_parts, _post_store

from ._bpe import byte_bpe


transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SPECIALS = {"eos_token": "<|im_end|>", "pad_token": "<pad>"}
# ChatML that ignores tools; `{% generation %}` takes the answer, its
# `<|im_end|>` and the newline after it
DEFAULT = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# ChatML that writes the tools as a system block first; `{% generation %}` takes
# the answer and its `<|im_end|>`, not the newline (what a template without
# markers learns)
TOOL_USE = (
    "{% if tools %}{{ '<|im_start|>system\n# Tools\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
RAG = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def plain(template):
    """`template` without its `{% generation %}` markers: the same text."""
    return template.replace("{% generation %}", "").replace("{% endgeneration %}", "")


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [ADD]
CHAT = [
    {"role": "user", "content": "Hello there, how are you?"},
    {"role": "assistant", "content": "I am fine, thank you."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four."},
]
# a record's tools: none, a list, and the JSON string datasets often store
FORMS = {"none": None, "list": TOOLS, "json": json.dumps(TOOLS)}
LAYOUTS = ("config", "files")


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A tiny byte-level BPE (lossless) with ChatML's special tokens."""
    text = " ".join(m["content"] for m in CHAT) + json.dumps(TOOLS) + " # Tools"
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    return byte_bpe(path, [text] * 5, ["<pad>", "<|im_start|>", "<|im_end|>"], 400)


@pytest.fixture(scope="module")
def tok(tokenizer_file):
    return HFTokenizer.from_file(tokenizer_file)


def write_dir(path, tokenizer_file, templates, layout):
    """A tokenizer directory with the named `templates`, in `tokenizer_config.json`
    (`"config"`: a list of `{name, template}`, as Hermes ships it) or as transformers
    5's `save_pretrained` writes them (`"files"`)."""
    path.mkdir(parents=True)
    shutil.copy(tokenizer_file, path / "tokenizer.json")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **SPECIALS}
    if layout == "config":
        config["chat_template"] = [
            {"name": name, "template": text} for name, text in templates.items()
        ]
    else:
        for name, text in templates.items():
            if name == "default":
                (path / "chat_template.jinja").write_text(text, encoding="utf-8")
                continue
            (path / "additional_chat_templates").mkdir(exist_ok=True)
            extra = path / "additional_chat_templates" / f"{name}.jinja"
            extra.write_text(text, encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def hf_of(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


def hf_encode(hf, messages, tools, *, mask=False, **kwargs):
    """transformers' ids (and assistant mask) for `messages` with `tools`."""
    out = hf.apply_chat_template(
        messages,
        tools=tools,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=mask,
        **kwargs,
    )
    ids = [int(i) for i in out["input_ids"]]
    return (ids, [int(m) for m in out["assistant_masks"]]) if mask else ids


def runs(ids, mask, tok):
    """The decoded text of each run of consecutive learned tokens."""
    mask = np.asarray(mask, np.int64)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    ids = [int(i) for i in ids]
    return [
        tok._tok.decode(ids[a:b], skip_special_tokens=False)
        for a, b in zip(edges[::2], edges[1::2], strict=True)
    ]


def listed(tools):
    """A record's `tools` as transformers takes them (a list, or None)."""
    return json.loads(tools) if isinstance(tools, str) else tools


# -- where the templates come from ----------------------------------------------------
@pytest.mark.parametrize("layout", LAYOUTS)
def test_named_templates_are_read_as_transformers_reads_them(
    tmp_path, tokenizer_file, layout
):
    templates = {"default": DEFAULT, "tool_use": TOOL_USE, "rag": RAG}
    directory = write_dir(tmp_path / "model", tokenizer_file, templates, layout)
    if layout == "files":  # the .jinja files win over the config, as in transformers
        config = json.loads((directory / "tokenizer_config.json").read_text())
        config["chat_template"] = [{"name": "default", "template": RAG}]
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert read_chat_templates(directory) == hf_of(directory).chat_template
    assert read_chat_templates(directory) == templates
    assert read_chat_template(directory) == DEFAULT
    template = chat_template(directory / "tokenizer.json")
    assert isinstance(template, JinjaChatTemplate)
    assert (template.source, template.tool_use) == (DEFAULT, TOOL_USE)
    assert template.special_tokens == SPECIALS
    # one template alone: no tool_use, the default for every record
    alone = write_dir(tmp_path / "alone", tokenizer_file, {"default": DEFAULT}, layout)
    assert chat_template(alone).tool_use is None
    # a .jinja file is the one template to use
    if layout == "files":
        jinja = chat_template(directory / "chat_template.jinja")
        assert (jinja.source, jinja.tool_use) == (DEFAULT, None)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_templates_without_a_default_are_refused(tmp_path, tokenizer_file, layout):
    directory = write_dir(
        tmp_path / "model", tokenizer_file, {"tool_use": TOOL_USE}, layout
    )
    with pytest.raises(DataError, match="none named 'default'"):
        chat_template(directory)
    # transformers cannot render a record without tools there either
    with pytest.raises(ValueError, match="no default"):
        hf_of(directory).apply_chat_template(CHAT, tokenize=False)
    if layout == "config":  # an empty list names no default either
        (directory / "tokenizer_config.json").write_text('{"chat_template": []}')
        with pytest.raises(DataError, match="none named 'default'"):
            chat_template(directory)


def test_a_template_that_is_not_a_string_is_refused(tmp_path, tokenizer_file):
    directory = write_dir(
        tmp_path / "model", tokenizer_file, {"default": DEFAULT}, "config"
    )
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"].append({"name": "tool_use", "template": 3})
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match="'tool_use' with a template of type int"):
        chat_template(directory)


# -- which template renders a record --------------------------------------------------
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ids_and_masks_equal_transformers(tmp_path, tokenizer_file, tok, layout, form):
    """A record with tools is rendered with `tool_use`, one without with `default`,
    ids and `{% generation %}` masks as transformers gives them."""
    templates = {"default": DEFAULT, "tool_use": TOOL_USE}
    directory = write_dir(tmp_path / "model", tokenizer_file, templates, layout)
    hf, template = hf_of(directory), chat_template(directory)
    tools = listed(FORMS[form])
    text = template.render(CHAT, tools=FORMS[form])
    assert text == hf.apply_chat_template(CHAT, tools=tools, tokenize=False)
    assert ("# Tools" in text) == (tools is not None)  # only tool_use writes them
    ids, mask = template.encode(CHAT, tok, tools=FORMS[form])
    want_ids, want_mask = hf_encode(hf, CHAT, tools, mask=True)
    assert ids.tolist() == want_ids
    assert mask.astype(int).tolist() == want_mask
    learned = runs(ids, mask, tok)
    if tools is None:  # default's blocks take the newline
        assert learned == [
            "I am fine, thank you.<|im_end|>\n",
            "It is four.<|im_end|>\n",
        ]
        # byte-identical to the default template alone, as before named templates
        alone = JinjaChatTemplate(DEFAULT, SPECIALS).encode(CHAT, tok)
        np.testing.assert_array_equal(ids, alone[0])
        np.testing.assert_array_equal(mask, alone[1])
    else:  # tool_use's do not
        assert learned == ["I am fine, thank you.<|im_end|>", "It is four.<|im_end|>"]
    # a prompt to generate from (GRPO, `generate --chat`) is rendered the same way
    prompt = template.render(CHAT[:1], add_generation_prompt=True, tools=FORMS[form])
    assert prompt == hf.apply_chat_template(
        CHAT[:1], tools=tools, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_template_has_its_own_generation_markers(
    tmp_path, tokenizer_file, tok, layout
):
    """Each template's mask follows its own markers, or without any its located
    turns (the answer and the newline after `<|im_end|>`)."""
    marked_twin = hf_of(
        write_dir(
            tmp_path / "twin",
            tokenizer_file,
            {"default": DEFAULT, "tool_use": TOOL_USE},
            layout,
        )
    )
    # default without markers, tool_use with them
    directory = write_dir(
        tmp_path / "a",
        tokenizer_file,
        {"default": plain(DEFAULT), "tool_use": TOOL_USE},
        layout,
    )
    hf, template = hf_of(directory), chat_template(directory)
    assert not template.marked
    ids, mask = template.encode(CHAT, tok, tools=TOOLS)
    assert (ids.tolist(), mask.astype(int).tolist()) == hf_encode(
        hf, CHAT, TOOLS, mask=True
    )
    ids, mask = template.encode(CHAT, tok)
    assert ids.tolist() == hf_encode(hf, CHAT, None)
    # located turns learn what DEFAULT's markers take
    assert mask.astype(int).tolist() == hf_encode(marked_twin, CHAT, None, mask=True)[1]
    # default with markers, tool_use without
    directory = write_dir(
        tmp_path / "b",
        tokenizer_file,
        {"default": DEFAULT, "tool_use": plain(TOOL_USE)},
        layout,
    )
    hf, template = hf_of(directory), chat_template(directory)
    assert template.marked
    ids, mask = template.encode(CHAT, tok)
    assert (ids.tolist(), mask.astype(int).tolist()) == hf_encode(
        hf, CHAT, None, mask=True
    )
    ids, mask = template.encode(CHAT, tok, tools=TOOLS)
    assert ids.tolist() == hf_encode(hf, CHAT, TOOLS)
    assert runs(ids, mask, tok) == [
        "I am fine, thank you.<|im_end|>\n",
        "It is four.<|im_end|>\n",
    ]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_prompt_completion_pair_renders_every_part_with_tool_use(
    tmp_path, tokenizer_file, tok, layout
):
    """Without markers the turns and the prompt's end are found by rendering parts
    of the conversation: each with the record's template (TRL's split: the prompt
    with the generation prompt, then the rest)."""
    templates = {"default": plain(DEFAULT), "tool_use": plain(TOOL_USE)}
    directory = write_dir(tmp_path / "model", tokenizer_file, templates, layout)
    hf, template = hf_of(directory), chat_template(directory)
    prompt, completion = CHAT[:3], CHAT[3:]
    for tools in (TOOLS, None):
        p, c, m = template.encode_prompt_completion(
            prompt, completion, tok, tools=tools
        )
        assert p.tolist() == hf_encode(hf, prompt, tools, add_generation_prompt=True)
        assert p.tolist() + c.tolist() == hf_encode(hf, CHAT, tools)
        assert runs(c, m, tok) == ["It is four.<|im_end|>\n"]
    # the pipelines give a record's tools to the same choice
    records = [{"messages": CHAT, "tools": json.dumps(TOOLS)}, {"messages": CHAT}]
    rows, report = sft_rows(
        records, tok, format="chat", template=template, seq_len=256, pack=False
    )
    assert report.skipped == 0
    for i, tools in enumerate((TOOLS, None)):
        want = hf_encode(hf, CHAT, tools)
        assert rows["tokens"][i, : len(want) - 1].tolist() == want[:-1]


@pytest.mark.parametrize("none", [None, [], "", "[]"])
def test_empty_tools_are_no_tools(tmp_path, tokenizer_file, tok, none):
    """`check_tools` reads these as no tools (TRL passes `tools or None`): the
    default renders them, although transformers' own `tools=[]` picks tool_use."""
    templates = {"default": DEFAULT, "tool_use": TOOL_USE}
    template = chat_template(
        write_dir(tmp_path / "model", tokenizer_file, templates, "files")
    )
    ids, mask = template.encode(CHAT, tok, tools=none)
    alone = JinjaChatTemplate(DEFAULT, SPECIALS).encode(CHAT, tok)
    np.testing.assert_array_equal(ids, alone[0])
    np.testing.assert_array_equal(mask, alone[1])


def test_the_constructor_keeps_its_positional_form():
    template = JinjaChatTemplate(DEFAULT, SPECIALS)
    assert template.tool_use is None and template.marked
    both = JinjaChatTemplate(DEFAULT, SPECIALS, tool_use=plain(TOOL_USE))
    assert both.marked  # the default's
    assert repr(both) == f"JinjaChatTemplate({len(DEFAULT)} characters, tool_use: " + (
        f"{len(plain(TOOL_USE))})"
    )
    with pytest.raises(DataError, match="does not parse"):
        JinjaChatTemplate(DEFAULT, tool_use="{% for m in messages %}")


# -- stores -------------------------------------------------------------------------
def test_stores_are_keyed_by_the_tool_use_template(tmp_path, tokenizer_file, tok):
    """A change of the tool_use template gives a new store; a template without one
    keeps the key it had before there were named templates; worker processes
    rebuild the template with its tool_use."""
    default_only = JinjaChatTemplate(DEFAULT, SPECIALS)
    assert template_identity(default_only) == [
        "JinjaChatTemplate",
        data_lib.MASK_RULE,
        DEFAULT,
        SPECIALS,
    ]
    first = JinjaChatTemplate(DEFAULT, SPECIALS, tool_use=TOOL_USE)
    second = JinjaChatTemplate(DEFAULT, SPECIALS, tool_use=plain(TOOL_USE))
    keys = [template_identity(t) for t in (default_only, first, second)]
    assert len({json.dumps(k) for k in keys}) == 3
    rebuilt = _post_parts._template(_post_parts._template_spec(first))
    assert (rebuilt.source, rebuilt.tool_use) == (DEFAULT, TOOL_USE)
    assert (
        _post_parts._template(_post_parts._template_spec(default_only)).tool_use is None
    )

    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CHAT, "tools": TOOLS}) + "\n")

    def store(template):
        assert _post_store._identity(path, tok, template)["template"] == (
            template_identity(template)
        )
        rows = data_lib.prepare_post(
            path,
            tok,
            kind="sft",
            format="chat",
            seq_len=256,
            pack=False,
            template=template,
            cache_dir=tmp_path / "cache",
            executor="inline",
            say=lambda line: None,
        )
        return rows.directory, rows.take(np.arange(rows.num_rows))["loss_mask"][0]

    one, mask_one = store(first)
    two, mask_two = store(second)
    assert one != two
    # tool_use's markers leave out the newline that its located turns learn
    assert mask_two.sum() == mask_one.sum() + 2
