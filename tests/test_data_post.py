"""Post-training rows: SFT rows (chat, prompt/completion) and preference pairs,
their masks, packing, prompt truncation, the skip report, and files read through
`from_files`."""

import json

import numpy as np
import pytest

from eqtrain import ConfigError
from eqtrain.data import (
    ByteTokenizer,
    DataError,
    HFTokenizer,
    JinjaChatTemplate,
    SkipReport,
    from_files,
    infer_format,
    preference_rows,
    sft_rows,
)

from .test_data_chat import CHATML, build_bpe, learned_runs


BYTES = ByteTokenizer()
PREFERENCE_KEYS = {
    f"{side}_{part}"
    for side in ("chosen", "rejected")
    for part in ("tokens", "targets", "mask")
}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


CHATS = [
    {"messages": [user("hi"), assistant("hello"), user("2+2?"), assistant("4")]},
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            user("x"),
            assistant("y"),
        ]
    },
    {"messages": [user("name?"), assistant("eq")]},
]
PAIRS = [
    {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
    {"prompt": "2+2=", "chosen": "4", "rejected": "five"},
]
CONVERSATIONAL_PAIRS = [
    {
        "prompt": [user("Hello there, how are you?")],
        "chosen": [assistant("I am fine, thank you.")],
        "rejected": [assistant("The weather is nice.")],
    },
    {
        "prompt": [user("What is two plus two?"), assistant("It is four."), user("?")],
        "chosen": [assistant("four")],
        "rejected": [assistant("two")],
    },
]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """An HF tokenizer with a ChatML template next to it."""
    directory = tmp_path_factory.mktemp("hf")
    build_bpe(directory)
    config = {"eos_token": "<|im_end|>", "pad_token": "<pad>", "chat_template": CHATML}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return HFTokenizer.from_file(directory)


def learned_targets(rows, mask_key="loss_mask", targets_key="targets"):
    """The targets with loss, row by row, as one id list."""
    return rows[targets_key][rows[mask_key] > 0].tolist()


def check_sft_rows(rows, seq_len):
    assert set(rows) == {"tokens", "targets", "loss_mask", "segment_ids"}
    for key, value in rows.items():
        assert value.shape[1] == seq_len
        assert value.dtype == (np.float32 if key == "loss_mask" else np.int32)
    # loss never crosses an example: a learned target is in its input's segment
    tok_seg, mask = rows["segment_ids"], rows["loss_mask"]
    inner = mask[:, :-1] > 0
    assert (tok_seg[:, 1:][inner] == tok_seg[:, :-1][inner]).all()
    assert (tok_seg[mask > 0] > 0).all()


def test_infer_format():
    assert infer_format(CHATS) == "chat"
    assert infer_format(PAIRS) == "preference"
    assert infer_format({"chosen": [[]], "rejected": [[]]}) == "preference"
    assert infer_format([{"prompt": "a", "completion": "b"}]) == "prompt_completion"
    assert infer_format({"text": ["a"]}) == "text"
    with pytest.raises(DataError, match=r"\['answer', 'question'\]"):
        infer_format([{"question": "a", "answer": "b"}])


# -- SFT --------------------------------------------------------------------------
def test_chat_rows_learn_only_assistant_turns_and_pack_by_segment():
    rows, report = sft_rows(CHATS, BYTES, seq_len=96, format="chat")
    check_sft_rows(rows, 96)
    assert report == SkipReport(total=3, kept=3) and str(report) == ""
    answers = [a for c in CHATS for a in _answers(c["messages"])]
    want = [i for a in answers for i in [*BYTES.encode(a).tolist(), BYTES.eos_id]]
    assert learned_targets(rows) == want
    # three examples (63, 48 and 33 tokens) packed into two rows of 97
    assert len(rows["tokens"]) == 2
    assert sorted(set(rows["segment_ids"][1].tolist())) == [0, 1, 2]


def _answers(messages):
    return [m["content"] for m in messages if m["role"] == "assistant"]


def test_chat_rows_with_a_jinja_template(hf):
    template = JinjaChatTemplate(CHATML)
    rows, _ = sft_rows(CHATS, hf, seq_len=128, format="chat", template=template)
    check_sft_rows(rows, 128)
    text = hf._tok.decode(learned_targets(rows), skip_special_tokens=False)
    answers = [a for c in CHATS for a in _answers(c["messages"])]
    assert text == "".join(a + "<|im_end|>\n" for a in answers)
    # a template given as a tokenizer directory is read from there
    again, _ = sft_rows(CHATS, hf, seq_len=128, format="chat", template=hf.directory)
    assert all((again[k] == rows[k]).all() for k in rows)


def test_string_prompt_completion_rows():
    records = [
        {"prompt": "Q: 1+1? A:", "completion": " 2"},
        {"prompt": "a", "completion": "b"},
    ]
    rows, _ = sft_rows(records, BYTES, seq_len=24, format="prompt_completion")
    check_sft_rows(rows, 24)
    want = [*BYTES.encode(" 2").tolist(), BYTES.eos_id, ord("b"), BYTES.eos_id]
    assert learned_targets(rows) == want
    columns = {k: [r[k] for r in records] for k in ("prompt", "completion")}
    same, _ = sft_rows(columns, BYTES, seq_len=24)  # a mapping of columns
    assert all((same[k] == rows[k]).all() for k in rows)
    # BOS + prompt + completion + EOS
    first = [BYTES.bos_id, *BYTES.encode("Q: 1+1? A: 2").tolist(), BYTES.eos_id]
    assert rows["tokens"][0, : len(first) - 1].tolist() == first[:-1]
    # one example per row: padding is masked and outside the segment
    rows, _ = sft_rows(
        records, BYTES, seq_len=24, format="prompt_completion", pack=False
    )
    check_sft_rows(rows, 24)
    assert rows["tokens"].shape == (2, 24)
    # BOS a b EOS: EOS is an input too (its target is padding, not learned)
    assert rows["segment_ids"][1].tolist() == [1] * 4 + [0] * 20
    assert rows["tokens"][1, 4:].tolist() == [BYTES.pad_id] * 20
    assert learned_targets(rows) == want


def test_conversational_prompt_completion_rows(hf):
    records = [
        {"prompt": [user("Hello there")], "completion": [assistant("I am fine.")]},
        {"prompt": [user("how are you?")], "completion": [assistant("fine")]},
    ]
    rows, _ = sft_rows(records, hf, seq_len=64, template=JinjaChatTemplate(CHATML))
    text = hf._tok.decode(learned_targets(rows), skip_special_tokens=False)
    assert text == "I am fine.<|im_end|>\nfine<|im_end|>\n"
    rows, _ = sft_rows(records, BYTES, seq_len=64)  # the built-in template
    assert BYTES.decode(learned_targets(rows)) == "I am fine.fine"


def test_long_prompts_keep_their_end_and_long_rows_are_skipped():
    records = [
        {"prompt": "0123456789abcdef", "completion": "XY"},
        {"prompt": "p", "completion": "Z" * 20},  # too long even with a short prompt
    ]
    rows, report = sft_rows(
        records, BYTES, seq_len=16, format="prompt_completion", pack=False
    )
    # BOS kept, then the last 7 prompt bytes (max_prompt_len default: 16 // 2)
    want = [BYTES.bos_id, *BYTES.encode("9abcdefXY").tolist(), BYTES.eos_id]
    assert rows["tokens"][0, : len(want) - 1].tolist() == want[:-1]
    assert report.reasons == {"longer than 17 tokens after truncating the prompt": 1}
    assert report.first == {"longer than 17 tokens after truncating the prompt": 1}
    assert str(report) == (
        "1 of 2 rows skipped: 1 longer than 17 tokens after truncating the prompt "
        "(first: row 1)"
    )
    rows, _ = sft_rows(
        records[:1], BYTES, seq_len=16, max_prompt_len=3, format="prompt_completion"
    )
    assert rows["tokens"][0, :3].tolist() == [BYTES.bos_id, ord("e"), ord("f")]
    with pytest.raises(ConfigError, match="max_prompt_len"):
        sft_rows(records, BYTES, seq_len=16, max_prompt_len=17)


def test_long_chats_keep_their_start():
    long_user = {"messages": [user("u" * 30), assistant("a")]}
    long_answer = {"messages": [user("q"), assistant("b" * 40)]}
    rows, report = sft_rows([long_user, long_answer], BYTES, seq_len=32, pack=False)
    assert report.reasons == {"with no assistant token in the first 33 tokens": 1}
    assert report.first["with no assistant token in the first 33 tokens"] == 0
    # the kept row is the long answer's start: BOS <|user|>\nq\n<|assistant|>\nbbb...
    assert BYTES.decode(learned_targets(rows)) == "b" * 7


def test_every_skip_reason_is_counted():
    good = {"messages": [user("q"), assistant("a")]}
    records = [
        good,
        {"other": 1},
        {"messages": "not a list"},
        {"messages": [{"role": "robot", "content": "x"}, assistant("a")]},
        {"messages": [user("q"), {"role": "assistant", "content": 3}]},
        {"messages": [user("q"), user("again")]},
        {"messages": ["q", assistant("a")]},
        {"messages": [user("u" * 40), assistant("a")]},
        good,
    ]
    _, report = sft_rows(records, BYTES, seq_len=32, format="chat")
    assert (report.total, report.kept, report.skipped) == (9, 2, 7)
    assert report.reasons == {
        "missing 'messages'": 1,
        "with messages that are not a list": 1,
        "with a message role the template does not know": 1,
        "with a message content that is not a string": 1,
        "with no assistant message": 1,
        "with a message that is not a {role, content} mapping": 1,
        "with no assistant token in the first 33 tokens": 1,
    }
    assert report.first["with no assistant message"] == 5
    completions = [
        {"prompt": "q", "completion": "a"},
        {"prompt": "q", "completion": "  "},
        {"prompt": "q", "completion": [assistant("a")]},
        {"prompt": 3, "completion": 4},
        {"prompt": [user("q")], "completion": []},
        {"completion": "a"},
    ]
    _, report = sft_rows(completions, BYTES, seq_len=32, format="prompt_completion")
    assert report.reasons == {
        "with an empty completion": 2,
        "with 'prompt' and 'completion' not both text or both message lists": 2,
        "missing 'prompt'": 1,
    }
    assert "5 of 6 rows skipped: 2 with an empty completion (first: row 1)" in str(
        report
    )


def test_template_refusals_are_skips(hf):
    template = JinjaChatTemplate(
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('no system prompts') }}{% endif %}"
        "{{ m.role + ': ' + m.content + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    _, report = sft_rows(CHATS, hf, seq_len=64, format="chat", template=template)
    assert report.reasons == {"rejected by the chat template (no system prompts)": 1}
    # a completion without an assistant turn has nothing to learn
    records = [
        {"prompt": [user("q")], "completion": [assistant("a")]},
        {"prompt": [user("q")], "completion": [{"role": "tool", "content": "42"}]},
    ]
    _, report = sft_rows(records, hf, seq_len=64, template=JinjaChatTemplate(CHATML))
    assert report.reasons == {"with no completion token to learn": 1}


