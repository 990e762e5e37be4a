"""Train a small byte-level Llama on the Python standard library's own source code.

Everything comes from eqtrain: the model (`eqtrain.models.Llama`), the loss
(`eqtrain.losses.causal_lm_loss`), the corpus, tokenizer, pipeline and resumable
loader (`eqtrain.data`), and the step builders and loop. Nothing is downloaded: the
corpus is the standard library found on this machine.

    python examples/llama_stdlib.py               # a few minutes on a laptop CPU
    python examples/llama_stdlib.py --smoke       # seconds, for tests
"""

import argparse
import json
from pathlib import Path

import jax.random as jr
import optax

import eqtrain
from eqtrain.data import ByteTokenizer, Loader, chunk_documents, stdlib_corpus
from eqtrain.losses import causal_lm_loss
from eqtrain.models import Llama, LlamaConfig


def build(args: argparse.Namespace):
    tokenizer = ByteTokenizer()
    train_rows = chunk_documents(
        stdlib_corpus("train"), tokenizer, seq_len=args.seq_len
    )
    eval_rows = chunk_documents(stdlib_corpus("eval"), tokenizer, seq_len=args.seq_len)
    # A fixed, modest eval set: the first rows of the held-out files.
    eval_rows = {k: v[: args.eval_rows] for k, v in eval_rows.items()}
    loader = Loader(train_rows, args.batch_size, seed=args.seed)
    eval_loader = Loader(eval_rows, args.batch_size, mode="eval")

    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=args.dim,
        intermediate_size=4 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
        tie_word_embeddings=True,
    )
    model = Llama(config, jr.key(args.seed))
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, max(1, args.steps // 20), args.steps, end_value=args.lr / 10
    )
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=0.1),
    )
    return model, optimizer, loader, eval_loader


def main(argv: list[str] | None = None) -> eqtrain.FitResult:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-rows", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-dir", default="runs/llama_stdlib")
    parser.add_argument("--smoke", action="store_true", help="a tiny, fast run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.dim, args.layers, args.seq_len = 20, 32, 2, 32
        args.batch_size, args.eval_rows = 4, 16

    model, optimizer, loader, eval_loader = build(args)
    state = eqtrain.TrainState.create(model, optimizer, key=args.seed)
    step = eqtrain.jit(eqtrain.train_step(causal_lm_loss, optimizer))
    evaluate = eqtrain.jit(eqtrain.eval_step(causal_lm_loss), donate=False)

    run_dir = Path(args.run_dir)
    before = eqtrain.evaluate(state, evaluate, eval_loader)
    result = eqtrain.fit(
        state,
        step,
        loader,
        num_steps=args.steps,
        hooks=[
            eqtrain.hooks.ProgressBar(),
            eqtrain.hooks.JsonlWriter(run_dir / "metrics.jsonl"),
        ],
        evaluation=eqtrain.Evaluation(
            evaluate, eval_loader, every=max(1, args.steps // 4)
        ),
        stop=eqtrain.StopConditions(kill_switch=run_dir / "STOP"),
    )
    loader.close()
    summary = {
        "stop_reason": str(result.stop_reason),
        "eval_loss_before": before["eval/loss"],
        "eval_loss_after": result.metrics.get("eval/loss"),
        "eval_accuracy_after": result.metrics.get("eval/accuracy"),
        "data_position": loader.position,
    }
    print(f"\nstopped: {result.stop_reason}\n{json.dumps(summary)}")
    return result


if __name__ == "__main__":
    main()
