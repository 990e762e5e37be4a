"""The built-in corpus: the Python standard library's own source files.

Real text that exists on every machine with Python, so `eqtrain fit` has data with
no download and no argument.
"""

import sysconfig
import zlib
from pathlib import Path

from .._errors import ConfigError
from ._errors import DataError
from ._sources import read_text


EVAL_EVERY = 10
"""A file belongs to the eval split when crc32(relative path) % EVAL_EVERY == 0."""


def stdlib_files(split: str = "train") -> list[Path]:
    """The corpus files: the top-level `*.py` modules of the standard library.

    Only the top level of `sysconfig.get_paths()["stdlib"]` is read (about 170
    files and 4.7 MB on CPython 3.11), so packages, their test directories and
    `site-packages` are never included; `test_*.py` files are skipped as well.
    Files are ordered by name; a file is in the `"eval"` split when the CRC-32 of
    its name is divisible by 10 (about a tenth of the files), else in `"train"`.
    Both are deterministic for a given Python version; the two never overlap.

    Raises:
        DataError: the standard library's sources are not found (e.g. a Python
            build that ships only bytecode).
    """
    if split not in ("train", "eval", "all"):
        raise ConfigError(f"`split` must be 'train', 'eval' or 'all'; got {split!r}.")
    files = _sources(Path(sysconfig.get_paths()["stdlib"]))
    if split == "all":
        return files
    return [p for p in files if _is_eval(p.name) == (split == "eval")]


def _sources(root: Path) -> list[Path]:
    """The `*.py` files at the top of `root`, but `test_*.py`, by name."""
    files = sorted(
        (
            p
            for p in root.glob("*.py")
            if p.is_file() and not p.name.startswith("test_")
        ),
        key=lambda p: p.name,
    )
    if not files:
        raise DataError(
            f"no standard-library sources (*.py) were found in {root}; this Python "
            "ships without them. Pass your own text (e.g. `load_text_dir(...)`)."
        )
    return files


def _is_eval(name: str) -> bool:
    return zlib.crc32(name.encode("utf-8")) % EVAL_EVERY == 0


def stdlib_corpus(split: str = "train") -> list[str]:
    """The standard-library corpus as documents (one per file, in `stdlib_files`
    order), read as UTF-8.

    Example:
        >>> docs = stdlib_corpus("eval")
        >>> len(docs) > 5 and all(isinstance(d, str) for d in docs)
        True
    """
    return [read_text(p) for p in stdlib_files(split)]
