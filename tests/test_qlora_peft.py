"""QLoRA against bitsandbytes and peft: the 4-bit codes eqtrain makes of a
Hugging Face checkpoint are bitsandbytes' own; a LoRA run on an nf4 base
(`model.quantize = "nf4"`, double quantization) writes a PEFT adapter that peft,
on the weights bitsandbytes dequantizes, turns into eqtrain's logits; and
`eqtrain export --merged` writes a plain float model with those logits. fp4
through the library (no run). (int8's rows against `int8_vectorwise_quant`:
tests/test_quant.py.)"""

import json
import os
import sys
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

from eqtrain import config as config_lib, hf, job, lora, quantize


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _import_bitsandbytes():
    """bitsandbytes 0.50, imported on a CPU with AVX512-BF16, asks the `kernels`
    package for a Hub kernel (a network call; a download where it is trusted).
    With `kernels` hidden during the import it falls back to its own CPU code at
    once; peft imports bitsandbytes too, so this comes first."""
    hidden = "kernels" not in sys.modules
    if hidden:
        sys.modules["kernels"] = None
    try:
        pytest.importorskip("bitsandbytes")
        return pytest.importorskip("bitsandbytes.functional")
    finally:
        if hidden:
            del sys.modules["kernels"]


bnbf = _import_bitsandbytes()
peft = pytest.importorskip("peft")

from .test_cli import TEXT, inproc  # noqa: E402
from .test_lora_peft import _tokens, _torch_logits  # noqa: E402


TOL = 1e-4  # float32 logits (torch's products against XLA's, and the mean below)
"""bitsandbytes' CPU double quantization sums the block maxima in float32 in an
order of its own, so its mean (`offset`) may differ from eqtrain's in the last
bit: weights agree to about 1e-7, logits to about 1e-5."""

LINEARS = [
    f"layers.{m}"
    for m in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    )
]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A small random `transformers` Llama (fixed seeds), float32, with every
    linear layer's rows whole blocks of 64 (hidden 64, intermediate 128), on the
    byte vocabulary of eqtrain's text runs."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=300.0,
    )
    model = transformers.LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    path = tmp_path_factory.mktemp("qlora") / "base"
    model.save_pretrained(path)
    return path


def _bnb_base(path, kind, double=True):
    """The `transformers` model at `path` with each linear layer but `lm_head`
    (eqtrain's default `model.quantize_skip`; embeddings are not linear) holding
    what bitsandbytes makes of its weight: `dequantize_4bit(quantize_4bit(w))`."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    done = 0
    with torch.no_grad():
        for name, layer in model.named_modules():
            if isinstance(layer, torch.nn.Linear) and name != "lm_head":
                codes, state = bnbf.quantize_4bit(
                    layer.weight,
                    blocksize=64,
                    quant_type=kind,
                    compress_statistics=double,
                )
                layer.weight.copy_(bnbf.dequantize_4bit(codes, state))
                done += 1
    assert done == 2 * len(LINEARS)
    return model.eval()


def _peft_on(base, adapter_dir):
    """peft's own loader; any warning is a failure but transformers 5's
    deprecation notice at peft's call of `is_gradient_checkpointing`."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
        )
        model = peft.PeftModel.from_pretrained(base, adapter_dir)
    return model.eval()


def _layer(model, path):
    """The module at dotted `path` of an eqtrain model."""
    for part in path.split("."):
        model = getattr(model, part)
    return model


_forward = eqx.filter_jit(lambda model, tokens: model(tokens))
_dequantized = eqx.filter_jit(quantize.dequantize)


def _ours(model):
    """eqtrain's logits on test_lora_peft's tokens (one compile per model
    structure)."""
    return np.asarray(_forward(model, jnp.asarray(_tokens())))


def _largest(a, b):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


# -- a QLoRA run -----------------------------------------------------------------


