"""Assistant masks for any chat template, with the published templates of the
most fine-tuned families (tests/chat_templates/, as data) and a tiny byte-level
BPE holding their special tokens:

- a template with `{% generation %}` markers (TRL's training templates, read from
  the installed `trl`) gives transformers' `return_assistant_tokens_mask`, token
  for token;
- a template without markers, including those that rewrite earlier turns
  (Qwen3's think block on the last answer only, Phi-3's EOS after the last turn,
  DeepSeek-R1's dropped reasoning, Mistral Nemo's system prompt in the last user
  turn), is masked from the render of the whole conversation: what TRL learns
  with its training template, except where the original template itself writes
  the turn differently (each such difference is spelled out below);
- multi-turn sets, with system prompts and tool calls where the template takes
  them, train with nothing skipped; a skip says which template behaviour caused it.
"""

import pathlib
import re

import numpy as np
import pytest

from eqtrain.data import HFTokenizer, JinjaChatTemplate, sft_rows
from eqtrain.data._errors import ChatTemplateError

from ._bpe import byte_bpe


transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
pytest.importorskip("tokenizers")

HERE = pathlib.Path(__file__).parent / "chat_templates"
TRL_TEMPLATES = pathlib.Path(trl.__file__).parent / "chat_templates"

SPECIALS = [
    "<pad>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
    "<|endoftext|>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
]
CHATML = {"eos_token": "<|im_end|>", "pad_token": "<pad>"}
LLAMA = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
GEMMA = {"bos_token": "<bos>", "eos_token": "<eos>"}
PHI = {"eos_token": "<|endoftext|>"}
R1 = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
MISTRAL = {"bos_token": "<s>", "eos_token": "</s>"}

# name: (special tokens, TRL's training template or None, takes a system
# message, takes tool calls)
FAMILIES = {
    "qwen3": (CHATML, "qwen3_training", True, True),
    "qwen2_5": (CHATML, "qwen2_5_training", True, True),
    "llama3": (LLAMA, "llama3_training", True, False),
    "llama3_1": (LLAMA, None, True, True),
    "llama3_2": (LLAMA, None, True, True),
    "gemma": (GEMMA, "gemma_training", False, False),
    "gemma3": (GEMMA, "gemma3_training", True, False),
    "phi3": (PHI, "phi3_training", True, False),
    "phi3_5": (PHI, "phi3_5_training", True, False),
    "deepseek_r1_distill": (R1, "deepseek_r1_distill_training", True, False),
    "mistral": (MISTRAL, None, False, False),
    "mistral_nemo": (MISTRAL, None, True, False),
    "smollm3": (CHATML, None, True, False),
}
TRAINED = [name for name, family in FAMILIES.items() if family[1]]

CHAT = [
    {"role": "user", "content": "Hello there, how are you?"},
    {"role": "assistant", "content": "I am fine, thank you."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four."},
    {"role": "user", "content": "And the answer?"},
    {"role": "assistant", "content": "The answer is 42."},
]
SYSTEM = [{"role": "system", "content": "You are nice."}]
REASONING = [
    {"role": "user", "content": "What is two plus two?"},
    {
        "role": "assistant",
        "content": "<think>\nLet me think about it.\n</think>\n\nIt is four.",
    },
    {"role": "user", "content": "And the answer?"},
    {
        "role": "assistant",
        "content": "<think>\nTwo plus two.\n</think>\n\nThe answer is 42.",
    },
]
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}
TOOLS = [
    *SYSTEM,
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "name": "add", "content": "4"},
    {"role": "assistant", "content": "It is four."},
    {"role": "user", "content": "And the answer?"},
    {"role": "assistant", "content": "The answer is 42."},
]


def chats(name):
    """The conversations `name`'s template takes."""
    _, _, system, tools = FAMILIES[name]
    out = {"chat": CHAT, "reasoning": REASONING}
    if system:
        out["system"] = SYSTEM + CHAT
    if tools:
        out["tools"] = TOOLS
    return out


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A tiny byte-level BPE (lossless, so learned text can be read back) with
    every family's special tokens."""
    text = " ".join(m["content"] for m in CHAT + REASONING + TOOLS)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    return byte_bpe(path, [text] * 5, SPECIALS, 500)


def hf_tokenizer(path, name):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(path), **FAMILIES[name][0])


def original(name):
    source = (HERE / f"{name}.jinja").read_text(encoding="utf-8")
    return JinjaChatTemplate(source, FAMILIES[name][0])


def training_source(name):
    return (TRL_TEMPLATES / f"{FAMILIES[name][1]}.jinja").read_text(encoding="utf-8")


