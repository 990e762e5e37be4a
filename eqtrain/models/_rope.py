"""Rotary position embeddings as data: a `Rope` is one attention kind's
`rope_parameters` (transformers 5), `rope_cos_sin` computes the cos and sin tables
transformers 5.24 computes for it, and `apply_rope` rotates queries and keys.

The frequencies that do not depend on the sequence length are computed once per
`Rope`, on the host, in float32 numpy in transformers' order of operations: numpy
divides exactly, as torch does, where XLA turns a division by a scalar into a
multiplication by its reciprocal. Powers are rounded correctly; torch's vectorised
pow rounds about 1% of them one ulp apart, which moves an angle by at most
`position * ulp(inv_freq)`.
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._errors import ConfigError


# The `Rope` fields each type reads beyond theta, dim and partial_rotary_factor,
# as transformers' function for that type reads them: required, then optional.
_ORIGINAL = "original_max_position_embeddings"
_REQUIRED: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor", "max_position_embeddings"),
    "yarn": ("factor", _ORIGINAL),
    "longrope": ("factor", _ORIGINAL, "short_factor", "long_factor"),
    "llama3": ("factor", _ORIGINAL, "low_freq_factor", "high_freq_factor"),
}
_OPTIONAL = {
    "yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    + ("truncate",),
    "longrope": ("attention_factor",),
}
ROPE_TYPES = tuple(_REQUIRED)
_HINTS = {  # for a missing required key
    "factor": "the scaling factor: 8.0 in Llama 3.1",
    "low_freq_factor": "1.0 in Llama 3.1",
    "high_freq_factor": "4.0 in Llama 3.1",
    "short_factor": "one number per frequency",
    "long_factor": "one number per frequency",
}
# Keys that change the math in model code eqtrain does not have.
_UNSUPPORTED_KEYS = ("mrope_section", "mrope_interleaved")


class _FieldError(ConfigError):
    """A `Rope` field is wrong; `rope_from_hf` re-raises it in config.json's terms."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"`Rope.{field}`: {problem}")
        self.field, self.problem = field, problem


