"""`eqtrain.data.Loader`: deterministic order, O(1) resume from a position,
per-process slicing, drop_last/padding, eval passes, prefetch and device placement."""

import gc
import json
import os
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from eqtrain import ConfigError
from eqtrain.data import DataError, Loader


def rows(n=37, width=3):
    """Row i holds `i` in `id` and `i, i, ...` in `x`: rows are recognisable."""
    ids = np.arange(n, dtype=np.int32)
    return {"id": ids, "x": np.repeat(ids[:, None], width, axis=1).astype(np.float32)}


def take(loader_or_iter, n):
    it = iter(loader_or_iter)
    return [next(it) for _ in range(n)]


def ids_of(batches):
    return [b["id"].tolist() for b in batches]


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "eqtrain-prefetch"]


def wait_for_no_prefetch_threads(timeout=5.0):
    deadline = time.monotonic() + timeout
    while prefetch_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return prefetch_threads()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_same_seed_same_batches_other_seed_other_order(prefetch):
    a = ids_of(take(Loader(rows(), 4, seed=3, prefetch=prefetch), 20))
    b = ids_of(take(Loader(rows(), 4, seed=3, prefetch=prefetch), 20))
    c = ids_of(take(Loader(rows(), 4, seed=4, prefetch=prefetch), 20))
    assert a == b
    assert a != c
    # epochs differ in order: the permutation depends on (seed, epoch)
    assert a[:9] != a[9:18]


@pytest.mark.parametrize("prefetch", [0, 3])
def test_restore_from_position_equals_continuing(prefetch):
    loader = Loader(rows(), 4, seed=1, prefetch=prefetch)  # 9 batches per epoch
    assert len(loader) == 9
    it = iter(loader)
    reference, positions = [], [loader.position]
    for _ in range(30):
        reference.append(next(it)["id"].tolist())
        positions.append(loader.position)
    assert positions[0] == {"epoch": 0, "index": 0}
    assert positions[5] == {"epoch": 0, "index": 5}
    assert positions[9] == {"epoch": 1, "index": 0}  # the epoch boundary
    assert positions[26] == {"epoch": 2, "index": 8}
    for k in [0, 1, 5, 8, 9, 10, 17, 18, 26]:
        saved = json.loads(json.dumps(positions[k]))  # positions are plain JSON
        resumed = Loader(rows(), 4, seed=1, prefetch=prefetch, position=saved)
        assert ids_of(take(resumed, 4)) == reference[k : k + 4], k
        assert resumed.position == positions[k + 4]


def test_seek_and_reiterating_a_train_loader_continue_from_its_position():
    loader = Loader(rows(), 4, seed=2, prefetch=2)
    first = ids_of(take(loader, 3))
    rest = ids_of(take(loader, 3))  # a new iter() continues from position 3
    assert loader.position == {"epoch": 0, "index": 6}
    loader.seek({"epoch": 0, "index": 0})
    assert ids_of(take(loader, 6)) == first + rest
    loader.seek({"epoch": 0, "index": 9})  # the end of epoch 0 is the start of 1
    assert loader.position == {"epoch": 1, "index": 0}


def test_positions_count_yielded_batches_not_prefetched_ones():
    loader = Loader(rows(), 4, seed=0, prefetch=4)
    it = iter(loader)
    next(it)
    time.sleep(0.2)  # let the thread fill its queue
    assert loader.position == {"epoch": 0, "index": 1}


def test_peek_does_not_advance():
    loader = Loader(rows(), 4, seed=0)
    take(loader, 2)
    peeked = loader.peek()
    assert loader.position == {"epoch": 0, "index": 2}
    assert next(iter(loader))["id"].tolist() == peeked["id"].tolist()


