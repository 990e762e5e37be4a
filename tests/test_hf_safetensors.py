"""eqtrain.hf's safetensors files through the `safetensors` package: the same bytes
as eqtrain's own former writer (kept below as a frozen oracle), damaged files as
`HFFormatError`s naming the file, and `hf.load` reading lazily, block by block,
straight into a sharding over the 8 simulated devices."""

import dataclasses
import json
import struct

import equinox as eqx
import jax
import jax.random as jr
import jax.tree_util as jtu
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import save_file

from eqtrain import hf, sharding
from eqtrain._errors import StructureError
from eqtrain.hf import _safetensors
from eqtrain.hf._export import hf_tensors
from eqtrain.models import GPT2, GPT2Config, Llama, LlamaConfig


LLAMA = LlamaConfig(
    vocab_size=96,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
GPT2_TINY = GPT2Config(vocab_size=96, n_positions=32, n_embd=16, n_layer=4, n_head=2)


def _oracle_write(path, tensors, metadata):
    """eqtrain's hand-written writer before it used the package (frozen copy)."""
    arrays = {}
    for name, value in tensors.items():
        value = np.asarray(value)
        arrays[name] = np.ascontiguousarray(value.astype(value.dtype.newbyteorder("<")))
    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    header = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        a = arrays[name]
        header[name] = {
            "dtype": _safetensors.dtype_code(a.dtype),
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            f.write(memoryview(arrays[name].reshape(-1).view(np.uint8)))


def _tensors(dtypes):
    rng = np.random.default_rng(0)
    out = {}
    for i, dtype in enumerate(dtypes):
        shape = [(3, 5), (7,), (2, 3, 4), (0, 4)][i % 4]
        values = rng.standard_normal(shape) * 100
        out[f"t{i}.{np.dtype(dtype).name}"] = values.astype(dtype)
    out["transposed"] = rng.standard_normal((4, 6)).astype(dtypes[0]).T
    return out


# Files with one dtype per item size: the package orders tensors by dtype, then
# name; the old writer by item size, then name. Both keep every tensor aligned.
@pytest.mark.parametrize(
    "dtypes",
    [
        [np.float32],
        [ml_dtypes.bfloat16],
        [np.float16],
        [np.int64, np.int32, np.int8],
        [np.uint8],
        [np.bool_],
        [np.float32, ml_dtypes.bfloat16, np.int64, np.uint8],
        [np.dtype(">f4")],  # big-endian input is written little-endian
    ],
    ids=["f32", "bf16", "f16", "ints", "u8", "bool", "mixed", "big-endian"],
)
def test_write_is_byte_identical_to_the_old_writer(tmp_path, dtypes):
    tensors = _tensors(dtypes)
    _safetensors.write(str(tmp_path / "new.safetensors"), tensors, {"format": "pt"})
    _oracle_write(tmp_path / "old.safetensors", tensors, {"format": "pt"})
    new = (tmp_path / "new.safetensors").read_bytes()
    assert new == (tmp_path / "old.safetensors").read_bytes()
    read, metadata = _safetensors.read(str(tmp_path / "new.safetensors"))
    assert metadata == {"format": "pt"} and set(read) == set(tensors)
    for name, value in tensors.items():
        assert read[name].dtype == value.dtype.newbyteorder("<")
        np.testing.assert_array_equal(read[name], value)


def test_zero_dim_tensor_stays_zero_dim(tmp_path):
    # The old writer (np.ascontiguousarray) wrote a 0-d array with shape [1].
    file = str(tmp_path / "s.safetensors")
    _safetensors.write(file, {"s": np.array(2.5, np.float32)}, {})
    assert _safetensors.read_header(file)["s"]["shape"] == []
    assert _safetensors.read(file)[0]["s"].shape == ()


def test_write_refuses_unknown_dtype(tmp_path):
    with pytest.raises(hf.HFFormatError, match="cannot write dtype complex64"):
        _safetensors.write(str(tmp_path / "c"), {"c": np.zeros(2, np.complex64)}, {})


def test_read_slice_reads_blocks(tmp_path):
    file = str(tmp_path / "a.safetensors")
    a = np.arange(48, dtype=np.float32).reshape(6, 8).astype(ml_dtypes.bfloat16)
    _safetensors.write(file, {"a": a}, {})
    block = (slice(2, 4), slice(None))
    np.testing.assert_array_equal(_safetensors.read_slice(file, "a", block), a[2:4])
    np.testing.assert_array_equal(_safetensors.read_slice(file, "a"), a)
    with pytest.raises(hf.HFFormatError, match="has no tensor 'b'"):
        _safetensors.read_slice(file, "b")


def _damaged(good: bytes) -> dict[str, bytes]:
    (length,) = struct.unpack("<Q", good[:8])
    return {
        "truncated": good[:-7],
        "cut-in-header": good[:20],
        "garbage-header": struct.pack("<Q", 16) + b"this is no JSON!" + b"\0" * 8,
        "header-length-too-big": struct.pack("<Q", 1 << 40) + good[8:],
        "header-longer-than-file": struct.pack("<Q", len(good)) + good[8:],
        "empty": b"",
    }


@pytest.mark.parametrize(
    "case",
    list(_damaged(b"\0" * 32)),
)
def test_damaged_files_raise_hf_format_error_naming_the_file(tmp_path, case):
    good = tmp_path / "good.safetensors"
    _safetensors.write(str(good), {"a": np.ones((4, 4), np.float32)}, {})
    file = tmp_path / f"{case}.safetensors"
    file.write_bytes(_damaged(good.read_bytes())[case])
    for read in (_safetensors.read, _safetensors.read_header):
        with pytest.raises(hf.HFFormatError) as info:
            read(str(file))
        message = str(info.value)
        assert str(file) in message and "not a valid safetensors file" in message
        assert "Re-export or re-download it" in message


def test_load_names_the_damaged_shard(tmp_path):
    hf.export(Llama(LLAMA, jr.key(0)), None, tmp_path, max_shard_size="8KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = tmp_path / sorted(set(index["weight_map"].values()))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(hf.HFFormatError, match=rf"{shard}.*(cut short|damaged)"):
        hf.load(tmp_path)


def test_load_refuses_a_dtype_it_cannot_read(tmp_path):
    hf.export(GPT2(GPT2_TINY, jr.key(0)), None, tmp_path)
    file = str(tmp_path / "model.safetensors")
    tensors, metadata = _safetensors.read(file)
    name = "transformer.wpe.weight"
    tensors[name] = tensors[name].astype(np.uint16)
    save_file(tensors, file, metadata=metadata)
    with pytest.raises(
        hf.HFFormatError,
        match=rf"{file} stores tensor '{name}' as U16, which eqtrain cannot",
    ):
        hf.load(tmp_path)


def _assert_equal_trees(a, b):
    la, lb = jtu.tree_leaves(a), jtu.tree_leaves(b)
    assert jtu.tree_structure(a) == jtu.tree_structure(b)
    for x, y in zip(la, lb, strict=True):
        if hasattr(x, "dtype"):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        else:
            assert x == y


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_lazy_load_of_shards_equals_the_model_and_an_eager_read(
    tmp_path, family, stored
):
    model = GPT2(GPT2_TINY, jr.key(1)) if family == "gpt2" else Llama(LLAMA, jr.key(1))
    hf.export(model, None, tmp_path / "one", dtype=stored)
    hf.export(model, None, tmp_path / "many", dtype=stored, max_shard_size="4KB")
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 4
    one, config = hf.load(tmp_path / "one", dtype="float32")
    many, _ = hf.load(tmp_path / "many", dtype="float32")
    _assert_equal_trees(one, many)
    expected = jtu.tree_map(
        lambda x: x.astype(stored).astype("float32") if hasattr(x, "dtype") else x,
        model,
    )
    _assert_equal_trees(one, expected)
    # The file read whole and eagerly, as the old loader did, holds exactly the
    # loaded model's tensors.
    eager = _safetensors.read(str(tmp_path / "one" / "model.safetensors"))[0]
    ours = hf_tensors(one, hf.ARCHS[family], stored)
    assert set(ours) == set(eager)
    for name, value in eager.items():
        np.testing.assert_array_equal(ours[name], value)
    assert config == dataclasses.replace(model.config, param_dtype="float32")


def _full_shape(path, name):
    return _safetensors.read_header(path)[name]["shape"]


def _fsdp_tensor_shardings(mesh):
    return lambda m: sharding.state_shardings(m, mesh, sharding.rules_for(m, mesh))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_load_into_a_sharding_reads_only_each_devices_block(
    tmp_path, family, monkeypatch
):
    model = GPT2(GPT2_TINY, jr.key(2)) if family == "gpt2" else Llama(LLAMA, jr.key(2))
    hf.export(model, None, tmp_path, max_shard_size="4KB")
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    targets = _fsdp_tensor_shardings(mesh)

    reads = []
    original = _safetensors.read_slice

    def counted(path, name, index=None):
        out = original(path, name, index)
        reads.append((name, out.size, int(np.prod(_full_shape(path, name)))))
        return out

    monkeypatch.setattr(_safetensors, "read_slice", counted)
    loaded, _ = hf.load(tmp_path, shardings=targets)
    abstract = eqx.filter_eval_shape(lambda: model)
    expected_sh = jtu.tree_leaves(targets(abstract))
    arrays = [x for x in jtu.tree_leaves(loaded) if hasattr(x, "sharding")]
    assert len(arrays) == len(expected_sh)
    for x, s in zip(arrays, expected_sh, strict=True):
        assert x.sharding == s
    _assert_equal_trees(loaded, model)
    # Blocks, not whole tensors: the large weights are split over fsdp x tensor.
    partial = [r for r in reads if r[1] < r[2]]
    assert partial and sum(r[1] for r in reads) < 2 * sum(
        int(np.prod(x.shape)) for x in jtu.tree_leaves(abstract) if hasattr(x, "shape")
    )


def test_load_into_one_sharding_and_a_tree(tmp_path):
    model = Llama(LLAMA, jr.key(3))
    hf.export(model, None, tmp_path)
    mesh = sharding.make_mesh({"fsdp": 8})
    replicated = NamedSharding(mesh, PartitionSpec())
    loaded, _ = hf.load(tmp_path, shardings=replicated)
    assert all(
        x.sharding == replicated
        for x in jtu.tree_leaves(loaded)
        if isinstance(x, jax.Array)
    )
    _assert_equal_trees(loaded, model)
    abstract = eqx.filter_eval_shape(lambda: model)
    tree = sharding.state_shardings(abstract, mesh, sharding.rules_for(abstract, mesh))
    loaded, _ = hf.load(tmp_path, shardings=tree)
    _assert_equal_trees(loaded, model)
    assert loaded.embed_tokens.weight.sharding == tree.embed_tokens.weight
    with pytest.raises(StructureError, match="has 1 shardings but the model has"):
        hf.load(tmp_path, shardings=[replicated])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_large_tensors_are_read_in_runs_of_rows(tmp_path, family, monkeypatch):
    from eqtrain.hf import _lazy

    model = GPT2(GPT2_TINY, jr.key(4)) if family == "gpt2" else Llama(LLAMA, jr.key(4))
    hf.export(model, None, tmp_path, dtype="bfloat16")
    monkeypatch.setattr(_lazy, "_CHUNK", 100)  # a few rows per read
    reads = []
    original = _safetensors.read_slice
    monkeypatch.setattr(
        _safetensors,
        "read_slice",
        lambda path, name, index=None: (
            reads.append(name) or original(path, name, index)
        ),
    )
    expected = jtu.tree_map(
        lambda x: x.astype("bfloat16").astype("float32") if hasattr(x, "dtype") else x,
        model,
    )
    loaded, _ = hf.load(tmp_path, dtype="float32")
    _assert_equal_trees(loaded, expected)
    assert len(reads) > 5 * len(set(reads))
    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    loaded, _ = hf.load(
        tmp_path, dtype="float32", shardings=_fsdp_tensor_shardings(mesh)
    )
    _assert_equal_trees(loaded, expected)
