"""What a CLI user gets: `eqtrain fit` against `transformers.Trainer` on the same
model shape and batch, each in its own process, in tokens per second.

`benchmarks/models.py` compares the two models' training steps in one process;
this compares the whole programs a user runs:

- eqtrain: `python -m eqtrain.cli fit cfg.toml` (the `eqtrain` console script's
  code), with a config that sets only the model's shape (`model.arch = "llama"`,
  hidden 256, MLP 1024, 4 layers, 4 heads and 4 key/value heads, untied: 4.3M
  parameters), `data.seq_len`, `data.batch_size` and `loop.steps`; everything
  else is the CLI's default: the built-in `stdlib` corpus and byte tokenizer, f32,
  the optimizer and schedule, evaluation, checkpoints, logging, export. `--set
  KEY=VALUE` (repeatable) passes more overrides, e.g. `--set
  model.scan_layers=false`. Each round trains a fresh run directory.
- Trainer: `transformers.Trainer` with `LlamaForCausalLM` of the same shape
  (vocabulary 259, the byte tokenizer's) on byte-tokenized standard-library rows of
  `seq` tokens, `TrainingArguments` at their defaults except: batch, `max_steps`,
  eqtrain's resolved learning rate, warm-up, cosine decay to its final rate,
  weight decay and clip norm, `use_cpu`, no saving, no logging, no reporting, no
  progress bar, `dataloader_num_workers=0`; `torch.set_num_threads(--threads)`.

Timing, after warm-up, from wall time inside each process (so neither start-up,
compilation, nor the end of the run counts):

- eqtrain: the run's `metrics.jsonl`. Each record's `time` is the seconds since
  `fit` started at the moment the loop read that step's metrics, which it does
  after the step completed (it reads several steps at once when they are quicker
  than `read_seconds`; such records share one `time`, taken once the last of them
  completed). The rate is the `tokens_seen` between the read that covered step
  `--warmup` and the last step's read, over the `time` between them.
- Trainer: a `TrainerCallback` takes `time.perf_counter()` at every `on_step_end`;
  the rate is the tokens of steps `warmup + 1 .. steps` over the time between the
  end of step `warmup` and of the last step.

With the default 60 steps no evaluation or checkpoint falls inside the timed
window (the CLI's cadence is every 100 steps, recorded in `eqtrain_defaults`): the
rates are the steady state between them. The two alternate (ABBA) over
`--rounds`, each round in fresh processes. The environment passes through
unchanged (no allocator or XLA flags are added), with `JAX_PLATFORMS` set to
`--platform`. It prints one JSON line:

    {"steps", "warmup", "batch", "seq", "threads", "cpus", "params",
     "eqtrain_set", "eqtrain_tokens_per_s", "trainer_tokens_per_s", "ratio",
     "ratio_range", "rounds_eqtrain", "rounds_trainer", "process_s",
     "eqtrain_data_ms", "eqtrain_phases_s", "eqtrain_defaults",
     "trainer_optim", "loadavg"}

with the median rates, `ratio` the median over rounds of eqtrain / Trainer within
a round (> 1: eqtrain is faster), `process_s` the median wall time of each whole
process, `eqtrain_data_ms` the median time the loop waited for a batch in the
window, `eqtrain_phases_s` where the rest of eqtrain's process time went (see
`eqtrain_phases`), and `loadavg` the 1/5/15-minute load averages at the start and
the end. Per-round rates go to stderr.

Usage (needs `pip install torch==2.13.0 transformers`):

    .venv/bin/python benchmarks/cli.py [--steps 60] [--warmup 10] [--rounds 3]
        [--threads 2] [--set model.scan_layers=false] [--platform cpu] [--quick]
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import print_machine


SHAPE = {"hidden": 256, "mlp": 1024, "layers": 4, "heads": 4, "batch": 16, "seq": 256}
QUICK = {"hidden": 32, "mlp": 128, "layers": 2, "heads": 4, "batch": 4, "seq": 32}
BYTE_VOCAB = 259  # eqtrain.data.ByteTokenizer: 256 bytes + PAD, BOS, EOS
RMS_NORM_EPS = 1e-6  # eqtrain's Llama-family default (model.norm_eps unset)


# -- eqtrain fit ---------------------------------------------------------------------
def write_config(path: Path, shape: dict[str, int], steps: int) -> Path:
    """The TOML a user would write: the model's shape, the batch and the steps."""
    path.write_text(
        f"""run_dir = "{path.parent / "runs" / "default"}"

[model]
arch = "llama"
hidden_size = {shape["hidden"]}
intermediate_size = {shape["mlp"]}
num_layers = {shape["layers"]}
num_heads = {shape["heads"]}
num_kv_heads = {shape["heads"]}
tie_embeddings = false

[data]
train = "stdlib"
tokenizer = "byte"
seq_len = {shape["seq"]}
batch_size = {shape["batch"]}

[loop]
steps = {steps}
""",
        encoding="utf-8",
    )
    return path


