"""The tokenized store where things go wrong (issue 52): compressed files in a
directory, text that is not valid Unicode, very long documents, workers that die
or are interrupted, files left by killed builds, and the gaps between the docs and
the code (the content key's reads, a mixture's memory, tiny weights, a truncated
`.ends`)."""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from eqtrain.data import (
    ByteTokenizer,
    DataError,
    DataWarning,
    HFTokenizer,
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
