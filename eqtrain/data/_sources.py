"""Where examples come from: local files through `datasets`' own loaders, a
directory of text files, and named columns/fields of any of them."""

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._errors import ConfigError
from ._errors import (
    DataError,
    DataFileNotFoundError,
    DataWarning,
    PathLike,
    check_exists,
    missing_field,
)
from ._source_files import compression_of, opened


# File suffix -> the `datasets` packaged builder that reads it.
FORMATS = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
    ".text": "text",
}


def from_files(
    paths: PathLike | Sequence[PathLike],
    format: str | None = None,
    *,
    cache_dir: PathLike | None = None,
) -> Any:
    """Read local files into one `datasets.Dataset`, in the order given.

    Uses `datasets.load_dataset(format, data_files=...)`, whose packaged builders
    (`json`, `parquet`, `csv`, `text`) read local files only; nothing is
    downloaded. A JSON Lines file gives one row per line; a `text` file one row
    (column `"text"`) per line.

    Args:
        paths: one path or a list of paths (all of one format).
        format: `"json"` (also for `.jsonl`), `"parquet"`, `"csv"` or `"text"`;
            inferred from the suffix when omitted.
        cache_dir: where `datasets` keeps its Arrow cache (its default otherwise).

    Raises:
        DataFileNotFoundError: a path does not exist.
        DataError: the files hold no rows, or do not parse as `format`.
    """
    files = _paths(paths)
    format = format or _infer_format(files)
    if all(os.path.getsize(f) == 0 for f in files):
        raise DataError(
            f"the files {files} are empty (0 bytes). Point `from_files` at files "
            "that hold rows."
        )
    dataset = _load_dataset(files, format, cache_dir)
    if len(dataset) == 0:
        raise DataError(
            f"the files {files} hold no rows. Point `from_files` at non-empty files."
        )
    return dataset


