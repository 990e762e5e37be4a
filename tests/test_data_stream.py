"""eqtrain.data._stream: pieces of a source read one at a time give the documents
of the in-memory reading (`from_files` + `text_column`, `load_text_dir`,
`read_text`), in order, for every format; errors name the file and line."""

import gzip
import json
import os
import shutil
import sys
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from eqtrain._errors import ConfigError
from eqtrain.data import (
    DataError,
    DataFileNotFoundError,
    DataWarning,
    _source_files,
    from_files,
    load_text_dir,
    read_text,
    stdlib_corpus,
    stdlib_files,
    text_column,
)
from eqtrain.data._stream import (
    Piece,
    check_counts,
    documents,
    fingerprint,
    fingerprint_files,
    plan,
    plan_files,
)


# CRLF, blank and whitespace-only lines, a null, non-ASCII, an empty text, a
# string with an escaped newline, and a last line without its newline.
JSONL = (
    b'{"text": "alpha", "id": 1}\r\n\r\n'
    b'{"text": "b\xc3\xa9ta \xe6\x97\xa5\xe6\x9c\xac", "id": 2}\n   \n'
    b'{"text": null, "id": 3}\n'
    b'{"text": "line\\nwith newline, and a long body that straddles pieces", "id": 4}\n'
    b"\n"
    b'{"text": "", "id": 5}\n'
    b'{"text": "last, without a newline", "id": 6}'
)
MIXED = (  # values that are not strings: skipped and counted, never "3"
    b'{"text": "a", "n": 1}\n{"text": 3, "n": 2}\n{"text": ["x"], "n": 3}\n'
    b'{"text": null, "n": 4}\n{"text": "z", "n": 5}\n'
)
CSV = (
    "id,text,note\r\n1,hello,x\r\n"
    '2,"multi\nline, with a comma",y\r\n3,,z\r\n4,NA,w\r\n5,café ☕,v\r\n6\r\n'
    '7,"a ""quoted"" word",u\r\n'
)


def write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


def streamed(source, piece_bytes=16, **kwargs):
    counts = {}
    column = kwargs.pop("text_column", "text")
    pieces = plan(source, piece_bytes=piece_bytes, text_column=column, **kwargs)
    docs = [d for p in pieces for d in documents(p, text_column=column, counts=counts)]
    return docs, counts, pieces


def in_memory(path, tmp_path, column="text"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)
        return text_column(from_files(path, cache_dir=tmp_path / "cache"), column)


# -- equal to the in-memory reading ---------------------------------------------------
@pytest.mark.parametrize("piece_bytes", [1, 13, 40, 2**20])
def test_jsonl_pieces_read_as_in_memory(tmp_path, piece_bytes):
    path = write(tmp_path / "a.jsonl", JSONL)
    docs, counts, pieces = streamed(path, piece_bytes)
    assert docs == in_memory(path, tmp_path)
    assert counts == {
        "documents": 5,
        "skipped": 1,
        "first_skipped": f"{path}:5",
    }
    assert (len(pieces) > 3) == (piece_bytes < 2**20)
    assert sum(p.nbytes for p in pieces) == len(JSONL)
    assert [p.stop for p in pieces[:-1]] == [p.start for p in pieces[1:]]
    for p in pieces:  # each starts a line, its number counted exactly
        assert p.start == 0 or JSONL[p.start - 1 : p.start] == b"\n"
        assert p.line == JSONL[: p.start].count(b"\n") + 1


def test_non_strings_are_skipped_and_counted(tmp_path):
    path = write(tmp_path / "m.jsonl", MIXED)
    docs, counts, _ = streamed(path, 20)
    assert docs == in_memory(path, tmp_path) == ["a", "z"]
    assert counts["skipped"] == 3 and counts["first_skipped"] == f"{path}:2"
    with pytest.warns(DataWarning, match=r"skipped 3 of \d+ rows .*m.jsonl:2\)"):
        check_counts(str(path), counts)
    nulls = write(tmp_path / "n.jsonl", b'{"text": null}\n{"text": 1}\n')
    _, counts, _ = streamed(nulls)
    with pytest.raises(DataError, match=r"n.jsonl holds no text in 'text'; all 2"):
        check_counts(str(nulls), counts)


def test_json_documents(tmp_path):
    records = [{"text": "a", "k": 1}, {"text": None, "k": 2}, {"text": "é", "k": 3}]
    array = write(tmp_path / "r.json", json.dumps(records, indent=1))
    strings = write(tmp_path / "s.json", json.dumps(["x", "y"]))
    for path in (array, strings):
        docs, _, pieces = streamed(path)
        assert docs == in_memory(path, tmp_path)
        assert [p.kind for p in pieces] == ["json"]
    lines = write(tmp_path / "l.json", JSONL)  # JSON Lines named .json: split
    docs, _, pieces = streamed(lines, 13)
    assert docs == in_memory(lines, tmp_path) and len(pieces) > 3
    assert {p.kind for p in pieces} == {"jsonl"}