def resolved(config: Path, overrides: list[str]) -> dict[str, Any]:
    """The settings of `config` that decide the step and what runs between steps,
    as `eqtrain fit` resolves them (`eqtrain.job.build` allocates nothing), and the
    optimizer settings the Trainer copies."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # nothing runs here: no device
    import eqtrain.config
    import eqtrain.job
    from eqtrain.models import num_params

    cfg = eqtrain.config.load(config, overrides)
    job = eqtrain.job.build(cfg)
    m, optim = cfg.model, cfg.optim.resolved(cfg.loop.steps)
    defaults = {
        "scan_layers": m.scan_layers,
        "loss_chunk": job.loss_chunk,
        "remat": m.remat,
        "prefetch": cfg.data.prefetch,
        "eval_every": cfg.loop.eval_every,
        "eval_rows": cfg.data.eval_rows,
        "checkpoint_every": cfg.checkpoint.every,
        "async_save": cfg.checkpoint.async_save,
        "log_every": cfg.log.every,
        "progress": cfg.log.progress,
        "nonfinite": cfg.loop.nonfinite,
        "export_hf": None if cfg.export.hf is None else str(cfg.export.hf),
    }
    return {
        "defaults": defaults,
        "params": num_params(job.abstract.model),
        "optim": {
            "name": optim.name,
            "lr": optim.lr,
            "final_lr": optim.final_lr,
            "schedule": optim.schedule,
            "warmup_steps": optim.warmup_steps,
            "weight_decay": optim.weight_decay,
            "clip_norm": optim.clip_norm or 0.0,
        },
    }


def run_eqtrain(
    config: Path, run_dir: Path, overrides: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    """One `eqtrain fit` in a fresh run directory; its rate from metrics.jsonl."""
    command = [sys.executable, "-m", "eqtrain.cli", "fit", str(config)]
    command += ["--run-dir", str(run_dir)]
    for override in overrides:
        command += ["--set", override]
    seconds = _run(command, run_dir.with_suffix(".log"), args.platform)
    records = _read_jsonl(run_dir / "metrics.jsonl")
    phases = eqtrain_phases(records, seconds)
    return {**eqtrain_rate(records, args.warmup), "process_s": seconds, **phases}


def eqtrain_rate(records: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """Tokens/s between the read that covered step `warmup` and the last read.

    Records read together share a `time`, taken when the last of them had
    completed, so the start is the last record of the group holding `warmup`."""
    steps = [r for r in records if "stop_reason" not in r]  # the end line: after it
    at_warmup = next(r for r in steps if r["step"] >= warmup)
    group = [r for r in steps if r["time"] == at_warmup["time"]]
    start, end = group[-1], steps[-1]
    if end["time"] <= start["time"]:
        raise RuntimeError(
            f"eqtrain read steps {start['step']}..{end['step']} at once: no time "
            f"passed after warm-up step {warmup}. Raise --steps."
        )
    window = [r for r in steps if start["step"] < r["step"] <= end["step"]]
    tokens = end["tokens_seen"] - start["tokens_seen"]
    return {
        "tokens_per_s": tokens / (end["time"] - start["time"]),
        "data_ms": 1e3 * statistics.median(r["data_time"] for r in window),
    }


def eqtrain_phases(records: list[dict[str, Any]], seconds: float) -> dict[str, float]:
    """Where the rest of the process's wall time went: `first_step_s` (from
    `fit`'s start to the first read: compilation and step 1), `end_of_fit_s` (the
    last step's read to the end line: the final evaluation and checkpoint) and
    `outside_fit_s` (start-up before `fit`, and the export and exit after it)."""
    end = records[-1]  # the `at_end` line, with `stop_reason`
    last = [r for r in records if "stop_reason" not in r][-1]
    return {
        "first_step_s": records[0]["time"],
        "end_of_fit_s": end["time"] - last["time"],
        "outside_fit_s": seconds - end["time"],
    }


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _run(command: list[str], log: Path, platform: str) -> float:
    """Run `command` with the caller's environment (plus JAX_PLATFORMS and the
    path to the eqtrain being measured); its output goes to `log`. Wall seconds."""
    import eqtrain

    env = dict(os.environ, JAX_PLATFORMS=platform)
    root = str(Path(eqtrain.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            proc.wait()
        finally:  # interrupted (Ctrl-C, SIGTERM): leave no process training
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    if proc.returncode != 0:
        tail = log.read_text(encoding="utf-8")[-3000:]
        raise RuntimeError(f"{command[:5]} exited {proc.returncode}:\n{tail}")
    return time.perf_counter() - start


# -- transformers.Trainer -------------------------------------------------------------
def run_trainer(
    spec: dict[str, Any], workdir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """One Trainer run in its own process (this script, `--trainer SPEC`)."""
    out = workdir / "trainer.json"
    spec = {**spec, "out": str(out), "output_dir": str(workdir / "trainer")}
    command = [sys.executable, __file__, "--trainer", json.dumps(spec)]
    seconds = _run(command, workdir / "trainer.log", args.platform)
    result = json.loads(out.read_text(encoding="utf-8"))
    ends, warmup = result["step_ends"], spec["warmup"]
    tokens = (len(ends) - warmup) * spec["batch"] * spec["seq"]
    rate = tokens / (ends[-1] - ends[warmup - 1])
    return {
        "tokens_per_s": rate,
        "process_s": seconds,
        "params": result["params"],
        "optim": result["optim"],
    }


def stdlib_rows(n: int, seq: int) -> list[list[int]]:
    """`n` rows of `seq` byte tokens from the standard library's sources (the
    text eqtrain's `stdlib` corpus reads; the order does not change the cost)."""
    need, chunks = n * seq, []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        chunks.append(path.read_bytes())
        if sum(map(len, chunks)) >= need:
            break
    data = b"".join(chunks)[:need]
    return [list(data[i * seq : (i + 1) * seq]) for i in range(n)]


