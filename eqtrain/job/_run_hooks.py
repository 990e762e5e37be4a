"""The hooks of a run: progress, the metrics writers (JSONL, TensorBoard,
wandb), a mixture's per-source token counts, the Hugging Face exports and the
`[log] samples` writer."""

import sys
from pathlib import Path
from typing import Any

import jax

from .. import data as data_lib, hf, hooks as hooks_lib
from .._hooks import at_end, every
from ..config import Config, explicit, steps_export_dir, to_dict
from ..cpu import generation_options
from ..generate import Sampling
from . import _build, _data, _grpo, _samples


def run_hooks(
    job: _build.Job,
    samples: _samples.Prompts | None,
    mesh: Any,
    *,
    targets: dict[str, Path],
    start: int = 0,
    rows: Any = None,
) -> list[Any]:
    """Every hook of the run: process 0's progress, logs and exports to
    `targets` (`eqtrain.config.export_targets`; none: no export), the logs
    starting at step `start`, the resumed one (the redone steps' earlier lines
    and events are replaced); and every process's samples writer."""
    out: list[Any] = []
    if job.grpo is not None:  # a reward's failure ends the run, unlogged
        out.append(every(1, _grpo.RewardCheck(job)))
    if jax.process_index() == 0:  # process 0 logs and exports for the run
        out += _logging_hooks(job.config, start, rows)
        out += _export_hooks(job, targets)
    return out + samples_hooks(job, samples, mesh, start=start)


def _progress_hooks(config: Config) -> list[Any]:
    """`bar`: a live bar; `lines`: a line every `log.every` steps; `auto`: the bar
    on a terminal, else a line about every 5% of the run (and at evaluations;
    every `log.every` steps when that key is set), so that a log file stays
    short."""
    mode = config.log.progress
    if mode == "none":
        return []
    if mode == "lines":
        return [every(config.log.every, hooks_lib.ConsoleLogger(stream=sys.stderr))]
    if mode == "auto" and not sys.stderr.isatty():
        period = config.log.every if "log.every" in explicit(config) else None
        return [hooks_lib.ProgressBar(plain_every=period, force_terminal=False)]
    return [hooks_lib.ProgressBar(force_terminal=True)]


def _logging_hooks(config: Config, start: int, rows: Any) -> list[Any]:
    """Progress, then per-source tokens (before the writers), then the writers."""
    log = config.log
    out = _progress_hooks(config)
    if _data.mixture_of(rows) is not None:
        out.append(every(log.every, _data.SourceTokens(rows, config.data.batch_size)))
    evals = config.loop.eval_every
    for writer in _writers(config, start):
        out += [every(log.every, writer), at_end(writer)]
        if evals and evals % log.every:  # evaluations between logged steps
            out.append(every(evals, _Unlogged(writer, log.every)))
    return out


class _Unlogged:
    """`writer` at the steps a period of `every` misses (an evaluation's results
    would otherwise never reach it); closing is left to its own schedule."""

    uses_state = False

    def __init__(self, writer: Any, every: int):
        self.writer, self.every = writer, every

    def __call__(self, info: Any) -> None:
        if info.step % self.every:
            self.writer(info)

    def close(self) -> None:
        pass


def _writers(config: Config, start: int) -> list[Any]:
    """metrics.jsonl, and TensorBoard and wandb where `[log]` asks for them."""
    log, run_dir = config.log, Path(config.run_dir)
    writers: list[Any] = [hooks_lib.JsonlWriter(run_dir / "metrics.jsonl", start=start)]
    if log.tensorboard:
        writers.append(hooks_lib.TensorBoardWriter(run_dir / "tb", start=start))
    if log.wandb_project is not None:
        writers.append(
            hooks_lib.WandbLogger(
                project=log.wandb_project,
                name=log.wandb_name,
                mode=log.wandb_mode,
                dir=str(run_dir),
                config=to_dict(config),
            )
        )
    return writers


def _export_hooks(job: _build.Job, targets: dict[str, Path]) -> list[Any]:
    """The final export to each of `targets` (by form), and with `export.every`
    the per-step exports beside it (the final one replaces its target whole)."""
    export = job.config.export
    if not targets:
        return []
    kwargs, out = _export_kwargs(job), []
    for form, target in targets.items():
        if export.every:
            steps = steps_export_dir(target)
            hook = hf.export_hook(steps, form=form, **kwargs)
            out.append(every(export.every, hook))
        out.append(at_end(hf.export_hook(target, per_step=False, form=form, **kwargs)))
    return out


def _export_kwargs(job: _build.Job) -> dict[str, Any]:
    """What every export of the run writes besides the weights."""
    export = job.config.export
    kwargs: dict[str, Any] = dict(
        dtype=export.dtype,
        max_shard_size=export.max_shard_size,
        tokenizer=job.tokenizer,
        model_type=job.model_type,
        which="ema" if export.ema else "model",
        pick=job.exported,  # the policy, at its real vocabulary
    )
    templates = exported_templates(job)
    if templates is not None:  # a Jinja chat template, and its named others
        kwargs["chat_template"] = templates
    if job.lora is not None:
        kwargs["spec"] = job.lora
        kwargs["base_model_name_or_path"] = adapter_base(job)
    return kwargs


def adapter_base(job: _build.Job) -> str | None:
    """What a LoRA run's adapter export names as its base
    (`base_model_name_or_path`): `model.init_from` as an absolute path, so that
    `peft.AutoPeftModelForCausalLM.from_pretrained(adapter)` and `eqtrain
    generate ADAPTER` find it from any directory; None without one."""
    init_from = job.config.model.init_from
    return str(Path(init_from).resolve()) if init_from else None


def exported_templates(job: _build.Job) -> dict[str, str] | None:
    """The Jinja chat templates, by name, a run's Hugging Face export writes
    beside its tokenizer: the run's own (`job.template`), or for a run on plain
    text, which has none, those `data.chat_template` names (`auto`: its tokenizer
    directory's), so that a model keeps its templates (`tool_use` and any other
    named one with its default); None for the built-in."""
    template, name = job.template, job.config.data.chat_template
    if template is None and name != "builtin":
        where = name if name != "auto" else getattr(job.tokenizer, "directory", None)
        template = data_lib.chat_template(where)  # None: the built-in one
    return getattr(template, "templates", None)


def samples_hooks(
    job: _build.Job, found: _samples.Prompts | None, mesh: Any, start: int
) -> list[Any]:
    """The run's `SamplesWriter` of the prompts `found` (`prompts_of`), every
    `log.samples_every` steps and at the end (none without `log.samples`)."""
    if found is None:
        return []
    hook = _writer(job, found, mesh, start)
    return [every(job.config.log.samples_every, hook), at_end(hook)]


def _writer(
    job: _build.Job, found: _samples.Prompts, mesh: Any, start: int
) -> hooks_lib.SamplesWriter:
    log, run_dir = job.config.log, Path(job.config.run_dir)
    return hooks_lib.SamplesWriter(
        found.prompts,
        found.tokens,
        decode=job.tokenizer.decode,
        path=run_dir / "samples.jsonl",
        max_new_tokens=log.samples_max_new_tokens,
        stop_ids=found.stop_ids,
        sampling=Sampling(temperature=log.samples_temperature),
        seed=job.config.seed,
        pick=job.policy,
        vocab_size=job.vocab_size,
        mesh=mesh,
        multiple=found.multiple,
        tensorboard=run_dir / "tb" if log.tensorboard else None,
        start=start,
        write=jax.process_index() == 0,
        compiler_options=generation_options(),
    )