def test_compressed_files_read_as_plain(tmp_path):
    plain, _, _ = streamed(write(tmp_path / "a.jsonl", JSONL))
    zst = zstandard.ZstdCompressor().compress
    two_frames = zst(JSONL[:50]) + zst(JSONL[50:])  # as concatenated files are
    for name, content in [
        ("a.jsonl.gz", gzip.compress(JSONL)),
        ("a.jsonl.zst", two_frames),
        ("a.json.gz", gzip.compress(JSONL)),
        ("a.json.zst", zst(JSONL)),
    ]:
        docs, counts, pieces = streamed(write(tmp_path / name, content))
        assert docs == plain and counts["skipped"] == 1, name
        assert len(pieces) == 1 and pieces[0].compression == name[-3:].strip(".")
    text = "héllo\r\nworld\n" * 50
    for name, content in [("t.txt.gz", gzip.compress), ("t.txt.zst", zst)]:
        path = write(tmp_path / name, content(text.encode()))
        assert streamed(path)[0] == [text]


def test_text_files_read_as_load_text_dir(tmp_path):
    root = tmp_path / "docs"
    write(root / "b.txt", "second\r\nfile ünï\n")
    write(root / "a" / "z.txt", b"bad \xff byte")  # replaced, as in memory
    write(root / "a" / "empty.txt", b"")
    write(root / "c.md", "not matched")
    write(root / "d.txt", "x" * 40)
    docs, _, pieces = streamed(root, piece_bytes=20)
    assert docs == load_text_dir(root)
    assert [len(p.paths) for p in pieces] == [2, 1, 1]  # grouped up to 20 bytes
    assert all(p.kind == "text_files" and os.path.isabs(p.paths[0]) for p in pieces)
    assert streamed(root, pattern="**/*.md")[0] == ["not matched"]
    assert streamed(root / "b.txt")[0] == [read_text(root / "b.txt")]


def test_stdlib_files():
    pieces = plan_files(stdlib_files("eval"), piece_bytes=50_000)
    assert len(pieces) > 2
    assert [d for p in pieces for d in documents(p)] == stdlib_corpus("eval")


def test_parquet_row_groups(tmp_path):
    texts = [f"row {i} é" if i % 4 else None for i in range(30)]
    path = tmp_path / "t.parquet"
    table = pa.table({"id": list(range(30)), "text": texts})
    pq.write_table(table, path, row_group_size=4)
    docs, counts, pieces = streamed(path, piece_bytes=500)
    assert docs == in_memory(path, tmp_path)
    assert counts["skipped"] == 8 and counts["first_skipped"] == f"{path} (row 0)"
    assert 1 < len(pieces) < 8 and pieces[-1].stop == 8
    assert [p.stop for p in pieces[:-1]] == [p.start for p in pieces[1:]]


def test_csv_agrees_with_datasets(tmp_path):
    path = write(tmp_path / "t.csv", CSV)
    docs, counts, _ = streamed(path)
    assert docs == in_memory(path, tmp_path)
    assert counts["skipped"] == 3  # the empty cell, "NA", the short row
    gz = write(tmp_path / "t.csv.gz", gzip.compress(CSV.encode()))
    assert streamed(gz)[0] == docs


# -- pieces: deterministic, self-contained tasks --------------------------------------
def test_pieces_depend_on_content_only(tmp_path):
    path = write(tmp_path / "one" / "a.jsonl", JSONL)
    pieces = plan(path, piece_bytes=13)
    assert plan(path, piece_bytes=13) == pieces
    copy = tmp_path / "two" / "a.jsonl"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    moved = [
        Piece.from_json({**p.to_json(), "path": str(path)})
        for p in plan(copy, piece_bytes=13)
    ]
    assert moved == pieces
    tasks = [Piece.from_json(json.loads(json.dumps(p.to_json()))) for p in pieces]
    assert tasks == pieces
    forward = [list(documents(p)) for p in pieces]
    backward = [list(documents(p)) for p in reversed(tasks)][::-1]
    assert forward == backward  # each piece reads alone, in any order


def test_fingerprint(tmp_path):
    path = write(tmp_path / "big.jsonl", b'{"text": "x"}\n' * 300_000)  # > 2 MiB
    key = fingerprint(path)
    plan(path)
    assert fingerprint(path) == key and key["kind"] == "jsonl"
    assert key["files"][0]["name"] == "big.jsonl"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] = ord("y")  # the middle: not hashed, seen through mtime
    stat = path.stat()
    path.write_bytes(data)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fingerprint(path) == key
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert fingerprint(path) != key
    with open(path, "ab") as f:
        f.write(b'{"text": "z"}\n')
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert fingerprint(path)["files"][0]["size"] == len(data) + 14