def trainer_worker(spec: dict[str, Any]) -> None:
    """Train with `transformers.Trainer` as `spec` says; write each step's end
    time (`time.perf_counter()`) and the parameter count to `spec["out"]`."""
    import torch
    import transformers

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    s = spec["shape"]
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=BYTE_VOCAB,
            hidden_size=s["hidden"],
            intermediate_size=s["mlp"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["heads"],
            rms_norm_eps=RMS_NORM_EPS,
            max_position_embeddings=s["seq"],
            tie_word_embeddings=False,
        )
    ).float()
    rows = stdlib_rows(spec["steps"] * s["batch"], s["seq"])
    data = [{"input_ids": r, "labels": r} for r in map(torch.tensor, rows)]
    ends: list[float] = []

    class StepTimes(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any):
            ends.append(time.perf_counter())

    trainer = transformers.Trainer(
        model=model,
        args=_training_args(spec),
        train_dataset=data,  # type: ignore[arg-type]
        callbacks=[StepTimes()],
    )
    trainer.train()
    params = sum(p.numel() for p in model.parameters())
    optim = getattr(trainer.args.optim, "value", str(trainer.args.optim))  # an enum
    result = {"step_ends": ends, "params": params, "optim": optim}
    Path(spec["out"]).write_text(json.dumps(result), encoding="utf-8")


def _training_args(spec: dict[str, Any]) -> Any:
    import transformers

    o = spec["optim"]
    return transformers.TrainingArguments(
        output_dir=spec["output_dir"],
        per_device_train_batch_size=spec["shape"]["batch"],
        max_steps=spec["steps"],
        learning_rate=o["lr"],
        lr_scheduler_type="cosine_with_min_lr",  # eqtrain's cosine to final_lr
        lr_scheduler_kwargs={"min_lr_rate": o["final_lr"] / o["lr"]},
        warmup_steps=o["warmup_steps"],
        weight_decay=o["weight_decay"],
        max_grad_norm=o["clip_norm"],
        use_cpu=spec["use_cpu"],
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )


# -- the benchmark -------------------------------------------------------------------
def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    shape = QUICK if args.quick else SHAPE
    load = os.getloadavg()  # the machine may be shared: say how busy it was
    with tempfile.TemporaryDirectory(prefix="eqtrain-cli-bench-") as tmp:
        workdir = Path(tmp)
        config = write_config(workdir / "bench.toml", shape, args.steps)
        settings = resolved(config, args.set)
        spec = {
            "shape": shape,
            "steps": args.steps,
            "warmup": args.warmup,
            "batch": shape["batch"],
            "seq": shape["seq"],
            "threads": args.threads,
            "use_cpu": args.platform == "cpu",
            "optim": settings["optim"],
        }
        runs: dict[str, list[dict[str, Any]]] = {"eqtrain": [], "trainer": []}
        for r in range(args.rounds):
            order = ["eqtrain", "trainer"] if r % 2 == 0 else ["trainer", "eqtrain"]
            for name in order:
                if name == "eqtrain":
                    run_dir = workdir / "runs" / f"round{r}"
                    runs[name].append(run_eqtrain(config, run_dir, args.set, args))
                else:
                    runs[name].append(run_trainer(spec, workdir, args))
            shown = {k: round(v[-1]["tokens_per_s"]) for k, v in runs.items()}
            print(f"round {r}: tokens/s {shown}", file=sys.stderr, flush=True)
    record = _record(args, shape, settings, runs)
    record["loadavg"] = {"start": _rounded(load), "end": _rounded(os.getloadavg())}
    return record


def _rounded(load: tuple[float, ...]) -> list[float]:
    return [round(x, 2) for x in load]


def _record(
    args: argparse.Namespace,
    shape: dict[str, int],
    settings: dict[str, Any],
    runs: dict[str, list[dict[str, Any]]],
) -> dict[str, Any]:
    rates = {k: [r["tokens_per_s"] for r in v] for k, v in runs.items()}
    paired = [e / t for e, t in zip(rates["eqtrain"], rates["trainer"], strict=True)]
    if runs["trainer"][0]["params"] != settings["params"]:
        print(
            f"warning: eqtrain has {settings['params']} parameters, the Trainer's "
            f"model {runs['trainer'][0]['params']}",
            file=sys.stderr,
        )
    median = statistics.median
    return {
        "steps": args.steps,
        "warmup": args.warmup,
        "batch": shape["batch"],
        "seq": shape["seq"],
        "threads": args.threads,
        "cpus": len(os.sched_getaffinity(0)),
        "params": settings["params"],
        "eqtrain_set": args.set,
        "eqtrain_tokens_per_s": round(median(rates["eqtrain"]), 1),
        "trainer_tokens_per_s": round(median(rates["trainer"]), 1),
        "ratio": round(median(paired), 4),
        "ratio_range": [round(min(paired), 4), round(max(paired), 4)],
        "rounds_eqtrain": [round(x, 1) for x in rates["eqtrain"]],
        "rounds_trainer": [round(x, 1) for x in rates["trainer"]],
        "process_s": {
            k: round(median(r["process_s"] for r in v), 1) for k, v in runs.items()
        },
        "eqtrain_data_ms": round(median(r["data_ms"] for r in runs["eqtrain"]), 3),
        "eqtrain_phases_s": {
            key: round(median(r[key] for r in runs["eqtrain"]), 1)
            for key in ("first_step_s", "end_of_fit_s", "outside_fit_s")
        },
        "eqtrain_defaults": settings["defaults"],
        "trainer_optim": runs["trainer"][0]["optim"],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="steps per run")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps")
    parser.add_argument("--rounds", type=int, default=None, help="runs of each")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for eqtrain fit (repeatable)",
    )
    parser.add_argument("--platform", default="cpu", help="JAX_PLATFORMS for eqtrain")
    parser.add_argument("--quick", action="store_true", help="tiny smoke test")
    parser.add_argument("--trainer", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (30 if args.quick else 60)
    args.warmup = args.warmup or (5 if args.quick else 10)
    args.rounds = args.rounds or (1 if args.quick else 3)
    if not 1 <= args.warmup < args.steps:
        parser.error(f"need 1 <= --warmup < --steps; got {args.warmup}, {args.steps}")
    return args


def main(argv: list[str] | None = None) -> None:
    print_machine()  # the processor and settings: figures are per machine
    args = parse_args(argv)
    # SIGTERM as an exception: the subprocesses and the temporary directory go too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.trainer is not None:  # the Trainer's own process
        return trainer_worker(json.loads(args.trainer))
    print(json.dumps(benchmark(args)), flush=True)


if __name__ == "__main__":
    main()