@pytest.mark.parametrize("processes", [1, 2, 4])
@pytest.mark.parametrize("drop_last", [True, False])
def test_each_row_once_per_epoch_across_process_slices(processes, drop_last):
    n, batch_size = 38, 8
    per_process = []
    for p in range(processes):
        loader = Loader(
            rows(n),
            batch_size,
            seed=5,
            drop_last=drop_last,
            num_epochs=2,
            process_index=p,
            process_count=processes,
        )
        per_process.append(list(loader))
    num_batches = n // batch_size if drop_last else -(-n // batch_size)
    for epoch in range(2):
        seen = []
        for i in range(epoch * num_batches, (epoch + 1) * num_batches):
            global_batch = []
            for p in range(processes):
                b = per_process[p][i]
                assert b["x"].shape == (batch_size // processes, 3)
                real = b.get("weights", np.ones(len(b["id"]))) > 0
                global_batch += b["id"][real].tolist()
            seen += global_batch
        assert len(seen) == len(set(seen))  # disjoint slices, no repeats
        if drop_last:
            assert len(seen) == (n // batch_size) * batch_size
        else:
            assert sorted(seen) == list(range(n))  # nothing lost
    # the processes together yield what one process yields
    single = list(
        Loader(rows(n), batch_size, seed=5, drop_last=drop_last, num_epochs=2)
    )
    for i, b in enumerate(single):
        joined = np.concatenate([per_process[p][i]["id"] for p in range(processes)])
        assert joined.tolist() == b["id"].tolist()


def test_drop_last_and_padding_of_the_last_batch():
    dropped = list(Loader(rows(10), 4, num_epochs=1))
    assert [len(b["id"]) for b in dropped] == [4, 4]
    padded = list(Loader(rows(10), 4, num_epochs=1, shuffle=False, drop_last=False))
    assert len(padded) == 3
    last = padded[-1]
    assert last["id"].tolist() == [8, 9, 0, 0]
    assert last["weights"].tolist() == [1, 1, 0, 0]
    assert np.all(last["x"][2:] == 0)
    assert all(b["weights"].dtype == np.float32 for b in padded)
    # a batch with a loss_mask is padded with loss_mask 0 and gets no `weights`
    data = {
        "tokens": np.ones((5, 2), np.int32),
        "loss_mask": np.ones((5, 2), np.float32),
    }
    last = list(Loader(data, 4, mode="eval"))[-1]
    assert set(last) == {"tokens", "loss_mask"}
    assert last["loss_mask"].sum(axis=1).tolist() == [2, 0, 0, 0]


def test_eval_loader_is_finite_and_reiterable():
    loader = Loader(rows(10), 4, mode="eval")
    first, second = ids_of(loader), ids_of(loader)
    assert first == second == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 0]]
    assert iter(loader) is not loader  # fit accepts it as eval_data
    # two passes may run side by side
    a, b = iter(loader), iter(loader)
    assert next(a)["id"].tolist() == next(b)["id"].tolist()
    shuffled = Loader(rows(10), 4, mode="eval", shuffle=True, seed=1)
    assert ids_of(shuffled) == ids_of(shuffled) != first
    with pytest.raises(ConfigError, match="no position"):
        _ = loader.position


def test_num_epochs_ends_a_train_loader():
    loader = Loader(rows(8), 4, num_epochs=3)
    assert len(list(loader)) == 6
    assert loader.position == {"epoch": 3, "index": 0}
    assert list(loader) == []


def test_prefetch_places_batches_on_the_sharding():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("data"))
    loader = Loader(rows(32), 8, seed=0, sharding=sharding, prefetch=2)
    batches = take(loader, 3)
    for b in batches:
        assert isinstance(b["x"], jax.Array)
        assert b["x"].sharding == sharding and b["id"].sharding == sharding
        assert len(b["x"].addressable_shards) == 8
    unplaced = take(Loader(rows(32), 8, seed=0, prefetch=0), 3)
    for placed, host in zip(batches, unplaced, strict=True):
        np.testing.assert_array_equal(np.asarray(placed["x"]), host["x"])


