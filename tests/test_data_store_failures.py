"""The tokenized store where things go wrong (issue 52): compressed files in a
directory, text that is not valid Unicode, very long documents, workers that die
or are interrupted, files left by killed builds, and the gaps between the docs and
the code (the content key's reads, a mixture's memory, tiny weights, a truncated
`.ends`)."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eqtrain.data import (
    ByteTokenizer,
    DataError,
    DataWarning,
    HFTokenizer,
    _encoder,
    _parts,
    _stream,
    _workers,
    load_text_dir,
    prepare,
)


def _documents(store) -> list[str]:
    """A byte-tokenized store's documents, decoded."""
    tokens = store.read(0, store.num_tokens)
    cuts = np.flatnonzero(tokens == ByteTokenizer().eos_id)
    pieces = np.split(tokens, cuts + 1)[:-1]
    return [bytes(p[:-1].astype(np.uint8)).decode("utf-8") for p in pieces]


def _jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]
    )
    tok.train_from_iterator(["alpha beta, gamma!\n  delta  zeta.\n"] * 50, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer.from_file(path)


# -- 10: a directory's compressed files are decompressed, as single files are ----
@pytest.mark.parametrize("pattern", ["**/*.txt*", "**/*"])
def test_a_directorys_compressed_files_are_decompressed(tmp_path, pattern):
    texts = {"a.txt": "plain text", "b/c.txt.gz": "gzipped text é"}
    (tmp_path / "d" / "b").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text(texts["a.txt"], encoding="utf-8")
    (tmp_path / "d" / "b" / "c.txt.gz").write_bytes(
        gzip.compress(texts["b/c.txt.gz"].encode("utf-8"))
    )
    try:
        import zstandard
    except ImportError:
        pass
    else:
        texts["b/e.txt.zst"] = "zstd text"
        (tmp_path / "d" / "b" / "e.txt.zst").write_bytes(
            zstandard.ZstdCompressor().compress(b"zstd text")
        )
    want = [texts[name] for name in sorted(texts)]
    tok, cache = ByteTokenizer(), tmp_path / "cache"
    store = prepare(tmp_path / "d", tok, cache_dir=cache, pattern=pattern)
    assert _documents(store) == want
    alone = prepare(tmp_path / "d" / "b" / "c.txt.gz", tok, cache_dir=cache)
    assert _documents(alone) == [texts["b/c.txt.gz"]]
    assert load_text_dir(tmp_path / "d", pattern=pattern) == want


# -- 11: text that is not valid Unicode is skipped like other bad rows -----------
BAD_UNICODE = '{"text": "half of a pair: \\ud800!"}'  # valid JSON, not Unicode


@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
def test_an_unpaired_surrogate_skips_its_row_naming_it(tmp_path, tokenizer, request):
    tok = (
        ByteTokenizer()
        if tokenizer == "byte"
        else request.getfixturevalue("hf_tokenizer")
    )
    lines = ['{"text": "first"}', BAD_UNICODE, '{"text": null}', '{"text": "last"}']
    source = _jsonl(tmp_path / "c.jsonl", lines)
    with pytest.warns(DataWarning) as caught:
        store = prepare(source, tok, cache_dir=tmp_path / "cache", executor="inline")
    (message,) = [str(w.message) for w in caught]
    assert "skipped 2 of 4 rows: 1 whose 'text' is not a string" in message
    assert f"(the first: {source}:3)" in message
    assert "not valid Unicode" in message and f"{source}:2;" in message
    assert store.num_documents == 2
    if tokenizer == "byte":
        assert _documents(store) == ["first", "last"]
    # a JSON array and a Python source: the same rule (Python's: an error)
    array = tmp_path / "a.json"
    array.write_text(f"[{lines[0]}, {BAD_UNICODE}]", encoding="utf-8")
    with pytest.warns(DataWarning, match=r"a.json \(record 2\)"):
        prepare(array, tok, cache_dir=tmp_path / "cache", executor="inline")
    with pytest.raises(DataError, match=r"item 1 of the source .*character 16"):
        prepare(["ok", json.loads(BAD_UNICODE)["text"]], tok, cache_dir=tmp_path)


# -- 12: long documents are encoded in bounded spans; a killed worker is explained
def _long_document(n: int) -> str:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta,", "gamma!", "\n", "  delta", "zeta.\n\n", "é", "\n  "]
    return "".join(rng.choice(words, size=n)) + " the end"


@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
def test_a_long_document_is_encoded_in_bounded_spans(
    tmp_path, monkeypatch, tokenizer, request
):
    tok = (
        ByteTokenizer()
        if tokenizer == "byte"
        else request.getfixturevalue("hf_tokenizer")
    )
    monkeypatch.setattr(_encoder, "SPAN_CHARS", 200)
    monkeypatch.setattr(_encoder, "_WINDOW", 40)
    seen = []
    real = _encoder.Encoder._ids

    def ids(self, texts):
        seen.extend(len(t) for t in texts)
        return real(self, texts)

    monkeypatch.setattr(_encoder.Encoder, "_ids", ids)
    doc = _long_document(1500)
    short = ["a short one", "another\nshort one"]
    source = _jsonl(
        tmp_path / "c.jsonl", [json.dumps({"text": t}) for t in [doc, *short]]
    )
    store = prepare(source, tok, cache_dir=tmp_path / "cache", executor="inline")
    assert len(doc) > 20 * 200 and max(seen) <= 200
    eos = [tok.eos_id]
    want = np.concatenate([np.concatenate([tok.encode(t), eos]) for t in [doc, *short]])
    np.testing.assert_array_equal(store.read(0, store.num_tokens), want)


def test_a_worker_killed_by_the_kernel_is_said_to_be_out_of_memory(tmp_path):
    script = "import os, sys; sys.stdin.readline(); os.kill(os.getpid(), 9)"
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    piece = _stream.plan(_jsonl(tmp_path / "c.jsonl", ['{"text": "x"}']))[0]
    task = _parts.Task(3, str(tmp_path), "uint16", "text", piece=piece.to_json())
    try:
        answer = _workers._ask(process, task)
    finally:
        process.kill()
        process.wait()
    message = answer["message"]
    assert "killed (SIGKILL) while building part 3" in message
    assert f"{tmp_path / 'c.jsonl'} from line 1" in message
    assert "out of memory" in message and "fewer workers (data.workers" in message
