"""Text data: tokenizers, sources from local files, the LM pipelines (chunking,
packing, collate, chat) and the standard-library corpus."""

import json

import numpy as np
import pytest

from eqtrain import ConfigError, EqtrainError
from eqtrain.data import (
    ByteTokenizer,
    DataError,
    DataFileNotFoundError,
    HFTokenizer,
    Tokenizer,
    chat_examples,
    chunk_documents,
    collate,
    column,
    encode_chat,
    from_files,
    load_text_dir,
    pack,
    stdlib_corpus,
    stdlib_files,
)


BYTES = ByteTokenizer()


def check_lm_rows(rows, seq_len):
    assert rows["tokens"].dtype == np.int32 and rows["targets"].dtype == np.int32
    assert rows["loss_mask"].dtype == np.float32
    for value in rows.values():
        assert value.ndim == 2 and value.shape[1] == seq_len


# -- tokenizers -----------------------------------------------------------------
def test_byte_tokenizer_round_trip():
    text = "héllo, wörld! 🙂\n\ttabs"
    ids = BYTES.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert BYTES.decode(ids) == text
    with_specials = np.concatenate([[BYTES.bos_id], ids, [BYTES.eos_id, BYTES.pad_id]])
    assert BYTES.decode(with_specials) == text
    assert BYTES.vocab_size == 259
    assert len({BYTES.bos_id, BYTES.eos_id, BYTES.pad_id}) == 3
    assert isinstance(BYTES, Tokenizer)


def build_tokenizer_json(directory):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["hello world, the quick brown fox"] * 20, trainer)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_tokenizer_from_a_local_file(tmp_path):
    path = build_tokenizer_json(tmp_path)
    tok = HFTokenizer.from_file(path)
    assert isinstance(tok, Tokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 3)
    ids = tok.encode("hello world")
    assert ids.dtype == np.int32 and 1 not in ids.tolist()  # no specials added
    assert tok.decode(ids) == "hello world"
    assert tok.decode([1, *ids.tolist(), 2]) == "hello world"
    assert tok.vocab_size >= 260
    assert HFTokenizer.from_file(tmp_path).eos_id == 2  # a directory works too
    # tokenizer_config.json names win over the common spellings; arguments win over both
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<s>"}))
    assert HFTokenizer.from_file(path).eos_id == 1
    assert HFTokenizer.from_file(path, eos="<pad>").eos_id == 3
    with pytest.raises(DataError, match="not in the vocabulary"):
        HFTokenizer.from_file(path, bos="<nope>")
    rows = chunk_documents(["hello world", "the fox"], tok, seq_len=3)
    check_lm_rows(rows, 3)


def test_hf_tokenizer_errors(tmp_path):
    pytest.importorskip("tokenizers")
    with pytest.raises(DataFileNotFoundError, match="tokenizer file not found"):
        HFTokenizer.from_file(tmp_path / "missing.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{ this is not json")
    with pytest.raises(DataError, match="could not parse the tokenizer file"):
        HFTokenizer.from_file(bad)
    bad.write_text(json.dumps({"version": "1.0", "model": {"type": "Nope"}}))
    with pytest.raises(DataError, match="could not parse"):
        HFTokenizer.from_file(bad)


# -- sources ----------------------------------------------------------------------
RECORDS = [{"text": f"line {i}", "n": i} for i in range(5)]


def write_files(tmp_path):
    import pandas as pd

    paths = {}
    paths["jsonl"] = tmp_path / "d.jsonl"
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    paths["json"] = tmp_path / "d.json"
    paths["json"].write_text(json.dumps(RECORDS))
    paths["csv"] = tmp_path / "d.csv"
    pd.DataFrame(RECORDS).to_csv(paths["csv"], index=False)
    paths["parquet"] = tmp_path / "d.parquet"
    pd.DataFrame(RECORDS).to_parquet(paths["parquet"])
    paths["txt"] = tmp_path / "d.txt"
    paths["txt"].write_text("".join(r["text"] + "\n" for r in RECORDS))
    return paths


def test_sources_from_local_files(tmp_path):
    paths = write_files(tmp_path)
    cache = tmp_path / "cache"
    for kind in ("jsonl", "json", "csv", "parquet"):
        ds = from_files(paths[kind], cache_dir=cache)
        assert column(ds, "text") == [r["text"] for r in RECORDS], kind
        assert column(ds, "n") == list(range(5)), kind
    text = from_files([paths["txt"]], "text", cache_dir=cache)
    assert column(text, "text") == [r["text"] for r in RECORDS]
    # two files are read in the order given
    both = from_files([paths["jsonl"], paths["jsonl"]], cache_dir=cache)
    assert len(both) == 10