def test_all_bad_and_empty_data_are_errors():
    bad = [{"prompt": "q", "completion": ""}, {"prompt": "q"}]
    with pytest.raises(DataError, match=r"all 2 rows were skipped: 1 with an empty"):
        sft_rows(bad, BYTES, seq_len=8, format="prompt_completion")
    with pytest.raises(DataError, match="no records"):
        sft_rows([], BYTES, seq_len=8, format="chat")
    with pytest.raises(DataError, match="1 with chosen == rejected"):
        preference_rows(
            [{"prompt": "a", "chosen": "b", "rejected": "b"}], BYTES, seq_len=8
        )
    with pytest.raises(ConfigError, match="preference_rows"):
        sft_rows(PAIRS, BYTES, seq_len=8)


# -- preference -------------------------------------------------------------------
def check_pairs(rows, n, seq_len, pad):
    assert set(rows) == PREFERENCE_KEYS
    for key, value in rows.items():
        assert value.shape == (n, seq_len)
        assert value.dtype == (np.float32 if key.endswith("mask") else np.int32)
    for side in ("chosen", "rejected"):
        # right padding: pad id in, target 0 and mask 0 out; masks within the real part
        real = rows[f"{side}_targets"] != 0
        pad_part = ~np.maximum.accumulate(real[:, ::-1], axis=1)[:, ::-1]
        assert (rows[f"{side}_tokens"][pad_part] == pad).all()
        assert (rows[f"{side}_mask"][pad_part] == 0).all()