def test_fingerprint_of_directories_and_lists(tmp_path):
    root = tmp_path / "docs"
    write(root / "a.txt", "a")
    write(root / "b" / "c.txt", "c")
    key = fingerprint(root)
    assert [f["name"] for f in key["files"]] == ["a.txt", "b/c.txt"]
    root.rename(tmp_path / "moved")
    assert fingerprint(tmp_path / "moved") == key
    write(tmp_path / "moved" / "d.txt", "d")
    assert fingerprint(tmp_path / "moved") != key
    files = stdlib_files("eval")
    listed = fingerprint_files(files)
    assert listed == fingerprint_files(files)
    assert [f["name"] for f in listed["files"]] == [p.name for p in files]


# -- errors name the file, the line, and what to do -----------------------------------
@pytest.mark.parametrize(
    "line, match",
    [
        (b'{"text": oops}', r"bad.jsonl:8 is not valid JSON .* fix or remove"),
        (b'["text"]', r"bad.jsonl:8 holds a JSON list, not an object"),
        (
            b'{"body": "x", "id": 1}',
            r"bad.jsonl:8 has no field 'text'; its fields are "
            r"\['body', 'id'\]. Set data.text_column",
        ),
        (b'{"text": "caf\xe9"}', r"bad.jsonl:8 is not valid UTF-8"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, line, match):
    content = JSONL.replace(b'{"text": "", "id": 5}', line)  # line 8 (of piece 3+)
    path = write(tmp_path / "bad.jsonl", content)
    with pytest.raises(DataError, match=match):
        streamed(path, piece_bytes=40)
    gz = write(tmp_path / "bad.jsonl.gz", gzip.compress(content))
    with pytest.raises(DataError, match=match.replace("jsonl", "jsonl.gz", 1)):
        streamed(gz)


def test_source_errors(tmp_path):
    with pytest.raises(DataFileNotFoundError, match="nope.jsonl"):
        plan(tmp_path / "nope.jsonl")
    with pytest.raises(
        ConfigError, match=r"d.xml has a suffix .*known: .*\.txt\.zst, \.jsonl,"
    ):
        plan(write(tmp_path / "d.xml", "<a/>"))
    with pytest.raises(ConfigError, match="`piece_bytes` must be at least 1; got 0"):
        plan(write(tmp_path / "p.jsonl", JSONL), piece_bytes=0)
    with pytest.raises(ConfigError, match="`piece_bytes` must be at least 1; got 0"):
        plan(write(tmp_path / "p.jsonl", JSONL), piece_bytes=0)
    with pytest.raises(DataError, match=r"e.jsonl is empty \(0 bytes\)"):
        plan(write(tmp_path / "e.jsonl", b""))
    with pytest.raises(DataError, match="b.jsonl holds only blank lines"):
        plan(write(tmp_path / "b.jsonl", b"\n  \r\n"))
    with pytest.raises(DataError, match=r"no file under .*empty matches '\*\*/\*.txt'"):
        plan((tmp_path / "empty").mkdir() or tmp_path / "empty")
    with pytest.raises(DataError, match=r"o.json holds one JSON dict, not an array"):
        streamed(write(tmp_path / "o.json", b'{\n"text": ["a"]\n}'))
    with pytest.raises(DataError, match=r"j.json:2 is neither JSON Lines nor one"):
        streamed(write(tmp_path / "j.json", b'[{"text": "a"},\n oops]'))
    with pytest.raises(DataError, match=r"t.csv:1 has no field 'body'; its fields"):
        streamed(write(tmp_path / "t.csv", CSV), text_column="body")
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["a"]}), path)
    with pytest.raises(DataError, match=r"t.parquet has no field 'body'; its fields"):
        plan(path, text_column="body")
    with pytest.raises(DataError, match=r"x.parquet is not a readable Parquet file"):
        plan(write(tmp_path / "x.parquet", b"not parquet"))


def test_unreadable_and_corrupt_files(tmp_path, monkeypatch):
    good = write(tmp_path / "a.jsonl", JSONL)
    data = gzip.compress(JSONL * 50)
    zst = zstandard.ZstdCompressor(write_checksum=True).compress(JSONL * 50)
    flipped = bytearray(zst)
    flipped[len(zst) // 2] ^= 0xFF
    for name, content in [
        ("cut.jsonl.gz", data[: len(data) // 2]),
        ("bad.jsonl.gz", data[:20] + b"\x00" * 40 + data[60:]),
        ("cut.jsonl.zst", zst[: len(zst) // 2]),
        ("bad.jsonl.zst", bytes(flipped)),
        ("not.txt.zst", b"not zstd at all"),
    ]:
        path = write(tmp_path / name, content)
        with pytest.raises(DataError, match=f"cannot read {path}: .* not a valid"):
            streamed(path)

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    pieces = plan(good)
    monkeypatch.setattr(_source_files, "open", denied, raising=False)
    with pytest.raises(DataError, match=r"cannot read .*a.jsonl: .*Check its perm"):
        list(documents(pieces[0]))


def test_zst_without_the_package(tmp_path, monkeypatch):
    path = write(tmp_path / "a.jsonl.zst", zstandard.ZstdCompressor().compress(JSONL))
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import fails
    with pytest.raises(DataError, match=r"a.jsonl.zst .*pip install zstandard"):
        plan(path)