def _write_config(root, base):
    (root / "train").mkdir()
    for i in range(2):
        (root / "train" / f"{i}.txt").write_text(TEXT * (i + 1))
    path = root / "qlora.toml"
    path.write_text(
        f"""
run_dir = "{root / "run"}"
seed = 0

[model]
init_from = "{base}"

[lora]
rank = 4
alpha = 8

[data]
train = "{root / "train"}"
seq_len = 16
batch_size = 8

[optim]
lr = 1e-2
warmup_steps = 1

[loop]
steps = 3

[checkpoint]
every = 3

[log]
progress = "none"
"""
    )
    return path


@pytest.fixture(scope="module")
def qlora_run(base_dir, tmp_path_factory):
    """A finished 3-step LoRA run on the nf4 base (`--set model.quantize=nf4`;
    double quantization, the default), its PEFT adapter in run/hf."""
    root = tmp_path_factory.mktemp("qlora_run")
    path = _write_config(root, base_dir)
    config = config_lib.load(path, ["model.quantize=nf4"])
    result = job.run(config, echo=lambda s: None)
    return root, result


def test_qlora_adapter_in_peft_on_bitsandbytes_weights(base_dir, qlora_run):
    root, result = qlora_run
    model = jax.device_get(result.fit.state.model)
    assert quantize.quantized_paths(model) == [f"{p}.weight" for p in LINEARS]
    assert not quantize.is_quantized(model.lm_head.weight)
    assert model.layers.self_attn.q_proj.weight.double  # the default
    assert np.any(np.asarray(model.layers.mlp.down_proj.lora_b))
    adapter = root / "run" / "hf"
    assert sorted(os.listdir(adapter)) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert settings["peft_type"] == "LORA" and settings["r"] == 4
    assert settings["lora_alpha"] == 8

    ours = _ours(model)  # eqtrain's quantized base and trained adapters
    theirs = _torch_logits(_peft_on(_bnb_base(base_dir, "nf4"), adapter))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOL)
    # eqtrain reading the files: the base quantized on load, the adapter onto it
    base, _ = hf.load(base_dir, quantize=quantize.Quantize("nf4"))
    again = _ours(hf.load_adapter(base, adapter))
    np.testing.assert_allclose(again, ours, rtol=0, atol=1e-6)
    # what the comparison tells apart: the adapters moved, and the quantization
    # shows (peft's adapter on the float base is far off)
    assert _largest(_ours(lora.unwrap(model)), ours) > 100 * TOL
    full = transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32
    )
    assert _largest(_torch_logits(_peft_on(full, adapter)), theirs) > 100 * TOL


def _assert_plain(out, base_dir):
    """`out` is an unquantized HF checkpoint with the base's tensors (names,
    shapes, float32) and no quantization settings."""
    from safetensors.numpy import load_file

    settings = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in settings
    assert not any("quant" in k for k in settings)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert files == ["model.safetensors"]
    ours = load_file(out / "model.safetensors")
    base = load_file(base_dir / "model.safetensors")
    assert {k: v.shape for k, v in ours.items()} == {
        k: v.shape for k, v in base.items()
    }
    assert {str(v.dtype) for v in ours.values()} == {"float32"}
    return ours


def test_cli_merged_export_is_a_plain_model_with_the_same_logits(
    base_dir, qlora_run, tmp_path
):
    root, result = qlora_run
    inproc("export", root / "run", tmp_path / "merged", "--merged", check_rc=0)
    weights = _assert_plain(tmp_path / "merged", base_dir)
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, output_loading_info=True
    )
    assert not any(v for k, v in info.items() if k != "error_msgs"), info
    ours = _ours(jax.device_get(result.fit.state.model))
    np.testing.assert_allclose(_torch_logits(theirs.eval()), ours, rtol=0, atol=TOL)
    # peft's own merge on bitsandbytes' weights: the same tensors
    peft_merged = _peft_on(
        _bnb_base(base_dir, "nf4"), root / "run" / "hf"
    ).merge_and_unload()
    for name, value in peft_merged.state_dict().items():
        np.testing.assert_allclose(
            weights[name], value.numpy(), rtol=0, atol=1e-6, err_msg=name
        )


