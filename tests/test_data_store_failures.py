"""The tokenized store where things go wrong (issue 52): compressed files in a
directory, text that is not valid Unicode, very long documents, workers that die
or are interrupted, files left by killed builds, and the gaps between the docs and
the code (the content key's reads, a mixture's memory, tiny weights, a truncated
`.ends`)."""

import contextlib
import errno
import gzip
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
import warnings
from pathlib import Path

import numpy as np
import pytest

from eqtrain.data import (
    ByteTokenizer,
    DataError,
    DataWarning,
    HFTokenizer,
    Mixture,
    _files,
    _mixture,
    _stream,
    load_text_dir,
    prepare,
)
from eqtrain.data.store import _encoder, _parts, _workers


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
    script = (  # a worker that starts its part, then is killed as by the kernel
        "import os, sys; sys.stdin.readline(); "
        "open(f'{sys.argv[1]}/parts/00003.tokens.tmp{os.getpid()}', 'w'); "
        "os.kill(os.getpid(), 9)"
    )
    (tmp_path / "parts").mkdir()
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)],
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
    assert not list(tmp_path.glob("parts/*.tmp*"))  # what it began is removed


# -- a mixture: its epoch order's memory, and weights below its resolution --------
class _Rows:
    """A row source of `num_rows` rows (what a Mixture reads of one)."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows

    def take(self, indices):
        return {"tokens": np.zeros((len(indices), 4), np.int32)}


def _old_epoch_order(mixture, epoch, *, seed, shuffle):
    """The order as eqtrain computed it before (kept: checkpoints' positions
    index into it)."""
    g = np.arange(epoch * mixture.num_rows, (epoch + 1) * mixture.num_rows)
    slot = g % _mixture.PERIOD
    source = mixture.schedule[slot]
    k = (g // _mixture.PERIOD) * mixture.quota[source] + mixture.rank[slot]
    out = np.empty_like(g)
    for s, n in enumerate(mixture.sizes):
        passes, index = np.divmod(k[source == s], n)
        rows = np.empty_like(passes)
        for e in np.unique(passes):
            rng = np.random.default_rng([seed, s, int(e)])
            order = rng.permutation(int(n)) if shuffle else np.arange(n)
            rows[passes == e] = order[index[passes == e]]
        out[source == s] = mixture.offsets[s] + rows
    return out


def test_a_mixtures_order_is_unchanged_and_takes_12_bytes_a_row(monkeypatch):
    monkeypatch.setattr(_mixture, "CHUNK", 1000, raising=False)
    small = Mixture([_Rows(5000), _Rows(300), _Rows(1700)], [0.5, 0.3, 0.2])
    for epoch, shuffle in [(0, True), (3, True), (1, False)]:
        np.testing.assert_array_equal(
            small.epoch_order(epoch, seed=7, shuffle=shuffle),
            _old_epoch_order(small, epoch, seed=7, shuffle=shuffle),
        )
    monkeypatch.setattr(_mixture, "CHUNK", 1 << 16, raising=False)
    rows = 2_000_000
    big = Mixture([_Rows(rows // 2), _Rows(rows // 2)], [0.7, 0.3])
    tracemalloc.start()
    try:
        big.epoch_order(1, seed=0, shuffle=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 12 * rows + (8 << 20), peak / rows  # was about 64 bytes a row


def test_a_weight_below_the_schedules_resolution_is_warned_about():
    with pytest.warns(DataWarning, match=r"source 'rare' has weight 0.0001 .*1/4096"):
        mixture = Mixture(
            [_Rows(100), _Rows(100)], [0.9999, 0.0001], names=["web", "rare"]
        )
    assert mixture.quota.tolist() == [4095, 1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Mixture([_Rows(100), _Rows(100)], [4095.0, 1.0])  # exactly 1/4096: no warning


# -- 13: files killed builds leave, writes that fail ------------------------------
def test_a_build_removes_what_a_killed_build_left(tmp_path):
    source = _jsonl(tmp_path / "c.jsonl", [json.dumps({"text": "x" * 50})] * 40)
    tok, cache = ByteTokenizer(), tmp_path / "cache"
    said = []
    store = prepare(
        source,
        tok,
        cache_dir=cache,
        piece_bytes=500,
        say=said.append,
        executor="inline",
    )
    # what a SIGKILL leaves: no store.json, a part not committed, temporary files
    (store.directory / "store.json").unlink()
    (store.directory / "parts" / "00002.json").unlink()
    left = [
        store.directory / "parts" / "00002.tokens.tmp4242",
        store.directory / "parts" / "00003.ends.tmp4243",
        store.directory / "store.json.tmp4242",
    ]
    for path in left:
        path.write_bytes(b"\0" * 1000)
    again = prepare(
        source,
        tok,
        cache_dir=cache,
        piece_bytes=500,
        say=said.append,
        executor="inline",
    )
    assert not [p for p in left if p.exists()]
    assert any("removed 3 unfinished files" in line for line in said), said
    assert again.num_documents == 40


def test_a_truncated_ends_file_is_said_to_be_damaged(tmp_path):
    source = _jsonl(tmp_path / "c.jsonl", [json.dumps({"text": "x" * 50})] * 40)
    tok, cache = ByteTokenizer(), tmp_path / "cache"
    store = prepare(source, tok, cache_dir=cache, piece_bytes=500, executor="inline")
    ends = _parts.part_paths(store.directory, 1)["ends"]
    ends.write_bytes(ends.read_bytes()[:-3])
    said = []
    prepare(
        source,
        tok,
        cache_dir=cache,
        piece_bytes=500,
        verify=True,
        say=said.append,
        executor="inline",
    )
    (line,) = [line for line in said if "damaged" in line]
    assert f"part 1 of {store.directory} is damaged (its 00001.ends is" in line
    assert ends.stat().st_size % 8 == 0


def test_a_store_json_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    from eqtrain import job

    source = _jsonl(tmp_path / "c.jsonl", [json.dumps({"text": "x" * 50})] * 4)

    real = _files.replace_durably

    def fails(code):
        def replace(tmp, path, **kwargs):
            if Path(path).name != "store.json":
                return real(tmp, path, **kwargs)
            raise OSError(code, os.strerror(code))  # as a failed write(): no name

        return replace

    monkeypatch.setattr(_files, "replace_durably", fails(errno.EROFS))
    with pytest.raises(OSError) as caught:
        prepare(source, ByteTokenizer(), cache_dir=tmp_path / "cache")
    message = job.write_error_message(caught.value, tmp_path / "run")
    assert (
        message.startswith(f"writing {tmp_path / 'cache'}") and "store.json" in message
    )
    monkeypatch.setattr(_files, "replace_durably", fails(errno.ENOSPC))
    with pytest.raises(DataError, match=r"disk is full: .*store.json could not be"):
        prepare(source, ByteTokenizer(), cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.tmp*"))


def test_opening_a_directory_store_again_reads_no_file(tmp_path, monkeypatch):
    for i in range(5):
        (tmp_path / "d").mkdir(exist_ok=True)
        (tmp_path / "d" / f"{i}.txt").write_text(f"text {i}", encoding="utf-8")
    tok, cache = ByteTokenizer(), tmp_path / "cache"
    first = prepare(tmp_path / "d", tok, cache_dir=cache)
    read = []
    real = _stream._edges_sha256
    monkeypatch.setattr(
        _stream, "_edges_sha256", lambda p, size: read.append(p) or real(p, size)
    )
    assert prepare(tmp_path / "d", tok, cache_dir=cache).directory == first.directory
    assert read == []
    (tmp_path / "d" / "3.txt").write_text("text 3, longer", encoding="utf-8")
    changed = prepare(tmp_path / "d", tok, cache_dir=cache)
    assert read == [tmp_path / "d" / "3.txt"] and changed.directory != first.directory


def test_after_a_workers_error_the_others_commit_their_part(tmp_path, hf_tokenizer):
    """Part 0 fails at its first line while the other worker builds part 1 (a
    second or more of work): part 1 is committed (it was killed, and its files
    left, before)."""
    good = json.dumps({"text": "alpha beta, gamma!\n  delta  zeta.\n" * 30})
    source = _jsonl(tmp_path / "c.jsonl", ["{not json", *[good] * 3000])
    with pytest.raises(DataError, match=rf"{source}:1 is not valid JSON"):
        prepare(
            source,
            hf_tokenizer,
            cache_dir=tmp_path / "cache",
            piece_bytes=1_500_000,
            workers=2,
            executor="processes",
        )
    (directory,) = (tmp_path / "cache").iterdir()
    ledgers = sorted(p.name for p in directory.glob("parts/*.json"))
    assert "00001.json" in ledgers and "00000.json" not in ledgers
    assert not list(directory.rglob("*.tmp*"))


def test_ctrl_c_ends_data_prepare_at_once_and_leaves_no_files(tmp_path, hf_tokenizer):
    """SIGINT to the process group, as a terminal's Ctrl-C sends it, while two
    workers build: one line, exit 130, no traceback, no unfinished file."""
    rng = np.random.default_rng(0)
    words = np.array(["alpha", "beta,", "gamma!", "delta", "zeta.\n", "é", "θ"])
    (tmp_path / "d").mkdir()
    for i in range(2):  # two pieces of 16 MiB at most
        text = " ".join(rng.choice(words, 1_500_000))
        (tmp_path / "d" / f"{i}.txt").write_text(text, encoding="utf-8")
    cache = tmp_path / "cache"
    settings = {
        "data.train": tmp_path / "d",
        "data.tokenizer": Path(hf_tokenizer.directory) / "tokenizer.json",
        "data.cache": cache,
        "data.workers": 2,
        "data.eval": "none",
    }
    command = [sys.executable, "-m", "eqtrain.cli", "data", "prepare"]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    env = {**os.environ, "EQTRAIN_CPU_TUNING": "0"}
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    try:
        deadline = time.monotonic() + 120
        while not list(cache.glob("*/parts/*.tokens.tmp*")):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.2)
        sent = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)
        code = process.wait(timeout=30)
        took = time.monotonic() - sent
        err = process.stderr.read()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert code == 128 + signal.SIGINT, err
    assert err.splitlines()[-1].startswith("error: interrupted by SIGINT: the parts")
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert took < 5, took  # about 1 s under load; the workers are killed
    assert not list(cache.rglob("*.tmp*"))