def prompt_length(rows, i):
    """Where chosen and rejected first differ in their targets' masks."""
    return int(np.argmax(rows["chosen_mask"][i] > 0))


def test_string_preference_rows():
    rows, report = preference_rows(PAIRS, BYTES, seq_len=32)
    check_pairs(rows, 2, 32, BYTES.pad_id)
    assert report.kept == 2
    for i, pair in enumerate(PAIRS):
        for side in ("chosen", "rejected"):
            learned = rows[f"{side}_targets"][i][rows[f"{side}_mask"][i] > 0].tolist()
            assert learned == [*BYTES.encode(pair[side]).tolist(), BYTES.eos_id]
        # the same prompt tokens on both sides
        p = len(pair["prompt"]) + 1
        assert (rows["chosen_tokens"][i, :p] == rows["rejected_tokens"][i, :p]).all()
        assert rows["chosen_tokens"][i, 0] == BYTES.bos_id


def test_conversational_preference_rows_explicit_and_implicit(hf):
    template = JinjaChatTemplate(CHATML)
    rows, _ = preference_rows(CONVERSATIONAL_PAIRS, hf, seq_len=64, template=template)
    check_pairs(rows, 2, 64, hf.pad_id)
    for i, pair in enumerate(CONVERSATIONAL_PAIRS):
        p = prompt_length(rows, i)
        assert (
            rows["chosen_tokens"][i, : p + 1] == rows["rejected_tokens"][i, : p + 1]
        ).all()
        for side in ("chosen", "rejected"):
            ids = rows[f"{side}_targets"][i]
            runs = learned_runs(ids, rows[f"{side}_mask"][i], hf)
            assert runs == [pair[side][0]["content"] + "<|im_end|>\n"]
    implicit = [
        {"chosen": p["prompt"] + p["chosen"], "rejected": p["prompt"] + p["rejected"]}
        for p in CONVERSATIONAL_PAIRS
    ]
    again, _ = preference_rows(implicit, hf, seq_len=64, template=template)
    assert all((again[k] == rows[k]).all() for k in rows)


