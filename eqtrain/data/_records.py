"""Post-training records: their format and fields, read leniently (a bad record
is skipped with a reason, never trained on), and the `SkipReport` that counts the
skipped ones.
"""

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._errors import ChatTemplateError, DataError


@dataclasses.dataclass(frozen=True)
class SkipReport:
    """How many of `total` records were kept, and why the others were skipped.

    `reasons` maps a reason (a phrase such as "with chosen == rejected") to the
    number of rows skipped for it, and `first` to the index of the first such row.
    `str(report)` is one line for a log, `""` when nothing was skipped.
    """

    total: int
    kept: int
    reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    first: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def skipped(self) -> int:
        return self.total - self.kept

    def __str__(self) -> str:
        if not self.skipped:
            return ""
        return f"{self.skipped} of {self.total} rows skipped: {self.details()}"

    def details(self) -> str:
        """The reasons with their counts and first rows, most frequent first."""
        order = sorted(self.reasons, key=lambda r: (-self.reasons[r], self.first[r]))
        return ", ".join(
            f"{self.reasons[r]} {r} (first: row {self.first[r]})" for r in order
        )


class Skip(Exception):
    """A row to skip, for `reason`."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# Each format and the columns that name it, in order of precedence.
_FORMAT_COLUMNS = (
    ("chat", {"messages"}),
    ("preference", {"chosen", "rejected"}),
    ("prompt_completion", {"prompt", "completion"}),
    ("text", {"text"}),
)


def infer_format(records: Any) -> str:
    """The record format its columns/fields name: `"chat"` (`messages`),
    `"preference"` (`chosen` and `rejected`, with or without `prompt`),
    `"prompt_completion"` (`prompt` and `completion`) or `"text"` (`text`), in
    this order of precedence.

    Raises:
        DataError: no format fits (the error lists the columns).
    """
    columns = set(_columns(records))
    for format, names in _FORMAT_COLUMNS:
        if names <= columns:
            return format
    raise DataError(
        f"cannot tell the data's format from its columns {sorted(columns)}: "
        "expected 'messages' (chat), 'chosen' + 'rejected' (preference, with an "
        "optional 'prompt'), 'prompt' + 'completion' or 'text'. Rename the "
        "columns, or pass the format explicitly."
    )


# -- fields -----------------------------------------------------------------------
def preference_fields(row: Any) -> tuple[Any, Any, Any]:
    """`(prompt, chosen, rejected)` of a row, the prompt extracted from the shared
    leading messages when the row has none."""
    chosen, rejected = field(row, "chosen"), field(row, "rejected")
    prompt = row.get("prompt") if isinstance(row, Mapping) else None
    if prompt is None and _kind(chosen) == _kind(rejected) == "messages":
        if chosen == rejected:
            raise Skip("with chosen == rejected")
        prompt, chosen, rejected = _split_shared(list(chosen), list(rejected))
    if prompt is None:
        raise Skip("missing 'prompt'")
    same_kind(("prompt", prompt), ("chosen", chosen), ("rejected", rejected))
    if chosen == rejected:
        raise Skip("with chosen == rejected")
    if is_empty(chosen) or is_empty(rejected):
        raise Skip("with an empty chosen or rejected completion")
    return prompt, chosen, rejected


def _split_shared(chosen: list[Any], rejected: list[Any]) -> tuple[list, list, list]:
    """The shared leading messages (the implicit prompt) and the two remainders."""
    n = 0
    while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
        n += 1
    return chosen[:n], chosen[n:], rejected[n:]


def field(row: Any, name: str) -> Any:
    """`row[name]`; a missing or null field skips the row."""
    if not isinstance(row, Mapping):
        raise Skip("that are not mappings")
    value = row.get(name)
    if value is None:
        raise Skip(f"missing {name!r}")
    return value


def _kind(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if isinstance(value, (list, tuple)):
        return "messages"
    return None


def same_kind(*fields: tuple[str, Any]) -> None:
    kinds = {_kind(value) for _, value in fields}
    if None in kinds or len(kinds) > 1:
        names = [repr(name) for name, _ in fields]
        listed = ", ".join(names[:-1]) + " and " + names[-1]
        each = "both" if len(names) == 2 else "all"
        raise Skip(f"with {listed} not {each} text or {each} message lists")


def is_empty(value: Any) -> bool:
    """A blank string, or messages none of which has non-blank text content."""
    if isinstance(value, str):
        return not value.strip()
    return not any(
        not isinstance(m, Mapping) or str(m.get("content") or "").strip() for m in value
    )


# -- records and skips ------------------------------------------------------------
def _columns(records: Any) -> list[str]:
    if isinstance(records, Mapping):
        return list(records)
    if hasattr(records, "column_names"):  # datasets.Dataset
        return list(records.column_names)
    mappings = (record for record in records if isinstance(record, Mapping))
    return list(dict.fromkeys(name for record in mappings for name in record))


def record_rows(records: Any) -> list[Any]:
    """The records as a list of rows (dicts, unless malformed)."""
    if isinstance(records, Mapping):
        rows = _column_rows(records)
    elif hasattr(records, "to_list"):  # datasets.Dataset
        rows = records.to_list()
    else:
        rows = list(records)
    if not rows:
        raise DataError("the data holds no records; pass at least one.")
    return rows


def _column_rows(records: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A mapping of columns as rows."""
    lengths = {name: len(values) for name, values in records.items()}
    if len(set(lengths.values())) > 1:
        raise DataError(
            f"the columns have different lengths: {lengths}. Pass columns of "
            "one length."
        )
    return [
        dict(zip(records, values, strict=True))
        for values in zip(*records.values(), strict=True)
    ]


def collect(
    rows: Sequence[Any], encode: Callable[[Any], Any]
) -> tuple[list, SkipReport]:
    """`encode` over `rows`, skipping (and counting) the rows it rejects."""
    kept, reasons, first = [], {}, {}
    for i, row in enumerate(rows):
        try:
            kept.append(encode(row))
        except (Skip, ChatTemplateError) as skip:
            reasons[skip.reason] = reasons.get(skip.reason, 0) + 1
            first.setdefault(skip.reason, i)
    report = SkipReport(total=len(rows), kept=len(kept), reasons=reasons, first=first)
    if not kept:
        raise _all_skipped(report)
    return kept, report


def _all_skipped(report: SkipReport) -> DataError:
    """The error when no row is left, saying what to check for the top reason."""
    top = max(report.reasons, key=report.reasons.__getitem__)
    check = (
        "the rows against the chat template (the tokenizer's own, or "
        "data.chat_template's; template= in Python)"
        if "chat template" in top
        else "the format and field names, and seq_len/max_prompt_len"
    )
    return DataError(
        f"all {report.total} rows were skipped: {report.details()}. Check {check}."
    )
