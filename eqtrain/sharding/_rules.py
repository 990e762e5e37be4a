"""Partition rules: regexes over a leaf's dotted path give its `PartitionSpec`, and a
default FSDP pass shards every large leaf over `fsdp` on a free dimension.

Builds on the named axes of `_mesh.py`; `_place.py` applies rules to a state.
"""

import dataclasses
import inspect
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax.tree_util as jtu
from jax.sharding import Mesh, PartitionSpec

from .._errors import ConfigError
from ._mesh import AXES, axis_sizes


LAYERS = "layers"
"""A pseudo-axis for a rule's spec: this dimension is a stack of layers (for
`lax.scan`). It is never sharded (not even by FSDP) and becomes `None`."""

Rule = tuple[str, PartitionSpec]
"""`(regex, spec)`: a leaf whose dotted path matches `regex` (`re.search`) gets
`spec`, padded with `None` to the leaf's rank."""

FSDP_MIN_SIZE = 2**14
"""Default: leaves with fewer elements stay replicated over `fsdp`."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """Ordered partition rules and the default FSDP pass.

    A leaf's spec is that of the first rule whose regex matches its dotted path
    (`model.layers.self_attn.q_proj.weight`), padded with `None`; no match means
    replicated. The mesh axes `data`, `sequence` and `tensor` in a rule are
    binding: if their sizes do not divide the dimension, it is an error. An axis
    the mesh lacks (one built with `jax.make_mesh`) counts as size 1: it splits
    nothing, as on a `make_mesh` mesh where that axis has size 1.

    `fsdp` is a memory optimisation and never an error. When the pass is on
    (`fsdp_min_size` is not None) and the mesh's `fsdp` axis is > 1, a leaf with
    fewer than `fsdp_min_size` elements is replicated over `fsdp`; a larger one
    gets `fsdp` where its rule names it if that dimension splits, else on its
    largest free dimension (a `None` entry, never a `LAYERS` one) that splits (the
    last such on ties), else nowhere. With the pass off, a rule's `fsdp` is binding
    like the other axes.

    Attributes:
        patterns: the `(regex, PartitionSpec)` rules, first match wins. Specs may
            name the mesh axes and `LAYERS`.
        fsdp_min_size: smallest leaf (in elements) that FSDP shards; `None`
            turns the pass off.
    """

    patterns: Sequence[Rule] = ()
    fsdp_min_size: int | None = FSDP_MIN_SIZE

    def __post_init__(self) -> None:
        patterns = tuple(self.patterns)
        for i, rule in enumerate(patterns):
            _check_rule(i, rule)
        object.__setattr__(self, "patterns", patterns)
        if self.fsdp_min_size is not None and self.fsdp_min_size < 0:
            raise ConfigError(
                f"`fsdp_min_size` must be >= 0 or None; got {self.fsdp_min_size}."
            )

    def match(self, path: str) -> PartitionSpec | None:
        """The spec of the first rule matching `path` (None: no rule matches)."""
        for pattern, spec in self.patterns:
            if re.search(pattern, path):
                return spec
        return None

    def spec_for(
        self,
        path: str,
        shape: tuple[int, ...],
        mesh: Mesh,
        *,
        fsdp: bool = True,
    ) -> PartitionSpec:
        """The mesh `PartitionSpec` of a leaf (`LAYERS` resolved to `None`).

        Args:
            path: the leaf's dotted path.
            shape: its shape.
            mesh: the mesh (for axis sizes and divisibility).
            fsdp: apply the FSDP pass to this leaf (`False`: its rule, if any,
                is taken as written, `fsdp` included).

        Raises:
            ConfigError: the spec is longer than the leaf's rank, names an axis
                twice, or an axis size does not divide the dimension it splits.
        """
        spec = self.match(path)
        entries = [_on_mesh(e, mesh) for e in _padded(spec, shape, path)]
        if fsdp and self.fsdp_min_size is not None:
            entries = _with_fsdp(entries, shape, axis_sizes(mesh), self.fsdp_min_size)
        _check_fits(entries, shape, mesh, path, spec)
        return PartitionSpec(*(None if e == LAYERS else e for e in entries))


def _check_rule(i: int, rule: Any) -> None:
    """Rule `i` is a `(regex, PartitionSpec)` pair naming known axes."""
    if not _is_rule(rule):
        raise ConfigError(
            f"partition rule {i} must be a `(regex, PartitionSpec)` pair; "
            f"got {rule!r}. Example: (r'q_proj\\.weight$', "
            "P(None, 'tensor', None))."
        )
    _check_names(rule[1], f"rule {i} ({rule[0]!r})")
    _check_regex(i, rule[0])


def _check_regex(i: int, pattern: str) -> None:
    try:
        re.compile(pattern)
    except re.error as e:
        raise ConfigError(
            f"partition rule {i} has an invalid regex {pattern!r}: {e}."
        ) from e


def _is_rule(rule: Any) -> bool:
    return (
        isinstance(rule, tuple)
        and len(rule) == 2
        and isinstance(rule[0], str)
        and isinstance(rule[1], PartitionSpec)
    )


def _names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _check_names(spec: PartitionSpec, where: str) -> None:
    seen: list[str] = []
    for entry in spec:
        for name in _names(entry):
            if name not in (*AXES, LAYERS):
                raise ConfigError(
                    f"{where}: unknown axis {name!r} in {spec}; use the mesh axes "
                    f"{list(AXES)}, {LAYERS!r} (a stacked-layer dimension) or None."
                )
            if name in seen and name != LAYERS:
                raise ConfigError(f"{where}: axis {name!r} appears twice in {spec}.")
            if name == LAYERS and entry != LAYERS:
                raise ConfigError(
                    f"{where}: {LAYERS!r} marks a whole dimension; it cannot be "
                    f"combined with mesh axes ({entry!r} in {spec})."
                )
            seen.append(name)


def _padded(spec: PartitionSpec | None, shape: tuple[int, ...], path: str) -> list[Any]:
    entries = [] if spec is None else list(spec)
    if len(entries) > len(shape):
        raise ConfigError(
            f"the partition rule for `{path}` gives {spec} ({len(entries)} "
            f"dimensions) but the leaf has shape {shape}. Shorten the spec or make "
            "the rule's regex more specific."
        )
    return entries + [None] * (len(shape) - len(entries))


def _without(entry: Any, name: str) -> Any:
    names = tuple(n for n in _names(entry) if n != name)
    if not names:
        return None
    return names[0] if len(names) == 1 else names


def _with_fsdp(
    entries: list[Any],
    shape: tuple[int, ...],
    sizes: dict[str, int],
    min_size: int,
) -> list[Any]:
    """The FSDP pass (see `Rules`): where `fsdp` goes, if anywhere."""
    fsdp = sizes["fsdp"]
    named = [i for i, entry in enumerate(entries) if "fsdp" in _names(entry)]
    out = [_without(entry, "fsdp") for entry in entries]
    if fsdp == 1 or math.prod(shape) < min_size:
        return out
    if named and shape[named[0]] % _ways(entries[named[0]], sizes) == 0:
        out[named[0]] = entries[named[0]]  # as the rule wrote it
        return out
    best = _largest_free(out, shape, fsdp)
    if best is not None:
        out[best] = "fsdp"
    return out


def _largest_free(entries: list[Any], shape: tuple[int, ...], fsdp: int) -> int | None:
    """The largest unsharded dimension that `fsdp` divides (the last on ties)."""
    free = [i for i, e in enumerate(entries) if e is None and shape[i] % fsdp == 0]
    return max(free, key=lambda i: (shape[i], i)) if free else None


def _check_fits(
    entries: list[Any],
    shape: tuple[int, ...],
    mesh: Mesh,
    path: str,
    spec: PartitionSpec | None,
) -> None:
    sizes = axis_sizes(mesh)
    resolved = PartitionSpec(*entries)
    for dim, (entry, n) in enumerate(zip(entries, shape, strict=True)):
        ways = _ways(entry, sizes)
        if n % ways:
            origin = _origin(spec, resolved)
            axes = {k: v for k, v in sizes.items() if v > 1} or sizes
            raise ConfigError(
                f"cannot shard `{path}` (shape {shape}) with {resolved}{origin}: "
                f"dimension {dim} of size {n} does not split over {entry!r} ({ways} "
                f"ways; mesh axes {axes}). Change the mesh sizes, or add an earlier "
                "rule for this leaf that shards it differently (or replicates it "
                "with P())."
            )


def _ways(entry: Any, sizes: dict[str, int]) -> int:
    """How many ways a spec entry splits its dimension."""
    return math.prod(sizes[name] for name in _names(entry) if name != LAYERS)


def _origin(spec: PartitionSpec | None, resolved: PartitionSpec) -> str:
    """Where a spec came from, when the FSDP pass added to the rule's."""
    added = spec is not None and "fsdp" in _names_in(resolved) - _names_in(spec)
    return f" (the rule's {spec} plus FSDP)" if added else ""