def test_source_errors(tmp_path):
    with pytest.raises(DataFileNotFoundError, match="data file not found") as info:
        from_files(tmp_path / "nope.jsonl")
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, EqtrainError)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="are empty"):
        from_files(empty, cache_dir=tmp_path / "cache")
    with pytest.raises(ConfigError, match="cannot infer one format"):
        (tmp_path / "d.xyz").write_text("")
        from_files([empty, tmp_path / "d.xyz"])
    with pytest.raises(DataError, match=r"no field 'txt'; available: \['n', 'text'\]"):
        column(RECORDS, "txt")
    with pytest.raises(DataError, match=r"available: \['n', 'text'\]"):
        column({"text": [], "n": []}, "txt")
    with pytest.raises(DataError, match="empty"):
        column({"text": []}, "text")


def test_text_directory_in_sorted_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("bz")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "c.txt").write_text("c")
    (tmp_path / "skip.md").write_text("no")
    assert load_text_dir(tmp_path) == ["a", "bz", "c"]
    assert load_text_dir(tmp_path, pattern="*.md") == ["no"]
    with pytest.raises(DataError, match="no file under"):
        load_text_dir(tmp_path, pattern="*.rst")
    with pytest.raises(DataFileNotFoundError):
        load_text_dir(tmp_path / "missing")


# -- pipelines ----------------------------------------------------------------------
def test_pretraining_chunks():
    docs = ["abc", "defgh", "ij"]
    rows = chunk_documents(docs, BYTES, seq_len=4)
    check_lm_rows(rows, 4)
    eos = BYTES.eos_id
    stream = [*b"abc", eos, *b"defgh", eos, *b"ij", eos]  # 13 tokens -> 3 rows
    assert rows["tokens"].tolist() == [stream[0:4], stream[4:8], stream[8:12]]
    assert rows["targets"].tolist() == [stream[1:5], stream[5:9], stream[9:13]]
    assert np.all(rows["loss_mask"] == 1)
    with pytest.raises(DataError, match="seq_len=20 is too large"):
        chunk_documents(docs, BYTES, seq_len=20)
    with pytest.raises(DataError, match="no documents"):
        chunk_documents([], BYTES, seq_len=4)


def test_packing_keeps_examples_apart_and_loses_nothing():
    rng = np.random.default_rng(0)
    examples = [rng.integers(0, 50, size=rng.integers(1, 9)) for _ in range(40)]
    seq_len = 8
    rows = pack(examples, seq_len=seq_len, pad_id=99)
    check_lm_rows(rows, seq_len)
    tokens, targets, mask, seg = (
        rows[k] for k in ("tokens", "targets", "loss_mask", "segment_ids")
    )
    full = np.concatenate([tokens, targets[:, -1:]], axis=1)  # the S + 1 slots
    # the last, target-only slot continues the segment before it, or is padding
    last = np.where(mask[:, -1] > 0, seg[:, -1], 0)
    full_seg = np.concatenate([seg, last[:, None]], axis=1)
    recovered = []
    for r in range(len(tokens)):
        assert seg[r, 0] == 1  # every row starts with an example
        numbers = [s for s in np.unique(full_seg[r]) if s > 0]
        assert numbers == list(range(1, len(numbers) + 1))  # 1, 2, 3, ... in order
        recovered += [full[r, full_seg[r] == s].tolist() for s in numbers]
        # a target counts only inside one example: never at a boundary or on padding
        same = (full_seg[r, :-1] == full_seg[r, 1:]) & (full_seg[r, :-1] > 0)
        assert mask[r].tolist() == same.astype(np.float32).tolist()
        assert np.all(full[r][full_seg[r] == 0] == 99)
    assert recovered == [e.tolist() for e in examples]
    assert mask.sum() == sum(len(e) - 1 for e in examples)


def test_packing_truncates_long_examples_and_applies_masks():
    long = np.arange(20)
    assert pack([long], seq_len=4)["tokens"].tolist() == [[0, 1, 2, 3]]
    assert pack([long], seq_len=4, truncation="keep_end")["targets"].tolist() == [
        [16, 17, 18, 19]
    ]
    rows = pack([[1, 2, 3], [4, 5, 6]], seq_len=6, masks=[[0, 0, 1], [0, 1, 1]])
    assert rows["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 2]]
    assert rows["targets"].tolist() == [[2, 3, 4, 5, 6, 0]]
    assert rows["loss_mask"].tolist() == [[0, 1, 0, 1, 1, 0]]


def test_collate_truncation_and_padding_sides():
    examples = [[1, 2, 3, 4, 5, 6, 7], [8, 9]]
    right = collate(examples, max_length=4, pad_id=0)
    check_lm_rows(right, 4)
    assert right["tokens"].tolist() == [[1, 2, 3, 4], [8, 9, 0, 0]]
    assert right["targets"].tolist() == [[2, 3, 4, 5], [9, 0, 0, 0]]
    assert right["loss_mask"].tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    assert "segment_ids" not in right
    end = collate(examples, max_length=4, truncation="keep_end")
    assert end["tokens"][0].tolist() == [3, 4, 5, 6]
    assert end["targets"][0].tolist() == [4, 5, 6, 7]
    left = collate(examples, max_length=4, padding_side="left", pad_id=0)
    assert left["tokens"].tolist() == [[1, 2, 3, 4], [0, 0, 0, 8]]
    assert left["targets"].tolist() == [[2, 3, 4, 5], [0, 0, 8, 9]]
    assert left["loss_mask"].tolist() == [[1, 1, 1, 1], [0, 0, 0, 1]]
    assert left["segment_ids"].tolist() == [[1, 1, 1, 1], [0, 0, 0, 1]]
    masked = collate([[1, 2, 3]], max_length=3, masks=[[1, 0, 1]])
    assert masked["loss_mask"].tolist() == [[0, 1, 0]]
    with pytest.raises(ConfigError, match="truncation"):
        collate(examples, max_length=4, truncation="middle")
    with pytest.raises(ConfigError, match="padding_side"):
        collate(examples, max_length=4, padding_side="top")
    with pytest.raises(ConfigError, match="example 1 has 2 tokens but its mask has 3"):
        collate(examples, max_length=4, masks=[[1] * 7, [1, 1, 1]])


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi?"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye?"},
    {"role": "assistant", "content": "Bye."},
]