def test_preference_skips():
    records = [
        PAIRS[0],
        {"prompt": "a", "chosen": "b", "rejected": "b"},
        {"chosen": "b", "rejected": "c"},
        {"prompt": "a", "chosen": "b" * 30, "rejected": "c"},
        {"prompt": "a", "chosen": "", "rejected": "c"},
        {"prompt": "a", "chosen": [assistant("b")], "rejected": "c"},
        {
            "chosen": [user("q"), assistant("a")],
            "rejected": [user("q"), assistant("a")],
        },
    ]
    rows, report = preference_rows(records, BYTES, seq_len=24)
    assert len(rows["chosen_tokens"]) == 1
    assert report.reasons == {
        "with chosen == rejected": 2,
        "missing 'prompt'": 1,
        "longer than 25 tokens after truncating the prompt": 1,
        "with an empty chosen or rejected completion": 1,
        "with 'prompt', 'chosen' and 'rejected' not all text or all message lists": 1,
    }
    assert report.first["with chosen == rejected"] == 1


def test_preference_rows_feed_preference_loss_fn():
    import jax.numpy as jnp

    from eqtrain.post_training.preference import preference_loss_fn

    rows, _ = preference_rows(PAIRS, BYTES, seq_len=16)
    uniform = lambda tokens, key=None: jnp.zeros((tokens.shape[0], BYTES.vocab_size))
    loss, aux = preference_loss_fn("simpo")(uniform, rows)
    assert np.isfinite(float(loss)) and float(aux["weight"]) == 2


# -- files ------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
def test_files_give_the_same_rows_as_dicts(tmp_path, suffix):
    import datasets

    chats = [dict(c) for c in CHATS]
    chats[0] = {"messages": [{**m, "name": "ann"} for m in CHATS[0]["messages"]]}
    for records, build in ((chats, sft_rows), (CONVERSATIONAL_PAIRS, preference_rows)):
        path = tmp_path / f"{build.__name__}.{suffix}"
        if suffix == "jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
        else:
            datasets.Dataset.from_list(records).to_parquet(str(path))
        dataset = from_files(path, cache_dir=tmp_path / "cache")
        from_dataset, report = build(dataset, BYTES, seq_len=128)
        from_dicts, _ = build(records, BYTES, seq_len=128)
        assert report.kept == len(records)
        assert set(from_dataset) == set(from_dicts)
        assert all((from_dataset[k] == from_dicts[k]).all() for k in from_dicts)
