"""Chat template keyword arguments reach a Jinja template as extra variables, as
`transformers`' `apply_chat_template(messages, **kwargs)` gives them: a record's
`chat_template_kwargs` (a mapping, or a JSON string of one, as TRL reads it) and
`data.chat_template_kwargs` (every record's, TRL's trainer-level
`chat_template_kwargs`), the record's keys winning. Checked token for token
against `transformers` with Qwen3's template, whose generation prompt writes an
empty `<think>` block for `enable_thinking=False`: each comparison also checks
that the variable changed the ids or the mask, so dropping it fails. Names every
render sets (`messages`, `tools`, ...) and values that are not mappings are
refused; the built-in template reads no variables."""

import json
import pathlib

import numpy as np
import pytest

from eqtrain import config as config_lib, data as data_lib
from eqtrain._errors import ConfigError
from eqtrain.data import (
    BuiltinChatTemplate,
    ByteTokenizer,
    HFTokenizer,
    JinjaChatTemplate,
    check_template_kwargs,
    preference_rows,
    sft_rows,
    template_identity,
)
from eqtrain.data._errors import ChatTemplateError
from eqtrain.data.store import _post_parts

from ._bpe import assert_same_rows, byte_bpe, chat_ids as hf_ids, learned_text as runs


transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

QWEN3 = pathlib.Path(__file__).parent / "chat_templates" / "qwen3.jinja"
CHATML = {"eos_token": "<|im_end|>", "pad_token": "<pad>"}
SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
CHAT = [
    {"role": "system", "content": "You are nice."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And in words?"},
    {"role": "assistant", "content": "It is four."},
]
NO_THINKING = {"enable_thinking": False}
# a record's kwargs as a mapping, and as a JSON string
FORMS = {"mapping": NO_THINKING, "json": json.dumps(NO_THINKING)}
THINK = "<think>\n\n</think>\n\n"
SFT = '[task]\nkind = "sft"\n'


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    text = " ".join(m["content"] for m in CHAT) + THINK + "assistant user system"
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    return byte_bpe(path, [text] * 5, SPECIALS, 400)


@pytest.fixture(scope="module")
def tok(tokenizer_file):
    return HFTokenizer.from_file(tokenizer_file)


@pytest.fixture(scope="module")
def hf(tokenizer_file):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), **CHATML)


@pytest.fixture(scope="module")
def template():
    return JinjaChatTemplate(QWEN3.read_text(encoding="utf-8"), CHATML)


def transformers_mask(hf, template, messages, **kwargs):
    """The mask TRL's prompt/completion split gives a one-answer conversation:
    the ids after `apply_chat_template(prompt, add_generation_prompt=True)`."""
    prompt = hf_ids(hf, template, messages[:-1], add_generation_prompt=True, **kwargs)
    whole = hf_ids(hf, template, messages, **kwargs)
    assert whole[: len(prompt)] == prompt
    return whole, [0] * len(prompt) + [1] * (len(whole) - len(prompt))


# -- a record's chat_template_kwargs ----------------------------------------------
@pytest.mark.parametrize("form", list(FORMS))
def test_a_conversations_kwargs_give_transformers_ids_and_mask(tok, hf, template, form):
    """Qwen3 writes the empty `<think>` block of the last answer either way; with
    `enable_thinking=False` it is the generation prompt's, so not learned."""
    one = CHAT[:3]
    want_ids, want_mask = transformers_mask(hf, template, one, **NO_THINKING)
    ids, mask = template.encode(one, tok, chat_template_kwargs=FORMS[form])
    assert ids.tolist() == want_ids
    assert mask.astype(int).tolist() == want_mask
    default_ids, default_mask = transformers_mask(hf, template, one)
    assert want_mask != default_mask  # the variable moved the answer's start
    ids, mask = template.encode(one, tok)
    assert (ids.tolist(), mask.astype(int).tolist()) == (default_ids, default_mask)
    # every turn of a longer chat; in the rows of a record that carries them
    rows, report = sft_rows(
        [{"messages": CHAT, "chat_template_kwargs": FORMS[form]}],
        tok,
        format="chat",
        template=template,
        seq_len=512,
        pack=False,
    )
    assert report.skipped == 0
    whole = hf_ids(hf, template, CHAT, **NO_THINKING)
    n = len(whole) - 1
    assert rows["tokens"][0, :n].tolist() == whole[:-1]
    learned = runs(whole[1:], rows["loss_mask"][0, :n], hf)
    assert learned == ["Four.<|im_end|>\n", "It is four.<|im_end|>\n"]
    default = runs(*template.encode(CHAT, tok), hf)
    assert default == ["Four.<|im_end|>\n", THINK + "It is four.<|im_end|>\n"]


