"""Human-friendly quantities of config keys: sizes in bytes (`"5GB"`, `"2GiB"`,
the `size` kind), durations in seconds (`"2h30m"`, the `duration` kind) and the
Ray resources of a worker (`"CPU=8,GPU=1"`)."""

import math
import re
from typing import Any

from .._errors import ConfigError


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS.update(KIB=2**10, MIB=2**20, GIB=2**30, TIB=2**40)


def parse_size(size: str | int, *, field: str = "max_shard_size") -> int:
    """`"5GB"` (10**9), `"2GiB"` (2**30), `"500MB"` or a byte count, in bytes.

    >>> parse_size("2GiB")
    2147483648
    """
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(
            f"`{field}` must be bytes or a size like '5GB', '500MB', '2GiB'; "
            f"got {size!r}."
        )
    value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ConfigError(f"`{field}` must be more than 0 bytes; got {size!r}.")
    return value


# Longer units first: `10min` and `500ms` are not `10m` or `500m` plus a rest.
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|min|sec|d|h|m|s)", re.IGNORECASE)
_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "min": 60.0}
_SECONDS |= {"s": 1.0, "sec": 1.0, "ms": 1e-3}
_DURATION_HELP = "a duration like '90s', '10m', '1.5h', '2h30m' or '1d'"


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string like `"90"`, `"45s"`, `"10m"`, `"2h30m"`,
    `"1.5h"`, `"1d"`.

    Every part of a compound duration names its unit, larger units first, each
    once: `"2h30"`, `"3s2h"` and `"1.5.5m"` are errors (not 2h30s, 2h3s or
    1.5s + 0.5m).

    >>> parse_duration("2h30m")
    9000.0
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif not isinstance(value, str):
        raise ValueError("expected seconds or a duration like '2h30m'")
    else:
        seconds = _parse_duration_text(value)
    if not math.isfinite(seconds):
        raise ValueError(f"expected a finite number of seconds or {_DURATION_HELP}")
    return seconds


def _parse_duration_text(value: str) -> float:
    text = value.strip().replace(" ", "").replace("_", "")
    if not text:
        raise ValueError("empty duration")
    try:
        return float(text)  # plain seconds, also as `1e4` (as `--set` gives them)
    except ValueError:
        pass
    total, pos, last_unit = 0.0, 0, math.inf
    while pos < len(text):
        amount, unit, pos = _duration_part(text, pos)
        if unit >= last_unit:
            raise ValueError(
                f"expected {_DURATION_HELP}: units must go from largest to smallest, "
                f"each once (e.g. '2h30m', not '30m2h')"
            )
        total, last_unit = total + amount * unit, unit
    return total


def _duration_part(text: str, pos: int) -> tuple[float, float, int]:
    """The amount, the unit (in seconds) and the end of the part at `pos`."""
    match = _DURATION.match(text, pos)
    if match is None:
        rest = text[pos:]
        why = (
            f"{rest!r} has no unit (write e.g. '2h30m', not '2h30')"
            if re.fullmatch(r"[\d.]+", rest)
            else f"cannot read {rest!r}"
        )
        raise ValueError(f"expected {_DURATION_HELP}: {why}")
    return float(match.group(1)), _SECONDS[match.group(2).lower()], match.end()


# Ray's own resource names are case-sensitive; a lower-case `gpu` would ask for a
# custom resource that no node has, and the run would wait for it forever.
_RAY_NAMES = {"cpu": "CPU", "gpu": "GPU", "tpu": "TPU", "memory": "memory"}
_RESOURCE = re.compile(r"\s*([A-Za-z_][\w:./-]*)\s*=\s*([^,=]+?)\s*")


def parse_resources(text: str) -> dict[str, float]:
    """`"CPU=8,GPU=1"` -> `{"CPU": 8.0, "GPU": 1.0}`: the Ray resources of one
    worker (`distributed.resources_per_worker`). `cpu`, `gpu`, `tpu` are spelled
    as Ray spells them; other names are custom resources, kept as written.

    >>> parse_resources("cpu=2, GPU=0.5, my_pool=1")
    {'CPU': 2.0, 'GPU': 0.5, 'my_pool': 1.0}
    """
    out: dict[str, float] = {}
    for part in text.split(","):
        name, amount = _resource(part, text)
        if name in out:
            raise ConfigError(
                f"`distributed.resources_per_worker` names {name} twice; got "
                f"{text!r}. Give each resource once."
            )
        out[name] = amount
    if not any(out.values()):
        raise ConfigError(
            f"`distributed.resources_per_worker` must ask for some resource (e.g. "
            f"'CPU=1'); got {text!r}, which would place no worker anywhere in "
            "particular."
        )
    return out


def _resource(part: str, text: str) -> tuple[str, float]:
    """One `NAME=AMOUNT` pair of `text`, with Ray's spelling of the name."""
    match = _RESOURCE.fullmatch(part)
    amount = _amount(match.group(2)) if match else None
    if match is None or amount is None:
        raise ConfigError(
            f"`distributed.resources_per_worker` must be `NAME=AMOUNT` pairs "
            f"separated by commas, each amount a number >= 0 (e.g. "
            f"'CPU=8,GPU=1'); got {text!r}."
        )
    return _RAY_NAMES.get(match.group(1).lower(), match.group(1)), amount


def _amount(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value >= 0 and value != float("inf") else None
