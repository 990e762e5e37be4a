"""`Table`: the rows a `Loader` reads, from any of its kinds of source (a dict of
arrays, a `datasets.Dataset`, a row source, a sequence of examples), fetched by
index arrays.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import ConfigError
from ._errors import DataError


def _kind(source: Any) -> str:
    """Which kind of source `source` is: `rows`, `arrays`, `dataset` or `sequence`."""
    if (
        hasattr(source, "num_rows")
        and hasattr(source, "take")
        and not hasattr(source, "column_names")  # a datasets.Dataset has both
    ):
        return "rows"  # a row source: a store's rows, a mixture
    if isinstance(source, Mapping):
        return "arrays"
    if hasattr(source, "column_names") and hasattr(source, "__getitem__"):
        return "dataset"  # a datasets.Dataset
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        return "sequence"
    raise ConfigError(
        f"cannot load batches from a {type(source).__name__}. Pass a dict of "
        "equal-length arrays (e.g. from `chunk_documents`/`pack`/`collate`), a "
        "`datasets.Dataset`, a row source (`num_rows` and `take`, e.g. "
        "`eqtrain.data.prepare(...).lm_rows(seq_len)`), or a list of examples "
        "with a `transform=`."
    )


def _arrays(source: Mapping[str, Any]) -> tuple[dict[str, np.ndarray], int]:
    """A mapping's values as arrays, and the leading length they share."""
    data = {k: np.asarray(v) for k, v in source.items()}
    if not data:
        raise DataError("the source mapping has no arrays; pass at least one.")
    lengths = {k: (v.shape[0] if v.ndim else None) for k, v in data.items()}
    if len(set(lengths.values())) != 1 or None in lengths.values():
        raise DataError(
            "the source arrays must share their leading length (one row per "
            f"example); got leading lengths {lengths}."
        )
    return data, next(iter(lengths.values()))


class Table:
    """Rows of a source, fetched by index arrays."""

    def __init__(self, source: Any):
        self.kind = _kind(source)
        self.data: Any = source
        if self.kind == "arrays":
            self.data, self.num_rows = _arrays(source)
        elif self.kind == "rows":
            self.num_rows = int(source.num_rows)
        else:
            self.num_rows = len(source)
        if self.num_rows == 0:
            raise DataError(
                "the source is empty (0 rows). Check the files or the filter that "
                "produced it."
            )

    def take(self, indices: np.ndarray) -> Any:
        """Rows `indices`, as the source's kind holds them."""
        if self.kind == "arrays":
            return {k: v[indices] for k, v in self.data.items()}
        if self.kind == "rows":
            return self.data.take(indices)
        if self.kind == "dataset":
            return self.data[indices.tolist()]  # a dict of columns (lists)
        return [self.data[i] for i in indices.tolist()]

    def add_columns(self, columns: Mapping[str, Any]) -> None:
        """Add per-row arrays to a table of arrays (see `Loader.add_columns`)."""
        if self.kind == "rows" and hasattr(self.data, "add_columns"):
            self.data.add_columns(columns)  # e.g. a post-training store's rows
            return
        if self.kind != "arrays":
            raise ConfigError(
                "`add_columns` needs a loader over a dict of arrays; this one reads "
                f"a {self.kind}."
            )
        for name, value in columns.items():
            array = np.asarray(value)
            if name in self.data:
                raise ConfigError(f"the loader already has a column {name!r}.")
            if array.ndim == 0 or array.shape[0] != self.num_rows:
                raise ConfigError(
                    f"column {name!r} has shape {array.shape}; it needs one entry "
                    f"per row ({self.num_rows} rows)."
                )
            self.data[name] = array
