"""The tokenized store: round trip against the in-memory pipeline, the content
key, a killed prepare continued byte for byte, damaged parts rebuilt (never read),
a full disk, the 1- vs 2-process split, and mixtures (composition and resume)."""

import errno
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import eqtrain
from eqtrain.data import (
    ByteTokenizer,
    DataError,
    HFTokenizer,
    Loader,
    Mixture,
    chunk_documents,
    prepare,
)
from eqtrain.data.store import _parts, _prepare, _store, _workers


def _docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "délta", "ε", "zeta\n", "eta", "θ", "iota"]
    return [
        f"doc {i}: " + " ".join(rng.choice(words, size=int(rng.integers(1, 60))))
        for i in range(n)
    ]


def _jsonl(path: Path, docs: list[str]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "id": len(d)}) + "\n")
    return path


def _files(directory: Path) -> dict[str, bytes]:
    """A store's bytes by relative path (its data, ledger and store.json)."""
    return {
        p.relative_to(directory).as_posix(): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _all_rows(rows) -> dict[str, np.ndarray]:
    return rows.take(np.arange(rows.num_rows))


def _assert_rows_equal(got, want) -> None:
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.fixture
def hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]
    )
    tok.train_from_iterator(_docs(200, seed=5), trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return HFTokenizer.from_file(path)


@pytest.mark.parametrize("tokenizer", ["byte", "hf"])
def test_store_rows_equal_the_in_memory_pipeline(tmp_path, tokenizer, hf_tokenizer):
    tok = ByteTokenizer() if tokenizer == "byte" else hf_tokenizer
    docs = _docs(400)
    source = _jsonl(tmp_path / "c.jsonl", docs)
    store = prepare(source, tok, cache_dir=tmp_path / "cache", piece_bytes=4000)
    assert store.num_parts > 3 and store.num_documents == len(docs)
    assert store.dtype == np.uint16
    for seq_len in (7, 64):
        _assert_rows_equal(
            _all_rows(store.lm_rows(seq_len)),
            chunk_documents(docs, tok, seq_len=seq_len),
        )


def test_a_python_source_and_workers_give_the_same_bytes(tmp_path):
    docs = _docs(300)
    tok = ByteTokenizer()
    source = _jsonl(tmp_path / "c.jsonl", docs)
    inline = prepare(
        source, tok, cache_dir=tmp_path / "a", piece_bytes=3000, executor="inline"
    )
    workers = prepare(
        source, tok, cache_dir=tmp_path / "b", piece_bytes=3000, workers=2
    )
    assert inline.directory.name == workers.directory.name  # the same key
    assert _files(inline.directory) == _files(workers.directory)
    # from Python: a list of strings and a datasets.Dataset give the same rows
    datasets = pytest.importorskip("datasets")
    from_list = prepare(docs, tok, cache_dir=tmp_path / "c", piece_bytes=3000)
    table = datasets.Dataset.from_dict({"text": docs})
    from_table = prepare(table, tok, cache_dir=tmp_path / "c", piece_bytes=3000)
    want = _all_rows(inline.lm_rows(32))
    _assert_rows_equal(_all_rows(from_list.lm_rows(32)), want)
    _assert_rows_equal(_all_rows(from_table.lm_rows(32)), want)
    iterable = table.to_iterable_dataset()
    from_iterable = prepare(iterable, tok, cache_dir=tmp_path / "c", piece_bytes=3000)
    _assert_rows_equal(_all_rows(from_iterable.lm_rows(32)), want)


def test_the_cache_key_follows_the_content(tmp_path):
    tok = ByteTokenizer()
    source = _jsonl(tmp_path / "c.jsonl", _docs(50))
    cache = tmp_path / "cache"
    first = prepare(source, tok, cache_dir=cache)
    again = prepare(source, tok, cache_dir=cache)
    assert again.directory == first.directory
    other_column = prepare(source, tok, cache_dir=cache, text_column="text")
    assert other_column.directory == first.directory
    time.sleep(0.01)
    _jsonl(source, _docs(50, seed=1))  # new content
    changed = prepare(source, tok, cache_dir=cache)
    assert changed.directory != first.directory
    assert changed.num_tokens != first.num_tokens


def _interrupted_prepare(source: Path, cache: Path, stop_after: int) -> None:
    """Prepare `source` in a subprocess killed once `stop_after` parts are
    committed (SIGKILL: no cleanup of any kind)."""
    script = textwrap.dedent(
        f"""
        import eqtrain.data.store._workers as s
        from eqtrain.data import ByteTokenizer, prepare
        real = s.build_part
        def slow(task, encoder):
            entry = real(task, encoder)
            import time; time.sleep(0.3)
            return entry
        s.build_part = slow
        prepare({str(source)!r}, ByteTokenizer(), cache_dir={str(cache)!r},
                piece_bytes=2000, executor="inline")
        """
    )
    process = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ledgers = list(cache.glob("*/parts/*.json"))
            if len(ledgers) >= stop_after:
                break
            if process.poll() is not None:
                raise AssertionError("the prepare ended before it was killed")
            time.sleep(0.02)
        else:
            raise AssertionError("no part was committed in time")
    finally:
        process.kill()
        process.wait()


def test_a_killed_prepare_continues_to_the_same_bytes(tmp_path, capfd):
    source = _jsonl(tmp_path / "c.jsonl", _docs(300))
    _interrupted_prepare(source, tmp_path / "killed", stop_after=3)
    (directory,) = (tmp_path / "killed").iterdir()
    assert not (directory / "store.json").exists()
    committed = len(list(directory.glob("parts/*.json")))
    assert committed >= 3
    said = []
    resumed = prepare(
        source,
        ByteTokenizer(),
        cache_dir=tmp_path / "killed",
        piece_bytes=2000,
        say=said.append,
    )
    assert any("prepared before; continuing" in line for line in said)
    fresh = prepare(
        source, ByteTokenizer(), cache_dir=tmp_path / "fresh", piece_bytes=2000
    )
    assert resumed.num_parts > committed
    assert _files(resumed.directory) == _files(fresh.directory)
    assert not list(resumed.directory.glob("parts/*.tmp*"))


def _damage(path: Path, at: int = 10) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_part_is_rebuilt_never_read(tmp_path):
    docs = _docs(200)
    source = _jsonl(tmp_path / "c.jsonl", docs)
    tok = ByteTokenizer()
    store = prepare(source, tok, cache_dir=tmp_path / "cache", piece_bytes=3000)
    want = _all_rows(store.lm_rows(16))
    tokens = _parts.part_paths(store.directory, 1)["tokens"]
    _damage(tokens)
    # opened without the tokenizer: the damaged part is refused, naming it
    bare = _store.Store(store.directory)
    with pytest.raises(DataError, match="part 1 .* damaged"):
        _all_rows(bare.lm_rows(16))
    # opened by prepare: rebuilt from its piece when first read, then read
    said = []
    again = prepare(
        source, tok, cache_dir=tmp_path / "cache", say=said.append, piece_bytes=3000
    )
    _assert_rows_equal(_all_rows(again.lm_rows(16)), want)
    assert any("part 1" in line and "rebuilding" in line for line in said)
    # `verify=True` (eqtrain data prepare) checks every part up front
    _damage(_parts.part_paths(store.directory, 2)["ends"])
    said.clear()
    prepare(
        source,
        tok,
        cache_dir=tmp_path / "cache",
        verify=True,
        say=said.append,
        piece_bytes=3000,
    )
    assert any("part 2" in line for line in said)
    assert _parts.verify_part(
        store.directory,
        json.loads(_parts.part_paths(store.directory, 2)["ledger"].read_text()),
    )


def test_a_full_disk_keeps_the_committed_parts(tmp_path, monkeypatch):
    source = _jsonl(tmp_path / "c.jsonl", _docs(200))
    real = os.fsync
    calls = {"n": 0}

    def fsync(fd):
        calls["n"] += 1
        if calls["n"] > 6:  # the first parts commit, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(_parts.os, "fsync", fsync)
    with pytest.raises(
        DataError, match=r"disk is full.*committed so far are kept.*About \d+ MB more"
    ):
        prepare(
            source,
            ByteTokenizer(),
            cache_dir=tmp_path / "cache",
            piece_bytes=2000,
            executor="inline",
        )
    (directory,) = (tmp_path / "cache").iterdir()
    assert len(list(directory.glob("parts/*.json"))) >= 1
    assert not list(directory.glob("parts/*.tmp*"))
    monkeypatch.setattr(_parts.os, "fsync", real)
    done = prepare(
        source, ByteTokenizer(), cache_dir=tmp_path / "cache", piece_bytes=2000
    )
    assert done.num_documents == 200


def test_one_and_two_processes_see_the_same_global_batches(tmp_path):
    store = prepare(_docs(300), ByteTokenizer(), cache_dir=tmp_path, piece_bytes=3000)
    rows = store.lm_rows(16)
    one = Loader(rows, 8, seed=4, prefetch=0, process_index=0, process_count=1)
    two = [
        Loader(rows, 8, seed=4, prefetch=0, process_index=p, process_count=2)
        for p in (0, 1)
    ]
    for batch, a, b, _ in zip(one, *two, range(2 * len(one)), strict=False):
        for k in batch:
            np.testing.assert_array_equal(batch[k], np.concatenate([a[k], b[k]]))


def _mixture(tmp_path) -> Mixture:
    tok = ByteTokenizer()
    big = prepare(_docs(400, seed=1), tok, cache_dir=tmp_path, key="big").lm_rows(16)
    small = prepare(_docs(30, seed=2), tok, cache_dir=tmp_path, key="small").lm_rows(16)
    return Mixture([big, small], [0.75, 0.25], names=["big", "small"])


def test_a_mixtures_batches_follow_the_weights(tmp_path):
    mixture = _mixture(tmp_path)
    assert mixture.sizes[1] < mixture.sizes[0] / 10  # the small source repeats
    order = np.concatenate(
        [mixture.epoch_order(e, seed=0, shuffle=True) for e in (0, 1)]
    )
    small = order >= mixture.offsets[1]
    per_batch = small[: len(small) // 16 * 16].reshape(-1, 16).sum(axis=1)
    assert set(per_batch.tolist()) <= {3, 4, 5}  # 16 * 0.25 = 4, give or take one
    assert abs(small.mean() - 0.25) < 1e-3
    # the counts per source are those of the schedule, at any point
    for rows in (0, 16, 16 * 37, len(order)):
        counts = mixture.rows_per_source(rows)
        assert counts["small"] == small[:rows].sum() and sum(counts.values()) == rows
    # each source's rows are its own epochs: every small row used before any twice
    first = order[small][: mixture.sizes[1]] - mixture.offsets[1]
    assert sorted(first.tolist()) == list(range(mixture.sizes[1]))


def test_a_mixture_resumes_exactly(tmp_path):
    mixture = _mixture(tmp_path)
    loader = Loader(mixture, 16, seed=3, prefetch=0)
    it = iter(loader)
    for _ in range(7):
        next(it)
    position = loader.position
    following = [next(it) for _ in range(3)]
    resumed = Loader(mixture, 16, seed=3, prefetch=0, position=position)
    for want, got in zip(following, resumed, strict=False):
        _assert_rows_equal(got, want)
    with pytest.raises(Exception, match="weight"):
        Mixture([mixture.sources[0]], [0.0])


# -- through the job: eqtrain fit on stores and mixtures ------------------------------
def _fit_args(tmp_path, run: str, *extra: str) -> list[str]:
    return [
        f"run_dir={tmp_path / run}",
        f"data.cache={tmp_path / 'cache'}",
        "model.hidden_size=32",
        "model.num_layers=1",
        "data.seq_len=16",
        "data.batch_size=8",
        "data.eval=none",
        "loop.eval_every=0",
        "log.progress=none",
        "log.every=1",
        "export.hf=",
        "optim.warmup_steps=1",
        *extra,
    ]


def _metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_fit_on_a_mixture_logs_each_source_and_resumes_exactly(tmp_path):
    from eqtrain import config as config_lib, job

    a = _jsonl(tmp_path / "web.jsonl", _docs(300, seed=1))
    b = _jsonl(tmp_path / "code.jsonl", _docs(40, seed=2))
    mix = f"data.sources=web:{a}=0.75,{b}=0.25"
    whole = config_lib.load(overrides=_fit_args(tmp_path, "whole", mix, "loop.steps=6"))
    job.run(whole)
    stores = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(stores) == 2  # one store per source, in data.cache
    split = config_lib.load(overrides=_fit_args(tmp_path, "split", mix, "loop.steps=6"))
    p = job.prepare(split)  # the first 3 of the 6 steps, then a resumed run
    try:
        eqtrain.fit(p.state, p.step, p.loader, **{**p.fit_kwargs, "num_steps": 3})
    finally:
        p.close()
    job.run(split, resume="auto")
    want, got = _metrics(tmp_path / "whole"), _metrics(tmp_path / "split")
    assert [m["loss"] for m in got] == [m["loss"] for m in want]
    last = want[-1]
    assert last["data/tokens/web"] + last["data/tokens/code"] == 6 * 8 * 16
    assert last["data/tokens/code"] == pytest.approx(0.25 * 6 * 8 * 16, abs=2 * 16)
    info = job.run_info(tmp_path / "whole")
    assert {s["name"]: s["tokens"] for s in info["sources"]} == {
        "web": last["data/tokens/web"],
        "code": last["data/tokens/code"],
    }


def test_data_prepare_uses_data_workers_and_the_cache(tmp_path, monkeypatch):
    from eqtrain import config as config_lib, job

    source = _jsonl(tmp_path / "c.jsonl", _docs(300))
    started = []
    real = _workers.WorkerPool.__init__

    def init(self, workers, spec):
        started.append(workers)
        real(self, workers, spec)

    monkeypatch.setattr(_workers.WorkerPool, "__init__", init)
    monkeypatch.setattr(_prepare, "PIECE_BYTES", 3000)
    overrides = _fit_args(tmp_path, "run", f"data.train={source}", "data.workers=2")
    stores = job.prepare_data(config_lib.load(overrides=overrides), say=lambda _: None)
    assert started == [2]
    (entry,) = stores
    assert entry["documents"] == 300 and entry["parts"] > 1
    assert Path(entry["store"]).parent == tmp_path / "cache"
    # a second prepare opens it (verify: every part's sha256 is checked)
    again = job.prepare_data(config_lib.load(overrides=overrides), say=lambda _: None)
    assert again == stores and started == [2]
    # a missing source is named before anything is read
    missing = _fit_args(tmp_path, "run", f"data.sources={tmp_path / 'nope.jsonl'}=1")
    with pytest.raises(Exception, match=r"data.sources\[0\].*does not exist"):
        job.prepare_data(config_lib.load(overrides=missing))


EXAMPLES = Path(__file__).parent.parent / "examples" / "data"


@pytest.mark.parametrize(
    ("task", "name"),
    [
        ("sft", "sft.jsonl"),
        # default-suite time: the same cache for pairs, under `nox -s slow`
        pytest.param("dpo", "preference.jsonl", marks=pytest.mark.slow),
    ],
)
def test_post_training_rows_are_made_once_then_mapped(
    tmp_path, monkeypatch, task, name
):
    """SFT and preference rows are prepared into a post-training store and
    memory-mapped by later runs (no records read, nothing tokenized); a changed
    setting makes another store, and a damaged file is found by `verify` (as
    `eqtrain data prepare` checks) and the store made again."""
    import shutil

    from eqtrain import config as config_lib
    from eqtrain.data.store import _post_store
    from eqtrain.job import _build, _rows

    real = _post_store._Build.run
    calls = []

    def counted(self, *args, **kwargs):
        calls.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(_post_store._Build, "run", counted)
    data = tmp_path / name
    shutil.copy(EXAMPLES / name, data)
    overrides = [
        *_fit_args(tmp_path, task, f"task.kind={task}", f"data.train={data}"),
        "data.seq_len=128",
    ]
    job = _build.build(config_lib.load(overrides=overrides))
    first = _rows.post_rows(job, str(data), "data.train")
    again = _rows.post_rows(job, str(data), "data.train")
    assert len(calls) == 1  # the second is opened from the store
    assert isinstance(again, eqtrain.data.PostRows)
    everything = np.arange(first.num_rows)
    _assert_rows_equal(again.take(everything), first.take(everything))
    longer = config_lib.load(overrides=[*overrides, "data.seq_len=160"])
    _rows.post_rows(_build.build(longer), str(data), "data.train")
    assert len(calls) == 2  # another seq_len: other rows
    # a damaged part is found (sha256) and the store made again
    for path in (tmp_path / "cache").glob("post-*/parts/*.tokens"):
        _damage(path, at=path.stat().st_size - 1)
    _rows.post_rows(job, str(data), "data.train", verify=True)
    assert len(calls) == 3


def test_a_bad_python_source_fails_with_workers_instead_of_hanging(tmp_path):
    """An error raised while reading the source in the workers' feeding threads
    ends `prepare` with that error (it once left the pool waiting forever)."""
    docs = [*_docs(100), 7, *_docs(100, seed=1)]  # item 100 is not a document
    with pytest.raises(DataError, match="item 100 of the source is a int"):
        prepare(docs, ByteTokenizer(), cache_dir=tmp_path, piece_bytes=1000, workers=2)