def test_chat_template_trains_only_on_assistant_tokens():
    ids, mask = encode_chat(CHAT, BYTES)
    rendered = BYTES.decode(ids)
    assert rendered == (
        "<|system|>\nBe brief.\n<|user|>\nHi?\n<|assistant|>\nHello."
        "<|user|>\nBye?\n<|assistant|>\nBye."
    )
    assert ids[0] == BYTES.bos_id
    learned = ids[mask == 1]
    eos = BYTES.eos_id
    assert learned.tolist() == [*b"Hello.", eos, *b"Bye.", eos]
    # in batches, exactly the assistant tokens are counted targets, in both pipelines
    one_row = collate([ids], max_length=len(ids) - 1, masks=[mask])
    assert one_row["targets"][one_row["loss_mask"] == 1].tolist() == learned.tolist()
    two_rows = pack([ids, ids], seq_len=len(ids) + 3, masks=[mask, mask])
    counted = two_rows["targets"][two_rows["loss_mask"] == 1]
    assert counted.tolist() == learned.tolist() * 2


def test_chat_jsonl_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    lines = [{"messages": CHAT}, {"messages": CHAT[1:3]}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    examples, masks = chat_examples(from_files(path, cache_dir=tmp_path / "c"), BYTES)
    assert len(examples) == 2
    assert examples[0].tolist() == encode_chat(CHAT, BYTES)[0].tolist()
    rows = collate(examples, max_length=32, masks=masks, truncation="keep_end")
    assert rows["loss_mask"][1].sum() == len("Hello.") + 1


def test_chat_errors():
    with pytest.raises(DataError, match=r"no field 'messages'; available: \['conv'\]"):
        chat_examples([{"conv": CHAT}], BYTES)
    with pytest.raises(DataError, match="record 1: message 0 has role 'bot'"):
        chat_examples(
            [{"messages": CHAT}, {"messages": [{"role": "bot", "content": "x"}]}], BYTES
        )
    with pytest.raises(DataError, match="'role' and 'content'"):
        encode_chat([{"text": "hi"}], BYTES)
    with pytest.raises(DataError, match="must be a string"):
        encode_chat([{"role": "user", "content": 3}], BYTES)


# -- the standard-library corpus ---------------------------------------------------
def test_stdlib_corpus_is_found_deterministic_and_split_without_overlap():
    train, evaluation, everything = (
        stdlib_files("train"),
        stdlib_files("eval"),
        stdlib_files("all"),
    )
    assert len(train) > 50 and len(evaluation) > 3
    assert not {p.name for p in train} & {p.name for p in evaluation}
    assert sorted(train + evaluation) == everything
    assert [p.name for p in everything] == sorted(p.name for p in everything)
    assert all(
        p.suffix == ".py" and p.parent == everything[0].parent for p in everything
    )
    assert stdlib_files("train") == train
    names = {p.name for p in everything}
    assert "os.py" in names and "site-packages" not in {
        p.parent.name for p in everything
    }
    docs = stdlib_corpus("eval")
    assert docs == stdlib_corpus("eval")
    assert len(docs) == len(evaluation) and all(d for d in docs)
    with pytest.raises(ConfigError, match="split"):
        stdlib_files("validation")


def test_hf_tokenizer_without_the_package_says_how_to_install(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"pip install 'eqtrain\[tokenizers\]'"):
        HFTokenizer.from_file(tmp_path / "tokenizer.json")


def test_docstring_examples_of_the_private_modules():
    import doctest
    import importlib
    import pkgutil

    import eqtrain.data

    failed = 0
    for mod in pkgutil.iter_modules(eqtrain.data.__path__):
        module = importlib.import_module(f"eqtrain.data.{mod.name}")
        failed += doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed
    assert failed == 0
