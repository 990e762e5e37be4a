"""`[model]`: the architecture, its mixture of experts, and the memory and
parallelism options of its layers."""

import dataclasses

from ._schema import (
    ARCHS,
    LOSS_CHUNK_MIN_VOCAB,
    QUANTIZE_KINDS,
    QUANTIZE_SKIP,
    SEQUENCE_LAYOUTS,
    SEQUENCE_SCHEMES,
    TRAIN_DTYPES,
    setting,
)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str = setting(
        "llama",
        "Architecture: a Hugging Face model type. All but gpt2 are one decoder "
        "with per-family switches (eqtrain.models.archs; docs/models.md).",
        choices=ARCHS,
    )
    init_from: str | None = setting(
        None,
        "Start from this Hugging Face directory (safetensors; e.g. written by "
        "`save_pretrained` or `eqtrain export`). The architecture fields come "
        "from its config.json; setting them too is an error.",
        kind="path",
    )
    vocab_size: int | None = setting(
        None, "Vocabulary size; unset: the tokenizer's.", min=1
    )
    hidden_size: int = setting(128, "Width of the residual stream.", min=1)
    intermediate_size: int | None = setting(
        None, "Width of the MLP; unset: 4 x hidden_size.", min=1
    )
    num_layers: int = setting(4, "Number of transformer blocks.", min=1)
    num_heads: int = setting(4, "Attention (query) heads.", min=1)
    num_kv_heads: int | None = setting(
        2,
        "Key/value heads (grouped-query attention; Llama family only); unset: "
        "num_heads.",
        min=1,
    )
    head_dim: int | None = setting(
        None,
        "Size of each head, an even number (rotary embeddings rotate pairs); "
        "unset: hidden_size / num_heads.",
        min=2,
    )
    max_seq_len: int | None = setting(
        None,
        "Longest sequence (position table size); unset: data.seq_len.",
        min=2,  # as data.seq_len, which must fit
    )
    rope_theta: float = setting(10000.0, "RoPE base (Llama family).", min=1)
    norm_eps: float | None = setting(
        None, "Epsilon of the norms; unset: 1e-6 (Llama family), 1e-5 (GPT-2).", min=0
    )
    tie_embeddings: bool = setting(
        True, "Share the input embedding with the output head (Llama family, GPT-2)."
    )
    attention_bias: bool = setting(
        False, "Biases on q/k/v projections (Qwen2 style; Llama family)."
    )
    mlp_bias: bool = setting(False, "Biases in the MLP (Llama family).")
    sliding_window: int | None = setting(
        None, "Sliding-window attention span (Mistral style).", min=1
    )
    num_experts: int = setting(
        0,
        "Experts of each mixture-of-experts MLP (Llama family; 0: dense MLPs). "
        "Every layer's MLP is then sparse, as in Mixtral and Qwen-MoE.",
        min=0,
    )
    experts_per_token: int = setting(
        2, "Experts each token is routed to (top-k; with model.num_experts).", min=1
    )
    expert_size: int | None = setting(
        None,
        "Width of one expert's MLP; unset: model.intermediate_size (Mixtral).",
        min=1,
    )
    shared_expert_size: int | None = setting(
        None,
        "Width of a shared expert every token also goes through, gated by a "
        "sigmoid (Qwen2-MoE); unset: none.",
        min=1,
    )
    norm_topk_prob: bool = setting(
        True,
        "Renormalise each token's top-k routing weights to sum to 1 (Mixtral: "
        "always; Qwen-MoE: its config's).",
    )
    router_aux_loss_coef: float | None = setting(
        None,
        "Coefficient of the load-balancing loss added to the LM loss (Switch/"
        "Mixtral form, as transformers computes it; 0: off); unset: the "
        "checkpoint's (model.init_from), else 0.001.",
        min=0,
    )
    router_z_loss_coef: float = setting(
        0.0, "Coefficient of the router z-loss (ST-MoE; 0: off).", min=0
    )
    capacity_factor: float | None = setting(
        None,
        "Each expert takes at most capacity_factor x its even share of a batch's "
        "assignments; the rest are dropped (counted in moe/dropped). Unset: "
        "dropless.",
        above=0,
    )
    moe_impl: str = setting(
        "auto",
        "How tokens reach their experts: `sorted` (grouped by expert, blocked "
        "products), `pallas` (the same blocks through a Pallas grouped matmul: "
        "Triton on GPUs, interpreted on CPU, not on TPU), `ragged` "
        "(jax.lax.ragged_dot), `dense` (every expert on every token: the "
        "reference); `auto`: ragged on TPU, else sorted.",
        choices=("auto", "sorted", "pallas", "ragged", "dense"),
    )
    init_std: float = setting(0.02, "Standard deviation of the initial weights.", min=0)
    param_dtype: str = setting(
        "float32",
        "Dtype the parameters are stored and updated in. Not float16: training in "
        "it needs loss scaling, which eqtrain does not do (a float16 run went "
        "non-finite at step 2); use bfloat16 (or export.dtype = float16).",
        choices=TRAIN_DTYPES,
    )
    remat: str = setting(
        "none",
        "Activation checkpointing of each block: `none` keeps every activation "
        "(scanned layers make their norms' outputs again: a norm's cost); "
        "`full` keeps each block's input and recomputes the rest; `dots` / "
        "`dots_no_batch` keep matmul outputs (without: attention's); `save_qkv` "
        "keeps q/k/v; `save_out` keeps the attention output; `offload_layer_input` "
        "is `full` with the block inputs in host memory (GPU/TPU; the CPU backend "
        "drops the move); `custom`: model.remat_save / remat_offload.",
        choices=(
            "none",
            "full",
            "dots",
            "dots_no_batch",
            "save_qkv",
            "save_out",
            "offload_layer_input",
            "custom",
        ),
    )
    remat_save: str = setting(
        "",
        "With remat = `custom`: activations to keep, by name (a list or "
        "comma-separated): layer_input, query, key, value, attn_out, mlp_in, "
        "mlp_out.",
        kind="names",
    )
    remat_offload: str = setting(
        "",
        "With remat = `custom`: activations to move to host memory until the "
        'backward pass (names as remat_save; e.g. ["layer_input"]).',
        kind="names",
    )
    mlp_chunks: int | str = setting(
        1,
        "Tiled MLP: run each block's MLP over this many pieces of the sequence, "
        "each recomputed in the backward pass, so only [seq / chunks, "
        "intermediate] exists at a time; must divide data.seq_len; `auto`: "
        "ceil(seq_len / hidden_size); 1: off.",
        min=1,
        kind="auto_int",
    )
    attention_impl: str = setting(
        "auto",
        "The attention kernel: `xla` (XLA's, in causal blocks of queries), "
        "`flash` (flash blocks in JAX), `pallas` (flash attention as Pallas "
        "kernels: Triton on GPUs, interpreted, slowly, on the CPU; every mask "
        "and Gemma 2's soft-cap), `cudnn` (cuDNN's fused kernel; needs a GPU; "
        "soft-capped layers take the Pallas kernels); `auto`: on GPUs cudnn for "
        "bf16/f16 heads of 8-128 without a soft-cap, else pallas (on several GPUs "
        "each device's own rows and heads; xla when the batch does not divide "
        "over the mesh's batch axes); xla elsewhere.",
        choices=("auto", "xla", "flash", "pallas", "cudnn"),
    )
    attention_chunk: int = setting(
        0,
        "Blocked attention: queries go through in blocks of this many, so the "
        "[heads, seq_len, seq_len] scores never exist at once (each block is "
        "recomputed in the backward pass); for backends without a fused "
        "attention kernel, such as the CPU; 0: off.",
        min=0,
    )
    loss_chunk: int | str = setting(
        "auto",
        "Chunked LM head + loss: compute the output head and cross-entropy over "
        "this many tokens at a time, never holding the [tokens, vocab] logits; 0: "
        "off (full logits); `auto`: 256-token chunks when the vocabulary has "
        f"at least {LOSS_CHUNK_MIN_VOCAB} ids and mesh.sequence is 1, else off.",
        min=0,
        kind="auto_int",
    )
    scan_layers: bool | str = setting(
        "auto",
        "Run the blocks with `lax.scan` (compile time flat in depth) or unrolled "
        "(false); `auto`: scanned on GPUs and TPUs; on the CPU as `eqtrain` "
        "measured faster on this processor (tune_cpu; unrolled without a "
        "measurement).",
        kind="auto_bool",
    )
    sequence_parallel: str | None = setting(
        None,
        "Attention over a sequence split on mesh.sequence devices: `ulysses` "
        "(all-to-all to heads; num_heads / mesh.tensor must divide by "
        "mesh.sequence), `ring` (K/V blocks round a ring) or `all_gather` "
        "(gathered K/V); unset: plain attention (mesh.sequence must be 1).",
        choices=SEQUENCE_SCHEMES,
    )
    sequence_layout: str = setting(
        "contiguous",
        "How each row's tokens lie on mesh.sequence: `contiguous`, or `zigzag` "
        "(device i holds chunks i and 2n-1-i of 2n: balanced causal work; "
        "data.seq_len must divide by 2 x mesh.sequence).",
        choices=SEQUENCE_LAYOUTS,
    )
    adapter_from: str | None = setting(
        None,
        "Continue training this PEFT LoRA adapter directory (adapter_config.json + "
        "adapter_model.safetensors) on `model.init_from`'s weights; its rank, "
        "alpha, targets and rsLoRA setting replace the [lora] ones.",
        kind="path",
    )
    quantize: str | None = setting(
        None,
        "QLoRA: keep the frozen base weights in 4 or 8 bits (needs LoRA, "
        "lora.rank > 0): `nf4` (NormalFloat4, QLoRA's), `fp4`, or `int8` (per "
        "row). Quantized while model.init_from is read, one tensor at a time; "
        "dequantized beside each product in the compute dtype. Unset: full "
        "precision.",
        choices=QUANTIZE_KINDS,
    )
    quantize_skip: str = setting(
        QUANTIZE_SKIP,
        "With model.quantize: regex searched in each linear layer's dotted path "
        "(e.g. `lm_head`, `layers.mlp.gate`) or experts' weight "
        "(`layers.mlp.experts.up_proj`); those it finds stay in full precision. "
        "Default: the head and the mixture-of-experts routers.",
    )
    quantize_double: bool = setting(
        True,
        "With model.quantize nf4/fp4: quantize the block scales too (QLoRA's "
        "double quantization: 8-bit scales of blocks of 256 scales).",
    )