def _on_mesh(entry: Any, mesh: Mesh) -> Any:
    """A spec entry without the axes `mesh` lacks (size 1: they split nothing)."""
    if entry == LAYERS:
        return entry
    for name in _names(entry):
        if name not in mesh.shape:
            entry = _without(entry, name)
    return entry


def _names_in(spec: PartitionSpec) -> set[str]:
    return {name for entry in spec for name in _names(entry)}


def as_rules(rules: "Rules | Sequence[Rule] | None") -> Rules:
    """`Rules` from `Rules`, a list of `(regex, spec)` pairs (with the default FSDP
    pass) or `None` (no patterns, the default FSDP pass only)."""
    if rules is None:
        return Rules()
    if isinstance(rules, Rules):
        return rules
    return Rules(tuple(rules))


def model_rules(model: Any) -> list[Rule] | None:
    """The model's own tensor-parallel rules, or None if it has none.

    Looked up as a `tensor_parallel_rules()` method of the model, else a
    `tensor_parallel_rules()` function of the module defining its class (as
    `eqtrain.models.llama` and `eqtrain.models.gpt2` have).
    """
    fn: Callable[[], Any] | None = getattr(model, "tensor_parallel_rules", None)
    if fn is None:
        module = inspect.getmodule(type(model))
        fn = getattr(module, "tensor_parallel_rules", None)
    return None if fn is None else list(fn())


