"""The post-training store (`eqtrain.data.prepare_post`, `PostRows`): SFT,
preference and GRPO prompt rows prepared in parts (in worker processes) from
records read one at a time, equal to the in-memory pipelines' rows; opened
without reading a record; never left half-built; the preparing process's peak
memory flat in the number of conversations."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from eqtrain import data as data_lib
from eqtrain.data import ByteTokenizer, DataError, from_files
from eqtrain.data.store import _post_parts, _post_store


EXAMPLES = Path(__file__).parent.parent / "examples" / "data"
TOK = ByteTokenizer()


def _messages(r: random.Random, i: int) -> list[dict]:
    chat = [{"role": "user", "content": f"q{i} " + "x" * r.randint(0, 40)}]
    if i % 17 != 3:  # some without an answer: skipped
        chat.append({"role": "assistant", "content": "a" * r.randint(0, 60)})
    if i % 5 == 0:
        chat += [
            {"role": "user", "content": "more"},
            {"role": "assistant", "content": "b" * r.randint(1, 80)},
        ]
    return chat


def _records(fmt: str, n: int = 300, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    if fmt == "chat":
        return [{"messages": _messages(r, i)} for i in range(n)]
    if fmt == "prompt_completion":  # strings; some too long for a row
        return [
            {"prompt": "p" * r.randint(1, 70), "completion": "c" * r.randint(0, 60)}
            for _ in range(n)
        ]
    if fmt == "pc_messages":
        return [
            {
                "prompt": [{"role": "user", "content": "q" * r.randint(1, 50)}],
                "completion": [
                    {"role": "assistant", "content": "a" * r.randint(1, 40)}
                ],
            }
            for _ in range(n)
        ]
    if fmt == "preference":
        return [
            {
                "prompt": "p" * r.randint(1, 60),
                "chosen": "c" * r.randint(1, 40),
                "rejected": "r" * r.randint(0, 40) if i % 9 else "same",
            }
            | ({"chosen": "same"} if i % 9 == 0 else {})
            for i in range(n)
        ]
    # implicit preference: conversations with a shared start
    out = []
    for i in range(n):
        shared = [{"role": "user", "content": "q" * r.randint(1, 40)}]
        out.append(
            {
                "chosen": shared
                + [{"role": "assistant", "content": "good" * (i % 4 + 1)}],
                "rejected": shared
                + [{"role": "assistant", "content": "bad" * (i % 3)}],
            }
        )
    return out


def _jsonl(path: Path, records: list[dict], *, blank_at: int = 7) -> Path:
    with open(path, "w") as f:
        for i, record in enumerate(records):
            f.write(json.dumps(record) + "\n")
            if i == blank_at:
                f.write("\n")  # a blank line: no record
    return path


def _equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


CASES = [
    ("chat", True, "processes"),
    ("chat", False, "inline"),
    ("prompt_completion", True, "inline"),
    ("prompt_completion", False, "inline"),
    ("pc_messages", True, "inline"),
    ("preference", None, "inline"),
    ("implicit_preference", None, "inline"),
]


@pytest.mark.parametrize(("fmt", "pack", "executor"), CASES)
def test_store_rows_equal_the_in_memory_rows(tmp_path, fmt, pack, executor):
    """Row for row (and the skip report) as `sft_rows` / `preference_rows` make
    them from `from_files` of the same file, across many parts."""
    path = _jsonl(tmp_path / "d.jsonl", _records(fmt))
    settings = dict(seq_len=64, max_prompt_len=40)
    if pack is None:
        want, report = data_lib.preference_rows(from_files(path), TOK, **settings)
        options = dict(kind="preference")
    else:
        sft = "prompt_completion" if fmt == "pc_messages" else fmt
        want, report = data_lib.sft_rows(
            from_files(path), TOK, format=sft, pack=pack, **settings
        )
        options = dict(kind="sft", format=sft, pack=pack)
    rows = data_lib.prepare_post(
        path,
        TOK,
        **options,
        **settings,
        cache_dir=tmp_path / "cache",
        piece_bytes=2000,
        workers=2,
        executor=executor,
        say=lambda _: None,
    )
    assert len(rows.meta["parts"]) > 3
    assert rows.num_rows == len(next(iter(want.values())))
    _equal(rows.take(np.arange(rows.num_rows)), want)
    order = np.random.default_rng(0).permutation(rows.num_rows)[:16]
    _equal(rows.take(order), {k: v[order] for k, v in want.items()})
    assert rows.report == report


def test_parquet_rows_by_row_group_equal_the_in_memory_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(_records("chat")), path, row_group_size=40)
    want, report = data_lib.sft_rows(from_files(path), TOK, seq_len=64, format="chat")
    rows = data_lib.prepare_post(
        path, TOK, kind="sft", seq_len=64, cache_dir=tmp_path, piece_bytes=1
    )
    assert len(rows.meta["parts"]) == 8  # one row group each
    assert rows.settings["format"] == "chat"  # from the columns
    _equal(rows.take(np.arange(rows.num_rows)), want)
    assert rows.report == report


def _sft_config(tmp_path: Path, data: Path, *extra: str):
    from eqtrain import config as config_lib

    return config_lib.load(
        overrides=[
            f"run_dir={tmp_path / 'run'}",
            f"data.cache={tmp_path / 'cache'}",
            f"data.train={data}",
            "task.kind=sft",
            "data.seq_len=128",
            "data.batch_size=8",
            "data.eval=none",
            "loop.eval_every=0",
            "data.workers=2",
            *extra,
        ]
    )


def test_second_start_reads_no_records(tmp_path, monkeypatch):
    """The job's second start opens the store: no record is read, parsed or
    encoded (the readers and encoders fail if called), and its skip report
    still reaches `job.notes`."""
    from eqtrain.job import _build, _rows

    data = _jsonl(tmp_path / "sft.jsonl", _records("chat", 200))
    config = _sft_config(tmp_path, data)
    job = _build.build(config)
    first = _rows.post_rows(job, str(data), "data.train")
    assert any("with no assistant message" in n for n in job.notes)

    def fail(*args, **kwargs):
        raise AssertionError("a record was read on the second start")

    monkeypatch.setattr(_post_parts, "records", fail)
    monkeypatch.setattr(_post_store, "records", fail)
    monkeypatch.setattr(_post_store, "record_columns", fail)
    monkeypatch.setattr(_post_parts.PostEncoder, "__init__", fail)
    monkeypatch.setattr(data_lib, "from_files", fail)
    again_job = _build.build(config)
    again = _rows.post_rows(again_job, str(data), "data.train")
    assert again.directory == first.directory
    assert any("with no assistant message" in n for n in again_job.notes)
    everything = np.arange(first.num_rows)
    _equal(again.take(everything), first.take(everything))


def test_a_failed_build_leaves_no_store(tmp_path):
    """A bad line in a later part fails the build naming the file and line;
    nothing that opens is left, and a fixed file builds."""
    records = _records("chat", 300)
    path = _jsonl(tmp_path / "d.jsonl", records)
    text = path.read_text().splitlines()
    text[250] = '{"messages": [oops'
    path.write_text("\n".join(text) + "\n")
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=rf"{path}:251 is not valid JSON"):
        data_lib.prepare_post(
            path, TOK, kind="sft", seq_len=64, cache_dir=cache, piece_bytes=2000
        )
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []
    _jsonl(path, records)
    rows = data_lib.prepare_post(
        path, TOK, kind="sft", seq_len=64, cache_dir=cache, piece_bytes=2000
    )
    assert rows.num_rows > 0


KILLED = """
import sys
from eqtrain import data
data.prepare_post(sys.argv[1], data.ByteTokenizer(), kind="sft", seq_len=64,
                  cache_dir=sys.argv[2], piece_bytes=4000, workers=2,
                  executor="processes", say=print)
