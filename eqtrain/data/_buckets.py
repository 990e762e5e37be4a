"""Prompt rows bucketed by length (GRPO): a batch's prompts are cut to the
narrowest of a few widths that holds its longest one, and an epoch's order puts
prompts of one bucket together, so a short prompt is not padded to the longest
the data has.

A prompt row is left-padded (`prompt [width]`, `prompt_len`, `index`), so cutting
it to width `w` keeps its last `w` columns. Every process computes the same
order and the same width for a batch from the lengths of all rows (known without
reading a token), so the processes of a run agree on each batch's shape; the
compiled step has one program per width, a handful at most.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np


MINIMUM = 64
"""The narrowest bucket: below it a compiled program per width costs more than
the padding it saves."""

GROUP = 16
"""Batches per group of an epoch whose rows are sorted by bucket (then the
group's batches are shuffled): prompts of one bucket meet in a batch while the
order of the epoch stays random at the scale of a group."""


def bucket_widths(width: int, buckets: int, minimum: int = MINIMUM) -> tuple[int, ...]:
    """The widths of at most `buckets` buckets up to `width`: `width`, then
    halves of it rounded up to a multiple of 8, the narrowest no less than
    `minimum` (one bucket when `width <= minimum`)."""
    out = [width]
    while len(out) < buckets and out[-1] > minimum:
        half = max(-(-out[-1] // 16) * 8, minimum)  # ceil(w / 2), up to 8s
        if half >= out[-1]:
            break
        out.append(half)
    return tuple(sorted(out))


class PromptBuckets:
    """A row source (`num_rows`, `take`) over GRPO prompt rows whose batches are
    cut to their bucket's width (`take_in_batch`, which `Loader` calls with the
    whole global batch's rows) and whose epochs group prompts by bucket
    (`epoch_order`). Every other attribute is the wrapped rows'.

    Args:
        rows: the prompt rows (`take(indices)` gives `prompt`, `prompt_len`,
            `index`), e.g. a `PostRows` of kind `"prompt"`.
        lengths: every row's prompt length (`[num_rows]`).
        widths: the buckets' widths, ascending; the last is the rows' width.
        batch_size: the global batch size (groups are whole batches).
        group: batches per sorted group (`GROUP`).
    """

    def __init__(
        self,
        rows: Any,
        lengths: Sequence[int] | np.ndarray,
        widths: Sequence[int],
        batch_size: int,
        group: int = GROUP,
    ):
        self.rows = rows
        self.num_rows = int(rows.num_rows)
        self.lengths = np.asarray(lengths, np.int64)
        self.widths = np.asarray(sorted(widths), np.int64)
        self.batch_size = int(batch_size)
        self.group = int(group)
        if len(self.lengths) != self.num_rows:
            raise ValueError(
                f"{len(self.lengths)} lengths for {self.num_rows} prompt rows"
            )
        if self.lengths.max(initial=0) > self.widths[-1]:
            raise ValueError("a prompt is longer than the widest bucket")
        self.bucket = np.searchsorted(self.widths, self.lengths, side="left")

    def __getattr__(self, name: str) -> Any:
        if name == "rows":  # not set yet (unpickling, copying): no recursion
            raise AttributeError(name)
        return getattr(self.rows, name)

    def __len__(self) -> int:
        return self.num_rows

    def width(self, batch_rows: np.ndarray) -> int:
        """The width of the batch made of `batch_rows` (all processes' rows)."""
        if len(batch_rows) == 0:
            return int(self.widths[-1])
        return int(self.widths[self.bucket[batch_rows].max()])

    def take(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Rows `indices` at the full width."""
        return self.rows.take(indices)

    def take_in_batch(
        self, indices: np.ndarray, batch_rows: np.ndarray
    ) -> dict[str, np.ndarray]:
        """Rows `indices` (this process's) of the batch `batch_rows`, cut to the
        batch's width: the last columns of the left-padded prompts."""
        out = dict(self.rows.take(indices))
        w = self.width(batch_rows)
        out["prompt"] = np.ascontiguousarray(out["prompt"][:, -w:])
        return out

    def epoch_order(self, epoch: int, *, seed: int, shuffle: bool) -> np.ndarray:
        """An epoch's order: a permutation drawn from `(seed, epoch)`, cut into
        groups of `group` batches; each group's rows sorted by bucket (stable),
        its whole batches shuffled. Without shuffling: the rows in order."""
        n = self.num_rows
        if not shuffle:
            return np.arange(n)
        order = np.random.default_rng([seed, epoch]).permutation(n)
        rng = np.random.default_rng([seed, epoch, 1])
        size, b = self.group * self.batch_size, self.batch_size
        out = []
        for start in range(0, n, size):
            chunk = order[start : start + size]
            chunk = chunk[np.argsort(self.bucket[chunk], kind="stable")]
            whole = len(chunk) // b
            batches = chunk[: whole * b].reshape(whole, b)
            out += [batches[rng.permutation(whole)].reshape(-1), chunk[whole * b :]]
        return np.concatenate(out)