@pytest.mark.parametrize("form", list(FORMS))
def test_a_prompt_completion_pairs_kwargs(tok, hf, template, form):
    """TRL's split with the kwargs in both renders: the prompt ends with the
    empty `<think>` block, the completion is the answer alone."""
    prompt, completion = CHAT[:4], CHAT[4:]
    want = hf_ids(hf, template, prompt, add_generation_prompt=True, **NO_THINKING)
    assert want != hf_ids(hf, template, prompt, add_generation_prompt=True)
    p, c, m = template.encode_prompt_completion(
        prompt, completion, tok, chat_template_kwargs=FORMS[form]
    )
    assert p.tolist() == want
    assert p.tolist() + c.tolist() == hf_ids(hf, template, CHAT, **NO_THINKING)
    assert runs(c, m, hf) == ["It is four.<|im_end|>\n"]
    record = {"prompt": prompt, "completion": completion}
    record["chat_template_kwargs"] = FORMS[form]
    rows, report = sft_rows(
        [record],
        tok,
        format="prompt_completion",
        template=template,
        seq_len=512,
        max_prompt_len=512,
        pack=False,
    )
    assert report.skipped == 0
    ids = p.tolist() + c.tolist()
    assert rows["tokens"][0, : len(ids) - 1].tolist() == ids[:-1]
    assert not rows["loss_mask"][0, : len(p) - 1].any()


def test_a_preference_pairs_kwargs(tok, hf, template):
    prompt = CHAT[:4]
    chosen = [{"role": "assistant", "content": "It is four."}]
    rejected = [{"role": "assistant", "content": "It is five."}]
    record = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    rows, report = preference_rows(
        [{**record, "chat_template_kwargs": NO_THINKING}, record],
        tok,
        template=template,
        seq_len=512,
        max_prompt_len=512,
    )
    assert report.skipped == 0
    want = hf_ids(hf, template, prompt, add_generation_prompt=True, **NO_THINKING)
    learned = rows["chosen_mask"][0]
    assert int(np.argmax(learned > 0)) == len(want) - 1  # the answer after it
    assert not np.array_equal(learned, rows["chosen_mask"][1])


def test_a_grpo_prompt_renders_with_its_kwargs(tok, hf, template):
    messages = CHAT[:2]
    want = hf_ids(hf, template, messages, add_generation_prompt=True, **NO_THINKING)
    assert want != hf_ids(hf, template, messages, add_generation_prompt=True)
    record = {"messages": messages, "chat_template_kwargs": NO_THINKING}
    assert _post_parts.prompt_ids(record, True, tok, template).tolist() == want
    # the config's kwargs alone, and the record's winning over them
    plain = {"messages": messages}
    configured = template.with_kwargs(NO_THINKING)
    assert _post_parts.prompt_ids(plain, True, tok, configured).tolist() == want
    thinking = {**plain, "chat_template_kwargs": {"enable_thinking": True}}
    default = hf_ids(hf, template, messages, add_generation_prompt=True)
    assert _post_parts.prompt_ids(thinking, True, tok, configured).tolist() == default
    # a store's worker rebuilds the template with its kwargs
    spec = _post_parts._template_spec(configured)
    assert _post_parts._template(spec).kwargs == NO_THINKING


