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
        match = _RESOURCE.fullmatch(part)
        amount = _amount(match.group(2)) if match else None
        if match is None or amount is None:
            raise ConfigError(
                f"`distributed.resources_per_worker` must be `NAME=AMOUNT` pairs "
                f"separated by commas, each amount a number >= 0 (e.g. "
                f"'CPU=8,GPU=1'); got {text!r}."
            )
        name = _RAY_NAMES.get(match.group(1).lower(), match.group(1))
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


def _amount(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if value >= 0 and value != float("inf") else None