@dataclasses.dataclass(frozen=True)
class Rope:
    """One attention kind's rotary embedding, as data (hashable: it sits in a
    frozen model config). Build it with `rope_from_hf`; `to_hf` writes it back.

    Fields are transformers' `rope_parameters` keys (`theta` is `rope_theta`) as
    given, None where absent; a field the type does not read must be None. `dim`
    is the number of rotated features, `int(head_dim * partial_rotary_factor)` (0:
    not set yet). `max_position_embeddings` is the model's; only `dynamic` reads it
    here (`rope_from_hf` resolves what yarn and longrope derive from it).
    """

    rope_type: str = "default"
    theta: float = 10000.0
    dim: int = 0
    partial_rotary_factor: float = 1.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self):
        _check(self)

    def to_hf(self) -> dict[str, Any]:
        """The transformers-5 `rope_parameters` dict. A `dynamic` Rope also needs
        the model config's `max_position_embeddings`; Phi-3's config class reads a
        top-level `original_max_position_embeddings`, which wins over this one."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.theta}
        if self.partial_rotary_factor != 1.0:
            out["partial_rotary_factor"] = self.partial_rotary_factor
        for name in _REQUIRED[self.rope_type] + _OPTIONAL.get(self.rope_type, ()):
            value = getattr(self, name)
            if value is not None and name != "max_position_embeddings":
                out[name] = list(value) if isinstance(value, tuple) else value
        return out


def _check(rope: Rope) -> None:
    t = rope.rope_type
    if t not in _REQUIRED:
        raise _FieldError(
            "rope_type",
            f"expected one of {', '.join(map(repr, ROPE_TYPES))}; got {t!r}. eqtrain "
            "computes these as transformers does; others are not supported yet.",
        )
    if not rope.theta > 0:
        raise _FieldError("theta", f"expected a positive number; got {rope.theta!r}.")
    if rope.dim < 0 or rope.dim % 2 or (t == "dynamic" and rope.dim == 2):
        raise _FieldError("dim", f"expected an even number; got {rope.dim}.")
    for name in (f.name for f in dataclasses.fields(rope)[4:]):
        _check_field(rope, name)


def _check_field(rope: Rope, name: str) -> None:
    """One of the type-specific fields: present if the type needs it, absent if
    it does not read it, and the factor lists one number per frequency."""
    t, value = rope.rope_type, getattr(rope, name)
    required, read = _REQUIRED[t], _REQUIRED[t] + _OPTIONAL.get(t, ())
    if name in required and value is None:
        hint = _HINTS.get(name, "a positive integer")
        raise _FieldError(name, f"rope_type {t!r} needs it ({hint}); it is missing.")
    if name not in read and value is not None:
        raise _FieldError(name, f"rope_type {t!r} does not read it; remove it.")
    lists = ("short_factor", "long_factor")
    if name in lists and value and rope.dim and len(value) != rope.dim // 2:
        raise _FieldError(
            name,
            f"expected {rope.dim // 2} numbers, one per frequency (rotary dim "
            f"{rope.dim} / 2); got {len(value)}. Check head_dim and "
            "partial_rotary_factor against the checkpoint.",
        )


def rope_from_hf(
    params: Mapping[str, Any],
    *,
    head_dim: int,
    max_position_embeddings: int,
    partial_rotary_factor: float = 1.0,
    original_max_position_embeddings: int | None = None,
    where: str = "config.json",
    name: str = "rope_parameters",
) -> Rope:
    """The `Rope` for one transformers rope parameter dict.

    Args:
        params: one `rope_parameters` dict (transformers 5), or a 4.x `rope_scaling`
            dict merged with the config's `rope_theta`. `type` is read as
            `rope_type`; `rope_theta` defaults to 10000.0. Gemma 3's dict of dicts
            takes one call per layer type.
        head_dim: the attention head size.
        max_position_embeddings: the model config's. longrope derives an absent
            `factor` (yarn a null one) as this / the original length; dynamic
            reads it at every call.
        partial_rotary_factor: the config's top-level value; one inside `params`
            wins, as in transformers.
        original_max_position_embeddings: the top-level value, for config classes
            that declare it (Phi-3: `config.get(key, 4096)`); as in transformers it
            then wins over `params`'. Otherwise None: `params`' value is used, else
            `max_position_embeddings`.
        where: names the file in error messages.
        name: names the dict in error messages (e.g. `rope_scaling`,
            `rope_parameters.full_attention`).

    Raises:
        ConfigError: an unknown type, a missing or malformed key, an odd rotary
            dimension; the message names the key.
    """
    t = params.get("rope_type", params.get("type", "default"))
    label = lambda key: f"`{name}.{key}` in {where}"
    _check_text_only(params, label)
    prf = _read(params, "partial_rotary_factor", label)
    prf = partial_rotary_factor if prf is None else prf
    fields = _read_fields(params, t, _rotary_dim(head_dim, prf, label), prf, label)
    _resolve_lengths(
        fields, params, t, max_position_embeddings, original_max_position_embeddings
    )
    try:
        return Rope(**fields)
    except _FieldError as e:
        key = {"theta": "rope_theta", "dim": "partial_rotary_factor"}.get(e.field)
        raise ConfigError(f"{label(key or e.field)}: {e.problem}") from None


def _check_text_only(params: Mapping[str, Any], label: Callable[[str], str]) -> None:
    """Refuse multimodal RoPE's keys."""
    for key in _UNSUPPORTED_KEYS:
        if params.get(key) is not None:
            raise ConfigError(
                f"{label(key)}: multimodal RoPE is not supported; remove the key "
                "for a text-only model."
            )


def _rotary_dim(head_dim: int, prf: float, label: Callable[[str], str]) -> int:
    """The rotating features of a head: `head_dim * prf`, even."""
    dim = int(head_dim * prf)
    if dim < 2 or dim % 2:
        raise ConfigError(
            f"{label('partial_rotary_factor')}: head_dim {head_dim} * {prf} gives "
            f"{dim} rotary features; expected an even number. Check both values."
        )
    return dim


def _read_fields(
    params: Mapping[str, Any],
    t: str,
    dim: int,
    prf: float,
    label: Callable[[str], str],
) -> dict[str, Any]:
    """`Rope`'s fields as `params` gives them for rope type `t`."""
    fields: dict[str, Any] = {"rope_type": t, "dim": dim, "partial_rotary_factor": prf}
    theta = _read(params, "rope_theta", label)
    fields["theta"] = 10000.0 if theta is None else theta
    for key in _REQUIRED.get(t, ()) + _OPTIONAL.get(t, ()):
        fields[key] = _read(params, key, label)
    if "truncate" in fields and "truncate" in params:  # transformers: null is False
        fields["truncate"] = bool(fields["truncate"])
    return fields