def test_prefetch_reraises_the_producers_exception_in_the_consumer():
    def transform(batch):
        if 7 in batch["id"].tolist():
            raise RuntimeError("bad row 7")
        return batch

    loader = Loader(rows(16), 2, shuffle=False, transform=transform, prefetch=2)
    it = iter(loader)
    assert [next(it)["id"].tolist() for _ in range(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(RuntimeError, match="bad row 7"):
        next(it)
    assert loader.position == {"epoch": 0, "index": 3}
    with pytest.raises(StopIteration):
        next(it)
    assert wait_for_no_prefetch_threads() == []


def test_no_thread_leaks_when_iteration_stops_early():
    assert wait_for_no_prefetch_threads() == []
    loader = Loader(rows(64), 2, prefetch=2)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    assert wait_for_no_prefetch_threads() == []  # the dropped iterator stopped it
    it = iter(loader)
    next(it)
    it.close()
    assert wait_for_no_prefetch_threads() == []
    # a newer iterator supersedes the old one, whose thread stops
    old = iter(loader)
    next(old)
    new = iter(loader)
    next(new)
    with pytest.raises(DataError, match="superseded"):
        next(old)
    del new
    assert wait_for_no_prefetch_threads() == []


def test_loader_errors():
    with pytest.raises(DataError, match="larger than the data"):
        Loader(rows(5), 8)
    with pytest.raises(DataError, match="empty"):
        Loader({"x": np.zeros((0, 2))}, 1)
    with pytest.raises(DataError, match="leading length"):
        Loader({"x": np.zeros(3), "y": np.zeros(4)}, 1)
    with pytest.raises(ConfigError, match="multiple of the process count"):
        Loader(rows(), 6, process_count=4, process_index=0)
    with pytest.raises(ConfigError, match="process_index"):
        Loader(rows(), 4, process_count=2, process_index=2)
    with pytest.raises(ConfigError, match="outside this loader"):
        Loader(rows(), 4, position={"epoch": 0, "index": 10})
    with pytest.raises(ConfigError, match="a position is a dict"):
        Loader(rows(), 4, position={"step": 3})
    with pytest.raises(ConfigError, match="cannot load batches"):
        Loader(42, 4)


def test_a_dataset_or_a_list_of_examples_with_a_transform():
    import datasets

    ds = datasets.Dataset.from_dict(
        {"a": list(range(10)), "b": [[i, i] for i in range(10)]}
    )
    batches = list(Loader(ds, 5, mode="eval"))
    assert batches[1]["a"].tolist() == [5, 6, 7, 8, 9]
    assert batches[0]["b"].shape == (5, 2)
    texts = [f"example {i}" for i in range(6)]
    loader = Loader(
        texts,
        3,
        mode="eval",
        transform=lambda ex: {"n": np.array([len(t) for t in ex])},
    )
    assert [b["n"].tolist() for b in loader] == [[9, 9, 9], [9, 9, 9]]


def test_add_columns_keeps_the_position_and_checks_lengths():
    rows = {"x": np.arange(12).reshape(6, 2)}
    loader = Loader(rows, 2, seed=0)
    it = iter(loader)
    next(it)
    loader.add_columns({"y": np.arange(6) * 10})
    batch = next(iter(loader))
    assert loader.position == {"epoch": 0, "index": 2}
    np.testing.assert_array_equal(batch["y"], batch["x"][:, 0] * 5)
    with pytest.raises(ConfigError, match="one entry per row"):
        loader.add_columns({"z": np.zeros(5)})
    with pytest.raises(ConfigError, match="already has"):
        loader.add_columns({"y": np.zeros(6)})


def test_an_iterator_left_open_at_exit_says_nothing(tmp_path):
    """A prefetching iterator still referenced when the interpreter exits stops
    quietly (its `__del__` runs after the modules it uses are torn down)."""
    import subprocess
    import sys

    script = tmp_path / "left_open.py"
    script.write_text(
        "import numpy as np\n"
        "from eqtrain.data import Loader\n"
        "it = iter(Loader({'x': np.arange(64)}, 2, prefetch=2))\n"
        "next(it)\n"
        "print('ok')\n"
    )
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"
    assert "Exception ignored" not in run.stderr, run.stderr


def test_a_prefetch_thread_busy_in_jax_at_exit_does_not_abort(tmp_path):
    """A prefetch thread still placing arrays on the device when the interpreter
    exits is stopped first: cut off inside JAX's C++ code, it aborted the
    process ("terminate called after throwing an instance of ''", status 134)."""
    import subprocess
    import sys

    script = tmp_path / "busy_at_exit.py"
    script.write_text(
        "import time\n"
        "import jax, numpy as np\n"
        "from eqtrain.data._prefetch import Prefetcher\n"
        "big = np.ones((2, 1024, 1024), np.float32)\n"
        "def source():\n"
        "    while True:\n"
        "        for _ in range(500):\n"
        "            jax.device_put(big).block_until_ready()\n"
        "        yield 1\n"
        "p = Prefetcher(source(), 1)\n"
        "time.sleep(0.3)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120,
        env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"
    assert "terminate called" not in run.stderr, run.stderr
