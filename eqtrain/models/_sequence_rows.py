"""The data side of sequence parallelism: LM rows with their `positions`
(restarting in every packed segment) and, for the zigzag layout, each row's
tokens permuted so that device `i` holds chunks `i` and `2n - 1 - i` of `2n`
(`_sequence`'s attention reads the layout back from the positions).
"""

from collections.abc import Mapping

import numpy as np

from .._errors import ConfigError
from ._sequence import check_scheme


def zigzag_order(seq_len: int, ways: int) -> np.ndarray:
    """The permutation of a row's positions that lays it out zigzag over `ways`
    devices: `2 * ways` chunks, device `i` holding chunks `i` and `2*ways - 1 - i`
    (Striped/zigzag ring attention's load balance for causal masks)."""
    if seq_len % (2 * ways):
        raise ConfigError(
            f"the zigzag layout splits a row into 2 x {ways} chunks; a row of "
            f"{seq_len} tokens does not split. Use a multiple of {2 * ways}."
        )
    chunks = np.arange(seq_len).reshape(2 * ways, -1)
    pairs = [(chunks[i], chunks[2 * ways - 1 - i]) for i in range(ways)]
    return np.concatenate([c for pair in pairs for c in pair])


def row_positions(rows: Mapping[str, np.ndarray]) -> np.ndarray:
    """`positions` of LM rows: restarting in every segment with `segment_ids`,
    else `0 .. seq_len - 1` (as the models' default)."""
    tokens = np.asarray(rows["tokens"])
    if "segment_ids" not in rows:
        return np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    seg = np.asarray(rows["segment_ids"])
    index = np.arange(seg.shape[1], dtype=np.int32)[None, :]
    starts = np.concatenate(
        [np.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1
    )
    first = np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    return (index - first).astype(np.int32)


def sequence_rows(
    rows: Mapping[str, np.ndarray], *, layout: str = "contiguous", ways: int = 1
) -> dict[str, np.ndarray]:
    """LM rows (`tokens`, `targets`, ... all `[N, seq_len]`) with `positions`
    added and, for `layout="zigzag"`, every column permuted by `zigzag_order`.

    The losses are token-weighted means, so permuting the tokens of a row (with
    their targets, masks, segment ids and positions) changes no result."""
    check_scheme(None, layout)
    out = {k: np.asarray(v) for k, v in rows.items()}
    out["positions"] = np.ascontiguousarray(row_positions(out))
    if layout == "zigzag" and ways > 1:
        order = zigzag_order(out["tokens"].shape[1], ways)
        out = {k: np.ascontiguousarray(v[:, order]) for k, v in out.items()}
    return out
