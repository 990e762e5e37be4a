"""Sizes in bytes from human-friendly strings (`"5GB"`, `"2GiB"`), the `size` kind
of config keys; `parse_duration` (in `_parse`) is its sibling for durations."""

import re

from .._errors import ConfigError


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update(KIB=2**10, MIB=2**20, GIB=2**30, TIB=2**40)


def parse_size(size: str | int, *, field: str = "max_shard_size") -> int:
    """`"5GB"` (10**9), `"2GiB"` (2**30), `"500MB"` or a byte count, in bytes.

    >>> parse_size("2GiB")
    2147483648
    """
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"`{field}` must be bytes or a size like '5GB', '500MB', '2GiB'; "
            f"got {size!r}."
        )
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"`{field}` must be more than 0 bytes; got {size!r}.")
    return value