def _resolve_lengths(
    fields: dict[str, Any],
    params: Mapping[str, Any],
    t: str,
    longest: int,
    original: int | None,
) -> None:
    """Fill in `fields`' lengths as transformers does: dynamic's model length,
    the original length (the top-level one wins, else `params`', else
    `longest`), and longrope's (and a null yarn's) `factor` from them."""
    if t == "dynamic":
        fields["max_position_embeddings"] = longest
    if _ORIGINAL in fields:
        fields[_ORIGINAL] = (original or fields[_ORIGINAL]) or longest
    derive = t == "longrope" or (t == "yarn" and "factor" in params)
    if derive and fields["factor"] is None:
        fields["factor"] = longest / fields[_ORIGINAL]


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_KINDS: dict[str, tuple[str, Callable[[Any], bool], Callable[[Any], Any]]] = {
    "number": ("a number", _is_number, float),
    "int": ("an integer", lambda v: _is_number(v) and v == int(v), int),
    "bool": ("true or false", lambda v: isinstance(v, bool), bool),
    "list": (
        "a list of numbers",
        lambda v: isinstance(v, (list, tuple)) and all(map(_is_number, v)),
        lambda v: tuple(map(float, v)),
    ),
}
_KIND_OF = {_ORIGINAL: "int", "max_position_embeddings": "int", "truncate": "bool"}
_KIND_OF |= {"short_factor": "list", "long_factor": "list"}


def _read(params: Mapping[str, Any], key: str, label: Callable[[str], str]) -> Any:
    """`params[key]` converted to the field's type; None if absent or null."""
    value = params.get(key)
    if value is None:
        return None
    expected, valid, convert = _KINDS[_KIND_OF.get(key, "number")]
    if not valid(value):
        raise ConfigError(
            f"{label(key)}: expected {expected}; got {value!r}. Fix the value "
            "(transformers' RopeParameters documents each key)."
        )
    return convert(value)


def _exponents(dim: int) -> np.ndarray:
    """`arange(0, dim, 2) / dim` in float32, exactly as torch divides."""
    return np.arange(0, dim, 2).astype(np.float32) / np.float32(dim)


def _powers(base: float, exponents: np.ndarray) -> np.ndarray:
    """`float32(base) ** exponents`, rounded correctly to float32."""
    powers = np.float64(np.float32(base)) ** exponents.astype(np.float64)
    return powers.astype(np.float32)


@functools.lru_cache(maxsize=256)
def _tables(rope: Rope) -> tuple[np.ndarray, np.ndarray | None, float]:
    """(inverse frequencies, those past the original length for longrope,
    attention scaling), as transformers' init function computes them."""
    t, dim, f, one = rope.rope_type, rope.dim, rope.factor, np.float32(1.0)
    powers = _powers(rope.theta, _exponents(dim))
    inv_freq = one / powers
    if t == "linear":
        return inv_freq / np.float32(f), None, 1.0
    if t == "dynamic":  # at init: seq_len = max_position_embeddings, Python floats
        m = rope.max_position_embeddings
        base = rope.theta * ((f * m / m) - (f - 1)) ** (dim / (dim - 2))
        return one / _powers(base, _exponents(dim)), None, 1.0
    if t == "yarn":
        return _yarn(rope, powers), None, _yarn_scale(rope)
    if t == "longrope":
        original = rope.original_max_position_embeddings
        scale = 1.0 if f <= 1.0 else math.sqrt(1 + math.log(f) / math.log(original))
        scale = scale if rope.attention_factor is None else rope.attention_factor
        short, long = (
            one / (np.asarray(factors, np.float32) * powers)
            for factors in (rope.short_factor, rope.long_factor)
        )
        return short, long, scale
    if t == "llama3":
        return _llama3(rope, inv_freq), None, 1.0
    return inv_freq, None, 1.0


def _yarn_scale(rope: Rope) -> float:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.factor, rope.mscale) / mscale(
            rope.factor, rope.mscale_all_dim
        )
    return mscale(rope.factor)


def _yarn(rope: Rope, powers: np.ndarray) -> np.ndarray:
    dim, length, one = rope.dim, rope.original_max_position_embeddings, np.float32(1)

    def correction_dim(rotations: float) -> float:
        turns = math.log(length / (rotations * 2 * math.pi))
        return (dim * turns) / (2 * math.log(rope.theta))

    low = correction_dim(rope.beta_fast or 32.0)
    high = correction_dim(rope.beta_slow or 1.0)
    if rope.truncate is None or rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(
        high - low
    )
    weight = one - np.clip(ramp, 0, 1)  # of the extrapolated (unscaled) frequency
    interpolated = one / (np.float32(rope.factor) * powers)
    return interpolated * (one - weight) + (one / powers) * weight