def runs(ids, mask, hf):
    """The decoded text of each run of consecutive learned tokens."""
    mask = np.asarray(mask, np.int64)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    ids = [int(i) for i in ids]
    return [hf.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def trl_runs(hf, name, messages):
    """What TRL learns: transformers' assistant mask on TRL's training template."""
    out = hf.apply_chat_template(
        messages,
        chat_template=training_source(name),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return runs(out["input_ids"], out["assistant_masks"], hf)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_renders_and_ids_equal_transformers(tokenizer_file, name):
    hf, tok, template = hf_tokenizer(tokenizer_file, name), None, original(name)
    tok = HFTokenizer.from_file(tokenizer_file)
    for messages in chats(name).values():
        text = hf.apply_chat_template(
            messages, chat_template=template.source, tokenize=False
        )
        assert template.render(messages) == text
        ids, mask = template.encode(messages, tok)
        assert ids.tolist() == hf(text, add_special_tokens=False)["input_ids"]
        assert mask.any()


@pytest.mark.parametrize("name", TRAINED)
def test_generation_markers_give_transformers_mask_token_for_token(
    tokenizer_file, name
):
    hf, tok = hf_tokenizer(tokenizer_file, name), HFTokenizer.from_file(tokenizer_file)
    template = JinjaChatTemplate(training_source(name), FAMILIES[name][0])
    assert template.marked
    for messages in chats(name).values():
        out = hf.apply_chat_template(
            messages,
            chat_template=template.source,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
        ids, mask = template.encode(messages, tok)
        assert ids.tolist() == list(out["input_ids"])
        assert mask.astype(int).tolist() == list(out["assistant_masks"])


def _drop_reasoning(run):
    """A run without the `<think>...</think>` block the original template drops."""
    return re.sub(r"^<think>.*?</think>\n\n", "", run, flags=re.S)


# What the original template writes differently from TRL's training template, per
# turn (`last`: the answer to the last user query): TRL's run -> ours.
DIFFERENCES = {
    # Qwen3 writes the think block (empty, or the reasoning) on answers after the
    # last user query only; TRL's template writes it on every answer.
    "qwen3": lambda run, last: run if last else _drop_reasoning(run),
    # TRL's generation block opens before the "\n" of `<|im_start|>assistant\n`,
    # which is the end of the generation prompt the model is given.
    "qwen2_5": lambda run, last: run.removeprefix("\n"),
    # TRL's block opens before `<｜Assistant｜>`, the generation prompt's start;
    # the original drops every answer's reasoning (all up to `</think>`).
    "deepseek_r1_distill": lambda run, last: run.removeprefix("<｜Assistant｜>").split(
        "</think>"
    )[-1],
}


@pytest.mark.parametrize("name", TRAINED)
def test_learned_tokens_equal_trls_on_its_training_templates(tokenizer_file, name):
    """The default suite compares every family TRL has a training template for
    (Qwen3 and Phi-3 among them)."""
    hf, tok = hf_tokenizer(tokenizer_file, name), HFTokenizer.from_file(tokenizer_file)
    template = original(name)
    assert not template.marked
    differs = DIFFERENCES.get(name, lambda run, last: run)
    for kind, messages in chats(name).items():
        expected = trl_runs(hf, name, messages)
        answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        last_query = max(i for i, m in enumerate(messages) if m["role"] == "user")
        expected = [
            differs(r, i > last_query) for r, i in zip(expected, answers, strict=True)
        ]
        ids, mask = template.encode(messages, tok)
        assert runs(ids, mask, hf) == expected, kind


def test_phi3_learns_eos_after_the_last_turn_only(tokenizer_file):
    hf, tok = (
        hf_tokenizer(tokenizer_file, "phi3"),
        HFTokenizer.from_file(tokenizer_file),
    )
    ids, mask = original("phi3").encode(CHAT, tok)
    assert runs(ids, mask, hf) == [
        "I am fine, thank you.<|end|>\n",
        "It is four.<|end|>\n",
        "The answer is 42.<|end|>\n<|endoftext|>",
    ]


# Templates TRL has no training version of: the learned text, written out.
EXPECTED = {
    "mistral": (
        "chat",
        ["I am fine, thank you.</s>", "It is four.</s>", "The answer is 42.</s>"],
    ),
    # the system prompt goes into the last user turn: of the prompt when an
    # answer is asked for, of no turn in a conversation that ends with one
    "mistral_nemo": (
        "system",
        ["I am fine, thank you.</s>", "It is four.</s>", "The answer is 42.</s>"],
    ),
    "smollm3": (
        "reasoning",
        [
            "<think>\nLet me think about it.\n</think>\n\nIt is four.<|im_end|>\n",
            "<think>\nTwo plus two.\n</think>\n\nThe answer is 42.<|im_end|>\n",
        ],
    ),
    "llama3_1": (
        "tools",
        [
            '{"name": "add", "parameters": {"a": 2, "b": 2}}<|eot_id|>',
            "It is four.<|eot_id|>",
            "The answer is 42.<|eot_id|>",
        ],
    ),
    "llama3_2": (
        "tools",
        [
            '{"name": "add", "parameters": {"a": 2, "b": 2}}<|eot_id|>',
            "It is four.<|eot_id|>",
            "The answer is 42.<|eot_id|>",
        ],
    ),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_templates_without_a_trl_training_version(tokenizer_file, name):
    hf, tok = hf_tokenizer(tokenizer_file, name), HFTokenizer.from_file(tokenizer_file)
    kind, expected = EXPECTED[name]
    ids, mask = original(name).encode(chats(name)[kind], tok)
    assert runs(ids, mask, hf) == expected


def test_tool_calls_are_learned_and_tool_results_are_not(tokenizer_file):
    hf, tok = (
        hf_tokenizer(tokenizer_file, "qwen3"),
        HFTokenizer.from_file(tokenizer_file),
    )
    ids, mask = original("qwen3").encode(TOOLS, tok)
    learned = runs(ids, mask, hf)
    assert learned[0] == (
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
        "<|im_end|>\n"
    )
    assert not any("tool_response" in run for run in learned)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_multi_turn_sets_train_with_nothing_skipped(tokenizer_file, name):
    tok = HFTokenizer.from_file(tokenizer_file)
    records = [{"messages": m} for m in chats(name).values() for _ in range(3)]
    rows, report = sft_rows(
        records, tok, format="chat", template=original(name), seq_len=2048, pack=False
    )
    assert report.skipped == 0, str(report)
    assert rows["loss_mask"].sum(axis=1).min() > 0


@pytest.mark.parametrize(
    "name", ["qwen3", "phi3", "deepseek_r1_distill", "mistral_nemo"]
)
def test_prompt_completion_split_of_templates_that_rewrite_turns(tokenizer_file, name):
    """A preference pair's prompt is the conversation up to the generation
    prompt, and prompt + completion is the whole conversation's tokens."""
    hf, tok = hf_tokenizer(tokenizer_file, name), HFTokenizer.from_file(tokenizer_file)
    template = original(name)
    messages = chats(name)["system" if FAMILIES[name][2] else "chat"]
    ids, mask = template.encode(messages, tok)
    prompt, completion, completion_mask = template.encode_prompt_completion(
        messages[:-1], messages[-1:], tok
    )
    assert np.concatenate([prompt, completion]).tolist() == ids.tolist()
    assert runs(completion, completion_mask, hf) == runs(ids, mask, hf)[-1:]


def test_a_template_that_drops_an_answer_says_so(tokenizer_file):
    tok = HFTokenizer.from_file(tokenizer_file)
    # renders only the last assistant answer
    source = (
        "{% for m in messages %}{% if m.role == 'user' %}<|user|>{{ m.content }}"
        "{% elif loop.last %}<|assistant|>{{ m.content }}<|end|>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    template = JinjaChatTemplate(source)
    with pytest.raises(ChatTemplateError, match="assistant message 1") as error:
        template.encode(CHAT, tok)
    assert (
        error.value.reason
        == "with a chat template that does not render an assistant message"
    )
    _, report = sft_rows(
        [{"messages": CHAT}, {"messages": CHAT[:2]}],
        tok,
        format="chat",
        template=template,
        seq_len=256,
    )
    assert report.kept == 1 and list(report.reasons) == [error.value.reason]


def test_a_template_that_rewrites_later_turns_by_an_answer_says_so(tokenizer_file):
    tok = HFTokenizer.from_file(tokenizer_file)
    # the closing line repeats the first answer
    source = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
        "(first answer: {{ messages[1].content if messages | length > 1 else '' }})"
    )
    with pytest.raises(ChatTemplateError) as error:
        JinjaChatTemplate(source).encode(CHAT, tok)
    assert "rewrites later turns" in error.value.reason


def test_smollm3_no_think_block_is_the_generation_prompts(tokenizer_file):
    """With `/no_think` SmolLM3 writes an empty think block on every answer and
    at the end of its generation prompt: the model is given it, so it is not
    learned."""
    hf, tok = (
        hf_tokenizer(tokenizer_file, "smollm3"),
        HFTokenizer.from_file(tokenizer_file),
    )
    messages = [{"role": "system", "content": "Be brief. /no_think"}, *CHAT]
    template = original("smollm3")
    assert template.render(messages).count("<think>\n\n</think>\n") == 3
    ids, mask = template.encode(messages, tok)
    assert runs(ids, mask, hf) == [
        "I am fine, thank you.<|im_end|>\n",
        "It is four.<|im_end|>\n",
        "The answer is 42.<|im_end|>\n",
    ]
