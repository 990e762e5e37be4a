"""A data-parallel run for tests/test_distributed.py: one process of a
multi-process run (or, with --single, both devices in one process). Not a test."""

import argparse
import json
import sys

from eqtrain.distributed import initialize


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--single", action="store_true")
    parser.add_argument("--every", type=int, default=1000)
    args = parser.parse_args()
    import eqtrain

    eqtrain.cpu.tune_cpu()  # what `eqtrain fit` applies (the tests name it)
    if not args.single:
        initialize()  # from EQTRAIN_* variables

    import jax
    import jax.random as jr
    import numpy as np
    import optax

    from eqtrain import checkpoint, sharding
    from eqtrain.data import Loader
    from eqtrain.losses import causal_lm_loss
    from eqtrain.models import Llama, LlamaConfig

    assert jax.device_count() == 2, jax.devices()
    mesh = sharding.make_mesh({"data": -1})
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (4096, 17)).astype(np.int32)
    rows = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    rows["loss_mask"] = np.ones(rows["tokens"].shape, np.float32)
    batch_sh = sharding.batch_sharding(mesh)
    loader = Loader(rows, 8, seed=0, sharding=batch_sh)
    opt = optax.adamw(3e-3)
    model = Llama(config, jr.key(0))
    rules = sharding.rules_for(model, mesh)
    state_sh = sharding.state_shardings(
        eqtrain.TrainState.create(model, opt, key=0), mesh, rules, optimizer=opt
    )
    start = checkpoint.resume_run(
        args.run_dir,
        lambda: sharding.shard(eqtrain.TrainState.create(model, opt, key=0), state_sh),
        shardings=state_sh,
        data=loader,
    )
    state, resumed = start.state, start.step
    step = eqtrain.jit(
        eqtrain.train_step(causal_lm_loss, opt), shardings=(state_sh, batch_sh)
    )
    ckpt = checkpoint.Checkpointer(args.run_dir, every_steps=args.every, data=loader)
    print("READY", flush=True)
    result = eqtrain.fit(
        state,
        step,
        loader,
        num_steps=args.steps,
        checkpointer=ckpt,
        stop=eqtrain.StopConditions(agree_every=2),
        reading=eqtrain.Reading(every=1),
    )
    loader.close()
    out = {
        "process": jax.process_index(),
        "losses": [h["loss"] for h in result.history],
        "stop": str(result.stop_reason.kind),
        "stop_step": result.stop_reason.step,
        "resumed": resumed,
    }
    print("RESULT " + json.dumps(out), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