# -- the template's kwargs (data.chat_template_kwargs) ------------------------------
def test_the_templates_kwargs_and_the_records_over_them(tok, hf, template):
    prompt = CHAT[:2]
    no = hf_ids(hf, template, prompt, add_generation_prompt=True, **NO_THINKING)
    yes = hf_ids(hf, template, prompt, add_generation_prompt=True)
    assert no != yes

    def rendered(t, **kwargs):
        text = t.render(prompt, add_generation_prompt=True, **kwargs)
        return tok.encode(text).tolist()

    off = template.with_kwargs(NO_THINKING)
    on = template.with_kwargs({"enable_thinking": True, "unread": 1})
    assert rendered(off) == no
    assert rendered(on) == yes
    assert rendered(on, chat_template_kwargs=NO_THINKING) == no  # the record wins
    assert rendered(off, chat_template_kwargs='{"enable_thinking": true}') == yes
    # key by key: a record's other keys leave the template's in place
    assert rendered(off, chat_template_kwargs={"other": 2}) == no
    assert off.with_kwargs({"other": 2}).kwargs == {**NO_THINKING, "other": 2}
    assert template.kwargs == {}  # with_kwargs made a new template


def test_kwargs_override_special_tokens_as_in_transformers(tok):
    source = "{{ eos_token }}|{{ flag }}"
    t = JinjaChatTemplate(source, CHATML, kwargs={"flag": "on"})
    assert t.render(CHAT[:1]) == "<|im_end|>|on"
    assert t.render(CHAT[:1], chat_template_kwargs={"eos_token": "E"}) == "E|on"


def test_the_store_key_follows_the_kwargs(template):
    plain_key = template_identity(template)
    assert len(plain_key) == 4  # a template without kwargs: its key as before
    off = template_identity(template.with_kwargs(NO_THINKING))
    on = template_identity(template.with_kwargs({"enable_thinking": True}))
    assert len({json.dumps(k) for k in (plain_key, off, on)}) == 3
    assert data_lib.MASK_RULE == 4  # stores made before kwargs reached templates


def test_the_config_key_reaches_the_jobs_template_and_rows_key(
    tokenizer_file, tmp_path
):
    from eqtrain.job import _build, _resolve, _rows

    train = tmp_path / "chat.jsonl"
    train.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(8)))

    def config(*extra):
        return config_lib.load(
            None,
            [
                f"run_dir={tmp_path / 'run'}",
                "task.kind=sft",
                f"data.train={train}",
                "data.eval=none",
                f"data.tokenizer={tokenizer_file}",
                f"data.chat_template={QWEN3}",
                f"data.cache={tmp_path / 'cache'}",
                "model.hidden_size=32",
                "model.num_layers=1",
                "data.seq_len=64",
                "data.batch_size=8",
                "data.pack=false",
                *extra,
            ],
        )

    plain = config()
    assert plain.data.chat_template_kwargs == ""
    assert _resolve.chat_template(plain, None).kwargs == {}
    given = config('data.chat_template_kwargs={"enable_thinking": false}')
    assert given.data.chat_template_kwargs == '{"enable_thinking": false}'
    assert _resolve.chat_template(given, None).kwargs == NO_THINKING
    # the rows' cache key, and the rows themselves, follow it
    jobs = [_build.build(c) for c in (plain, given)]
    keys = [_rows._post_identity(j, train)["template"] for j in jobs]
    assert keys[0] != keys[1]
    rows = [_rows.train_rows(j) for j in jobs]
    masks = [r.take(np.arange(r.num_rows))["loss_mask"] for r in rows]
    assert rows[0].directory != rows[1].directory  # a store each
    assert masks[0].sum() > masks[1].sum()  # the <think> block is not learned
    # the config reads back from its TOML, as a table or a string
    text = config_lib.to_toml(given)
    assert 'chat_template_kwargs = "{\\"enable_thinking\\": false}"' in text
    path = tmp_path / "c.toml"
    tables = [
        "[data]\nchat_template_kwargs = {enable_thinking = false}\n",
        '[data]\nchat_template_kwargs = "{\\"enable_thinking\\": false}"\n',
        "[data.chat_template_kwargs]\nenable_thinking = false\n",
    ]
    for table in tables:
        path.write_text(SFT + table)
        read = config_lib.load(path, [f"data.train={train}"]).data
        assert read.chat_template_kwargs == given.data.chat_template_kwargs
    # an lm run's plain text has no template (as for data.chat_template)
    path.write_text(tables[0])
    with pytest.raises(ConfigError, match="applies to post-training data"):
        config_lib.load(path, [])