"""


def test_a_killed_build_leaves_no_store_that_opens(tmp_path):
    """SIGKILL of the preparing process while its workers write parts: no store
    under the key (only the temporary directory, removed by the next build,
    which then gives the same rows as an uninterrupted one)."""
    path = _jsonl(tmp_path / "d.jsonl", _records("chat", 8000))
    cache = tmp_path / "cache"
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(path), str(cache)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    deadline = time.monotonic() + 120
    while not list(cache.glob("post-*.tmp*/parts/00000.tokens")):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not [p for p in cache.glob("post-*") if p.suffix not in (".lock",)
                and ".tmp" not in p.name]  # fmt: skip
    assert list(cache.glob("post-*.tmp*"))  # what the kill left
    rows = data_lib.prepare_post(
        path, TOK, kind="sft", seq_len=64, cache_dir=cache, piece_bytes=4000,
        executor="inline", say=lambda _: None,
    )  # fmt: skip
    assert not list(cache.glob("post-*.tmp*"))
    want, _ = data_lib.sft_rows(from_files(path), TOK, seq_len=64, format="chat")
    _equal(rows.take(np.arange(rows.num_rows)), want)


RSS = """
import json, resource, sys
from eqtrain import data
rows = data.prepare_post(sys.argv[1], data.ByteTokenizer(), kind="sft",
                         seq_len=256, cache_dir=sys.argv[2], piece_bytes=1 << 17,
                         workers=2, executor="processes", say=lambda _: None)