# -- other kinds, through the library ------------------------------------------


def _random_adapters(model, seed=3):
    """`model` with every adapter array drawn at random (numpy: no compile per
    shape, as `jr.normal` would cost)."""
    rng = np.random.default_rng(seed)

    def fill(path, x):
        if not lora.is_adapter_path(jtu.keystr(path, simple=True, separator=".")):
            return x
        return jnp.asarray(0.2 * rng.standard_normal(x.shape), x.dtype)

    return jtu.tree_map_with_path(fill, model)


@pytest.mark.parametrize("kind,double", [("fp4", True)])
def test_adapter_and_merge_on_other_kinds(base_dir, tmp_path, kind, double):
    """Adapters (random, fixed seed) on an fp4 base (double quantization): the
    PEFT adapter on bitsandbytes' weights and the merged export give eqtrain's
    logits. (nf4 without double quantization: its codes, below.)"""
    spec = quantize.Quantize(kind, double=double)
    base, _ = hf.load(base_dir, quantize=spec)
    adapted = lora.apply(base, lora.LoRA(rank=4, alpha=8), key=jr.key(0))
    model = _random_adapters(adapted)
    ours = _ours(model)
    adapter = hf.export_adapter(model, tmp_path / "adapter")
    theirs = _peft_on(_bnb_base(base_dir, kind, double), adapter)
    np.testing.assert_allclose(_torch_logits(theirs), ours, rtol=0, atol=TOL)
    hf.export(eqx.filter_jit(lora.merge)(model), None, tmp_path / "merged")
    _assert_plain(tmp_path / "merged", base_dir)
    merged = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32
    )
    np.testing.assert_allclose(_torch_logits(merged.eval()), ours, rtol=0, atol=TOL)


# -- the codes -------------------------------------------------------------------


@pytest.mark.parametrize("kind,double", [("nf4", True), ("fp4", True), ("nf4", False)])
def test_quantized_on_load_as_bitsandbytes_quantizes(base_dir, kind, double):
    """Each linear weight `hf.load` quantizes has bitsandbytes' packed codes and
    (double quantization) 8-bit block maxima, bit for bit, and dequantizes to its
    weights."""
    model, _ = hf.load(base_dir, quantize=quantize.Quantize(kind, double=double))
    assert quantize.quantized_paths(model) == [f"{p}.weight" for p in LINEARS]
    assert not quantize.is_quantized(model.lm_head.weight)
    dense = jax.device_get(_dequantized(model))
    model = jax.device_get(model)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32
    )
    for layer in range(2):
        for path in LINEARS:
            module = path.removeprefix("layers.")
            w = theirs.get_submodule(f"model.layers.{layer}.{module}").weight
            codes, state = bnbf.quantize_4bit(
                w.detach(), blocksize=64, quant_type=kind, compress_statistics=double
            )
            ours = _layer(model, path).weight
            assert ours.kind == kind and ours.double == double
            np.testing.assert_array_equal(
                ours.codes[layer].reshape(-1), codes.numpy().reshape(-1)
            )
            np.testing.assert_array_equal(
                ours.scales[layer].reshape(-1), state.absmax.numpy().reshape(-1)
            )
            if double:  # the means may differ in their last bit (TOL)
                offset = state.offset.numpy()
                ulp = np.spacing(np.abs(offset))
                np.testing.assert_allclose(ours.offset[layer], offset, rtol=0, atol=ulp)
                np.testing.assert_allclose(
                    ours.scales2[layer],
                    state.state2.absmax.numpy(),
                    rtol=0,
                    atol=2 * ulp,
                )
            expected = bnbf.dequantize_4bit(codes, state).numpy()
            np.testing.assert_allclose(
                _layer(dense, path).weight[layer], expected, rtol=0, atol=1e-6
            )