def _paths(paths: PathLike | Sequence[PathLike]) -> list[str]:
    """`paths` as a non-empty list of existing file names."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = [os.fspath(p) for p in paths]
    if not files:
        raise ConfigError("`from_files` needs at least one path; got none.")
    for path in files:
        check_exists(path, "data file")
    return files


def _load_dataset(files: list[str], format: str, cache_dir: PathLike | None) -> Any:
    """`datasets.load_dataset(format, data_files=files)`'s train split, without
    progress bars; a file that does not parse is a DataError."""
    import datasets

    # No "Generating train split" bars in a run's output (restored after).
    quiet = datasets.utils.are_progress_bars_disabled()
    datasets.utils.disable_progress_bars()
    try:
        return datasets.load_dataset(
            format,
            data_files=files,
            split="train",
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
        )
    except (ValueError, TypeError, KeyError, OSError, StopIteration) as error:
        raise _unparsed(files, format, error) from error
    except Exception as error:  # datasets wraps parse errors in DatasetGenerationError
        if type(error).__name__ != "DatasetGenerationError":
            raise
        raise _unparsed(files, format, error.__cause__ or error) from error
    finally:
        if not quiet:
            datasets.utils.enable_progress_bars()


def _unparsed(files: list[str], format: str, error: BaseException) -> DataError:
    return DataError(
        f"could not read {files} as {format!r}: {error}.{_bad_line(files, format)} "
        "Check the files' contents and their format (the file suffix, or "
        "`format=` in Python)."
    )


def _bad_line(files: list[str], format: str) -> str:
    """` The first bad line is <file>:<n>.` for a JSON Lines file with a line
    that does not parse as JSON (datasets reports a byte position only)."""
    if format != "json":
        return ""
    jsonl = (path for path in files if path.endswith(".jsonl"))  # not one document
    found = (_first_bad_line(path) for path in jsonl)
    return next((sentence for sentence in found if sentence is not None), "")


def _first_bad_line(path: str) -> str | None:
    """`_bad_line`'s sentence for one JSON Lines file: None when every line
    parses, "" when the file cannot be read."""
    import json

    number = 0
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                number += 1
                if line.strip():
                    json.loads(line)
    except json.JSONDecodeError as e:
        return f" The first bad line is {path}:{number} ({e.msg})."
    except (OSError, UnicodeDecodeError):
        return ""
    return None


def _infer_format(files: list[str]) -> str:
    found = {FORMATS.get(Path(f).suffix.lower()) for f in files}
    if None in found or len(found) != 1:
        suffixes = sorted({Path(f).suffix or "(none)" for f in files})
        raise ConfigError(
            f"cannot infer one format from the suffixes {suffixes}; known suffixes: "
            f"{sorted(FORMATS)}. Rename the files to one of those suffixes (or, in "
            "Python, pass `format=`: 'json', 'parquet', 'csv' or 'text')."
        )
    return found.pop()  # type: ignore[return-value]


def load_text_dir(directory: PathLike, *, pattern: str = "**/*.txt") -> list[str]:
    """The text files under `directory` matching `pattern`, one document each.

    Files are ordered by their path relative to `directory` (as POSIX strings), so
    the order is the same on every machine; they are read as UTF-8 (undecodable
    bytes replaced), a `.gz` or `.zst` file decompressed first.

    Raises:
        DataFileNotFoundError: `directory` does not exist.
        DataError: no file matches `pattern`.
    """
    check_exists(directory, "text directory")
    root = Path(directory)
    if not root.is_dir():
        raise DataFileNotFoundError(
            f"{root} is a file, not a directory. Pass the directory holding the text "
            "files, or read single files with `from_files(path, 'text')`."
        )
    return [_read_member(p) for p in text_files(root, pattern)]


def _read_member(path: Path) -> str:
    """A file of a text directory, decompressed when its suffix says so."""
    compression = compression_of(path)
    if compression is None:
        return read_text(path)
    with opened(path, compression) as f:
        return f.read().decode("utf-8", errors="replace")


def text_files(root: Path, pattern: str) -> list[Path]:
    """The files under the directory `root` matching `pattern`, ordered by their
    relative POSIX path (as `load_text_dir` reads them).

    Raises:
        DataError: no file matches.
    """
    return [path for _, path in named_files(root, pattern)]


def named_files(root: Path, pattern: str) -> list[tuple[str, Path]]:
    """`text_files` with each file's relative POSIX path (its name in a
    fingerprint), made without `Path.relative_to` (slow for 100,000 files)."""
    prefix = len(os.path.join(os.fspath(root), ""))
    files = sorted(
        (os.fspath(p)[prefix:].replace(os.sep, "/"), p)
        for p in root.glob(pattern)
        if p.is_file()
    )
    if not files:
        raise DataError(
            f"no file under {root} matches {pattern!r}. Pass another glob (such as "
            "'**/*.md': data.pattern in the config, `pattern=` in Python) or "
            "another directory."
        )
    return files


def read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def text_column(data: Any, name: str, *, source: str = "the data") -> list[str]:
    """Column `name` of `data` (as `column` reads it) as text documents.

    A row whose value is not a string (JSON `null`, a number, a list) is not
    text: it is skipped, and the number skipped is reported in one warning, never
    trained on as `"None"` or `"3"`.

    Raises:
        DataError: as `column`, or when no row holds a string.
    """
    values = column(data, name)
    texts = [v for v in values if isinstance(v, str)]
    if not texts:
        kinds = sorted({_kind(v) for v in values})
        raise DataError(
            f"no row of {source} holds text in {name!r}: all {len(values)} values "
            f"are {', '.join(kinds)}. Point data.text_column (`text_column`) at a "
            "column of strings."
        )
    if len(texts) < len(values):
        _warn_skipped(values, len(values) - len(texts), name, source)
    return texts


def _warn_skipped(values: list[Any], skipped: int, name: str, source: str) -> None:
    """One warning for the `skipped` values that are not strings."""
    first = next(i for i, v in enumerate(values) if not isinstance(v, str))
    warnings.warn(
        f"{source}: skipped {skipped} of {len(values)} rows whose {name!r} is "
        f"not a string (the first: row {first}, {_kind(values[first])}).",
        DataWarning,
        stacklevel=3,  # text_column's caller
    )


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def column(data: Any, name: str) -> list[Any]:
    """Column `name` of a `datasets.Dataset`, a mapping of arrays, or a list of
    records (dicts), as a list.

    Raises:
        DataError: there is no such column (the error lists those there are), or
            the data is empty.
    """
    if isinstance(data, Mapping):
        available = list(data)
        if name not in data:
            raise missing_field(name, available, "the data")
        values = list(data[name])
    elif hasattr(data, "column_names"):  # datasets.Dataset
        if name not in data.column_names:
            raise missing_field(name, list(data.column_names), "the dataset")
        values = list(data[name])
    else:
        values = _field_values(data, name)
    if not values:
        raise DataError(f"the data is empty: column {name!r} has no rows.")
    return values


def _field_values(records: Any, name: str) -> list[Any]:
    """Field `name` of each record (a mapping) of `records`."""
    records = list(records)
    for i, record in enumerate(records):
        if not isinstance(record, Mapping) or name not in record:
            keys = list(record) if isinstance(record, Mapping) else []
            raise missing_field(name, keys, f"record {i}")
    return [record[name] for record in records]