rows.take(list(range(min(rows.num_rows, 64))))
# VmHWM: this process's peak since its exec (ru_maxrss would keep the forking
# parent's); the workers' ru_maxrss has this process's size as its floor
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
print(json.dumps({
    "self": int(hwm.split()[1]),
    "workers": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
    "rows": rows.num_rows, "parts": len(rows.meta["parts"]),
}))
"""


def _peak_kib(tmp_path: Path, n: int) -> dict:
    path = _jsonl(tmp_path / f"chat{n}.jsonl", _records("chat", n))
    done = subprocess.run(
        [sys.executable, "-c", RSS, str(path), str(tmp_path / f"cache{n}")],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        check=True,
    )
    return json.loads(done.stdout.splitlines()[-1])


def test_peak_memory_does_not_grow_with_the_conversations(tmp_path):
    """The preparing process's (and its workers') peak RSS at 20k conversations
    is that at 2k, up to a small constant (the in-memory rows of 20k would add
    about 30 MB)."""
    small, large = _peak_kib(tmp_path, 2000), _peak_kib(tmp_path, 20000)
    assert large["parts"] >= 8 * small["parts"]  # the same parts, 10x as many
    slack = 12 * 1024  # KiB: allocator noise, a few lists of per-part counts
    assert large["self"] <= small["self"] + slack, (small, large)
    assert large["workers"] <= small["workers"] + slack, (small, large)


def _cli_prepare(tmp_path: Path, *sets: str) -> list[dict]:
    from typer.testing import CliRunner

    from eqtrain.cli import app

    args = ["data", "prepare"] + [a for s in sets for a in ("--set", s)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stdout + result.stderr
    return [json.loads(line) for line in result.stdout.splitlines() if line]


@pytest.mark.parametrize(
    ("task", "name", "unit", "records"),
    [
        ("sft", "sft.jsonl", "sft", 400),
        ("dpo", "preference.jsonl", "preference", 400),
        ("grpo", "arithmetic_prompts.jsonl", "prompt", 2000),
    ],
)
def test_data_prepare_builds_the_store_a_run_opens(tmp_path, task, name, unit, records):
    """`eqtrain data prepare` on an sft, a dpo and a grpo config: one JSON line
    per store; the run's rows then come from that store without building."""
    from eqtrain.job import _build, _rows

    data = EXAMPLES / name
    sets = [
        f"run_dir={tmp_path / 'run'}",
        f"data.cache={tmp_path / 'cache'}",
        f"data.train={data}",
        f"task.kind={task}",
        "data.seq_len=128",
        "data.eval=none",
        "loop.eval_every=0",
        *(["task.max_completion_len=8", "data.batch_size=4"] if task == "grpo" else []),
    ]
    (entry,) = _cli_prepare(tmp_path, *sets)
    assert entry["kind"] == unit and entry["split"] == "train"
    assert entry["records"] == records and entry["rows"] > 0
    assert Path(entry["store"]).parent == tmp_path / "cache"
    from eqtrain import config as config_lib

    job = _build.build(config_lib.load(overrides=sets))
    rows = _rows.train_rows(job)
    assert str(rows.directory) == entry["store"] and rows.num_rows == entry["rows"]