# -- generation prompts -------------------------------------------------------------
def test_generate_and_sample_prompts_carry_their_kwargs(tok, hf, template, tmp_path):
    from eqtrain import job
    from eqtrain.job import _samples
    from eqtrain.job._generate import Generator

    m = Generator(None, tok, (), pathlib.Path("model"), template, None)
    messages = CHAT[:2]
    ids = job.prompt_tokens(m, messages, chat=True, chat_template_kwargs=NO_THINKING)
    assert ids.tolist() == hf_ids(
        hf, template, messages, add_generation_prompt=True, **NO_THINKING
    )
    with pytest.raises(ConfigError, match="'chat_template_kwargs' needs --chat"):
        job.prompt_tokens(m, "2 + 2?", chat=False, chat_template_kwargs=NO_THINKING)
    with pytest.raises(ConfigError, match="sets 'tools'"):
        job.prompt_tokens(m, messages, chat=True, chat_template_kwargs={"tools": []})
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"messages": messages, "chat_template_kwargs": NO_THINKING},
        {"prompt": "x"},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    _, extras = _samples.read_prompts(path)
    assert [e["chat_template_kwargs"] for e in extras] == [NO_THINKING, None]


# -- no kwargs, the built-in template, and refusals ---------------------------------
@pytest.mark.parametrize("none", [None, {}, "", " ", "{}", "null"])
def test_no_kwargs_is_as_before(tok, template, none):
    assert check_template_kwargs(none) == {}
    assert_same_rows(tok, template, CHAT, chat_template_kwargs=none)


def test_the_builtin_template_ignores_kwargs():
    builtin, tok = BuiltinChatTemplate(), ByteTokenizer()
    chat = CHAT[1:3]
    want = builtin.encode(chat, tok)
    got = builtin.encode(chat, tok, chat_template_kwargs=NO_THINKING)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)
    rows, report = sft_rows(
        [{"messages": chat, "chat_template_kwargs": NO_THINKING}], tok, seq_len=64
    )
    assert report.skipped == 0
    with pytest.raises(ChatTemplateError, match="sets 'messages'"):
        builtin.encode(chat, tok, chat_template_kwargs={"messages": []})


BAD = {
    "messages": ({"messages": []}, "sets 'messages'"),
    "tools": ({"tools": None}, "sets 'tools'"),
    "documents": ('{"documents": []}', "sets 'documents'"),
    "add_generation_prompt": ({"add_generation_prompt": True}, "sets 'add_gen"),
    "a list": ([["enable_thinking", False]], "is a list"),
    "a json list": ("[1]", "is a JSON string of a list"),
    "a number": (3, "is a number"),
    "bad json": ("{enable_thinking", "not valid JSON"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_malformed_kwargs_are_refused(tok, template, case):
    value, said = BAD[case]
    with pytest.raises(ChatTemplateError, match=said) as error:
        template.encode(CHAT, tok, chat_template_kwargs=value)
    assert "'chat_template_kwargs'" in str(error.value)
    # in a pipeline: the record is skipped, its reason counted
    records = [{"messages": CHAT}, {"messages": CHAT, "chat_template_kwargs": value}]
    _, report = sft_rows(records, tok, format="chat", template=template, seq_len=512)
    assert report.kept == 1 and report.reasons == {error.value.reason: 1}
    # as the template's own kwargs, and as the config's
    with pytest.raises(ChatTemplateError, match=said):
        JinjaChatTemplate(template.source, kwargs=value)
    with pytest.raises(ConfigError, match="`data.chat_template_kwargs`") as error:
        config_lib.from_dict({"data": {"chat_template_kwargs": value}})
    assert said in str(error.value)


def test_a_toml_date_in_the_config_is_refused():
    """TOML has dates and times, JSON (and a template's variables as
    transformers gets them from JSON) does not: refused by name, not turned
    into a placeholder."""
    import datetime

    value = {"today": datetime.date(2026, 12, 7)}
    with pytest.raises(ConfigError, match="a TOML date: write it as a string"):
        config_lib.from_dict({"data": {"chat_template_kwargs": value}})
