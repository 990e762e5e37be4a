"""Train a small byte-level language model with eqtrain's builders, top to bottom.

The model is a Bengio-style MLP: it embeds the previous `CONTEXT` bytes and predicts
the next one. The text is the Python standard library's own source code (found on
this machine, nothing is downloaded). It shows the research-code path:

    TrainState.create -> train_step / eval_step -> eqtrain.jit -> eqtrain.fit

with built-in hooks (progress bar, JSONL metrics) and a custom one that samples text
from the model every few hundred steps.

    python examples/byte_mlp_lm.py               # ~1 minute on a laptop CPU
    python examples/byte_mlp_lm.py --smoke       # a few seconds, for tests
"""

import argparse
import sysconfig
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import optax

import eqtrain


CONTEXT = 8
VOCAB = 256


# -- data ----------------------------------------------------------------------
def load_corpus(max_bytes: int) -> np.ndarray:
    """Bytes of the standard library's .py files, in a fixed (sorted) order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(stdlib.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)


def windows(corpus: np.ndarray, batch_size: int, seed: int, epochs: int):
    """Yield {"tokens": int32[batch, CONTEXT + 1]}: a context and its next byte.

    Each epoch visits every window once, in an order fixed by (seed, epoch).
    """
    starts = np.arange(len(corpus) - CONTEXT)
    offsets = np.arange(CONTEXT + 1)
    for epoch in range(epochs):
        order = np.random.default_rng([seed, epoch]).permutation(starts)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            rows = order[i : i + batch_size, None] + offsets
            yield {"tokens": corpus[rows].astype(np.int32)}


# -- model and loss --------------------------------------------------------------
class ByteMLP(eqx.Module):
    embed: jax.Array
    hidden: eqx.nn.Linear
    out: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, *, dim: int, width: int, key):
        k1, k2, k3 = jr.split(key, 3)
        self.embed = jr.normal(k1, (VOCAB, dim)) * 0.1
        self.hidden = eqx.nn.Linear(CONTEXT * dim, width, key=k2)
        self.out = eqx.nn.Linear(width, VOCAB, key=k3)
        self.dropout = eqx.nn.Dropout(0.1)

    def __call__(self, context, *, key=None):
        """Logits for the byte after `context` (int[CONTEXT])."""
        h = jax.nn.gelu(self.hidden(self.embed[context].reshape(-1)))
        return self.out(self.dropout(h, key=key))


def loss_fn(model, batch, key):
    context, target = batch["tokens"][:, :-1], batch["tokens"][:, -1]
    keys = jr.split(key, context.shape[0])
    logits = jax.vmap(lambda c, k: model(c, key=k))(context, keys)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, target).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == target)
    return loss, {"accuracy": accuracy}


# -- a custom hook -------------------------------------------------------------
def sampler(prompt: bytes, length: int = 60):
    """A hook that prints a greedy continuation of `prompt` from the current model."""

    @eqx.filter_jit  # a one-off call outside the step loop: filter_jit is fine here
    def continue_text(model, context):
        def next_byte(ctx, _):
            b = jnp.argmax(model(ctx)).astype(jnp.int32)
            return jnp.concatenate([ctx[1:], b[None]]), b

        _, out = jax.lax.scan(next_byte, context, None, length=length)
        return out

    @eqtrain.uses_state  # it reads info.state: the loop gives it the exact state
    def hook(info: eqtrain.StepInfo) -> None:
        model = eqx.nn.inference_mode(info.state.model)
        context = jnp.asarray(np.frombuffer(prompt[-CONTEXT:], np.uint8), jnp.int32)
        text = bytes(np.asarray(continue_text(model, context), np.uint8).tolist())
        sample = text.decode(errors="replace")
        print(f"\n[step {info.step}] {prompt.decode()!r} -> {sample!r}")

    return hook


def main() -> eqtrain.FitResult:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--run-dir", default="runs/byte_mlp_lm")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a tiny, fast run")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.batch_size = 40, 32

    corpus = load_corpus(200_000 if args.smoke else 2_000_000)
    split = int(len(corpus) * 0.95)
    train, held_out = corpus[:split], corpus[split:]
    eval_batches = list(windows(held_out, 256, seed=1, epochs=1))[:8]

    model = ByteMLP(dim=32, width=256, key=jr.key(args.seed))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, max(1, args.steps // 20), args.steps, end_value=args.lr / 10
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(
            learning_rate=schedule, weight_decay=1e-4
        ),
    )
    state = eqtrain.TrainState.create(model, optimizer, key=args.seed)

    step = eqtrain.jit(
        eqtrain.train_step(loss_fn, optimizer, accumulate=args.accumulate)
    )
    evaluate = eqtrain.jit(eqtrain.eval_step(loss_fn), donate=False)
    run_dir = Path(args.run_dir)
    hooks = [
        eqtrain.hooks.ProgressBar(),
        eqtrain.hooks.JsonlWriter(run_dir / "metrics.jsonl"),
        eqtrain.every(max(1, args.steps // 3), sampler(b"def __init__(self")),
    ]
    result = eqtrain.fit(
        state,
        step,
        windows(train, args.batch_size, seed=args.seed, epochs=1000),
        num_steps=args.steps,
        hooks=hooks,
        evaluation=eqtrain.Evaluation(
            evaluate, eval_batches, every=max(1, args.steps // 5)
        ),
        stop=eqtrain.StopConditions(
            time_limit=args.time_limit, kill_switch=run_dir / "STOP"
        ),
    )
    last = result.metrics
    print(
        f"\nstopped: {result.stop_reason}\n"
        f"train loss {last.get('loss', float('nan')):.3f}, "
        f"eval loss {last.get('eval/loss', float('nan')):.3f}, "
        f"eval accuracy {last.get('eval/accuracy', float('nan')):.3f}\n"
        f"metrics: {run_dir / 'metrics.jsonl'}"
    )
    return result


if __name__ == "__main__":
    main()
