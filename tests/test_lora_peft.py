"""LoRA adapters through `peft` itself: eqtrain's PEFT export loads onto the
`transformers` base without a warning and with the same logits, peft's own
adapters load into eqtrain, and bad adapter directories are clear errors."""

import json
import os
import shutil
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

from eqtrain import ConfigError, hf, lora
from eqtrain.hf import HFFileNotFoundError, HFFormatError


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SEQ = 12


def _hf_base(family):
    """A small randomised `transformers` model (fixed seed), in eval mode."""
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4
        )
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=300.0,
        )
        model = transformers.LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def base_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "base"
    _hf_base(request.param).save_pretrained(path)
    return request.param, path


def _tokens():
    return np.random.default_rng(0).integers(0, 97, SEQ).astype(np.int32)


def _torch_logits(model):
    with torch.no_grad():
        ids = torch.from_numpy(_tokens().astype(np.int64))[None]
        return model(input_ids=ids).logits[0].float().numpy()


def _ours(model):
    return np.asarray(jax.jit(lambda m: m(jnp.asarray(_tokens())))(model))


def _randomize_adapters(model, seed=3):
    count = [0]

    def fill(path, x):
        name = jtu.keystr(path, simple=True, separator=".")
        if not lora.is_adapter_path(name):
            return x
        count[0] += 1
        return 0.2 * jr.normal(jr.fold_in(jr.key(seed), count[0]), x.shape, x.dtype)

    return jtu.tree_map_with_path(fill, model)


def _peft_load(base_dir, adapter_dir):
    """peft's own loader; any warning (peft's missing or unexpected keys, a
    `Conv1D` without fan_in_fan_out, ...) is a failure, except the one
    deprecation notice transformers 5 raises at peft 0.21's own call of
    `model.is_gradient_checkpointing` (not about the adapter)."""
    base = transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
        )
        model = peft.PeftModel.from_pretrained(base, adapter_dir)
    return model.eval()


SPECS = {
    "default": lora.LoRA(rank=4, alpha=8),
    "rslora_subset": lora.LoRA(
        rank=4,
        alpha=6,
        rslora=True,
        targets=r"(self_attn\.[qv]_proj|attn\.c_proj)$",
    ),
}


@pytest.mark.parametrize("which", list(SPECS))
def test_export_loads_in_peft_with_the_same_logits(base_dir, which, tmp_path):
    family, path = base_dir
    base, _ = hf.load(path)
    model = _randomize_adapters(lora.apply(base, SPECS[which], key=jr.key(0)))
    out = hf.export_adapter(model, tmp_path / "adapter", spec=SPECS[which])
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert settings["peft_type"] == "LORA" and settings["r"] == 4
    assert settings["use_rslora"] == SPECS[which].rslora
    assert settings["fan_in_fan_out"] == (family == "gpt2")
    theirs = _peft_load(path, out)
    # the prefix trap: without `base_model.model.`, peft keeps lora_B = 0
    b_weights = [p for n, p in theirs.named_parameters() if "lora_B" in n]
    assert b_weights and all(torch.count_nonzero(p) > 0 for p in b_weights)
    expected = _torch_logits(theirs)
    np.testing.assert_allclose(_ours(model), expected, rtol=0, atol=1e-4)
    plain = _ours(base)
    assert np.max(np.abs(plain - expected)) > 1e-2  # the adapter has an effect
    if which == "rslora_subset":
        wrapped = {
            n.rsplit(".", 1)[0] for n, _ in theirs.named_modules() if "lora_A" in n
        }
        wanted = "attn.c_proj" if family == "gpt2" else "self_attn.q_proj"
        assert any(n.endswith(wanted) for n in wrapped)
        assert not any(n.endswith(("mlp.c_proj", "k_proj", "up_proj")) for n in wrapped)