def test_grpo_prompt_rows_come_from_the_store(tmp_path):
    """GRPO's prompt rows (left-padded ids, lengths, indices) and the host's
    prompts and columns, from a store built by worker processes; a prompt longer
    than the width is left out and noted."""
    from eqtrain import config as config_lib
    from eqtrain.job import _build, _grpo

    r = random.Random(1)
    records = [{"prompt": "q" * r.randint(1, 12), "answer": str(i)} for i in range(300)]
    records[5]["prompt"] = "x" * 40  # longer than the width
    path = _jsonl(tmp_path / "p.jsonl", records)
    config = config_lib.load(
        overrides=[
            f"run_dir={tmp_path / 'run'}",
            f"data.cache={tmp_path / 'cache'}",
            f"data.train={path}",
            "task.kind=grpo",
            "task.max_completion_len=8",
            "data.seq_len=24",
            "data.batch_size=4",
            "data.workers=2",
            "data.eval=none",
            "loop.eval_every=0",
            "log.progress=none",
        ]
    )
    job = _build.build(config)
    options = {"cache_dir": tmp_path / "c", "piece_bytes": 1000, "workers": 2}
    rows = _grpo.rows(job, str(path), "data.train", options)
    assert len(rows.meta["parts"]) > 2
    kept = [rec for i, rec in enumerate(records) if i != 5]
    width = 24 - 8
    got = rows.take(np.arange(rows.num_rows))
    for i, rec in enumerate(kept):
        ids = np.concatenate([[TOK.bos_id], TOK.encode(rec["prompt"])])
        assert got["prompt_len"][i] == len(ids)
        np.testing.assert_array_equal(got["prompt"][i, width - len(ids) :], ids)
        assert (got["prompt"][i, : width - len(ids)] == TOK.pad_id).all()
    np.testing.assert_array_equal(got["index"], np.arange(len(kept)))
    assert job.grpo.prompts.prompts == [rec["prompt"] for rec in kept]
    assert job.grpo.prompts.columns["answer"][7] == kept[7]["answer"]
    assert any("skipped 1 of 300 prompts longer than 16" in n for n in job.notes)


def test_bad_settings_and_files_are_named(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", _records("chat", 20))
    with pytest.raises(DataError, match="`kind` must be one of"):
        data_lib.prepare_post(path, TOK, kind="chat", seq_len=64, cache_dir=tmp_path)
    with pytest.raises(data_lib.DataFileNotFoundError, match="nope.jsonl"):
        data_lib.prepare_post(
            tmp_path / "nope.jsonl", TOK, kind="sft", seq_len=64, cache_dir=tmp_path
        )
    text = _jsonl(tmp_path / "t.jsonl", [{"text": "hi"}] * 3)
    with pytest.raises(Exception, match="SFT `format` must be one of"):
        data_lib.prepare_post(text, TOK, kind="sft", seq_len=64, cache_dir=tmp_path)


def test_a_loader_over_the_store_gives_the_in_memory_batches(tmp_path):
    """Shuffled epochs and a resumed position: the same batches as a `Loader`
    over the in-memory rows (the order is the loader's, by row count)."""
    path = _jsonl(tmp_path / "d.jsonl", _records("chat", 300))
    want, _ = data_lib.sft_rows(from_files(path), TOK, seq_len=64, format="chat")
    rows = data_lib.prepare_post(
        path, TOK, kind="sft", seq_len=64, cache_dir=tmp_path, piece_bytes=3000
    )
    memory = data_lib.Loader(want, batch_size=8, seed=3, num_epochs=2, prefetch=0)
    stored = data_lib.Loader(rows, batch_size=8, seed=3, num_epochs=2, prefetch=0)
    for a, b in zip(memory, stored, strict=True):
        _equal(b, a)
    resumed = data_lib.Loader(rows, batch_size=8, seed=3, prefetch=0)
    resumed.seek({"epoch": 1, "index": 5})
    memory.seek({"epoch": 1, "index": 5})
    _equal(next(iter(resumed)), next(iter(memory)))
