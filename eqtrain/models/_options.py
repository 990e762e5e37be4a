"""The runtime options every language-model config holds (`RuntimeFields`):
how a model computes, never its arrays; their validation, the per-call
`RuntimeOptions` resolved from them, and `with_options`' copy of a model.
"""

import copy
import dataclasses
from typing import Any, TypeVar

import equinox as eqx

from .._errors import ConfigError
from ._layers import as_dtype
from ._sequence import check_scheme
from ._stack import check_remat


def mlp_chunk_count(chunks: int | str, seq: int, hidden: int) -> int:
    """The number of sequence chunks of a tiled MLP: `chunks`, or for `"auto"`
    `ceil(seq / hidden)` (1 unless the sequence is longer than the width)."""
    if chunks == "auto":
        return max(1, -(-seq // hidden))
    return int(chunks)


def check_mlp_chunks(chunks: Any) -> None:
    if chunks == "auto":
        return
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ConfigError(
            f"`mlp_chunks` must be a positive int or 'auto'; got {chunks!r}."
        )


def check_attention_chunk(attention_chunk: Any) -> None:
    if (
        not isinstance(attention_chunk, int)
        or isinstance(attention_chunk, bool)
        or attention_chunk < 0
    ):
        raise ConfigError(
            f"`attention_chunk` must be an int >= 0 (queries per block; 0: off); "
            f"got {attention_chunk!r}."
        )


@dataclasses.dataclass(frozen=True)
class RuntimeFields:
    """The runtime options every language-model config holds (`RUNTIME_OPTIONS`;
    documented in `DecoderConfig`): how the model computes, never its arrays."""

    remat: str = "none"
    scan_layers: bool = True
    attention_impl: str | None = "auto"
    remat_save: tuple[str, ...] = ()
    remat_offload: tuple[str, ...] = ()
    mlp_chunks: int | str = 1
    attention_chunk: int = 0
    sequence_parallel: str | None = None
    sequence_layout: str = "contiguous"


RUNTIME_OPTIONS = frozenset(f.name for f in dataclasses.fields(RuntimeFields))
"""Config fields of the language models that `with_options` may change on an
existing model (none changes an array's shape)."""


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
    """How a block computes, the same for every layer (one object instead of
    loose keywords): the attention kernel, its query chunks, sequence
    parallelism, and the MLP's sequence chunks (resolved for the sequence)."""

    implementation: str | None
    query_chunk: int
    sequence_parallel: str | None
    sequence_layout: str
    mlp_chunks: int
    moe: Any = None
    fold_norms: bool = False
    """Each norm computed inside its sublayer's first projections and made
    again in the backward pass (`_decoder_mlps.normed`): on for scanned
    layers without remat, whose kept values are stacked and copied each step."""

    @classmethod
    def of(cls, config: Any, seq: int, hidden: int) -> "RuntimeOptions":
        """The options of a model config (its `RUNTIME_OPTIONS` fields) for a
        sequence of `seq` tokens and a residual stream `hidden` wide."""
        return cls(
            implementation=config.attention_impl,
            query_chunk=config.attention_chunk,
            sequence_parallel=config.sequence_parallel,
            sequence_layout=config.sequence_layout,
            mlp_chunks=mlp_chunk_count(config.mlp_chunks, seq, hidden),
            moe=getattr(config, "moe_options", None),
            fold_norms=bool(config.scan_layers) and config.remat == "none",
        )

    def on_one_device(self) -> "RuntimeOptions":
        """These options without sequence parallelism (generation's: the cache
        holds whole rows) and without folded norms (nothing is differentiated)."""
        return dataclasses.replace(self, sequence_parallel=None, fold_norms=False)


def check_runtime(config: Any) -> None:
    """Validate a model config's runtime options (`RUNTIME_OPTIONS`)."""
    check_scheme(config.sequence_parallel, config.sequence_layout)
    check_attention_chunk(config.attention_chunk)
    check_attention_impl(config.attention_impl)
    check_remat(config.remat, config.remat_save, config.remat_offload)
    check_mlp_chunks(config.mlp_chunks)
    as_dtype(config.param_dtype)


ATTENTION_IMPLS = ("auto", None, "xla", "flash", "pallas", "cudnn")
"""The attention kernels (`attention`'s `implementation`)."""


def check_attention_impl(attention_impl: Any) -> None:
    if attention_impl not in ATTENTION_IMPLS:
        raise ConfigError(
            "`attention_impl` must be 'auto', None, 'xla', 'flash', 'pallas' or "
            f"'cudnn'; got {attention_impl!r}."
        )


ModuleT = TypeVar("ModuleT", bound=eqx.Module)


def with_config_options(
    model: ModuleT, allowed: frozenset[str], **changes: Any
) -> ModuleT:
    """A copy of `model` (same arrays) whose `config` has `changes` applied; only
    options that do not change any array's shape may change."""
    bad = sorted(set(changes) - allowed)
    if bad:
        raise ConfigError(
            f"`with_options` changes only {sorted(allowed)}; got {bad}. Options that "
            "change parameter shapes need a new model: `type(model)(config, key)`."
        )
    config = dataclasses.replace(model.config, **changes)  # type: ignore[attr-defined]
    new = copy.copy(model)
    object.__setattr__(new, "config", config)  # a static field; arrays are shared
    return new