def test_round_trip_and_peft_written_adapters(base_dir, tmp_path):
    family, path = base_dir
    base, _ = hf.load(path)
    model = _randomize_adapters(lora.apply(base, SPECS["default"], key=jr.key(0)))
    hf.export_adapter(model, tmp_path / "ours")
    back = hf.load_adapter(base, tmp_path / "ours")
    # arrays bit for bit, and the static fields (scale, dropout) too
    assert eqx.tree_equal(back, model)
    np.testing.assert_array_equal(_ours(back), _ours(model))
    # some peft versions write the adapter name into the keys
    infix = tmp_path / "infix"
    shutil.copytree(tmp_path / "ours", infix)
    _rewrite(infix, lambda t: {_with_default(k): v for k, v in t.items()})
    assert eqx.tree_equal(hf.load_adapter(base, infix), model)
    # adapters take the base's dtype
    half = jtu.tree_map(
        lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, base
    )
    loaded = hf.load_adapter(half, tmp_path / "ours")
    layer = dict(lora.linears(loaded))[lora.adapter_paths(loaded)[0]]
    assert layer.lora_a.dtype == layer.lora_b.dtype == jnp.bfloat16
    # an adapter peft made itself, on some layers only
    targets = ["c_attn", "c_fc"] if family == "gpt2" else ["q_proj", "down_proj"]
    theirs = peft.get_peft_model(
        _hf_base(family),
        peft.LoraConfig(
            r=2,
            lora_alpha=5,
            target_modules=targets,
            layers_to_transform=[1],
            fan_in_fan_out=family == "gpt2",
        ),
    )
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    theirs.save_pretrained(tmp_path / "peft")
    expected = _torch_logits(theirs.eval())
    loaded = hf.load_adapter(base, tmp_path / "peft")
    assert sorted(p.rsplit(".", 1)[-1] for p in lora.adapter_paths(loaded)) == sorted(
        targets
    )
    np.testing.assert_allclose(_ours(loaded), expected, rtol=0, atol=1e-4)
    spec = hf.adapter_spec(tmp_path / "peft")
    assert spec.rank == 2 and spec.scale == 2.5


def _adapter(tmp_path, base):
    model = _randomize_adapters(lora.apply(base, SPECS["default"], key=jr.key(0)))
    return hf.export_adapter(model, tmp_path / "adapter")


def _with_default(key):
    return key.replace(".lora_A.", ".lora_A.default.").replace(
        ".lora_B.", ".lora_B.default."
    )


def _rewrite(directory, change):
    from safetensors.numpy import load_file, save_file

    file = os.path.join(directory, "adapter_model.safetensors")
    save_file(change(load_file(file)), file)


def _lower_rank(layer):
    """The same adapter cut to rank 2 (another rank than the model's others)."""
    return lora.LoRALinear(
        weight=layer.weight,
        bias=layer.bias,
        lora_a=layer.lora_a[..., :2, :],
        lora_b=layer.lora_b[..., :2],
        scale=layer.scale,
        dropout=layer.dropout,
    )


