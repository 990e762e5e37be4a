"""`eqtrain.fit` over a `Loader`: batches are consumed in order, and the loader's
position after `fit` (and at each checkpoint) counts exactly the consumed batches."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax
import pytest

import eqtrain
from eqtrain.data import ByteTokenizer, Loader, chunk_documents


class Bigram(eqx.Module):
    """A tiny embedding-bag LM: logits for the next token from the current one."""

    embed: jax.Array
    head: jax.Array

    def __init__(self, vocab, dim, key):
        k1, k2 = jr.split(key)
        self.embed = jr.normal(k1, (vocab, dim)) * 0.1
        self.head = jr.normal(k2, (dim, vocab)) * 0.1


def lm_loss(model, batch, key):
    logits = model.embed[batch["tokens"]] @ model.head
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["loss_mask"]
    # `ids` rides along as a metric so the test can see which rows each step used
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0), {
        "first_id": batch["id"][0].astype(jnp.float32)
    }


def data(seq_len=8):
    docs = [f"def f{i}(x):\n    return x * {i}\n" for i in range(40)]
    rows = chunk_documents(docs, ByteTokenizer(), seq_len=seq_len)
    rows["id"] = np.arange(len(rows["tokens"]), dtype=np.int32)
    return rows


class PositionCheckpointer:
    """Saves the loader's position with every checkpoint, as a real one would."""

    def __init__(self, loader, every_n):
        self.loader, self.every_n = loader, every_n
        self.saved = {}

    def due(self, step):
        return step % self.every_n == 0

    def save(self, info, *, final):
        self.saved[info.step] = json.dumps(self.loader.position)

    def close(self):
        pass


def test_fit_consumes_loader_batches_in_order_and_position_matches():
    rows = data()
    assert len(rows["id"]) > 40
    batch_size = 8
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    loader = Loader(rows, batch_size, seed=0, sharding=sharding, prefetch=2)
    per_epoch = len(loader)
    expected = [
        b["id"].tolist()
        for b in Loader(rows, batch_size, seed=0, prefetch=0, num_epochs=3)
    ]
    opt = optax.adam(1e-2)
    state = eqtrain.TrainState.create(Bigram(259, 16, jr.key(0)), opt, key=0)
    step = eqtrain.jit(eqtrain.train_step(lm_loss, opt))
    evaluate = eqtrain.jit(eqtrain.eval_step(lm_loss), donate=False)
    eval_loader = Loader(rows, 16, mode="eval")
    ckpt = PositionCheckpointer(loader, every_n=3)
    num_steps = per_epoch + 4  # crosses an epoch boundary
    result = eqtrain.fit(
        state,
        step,
        loader,
        num_steps=num_steps,
        evaluation=eqtrain.Evaluation(evaluate, eval_loader, every=5),
        checkpointer=ckpt,
        reading=eqtrain.Reading(every=1),
    )
    assert result.stop_reason.kind == "max_steps"
    firsts = [h["first_id"] for h in result.history]
    assert firsts == [e[0] for e in expected[:num_steps]]
    assert loader.position == {"epoch": 1, "index": 4}
    # each checkpoint saw the position right after its step's batch
    for saved_step, position in ckpt.saved.items():
        epoch, index = divmod(saved_step, per_epoch)
        assert json.loads(position) == {"epoch": epoch, "index": index}
    # evaluations ran over the full eval loader each time
    evaluated = [h for h in result.history if "eval/weight" in h]
    assert [h["step"] for h in evaluated][:2] == [5, 10]
    assert {h["eval/weight"] for h in evaluated} == {float(rows["loss_mask"].sum())}
    # resuming from a saved position continues with the batches not yet consumed
    resumed = Loader(rows, batch_size, seed=0, position=json.loads(ckpt.saved[6]))
    more = eqtrain.fit(result.state, step, resumed, num_steps=num_steps + 2)
    assert [h["first_id"] for h in more.history] == [e[0] for e in expected[6:8]]


def test_loader_close_stops_prefetch_and_keeps_the_position():
    import threading

    loader = Loader(data(), 4, seed=0, prefetch=2)
    reference = [b["id"].tolist() for b in Loader(data(), 4, seed=0, num_epochs=1)]
    it = iter(loader)
    assert [next(it)["id"].tolist() for _ in range(2)] == reference[:2]
    loader.close()
    assert not [t for t in threading.enumerate() if t.name == "eqtrain-prefetch"]
    assert loader.position == {"epoch": 0, "index": 2}
    assert next(iter(loader))["id"].tolist() == reference[2]


@pytest.mark.slow  # default-suite time (docs/testing.md)
def test_data_benchmark_quick():
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "benchmarks" / "data.py"
    env = dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(script), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["loader_tokens_per_s"] > 0 and record["list_tokens_per_s"] > 0
    low, high = record["quartiles"]
    assert 0 < low <= record["ratio"] <= high
    assert "warning" not in proc.stderr
