"""One entry per model family: everything eqtrain knows about an architecture
beyond its modules, so that adding a family is adding one `Family`.

An entry owns the family's model and config classes, the `[model]` config
section both ways, FLOPs per token, the tensor-parallel rules and the names of
its tensors in each Hugging Face architecture it covers. The `[model]` section
is read by attribute (any object with its keys will do), so this module needs
nothing from `eqtrain.config`; the Hugging Face `config.json` translation lives
in `eqtrain.hf`, which looks families up here.
"""

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec

from .._errors import ConfigError
from . import decoder, gpt2
from ._attention import has_cudnn
from ._pallas import interpreted
from .archs import ARCHS as DECODER_ARCHS


@dataclasses.dataclass(frozen=True)
class HFNames:
    """How one Hugging Face architecture names an eqtrain model's tensors.

    eqtrain's paths already mirror Hugging Face's names; what differs is a
    `prefix` (`model.` / `transformer.`), the stacked layers (`layers.X[i]` in
    eqtrain, `{prefix}{layers}.{i}.X` there) and the `conv1d` leaves (under the
    layers), which Hugging Face stores `[in, out]` where eqtrain's `Linear`
    stores `[out, in]`. `embedding` is the input embedding's path (a tied head's
    duplicate in a file is recognised by it); `unprefixed`: files without the
    prefix are accepted too (OpenAI's original GPT-2 upload).

    `renames` are the layers' leaves named otherwise there, as `(X, name)`
    pairs: `layers.X[i]` is `{prefix}{layers}.{i}.{name}`. An `{expert}` in
    `name` makes the leaf one tensor per layer and expert (its axes `[layers,
    experts, ...]`; `mlp.experts.gate_proj` is
    `mlp.experts.{expert}.gate_proj.weight` in Qwen-MoE's files).
    """

    model_type: str
    architecture: str
    prefix: str
    layers: str
    conv1d: tuple[str, ...] = ()
    embedding: str = "embed_tokens.weight"
    unprefixed: bool = False
    renames: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: its classes and the knowledge built around them.

    Attributes:
        name: the family's name, `"llama"` or `"gpt2"`.
        model: the Equinox module, built as `model(config, key)`.
        config: its frozen config dataclass.
        hf: the Hugging Face architectures it covers, by `model_type` (also the
            values of the `[model]` section's `arch`).
        from_section: `(section, *, vocab_size, max_seq_len, given=(), arch=None)
            -> config`, from a `[model]` section; `given` names the section's
            keys a file or `--set` gave (a default may depend on it), `arch`
            is one of `hf` (default: the section's `arch`).
        to_section: `config -> {[model] key: value}`, the architecture keys of
            the `[model]` section describing `config` (the inverse).
        model_type_of: `config -> model_type`, the Hugging Face architecture
            that describes `config` most closely.
        flops_per_token: `(config, seq_len) -> float`, training FLOPs per token.
        tp_rules: `() -> [(regex, PartitionSpec)]`, the tensor-parallel rules.
        num_layers: `config -> int`, the depth of the stacked layers.
        section_keys: the `[model]` architecture keys `from_section` reads
            (setting another is a config error).
    """

    name: str
    model: type
    config: type
    hf: Mapping[str, HFNames]
    from_section: Callable[..., Any]
    to_section: Callable[[Any], dict[str, Any]]
    model_type_of: Callable[[Any], str]
    flops_per_token: Callable[[Any, int], float]
    tp_rules: Callable[[], list[tuple[str, PartitionSpec]]]
    num_layers: Callable[[Any], int]
    section_keys: frozenset[str]

    @property
    def model_types(self) -> tuple[str, ...]:
        return tuple(self.hf)


# -- the decoder families (Llama, Mistral, Qwen2, Qwen3, Gemma, ...) ---------------


def scan_layers(value: bool | str) -> bool:
    """`model.scan_layers`: `"auto"` scans on GPUs and TPUs and unrolls on
    the CPU (`eqtrain fit` resolves `"auto"` itself first, from what
    `eqtrain.cpu.tune_cpu` measured on this processor)."""
    if value == "auto":
        import jax

        return jax.default_backend() != "cpu"
    return bool(value)


MOE_RUNTIME = ("moe_impl", "capacity_factor", "router_z_loss_coef")
"""The `[model]` keys of a mixture-of-experts model's runtime options (the
same names as `DecoderConfig`'s fields)."""


def moe_options(m: Any, config: Any) -> dict[str, Any]:
    """The `[model]` section's mixture-of-experts training options for a model
    config that has experts (`{}` for one without): the runtime options and a
    set `router_aux_loss_coef` (unset: the config's own)."""
    if not getattr(config, "num_experts", 0):
        check_dense(m)
        return {}
    out = {k: getattr(m, k) for k in MOE_RUNTIME}
    if m.router_aux_loss_coef is not None:
        out["router_aux_loss_coef"] = m.router_aux_loss_coef
    return out


_MOE_DEFAULTS = {
    "moe_impl": "auto",
    "capacity_factor": None,
    "router_z_loss_coef": 0.0,
    "router_aux_loss_coef": None,
}


def check_dense(m: Any) -> None:
    """Refuse the `[model]` section's mixture-of-experts options for a model
    without experts (they would do nothing)."""
    for key, default in _MOE_DEFAULTS.items():
        if getattr(m, key, default) != default:
            raise ConfigError(
                f"`model.{key}` applies to mixture-of-experts models only, and this "
                "model has no experts (model.num_experts = 0, or a dense "
                "model.init_from); remove it, or set model.num_experts."
            )


def attention_kernel(impl: str) -> str:
    """`model.attention_impl`, refused where its kernel cannot run: cuDNN
    needs a GPU, the Pallas kernels are written for GPUs (Triton) and
    interpreted on the CPU, which TPUs do not do."""
    backend = jax.default_backend()
    if impl == "cudnn" and not has_cudnn():
        raise ConfigError(
            f"model.attention_impl = 'cudnn' needs a CUDA GPU with cuDNN; this "
            f"process runs on {backend}. Use 'auto' (cuDNN on CUDA GPUs, XLA's "
            "kernel on the CPU) or 'xla'."
        )
    if impl == "pallas":  # refused where the kernels neither compile nor interpret
        interpreted(backend, "model.attention_impl = 'auto', 'flash' or 'xla'")
    return impl


def runtime_options(m: Any) -> dict[str, Any]:
    """The `[model]` section's runtime options (`remat`, `remat_save`,
    `remat_offload`, `mlp_chunks`, `attention_chunk`, `attention_impl`,
    `scan_layers`, `sequence_parallel`, `sequence_layout`) as model-config
    fields, for `from_section` and a loaded model's `with_options`."""
    split = lambda text: tuple(n.strip() for n in text.split(",") if n.strip())
    return dict(
        remat=m.remat,
        remat_save=split(m.remat_save),
        remat_offload=split(m.remat_offload),
        mlp_chunks=m.mlp_chunks,
        attention_chunk=m.attention_chunk,
        attention_impl=attention_kernel(m.attention_impl),
        scan_layers=scan_layers(m.scan_layers),
        sequence_parallel=m.sequence_parallel,
        sequence_layout=m.sequence_layout,
    )


def _decoder_from_section(
    m: Any,
    *,
    vocab_size: int,
    max_seq_len: int,
    given: Collection[str] = (),
    arch: str | None = None,
) -> decoder.DecoderConfig:
    """A `[model]` section as a `DecoderConfig`: its sizes and keys, with the
    switches of its `arch` (the family's own name, `llama`, leaves the
    architecture to the keys: with a sliding window it is Mistral's)."""
    arch = arch or m.arch
    spec = DECODER_ARCHS.get(arch)
    if not m.num_experts:
        check_dense(m)
    fields = {
        **_section_shape(m, vocab_size, max_seq_len),
        **_section_experts(m, arch),
        **runtime_options(m),
    }
    if spec is not None and arch != "llama":
        fields.update(_arch_fields(spec, arch, fields, given))
    return decoder.DecoderConfig(**fields)


def _section_shape(m: Any, vocab_size: int, max_seq_len: int) -> dict[str, Any]:
    """The `DecoderConfig` fields of a `[model]` section's sizes and dense
    switches."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size or 4 * m.hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        rms_norm_eps=1e-6 if m.norm_eps is None else m.norm_eps,
        rope_theta=m.rope_theta,
        attention_bias=m.attention_bias,
        mlp_bias=m.mlp_bias,
        tie_word_embeddings=m.tie_embeddings,
        sliding_window=m.sliding_window,
        max_position_embeddings=max_seq_len,
        initializer_range=m.init_std,
        param_dtype=m.param_dtype,
    )


def _section_experts(m: Any, arch: str) -> dict[str, Any]:
    """The `DecoderConfig` fields of a `[model]` section's experts."""
    fields = dict(
        num_experts=m.num_experts,
        num_experts_per_tok=m.experts_per_token,
        moe_intermediate_size=m.expert_size,
        shared_expert_intermediate_size=m.shared_expert_size,
        norm_topk_prob=m.norm_topk_prob,
        router_aux_loss_coef=(
            0.001 if m.router_aux_loss_coef is None else m.router_aux_loss_coef
        ),
        **{k: getattr(m, k) for k in MOE_RUNTIME},
    )
    if m.num_experts and arch in ("llama", "mixtral") and m.expert_size is not None:
        # Every MLP is sparse, so the experts' width is Mixtral's intermediate_size.
        fields.update(intermediate_size=m.expert_size, moe_intermediate_size=None)
    return fields


def _arch_fields(
    spec: Any, arch: str, fields: dict[str, Any], given: Collection[str]
) -> dict[str, Any]:
    """The switches of architecture `arch`, but those the section set itself
    (`given`), with its `model_type` and activation."""
    section_keys = {_SECTION_KEYS.get(k, k) for k in given}
    # switches may depend on the section's other keys (Qwen2-MoE's o_proj bias)
    fixed = spec.fixed(decoder.DecoderConfig(**fields))
    out = {k: v for k, v in fixed.items() if k not in section_keys}
    return {**out, "model_type": arch, "hidden_act": spec.act[1]}


# `[model]` keys under their `DecoderConfig` names, where they differ
_SECTION_KEYS = {"tie_embeddings": "tie_word_embeddings", "norm_eps": "rms_norm_eps"}


def _decoder_to_section(c: decoder.DecoderConfig) -> dict[str, Any]:
    return dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.kv_heads,
        head_dim=c.head_dim,
        max_seq_len=c.max_position_embeddings,
        rope_theta=float(c.rope_theta),
        norm_eps=float(c.rms_norm_eps),
        tie_embeddings=c.tie_word_embeddings,
        attention_bias=c.attention_bias,
        mlp_bias=c.mlp_bias,
        sliding_window=c.sliding_window,
        init_std=float(c.initializer_range),
        num_experts=c.num_experts,
        experts_per_token=c.num_experts_per_tok,
        expert_size=c.moe_intermediate_size,
        shared_expert_size=c.shared_expert_intermediate_size,
        norm_topk_prob=c.norm_topk_prob,
    )


def _decoder_model_type(c: decoder.DecoderConfig) -> str:
    """The config's own `model_type`, else the first architecture that expresses
    it (`archs.ARCHS`' order: Llama, Mistral, Qwen2, ...)."""
    if c.model_type is not None:
        return c.model_type
    for name, spec in DECODER_ARCHS.items():
        if not spec.problems(c):
            return name
    return "llama"  # none does: `infer_model_type` names what llama lacks


# -- GPT-2 ---------------------------------------------------------------------------
def _gpt2_from_section(
    m: Any,
    *,
    vocab_size: int,
    max_seq_len: int,
    given: Collection[str] = (),
    arch: str | None = None,
) -> gpt2.GPT2Config:
    del given, arch  # one architecture, no defaults that depend on the section
    check_dense(m)
    return gpt2.GPT2Config(
        vocab_size=vocab_size,
        n_positions=max_seq_len,
        n_embd=m.hidden_size,
        n_layer=m.num_layers,
        n_head=m.num_heads,
        n_inner=m.intermediate_size,
        layer_norm_epsilon=1e-5 if m.norm_eps is None else m.norm_eps,
        initializer_range=m.init_std,
        tie_word_embeddings=m.tie_embeddings,
        param_dtype=m.param_dtype,
        **runtime_options(m),
    )


def _gpt2_to_section(c: gpt2.GPT2Config) -> dict[str, Any]:
    return dict(
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        intermediate_size=c.n_inner,
        num_layers=c.n_layer,
        num_heads=c.n_head,
        max_seq_len=c.n_positions,
        norm_eps=c.layer_norm_epsilon,
        tie_embeddings=c.tie_word_embeddings,
        init_std=float(c.initializer_range),
    )


# -- the registry --------------------------------------------------------------------
FAMILIES: dict[str, Family] = {
    "llama": Family(
        name="llama",
        model=decoder.Decoder,
        config=decoder.DecoderConfig,
        hf={
            t: HFNames(t, a.architecture, "model.", "layers", renames=a.renames)
            for t, a in DECODER_ARCHS.items()
        },
        from_section=_decoder_from_section,
        to_section=_decoder_to_section,
        model_type_of=_decoder_model_type,
        flops_per_token=decoder.flops_per_token,
        tp_rules=decoder.tensor_parallel_rules,
        num_layers=lambda c: c.num_hidden_layers,
        section_keys=frozenset(_decoder_to_section(decoder.DecoderConfig()))
        - {"init_std"}
        | {"arch", "max_seq_len"},
    ),
    "gpt2": Family(
        name="gpt2",
        model=gpt2.GPT2,
        config=gpt2.GPT2Config,
        hf={
            "gpt2": HFNames(
                "gpt2",
                "GPT2LMHeadModel",
                "transformer.",
                "h",
                conv1d=(
                    "attn.c_attn.weight",
                    "attn.c_proj.weight",
                    "mlp.c_fc.weight",
                    "mlp.c_proj.weight",
                ),
                embedding="wte.weight",
                unprefixed=True,
            )
        },
        from_section=_gpt2_from_section,
        to_section=_gpt2_to_section,
        model_type_of=lambda c: "gpt2",
        flops_per_token=gpt2.flops_per_token,
        tp_rules=gpt2.tensor_parallel_rules,
        num_layers=lambda c: c.n_layer,
        section_keys=frozenset(_gpt2_to_section(gpt2.GPT2Config())) - {"init_std"}
        | {"arch", "intermediate_size"},
    ),
}


def family(of: Any) -> Family:
    """The `Family` of a family name or Hugging Face `model_type` (`"qwen2"`), a
    model config (`LlamaConfig(...)`) or a model.

    Raises:
        ConfigError: for anything no family covers.
    """
    for fam in FAMILIES.values():
        if isinstance(of, str) and (of == fam.name or of in fam.hf):
            return fam
        if isinstance(of, (fam.config, fam.model)):
            return fam
    known = sorted({t for fam in FAMILIES.values() for t in fam.hf})
    what = repr(of) if isinstance(of, str) else f"a {type(of).__name__}"
    raise ConfigError(
        f"no model family covers {what}; eqtrain's families are the model types "
        f"{known} (configs: "
        + ", ".join(f.config.__name__ for f in FAMILIES.values())
        + ")."
    )