def test_bad_adapter_directories_are_clear_errors(base_dir, tmp_path):
    family, path = base_dir
    base, _ = hf.load(path)
    with pytest.raises(HFFileNotFoundError, match="not a directory"):
        hf.load_adapter(base, tmp_path / "missing")
    good = _adapter(tmp_path, base)

    def variant(name):
        target = tmp_path / name
        shutil.copytree(good, target)
        return target

    bare = variant("bare")
    os.remove(bare / "adapter_config.json")
    with pytest.raises(HFFileNotFoundError, match="no adapter_config.json"):
        hf.load_adapter(base, bare)
    weightless = variant("weightless")
    os.remove(weightless / "adapter_model.safetensors")
    with pytest.raises(HFFileNotFoundError, match="no adapter_model.safetensors"):
        hf.load_adapter(base, weightless)
    pickled = variant("pickled")
    os.replace(pickled / "adapter_model.safetensors", pickled / "adapter_model.bin")
    with pytest.raises(HFFormatError, match="pickle"):
        hf.load_adapter(base, pickled)
    other = variant("ia3")
    settings = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(
        json.dumps({**settings, "peft_type": "IA3"})
    )
    with pytest.raises(HFFormatError, match="'IA3' adapter"):
        hf.load_adapter(base, other)
    unprefixed = variant("unprefixed")
    _rewrite(
        unprefixed,
        lambda t: {k.removeprefix("base_model.model."): v for k, v in t.items()},
    )
    with pytest.raises(HFFormatError, match="skip it and keep lora_B at zero"):
        hf.load_adapter(base, unprefixed)
    foreign = variant("foreign")
    _rewrite(
        foreign,
        lambda t: {
            **t,
            "base_model.model.model.vision.lora_A.weight": next(iter(t.values())),
        },
    )
    with pytest.raises(HFFormatError, match="does not have"):
        hf.load_adapter(base, foreign)
    shapes = variant("shapes")
    _rewrite(shapes, lambda t: {k: np.concatenate([v, v]) for k, v in t.items()})
    with pytest.raises(
        HFFormatError, match=r"has shape \(8, 32\), but this model needs \(4, 32\)"
    ):
        hf.load_adapter(base, shapes)
    half = variant("half")
    # one layer's lora_B lost: loading it as zero would hide a truncated file
    lost = (
        ".1.self_attn.q_proj.lora_B" if family == "llama" else ".1.attn.c_attn.lora_B"
    )
    _rewrite(half, lambda t: {k: v for k, v in t.items() if lost not in k})
    with pytest.raises(HFFormatError, match=rf"no lora_B partner \('\S+{lost}"):
        hf.load_adapter(base, half)
    mixed = lora.map_linears(
        _randomize_adapters(lora.apply(base, SPECS["default"], key=jr.key(0))),
        lambda p, x: _lower_rank(x) if p.endswith("q_proj") or "c_attn" in p else x,
    )
    with pytest.raises(ConfigError, match=r"ranks \[2, 4\]"):
        hf.export_adapter(mixed, tmp_path / "mixed")
    with pytest.raises(ConfigError, match="no LoRA adapters"):
        hf.export_adapter(base, tmp_path / "none")


def test_trained_norms_travel_as_modules_to_save(base_dir, tmp_path):
    """`train_also` leaves (here the norms) are written whole with their modules as
    PEFT's `modules_to_save`: peft loads them, and so does `load_adapter`."""
    family, path = base_dir
    base, _ = hf.load(path)
    model = _randomize_adapters(lora.apply(base, SPECS["default"], key=jr.key(0)))
    also = r"(norm|ln_\d|ln_f)\."
    mask = lora.trainable(model, also=also)

    flat, _ = jtu.tree_flatten_with_path(mask)
    names = [jtu.keystr(k, simple=True, separator=".") for k, f in flat if f]
    chosen = {n for n in names if not lora.is_adapter_path(n)}
    assert chosen

    def nudge(keys, x):
        name = jtu.keystr(keys, simple=True, separator=".")
        if name in chosen:
            return x + 0.5 * jr.normal(jr.key(len(name)), x.shape, x.dtype)
        return x

    model = jtu.tree_map_with_path(nudge, model)
    out = hf.export_adapter(model, tmp_path / "adapter", trained=mask)
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert settings["modules_to_save"]
    theirs = _peft_load(path, out)
    np.testing.assert_allclose(_ours(model), _torch_logits(theirs), rtol=0, atol=1e-4)
    back = hf.load_adapter(base, out)
    np.testing.assert_allclose(_ours(back), _ours(model), rtol=0, atol=1e-6)


def test_merged_export_loads_in_transformers_with_the_same_logits(base_dir, tmp_path):
    family, path = base_dir
    base, _ = hf.load(path)
    model = _randomize_adapters(lora.apply(base, SPECS["default"], key=jr.key(0)))
    hf.export(lora.merge(model), None, tmp_path / "merged")
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, output_loading_info=True
    )
    assert not any(v for k, v in info.items() if k != "error_msgs"), info
    np.testing.assert_allclose(
        _ours(model), _torch_logits(theirs.eval()), rtol=0, atol=1e-4
    )