def _without_tensor(spec: PartitionSpec) -> PartitionSpec:
    return PartitionSpec(*(_without(e, "tensor") for e in spec))


def _is_adapted(x: Any) -> bool:
    return all(hasattr(x, name) for name in ("weight", "lora_a", "lora_b"))


def adapter_rules(model: Any, rules: Rules) -> list[Rule]:
    """Rules for the LoRA adapters of `model` (`eqtrain.lora`), derived from their
    base weights' rules: `lora_a [..., rank, in]` follows the weight's input
    dimension, `lora_b [..., out, rank]` its output dimension; a stacked-layer
    mark stays on the leading dimensions. No adapters: no rules."""
    flat, _ = jtu.tree_flatten_with_path(model, is_leaf=_is_adapted)
    out: list[Rule] = []
    for keys, layer in flat:
        if _is_adapted(layer):
            path = jtu.keystr(keys, simple=True, separator=".")
            out += _layer_adapter_rules(path, len(layer.weight.shape), rules)
    return out


def _layer_adapter_rules(path: str, rank: int, rules: Rules) -> list[Rule]:
    """The rules of one adapted layer's `lora_a` and `lora_b` (weight of `rank`)."""
    entries = list(rules.match(path + ".weight") or ())
    entries += [None] * (rank - len(entries))
    *lead, dim_out, dim_in = entries[:rank]
    where = r"(^|\.)" + re.escape(path)
    return [
        (where + r"\.lora_a$", PartitionSpec(*lead, None, dim_in)),
        (where + r"\.lora_b$", PartitionSpec(*lead, dim_out, None)),
    ]


def _tensor_rules(model: Any, tensor: int, extra: Sequence[Rule]) -> list[Rule]:
    """The model's tensor-parallel rules for a `tensor` axis of this size."""
    own = model_rules(model)
    if own is None:
        if tensor > 1 and not extra:
            raise ConfigError(
                f"the mesh has tensor={tensor} but {type(model).__name__} has no "
                "tensor-parallel rules (no `tensor_parallel_rules()`). Pass your "
                "own with `rules_for(model, mesh, extra=[(regex, P(...)), ...])`, "
                "or use tensor=1."
            )
        return []
    if tensor == 1:
        return [(pattern, _without_tensor(spec)) for pattern, spec in own]
    return own


def rules_for(
    model: Any,
    mesh: Mesh,
    *,
    fsdp_min_size: int | None = FSDP_MIN_SIZE,
    extra: Sequence[Rule] = (),
) -> Rules:
    """The partition rules for `model` on `mesh`.

    They are the LoRA adapters' rules (derived from their base weights' rules,
    see `adapter_rules`), then `extra` (so they win over the model's), then the
    model's tensor-parallel rules
    (see `model_rules`; with `tensor` of size 1 they keep only their `LAYERS`
    marks, so FSDP alone places the weights), then the default FSDP pass.

    Args:
        model: the model (e.g. an `eqtrain.models.Llama`), concrete or abstract.
        mesh: from `make_mesh`.
        fsdp_min_size: see `Rules`.
        extra: your own `(regex, spec)` rules, tried before the model's. Paths
            are as in the state: `model.layers.mlp.up_proj.weight`.

    Raises:
        ConfigError: `tensor` > 1 but the model has no tensor-parallel rules and
            no `extra` rules were given.
    """
    own = _tensor_rules(model, axis_sizes(mesh)["tensor"], extra)
    base = Rules((*extra, *own), fsdp_min_size=fsdp_min_size)
    adapters = adapter_rules(model, base)
    if not adapters:
        return base
    return Rules((*adapters, *extra, *own), fsdp_min_size=fsdp_min_size)