def _llama3(rope: Rope, inv_freq: np.ndarray) -> np.ndarray:
    low, high = rope.low_freq_factor, rope.high_freq_factor
    original, f, one = rope.original_max_position_embeddings, rope.factor, np.float32(1)
    # torch computes `scalar / tensor` as `tensor.reciprocal() * scalar`
    wavelen = (one / inv_freq) * np.float32(2 * math.pi)
    low_wavelen, high_wavelen = np.float32(original / low), np.float32(original / high)
    scaled = np.where(wavelen > low_wavelen, inv_freq / np.float32(f), inv_freq)
    smooth = ((one / wavelen) * np.float32(original) - np.float32(low)) / np.float32(
        high - low
    )
    smoothed = (one - smooth) * scaled / np.float32(f) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _dynamic_inv_freq(rope: Rope, seq_len: Int[Array, ""]) -> Float[Array, " half"]:
    """transformers' dynamic NTK frequencies for a sequence past the model's
    length, in float32 as torch computes them from a tensor `seq_len`."""
    m, f = rope.max_position_embeddings, rope.factor
    length = jnp.maximum(seq_len, m).astype(jnp.float32)
    ratio = jnp.float32(f) * length / jnp.float32(m) - jnp.float32(f - 1)
    base = jnp.float32(rope.theta) * ratio ** jnp.float32(rope.dim / (rope.dim - 2))
    return 1.0 / base ** jnp.asarray(_exponents(rope.dim))


def rope_cos_sin(
    rope: Rope, positions: Int[Array, " seq"]
) -> tuple[Float[Array, "seq dim"], Float[Array, "seq dim"]]:
    """f32 cos and sin tables, `[seq, rope.dim]`, in transformers' layout (the
    frequencies repeated for both halves), attention scaling multiplied in.

    `dynamic` and `longrope` depend on the sequence length, which transformers
    takes as `max(position_ids) + 1` over the whole batch; this takes it over
    `positions`, one row (models are vmapped over rows), which agrees for a batch
    of one row. transformers' dynamic module also keeps grown frequencies for later
    calls (until one is shorter than `max_position_embeddings`); this is stateless,
    as a freshly built transformers module is. `positions` may be traced.
    """
    if not rope.dim:
        raise ConfigError("`Rope.dim` is 0 (unset); build it with `rope_from_hf`.")
    inv_freq, long_inv_freq, scale = _tables(rope)
    seq_len = jnp.max(positions) + 1
    if rope.rope_type == "dynamic":
        longer = seq_len > rope.max_position_embeddings
        inv_freq = jnp.where(longer, _dynamic_inv_freq(rope, seq_len), inv_freq)
    elif long_inv_freq is not None:
        longer = seq_len > rope.original_max_position_embeddings
        inv_freq = jnp.where(longer, long_inv_freq, inv_freq)
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if scale != 1.0:
        cos, sin = cos * jnp.float32(scale), sin * jnp.float32(scale)
    return stored_once(cos, sin)


def stored_once(*tables: Array) -> tuple[Array, ...]:
    """`tables` as they are, but on the CPU computed once and kept in memory.

    XLA:CPU fuses an elementwise value into every fusion that reads it, and
    counts cos and sin as cheap: unrolled layers then evaluate the tables'
    cos and sin again for every element of every query and key copy that
    reads them (once per row and head that reads the table,
    `docs/performance.md`).
    A matrix product is a library call XLA cannot fuse into, so the tables go
    through one with the identity, in full precision: every value is kept
    exactly (`x * 1` plus zeros). The product takes them 8 values at a time
    (`[n, 8] x [8, 8]`), 16 flops a value, where one over the whole width
    (256 for a head of 128) took ten times as long. Other backends get the
    tables untouched."""
    if jax.default_backend() != "cpu":
        return tables
    with jax.named_scope(STORED_ONCE):
        joined = jnp.concatenate(tables, axis=-1)
        k = math.gcd(joined.shape[-1], 8)
        eye = jnp.eye(k, dtype=joined.dtype)
        kept = jnp.matmul(joined.reshape(-1, k), eye, precision=lax.Precision.HIGHEST)
        return tuple(jnp.split(kept.reshape(joined.shape), len(tables), axis=-1))


STORED_ONCE = "rope_tables_stored_once"
"""The named scope of `stored_once`'s product (f32 whatever the model's
precision: the tables are f32, as transformers computes them)."""


def apply_rope(
    x: Float[Array, "seq heads head_dim"],
    cos: Float[Array, "seq dim"],
    sin: Float[Array, "seq dim"],
) -> Float[Array, "seq heads head_dim"]:
    """`x * cos + rotate_half(x) * sin` over the first `cos.shape[-1]` features, in
    x's dtype; the rest pass through (partial rotary, as in Phi-3). Feature `i`
    pairs with `i + dim/2` (not the interleaved GPT-J layout)."""
    dim, head_dim = cos.shape[-1], x.shape[-1]
    cos, sin = cos.astype(x.dtype)[:, None, :], sin.astype(x.dtype)[:, None, :]
    rot = x[..., :dim] if dim < head_dim else x
    rotated = jnp.concatenate([-rot[..., dim // 2 :], rot[..., : dim // 2]], axis=-1)
    out = rot * cos + rotated * sin
    return out if dim == head_dim else jnp.concatenate([out, x[..., dim:]], axis=-1)
