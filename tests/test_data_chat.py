"""Chat templates: Jinja templates rendered and tokenized exactly as transformers'
`apply_chat_template` does (checked against transformers itself, on a tiny
tokenizer built here), masks of assistant turns, and the built-in fallback."""

import json
import shutil

import numpy as np
import pytest

from eqtrain.data import (
    BuiltinChatTemplate,
    ByteTokenizer,
    ChatTemplate,
    DataError,
    HFTokenizer,
    JinjaChatTemplate,
    chat_template,
    encode_chat,
    read_chat_template,
)

from ._bpe import byte_bpe


SPECIALS = [
    "<pad>",
    "<s>",
    "</s>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "[INST]",
    "[/INST]",
]
CORPUS = [
    "Hello there, how are you?",
    "I am fine, thank you. The weather is nice today.",
    "You are a helpful assistant. What is two plus two? It is four.",
]

# an AddedToken as tokenizer_config.json writes it
ADDED_EOT = {
    "__type": "AddedToken",
    "content": "<|eot_id|>",
    "lstrip": False,
    "normalized": False,
    "rstrip": False,
    "single_word": False,
    "special": True,
}
# Qwen2-style ChatML with a default system message
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}\n"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}\n"
)
# Llama 3's template (bos_token, header and eot tokens)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Mistral-7B-Instruct-v0.1's template (raise_exception on a bad role order)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
# ChatML with transformers' {% generation %} tag and tojson
GENERATION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] | tojson + '<|im_end|>' }}{% endif %}"
    "{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEMPLATES = {
    # the end of turn learned: all the template writes after an answer, up to
    # the next message (ChatML's newline included, as TRL's templates learn it)
    "chatml": (
        CHATML,
        "<|im_end|>\n",
        {"eos_token": "<|im_end|>", "pad_token": "<pad>"},
    ),
    "llama3": (
        LLAMA3,
        "<|eot_id|>",
        {"bos_token": "<|begin_of_text|>", "eos_token": ADDED_EOT},
    ),
    "mistral": (MISTRAL, "</s>", {"bos_token": "<s>", "eos_token": "</s>"}),
    "generation": (GENERATION, "<|im_end|>", {"eos_token": "<|im_end|>"}),
}
CHAT = [
    {"role": "user", "content": "Hello there, how are you?"},
    {"role": "assistant", "content": "I am fine, thank you."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four."},
]
SYSTEM = [{"role": "system", "content": "You are nice."}]


def build_bpe(directory):
    """A tiny byte-level BPE (lossless, so masks can be checked by decoding),
    saved as `directory/tokenizer.json`."""
    return byte_bpe(directory / "tokenizer.json", CORPUS * 3, SPECIALS, 400)


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    return build_bpe(tmp_path_factory.mktemp("bpe"))


def model_dir(tmp_path, tokenizer_json, name, *, as_list=False):
    """A tokenizer directory with the template `name` in tokenizer_config.json."""
    source, _, specials = TEMPLATES[name]
    tmp_path.mkdir(parents=True, exist_ok=True)
    shutil.copy(tokenizer_json, tmp_path / "tokenizer.json")
    template = [{"name": "default", "template": source}] if as_list else source
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
        **specials,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def hf_ids(hf, messages, **kwargs):
    out = hf.apply_chat_template(messages, tokenize=True, **kwargs)
    ids = out if isinstance(out, list) else out["input_ids"]
    return [int(i) for i in ids]


def learned_runs(ids, mask, tok):
    """The decoded text of each run of consecutive learned tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return [
        tok._tok.decode(ids[a:b].tolist(), skip_special_tokens=False)
        for a, b in zip(edges[::2], edges[1::2], strict=True)
    ]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_jinja_matches_transformers(tmp_path, tokenizer_json, name):
    from transformers import AutoTokenizer

    directory = model_dir(tmp_path, tokenizer_json, name)
    hf = AutoTokenizer.from_pretrained(str(directory))
    tok = HFTokenizer.from_file(directory)
    template = chat_template(tok.directory)
    assert isinstance(template, JinjaChatTemplate)
    conversations = [CHAT, CHAT[:2]] + ([SYSTEM + CHAT] if name == "chatml" else [])
    for messages in conversations:
        assert template.render(messages) == hf.apply_chat_template(
            messages, tokenize=False
        )
        ids, mask = template.encode(messages, tok)
        assert ids.dtype == np.int32 and mask.dtype == np.float32
        assert ids.tolist() == hf_ids(hf, messages)
        # the add_generation_prompt render is the prompt of a prompt/completion
        prompt, completion = messages[:-1], messages[-1:]
        prompt_ids, completion_ids, _ = template.encode_prompt_completion(
            prompt, completion, tok
        )
        assert prompt_ids.tolist() == hf_ids(hf, prompt, add_generation_prompt=True)
        assert template.render(prompt, add_generation_prompt=True) == (
            hf.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        )
        assert prompt_ids.tolist() + completion_ids.tolist() == hf_ids(hf, messages)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_mask_is_the_assistant_answers_and_their_end_of_turn(
    tmp_path, tokenizer_json, name
):
    directory = model_dir(tmp_path, tokenizer_json, name)
    tok = HFTokenizer.from_file(directory)
    ids, mask = chat_template(directory).encode(CHAT, tok)
    eot = TEMPLATES[name][1]
    answers = [m["content"] + eot for m in CHAT if m["role"] == "assistant"]
    assert learned_runs(ids, mask, tok) == answers
    # prompt/completion: only the completion's answer is learned
    p, c, m = chat_template(directory).encode_prompt_completion(CHAT[:3], CHAT[3:], tok)
    assert learned_runs(c, m, tok) == [answers[-1]]
    assert np.concatenate([p, c]).tolist() == ids.tolist()


def test_raise_exception_is_a_data_error_with_the_templates_message(
    tmp_path, tokenizer_json
):
    from transformers import AutoTokenizer

    directory = model_dir(tmp_path, tokenizer_json, "mistral")
    template, tok = chat_template(directory), HFTokenizer.from_file(directory)
    bad = [CHAT[0], CHAT[0]]
    with pytest.raises(DataError, match="Conversation roles must alternate"):
        template.encode(bad, tok)
    with pytest.raises(DataError, match="Only user and assistant roles"):
        template.encode([CHAT[0], {"role": "system", "content": "x"}], tok)
    hf = AutoTokenizer.from_pretrained(str(directory))
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        hf.apply_chat_template(bad, tokenize=False)


def test_template_from_save_pretrained_jinja_file(tmp_path, tokenizer_json):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(
        str(model_dir(tmp_path / "source", tokenizer_json, "llama3"))
    )
    saved = tmp_path / "saved"
    hf.save_pretrained(str(saved))
    assert (saved / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads(
        (saved / "tokenizer_config.json").read_text()
    )
    tok = HFTokenizer.from_file(saved)
    template = chat_template(saved)
    assert isinstance(template, JinjaChatTemplate)
    assert template.source == LLAMA3
    assert template.encode(CHAT, tok)[0].tolist() == hf_ids(hf, CHAT)
    # the .jinja file itself is a template too (special tokens from its directory)
    from_file = chat_template(saved / "chat_template.jinja")
    assert from_file.encode(CHAT, tok)[0].tolist() == hf_ids(hf, CHAT)


def test_where_templates_come_from(tmp_path, tokenizer_json):
    listed = model_dir(tmp_path / "listed", tokenizer_json, "chatml", as_list=True)
    assert read_chat_template(listed) == CHATML
    # a tokenizer.json path stands for its directory
    assert isinstance(chat_template(listed / "tokenizer.json"), JinjaChatTemplate)
    # transformers 5's file wins over the config
    (listed / "chat_template.jinja").write_text(LLAMA3)
    assert read_chat_template(listed) == LLAMA3
    # AddedToken-style special tokens are passed by their content
    llama = chat_template(model_dir(tmp_path / "llama", tokenizer_json, "llama3"))
    assert llama.special_tokens["eos_token"] == "<|eot_id|>"
    plain = tmp_path / "plain"
    plain.mkdir()
    shutil.copy(tokenizer_json, plain / "tokenizer.json")
    assert read_chat_template(plain) is None
    assert isinstance(chat_template(plain), BuiltinChatTemplate)
    assert isinstance(chat_template(None), BuiltinChatTemplate)
    no_default = tmp_path / "no_default"
    no_default.mkdir()
    (no_default / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "x"}]})
    )
    with pytest.raises(DataError, match="none named 'default'"):
        chat_template(no_default)
    with pytest.raises(DataError, match="does not parse"):
        JinjaChatTemplate("{% for m in messages %}")


def test_boundary_tokens_overlapping_an_answer_are_learned(tmp_path, tokenizer_json):
    """ "assistant: " + answer: byte-level BPE merges the space into " there", a
    token that starts before the answer's span; it carries answer text, so it
    is learned (transformers' assistant-mask rule: any overlap)."""
    source = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    tok = HFTokenizer.from_file(tokenizer_json)
    messages = [
        {"role": "user", "content": "how are you?"},
        {"role": "assistant", "content": "there is"},
    ]
    ids, mask = JinjaChatTemplate(source).encode(messages, tok)
    pieces = [tok._tok.decode([i], skip_special_tokens=False) for i in ids.tolist()]
    assert " there" in pieces  # the straddling token exists
    assert pieces[mask.tolist().index(1.0)] == " there"
    # the newline is what the template writes after the last answer: learned
    assert learned_runs(ids, mask, tok) == [" there is\n"]


def test_template_that_rewrites_earlier_turns_is_masked_by_its_markers():
    """No prefix of this conversation renders as the whole does (the count of
    messages comes first), and its `{% generation %}` blocks still say what to
    learn; tests/test_chat_masks.py has the templates without markers."""
    rewriting = "{{ messages | length }}" + GENERATION
    tok = ByteTokenizer()
    ids, mask = JinjaChatTemplate(rewriting).encode(CHAT, tok)
    runs = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    learned = [tok.decode(ids[a:b]) for a, b in zip(runs[::2], runs[1::2], strict=True)]
    assert learned == [m["content"] + "<|im_end|>" for m in CHAT[1::2]]


def test_jinja_with_byte_tokenizer():
    tok = ByteTokenizer()
    template = JinjaChatTemplate(CHATML)
    ids, mask = template.encode(CHAT, tok)
    assert tok.decode(ids) == template.render(CHAT)
    runs = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    learned = [tok.decode(ids[a:b]) for a, b in zip(runs[::2], runs[1::2], strict=True)]
    assert learned == [m["content"] + "<|im_end|>\n" for m in CHAT[1::2]]
    accented = [
        {"role": "user", "content": "é?"},
        {"role": "assistant", "content": "ça"},
    ]
    ids, mask = template.encode(accented, tok)
    assert tok.decode(ids[mask > 0]) == "ça<|im_end|>\n"


def test_sandbox_and_message_checks():
    tok = ByteTokenizer()
    for source in ("{{ ''.__class__.__mro__ }}", "{% set x = messages.append(1) %}"):
        with pytest.raises(DataError, match="SecurityError"):
            JinjaChatTemplate(source).encode(CHAT, tok)
    template = JinjaChatTemplate(CHATML)
    with pytest.raises(DataError, match="role 'robot'"):
        template.encode([{"role": "robot", "content": "hi"}], tok)
    with pytest.raises(DataError, match="content of type int"):
        template.encode([{"role": "user", "content": 3}], tok)
    with pytest.raises(DataError, match="mapping"):
        template.encode(["hi"], tok)
    # None-valued keys (datasets fills absent struct fields) are dropped
    ids, _ = template.encode([{**CHAT[0], "name": None}, CHAT[1]], tok)
    assert ids.tolist() == template.encode(CHAT[:2], tok)[0].tolist()


def test_builtin_template_fits_the_interface():
    tok = ByteTokenizer()
    builtin = chat_template(None)
    assert isinstance(builtin, ChatTemplate) and isinstance(
        JinjaChatTemplate(CHATML), ChatTemplate
    )
    ids, mask = builtin.encode(CHAT, tok)
    want_ids, want_mask = encode_chat(CHAT, tok)
    assert ids.tolist() == want_ids.tolist() and mask.tolist() == want_mask.tolist()
    p, c, m = builtin.encode_prompt_completion(CHAT[:3], CHAT[3:], tok)
    assert np.concatenate([p, c]).tolist() == ids.tolist()
    assert tok.decode(c[m > 0]) == "It is four." and c[-1] == tok.eos_id
    assert m[-1] == 1 and m[0] == 0  # the `<|assistant|>` header is not learned
    with pytest.raises(DataError, match="role 'tool'"):
        builtin.encode([{"role": "tool", "content": "x"}], tok)
