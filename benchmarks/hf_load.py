"""Peak host memory and time of loading a sharded Hugging Face export.

Writes a ~1 GB float32 Llama export in 200 MB shards to a temporary directory, then
loads it in fresh processes (so each peak is that load's own) and prints one JSON
line:

    {"config", "model_mb", "shards", "largest_param_mb", "import_mb",
     "before_peak_mb", "after_peak_mb", "ratio", "sharded_peak_mb",
     "before_overhead_mb", "after_overhead_mb", "sharded_overhead_mb",
     "before_s", "after_s", "sharded_s"}

- `before`: the loader as it was before `eqtrain.hf` used the `safetensors`
  package, copied below (`old_load`): every shard memory-mapped whole, then each
  parameter stacked, cast and copied to the device;
- `after`: `eqtrain.hf.load(dir)`: one tensor at a time through `safe_open`;
- `sharded`: `eqtrain.hf.load(dir, shardings=...)` onto an FSDP mesh of 8
  simulated CPU devices, each device's block read on its own;
- `*_peak_mb`: the process's peak resident memory (`VmHWM`), including the
  placed model itself: on CPU the device memory is host memory, so no loader can
  go below `import_mb + model_mb`; `import_mb` is the peak after importing JAX
  and eqtrain, before loading; `ratio` is `after_peak_mb / before_peak_mb`;
- `*_overhead_mb`: the loader's own share, `peak - import_mb - model_mb` (the
  new loader's should be about `largest_param_mb`: one parameter's host copy
  while it is placed). The peaks count the pages of the files mapped while a
  tensor is read (clean page cache, which the kernel can drop): the old loader
  kept every shard mapped to the end;
- `*_s`: the load's wall time (the fastest of `--rounds` processes).

Usage (CPU):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/hf_load.py [--rounds 2] [--quick]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from _machine import print_machine


CONFIGS = {
    # 268M parameters: 1.07 GB in float32, six shards of at most 200 MB.
    "1GB": dict(
        model=dict(
            vocab_size=32000,
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=16,
            tie_word_embeddings=False,
        ),
        shard="200MB",
    ),
    "quick": dict(
        model=dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
        shard="40KB",
    ),
}


def _peak_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


# --- "before": eqtrain.hf's loader before it used the safetensors package -------
# (its reader mapped each file whole and returned views of the map; `_fill` then
# stacked, cast and copied every parameter). Kept verbatim apart from names.


def old_read(path):
    import mmap
    import struct

    import ml_dtypes
    import numpy as np

    dtypes = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2")}
    dtypes["BF16"] = np.dtype(ml_dtypes.bfloat16)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (length,) = struct.unpack("<Q", buffer[:8])
    header = json.loads(bytes(buffer[8 : 8 + length]).decode("utf-8"))
    header.pop("__metadata__", None)
    base, tensors = 8 + length, {}
    for name, info in header.items():
        dtype, shape = dtypes[info["dtype"]], tuple(info["shape"])
        start, end = info["data_offsets"]
        assert base + end <= size
        count = int(np.prod(shape, dtype=np.int64))
        tensors[name] = np.frombuffer(buffer, dtype, count, base + start).reshape(shape)
    return tensors


def old_load(path):
    import equinox as eqx
    import jax.numpy as jnp
    import jax.random as jr
    import jax.tree_util as jtu
    import numpy as np

    from eqtrain import hf, models
    from eqtrain.hf import _maps

    config, model_type = hf.load_config(path)
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    tensors = {}
    for file in files:
        tensors.update(old_read(os.path.join(path, file)))
    arch = hf.ARCHS[model_type]
    template = eqx.filter_eval_shape(models.family(model_type).model, config, jr.key(0))
    flat, treedef = jtu.tree_flatten_with_path(template)
    values = []
    for key_path, struct in flat:
        if not _maps.is_struct(struct):
            values.append(struct)
            continue
        leaf_path = jtu.keystr(key_path, simple=True, separator=".")
        names = _maps.hf_names(arch, leaf_path, config.num_hidden_layers)
        stacked = leaf_path.startswith(arch.layers + ".")
        parts = [tensors[name] for name in names]
        value = np.stack(parts) if stacked else parts[0]
        values.append(jnp.asarray(value.astype(struct.dtype)))
    return jtu.tree_unflatten(treedef, values)


# --- one measurement, in its own process ------------------------------------------


def child(kind: str, path: str) -> None:
    import jax

    from eqtrain import hf, sharding

    import_mb = _peak_mb()
    start = time.perf_counter()
    if kind == "before":
        model = old_load(path)
    elif kind == "after":
        model, _ = hf.load(path)
    else:
        mesh = sharding.make_mesh({"fsdp": -1})
        rules = lambda m: sharding.state_shardings(m, mesh, sharding.rules_for(m, mesh))
        model, _ = hf.load(path, shardings=rules)
    jax.block_until_ready(jax.tree.leaves(model))
    seconds = time.perf_counter() - start
    print(json.dumps({"peak_mb": _peak_mb(), "import_mb": import_mb, "s": seconds}))


def _measure(kind: str, path: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    devices = 8 if kind == "sharded" else 1
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    proc = subprocess.run(
        [sys.executable, __file__, "--child", kind, path],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode:
        raise RuntimeError(f"the {kind} load failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def write_export(name: str, path: str) -> dict:
    import jax
    import jax.random as jr

    from eqtrain import hf
    from eqtrain.models import Llama, LlamaConfig

    spec = CONFIGS[name]
    model = Llama(LlamaConfig(**spec["model"]), jr.key(0))
    hf.export(model, None, path, max_shard_size=spec["shard"], overwrite=True)
    largest = max(x.nbytes for x in jax.tree.leaves(model) if hasattr(x, "nbytes"))
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    return {
        "model_mb": index["metadata"]["total_size"] / 2**20,
        "shards": len(set(index["weight_map"].values())),
        "largest_param_mb": largest / 2**20,
    }


def main() -> None:
    print_machine()  # the processor and settings: figures are per machine
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model (smoke)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("KIND", "DIR"), help="internal")
    parser.add_argument("--write", nargs=2, metavar=("CONFIG", "DIR"), help="internal")
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.write:
        print(json.dumps(write_export(*args.write)))
        return
    name = "quick" if args.quick else "1GB"
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory(prefix="eqtrain-hf-load-") as tmp:
        path = os.path.join(tmp, "hf")
        # Written in a subprocess so the parent holds no model while measuring.
        writer = subprocess.run(
            [sys.executable, __file__, "--write", name, path],
            capture_output=True,
            text=True,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
            check=False,
        )
        if writer.returncode:
            raise RuntimeError(f"the export failed:\n{writer.stderr[-3000:]}")
        info = json.loads(writer.stdout.strip().splitlines()[-1])
        runs: dict[str, list[dict]] = {"before": [], "after": [], "sharded": []}
        for _ in range(rounds):  # alternated, so the page cache favours neither
            for kind in runs:
                runs[kind].append(_measure(kind, path))
    peak = {k: max(r["peak_mb"] for r in v) for k, v in runs.items()}
    secs = {k: min(r["s"] for r in v) for k, v in runs.items()}
    import_mb = max(r["import_mb"] for k in runs for r in runs[k])
    record = {
        "config": name,
        **{k: round(v, 1) for k, v in info.items()},
        "import_mb": round(import_mb, 1),
        "before_peak_mb": round(peak["before"], 1),
        "after_peak_mb": round(peak["after"], 1),
        "ratio": round(peak["after"] / peak["before"], 3),
        "sharded_peak_mb": round(peak["sharded"], 1),
        **{
            f"{k}_overhead_mb": round(peak[k] - import_mb - info["model_mb"], 1)
            for k in peak
        },
        "before_s": round(secs["before"], 2),
        "after_s": round(secs["after"], 2),
        "sharded_s": round(secs["sharded"], 2),
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
