"""`eqtrain fit --dry-run`: what a run would do — mesh, parameters, training FLOPs
per token, a per-leaf sharding table and the per-device memory of its compiled
training step — without training or writing."""

import math
from typing import Any

import equinox as eqx
import jax

from .. import lora, models, quantize, sharding
from .._state import TrainState
from ..config import Config
from ..cpu import cpu_settings as describe_cpu
from . import _build, _distill, _memory, _plan, _rows, _samples


def _bytes(tree: Any) -> int:
    leaves = jax.tree.leaves(tree)
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves if _shaped(x))


def _shaped(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _lora_lines(job: _build.Job, abstract: Any) -> list[str]:
    """LoRA: the adapters, trainable vs frozen counts, optimizer state saved."""
    if job.lora is None:
        return []
    spec = job.lora
    total = models.num_params(abstract.model)
    trained = models.num_params(abstract.params)
    layers = len(lora.adapter_paths(abstract.model))
    return [
        f"lora         rank {spec.rank}, scale {spec.scale:g}"
        f"{' (rsLoRA)' if spec.rslora else ''}, dropout {spec.dropout:g}, on "
        f"{layers} linear layer groups (targets {spec.targets!r})",
        f"trainable    {trained:,} of {total:,} parameters "
        f"({100 * trained / total:.2f}%); frozen {total - trained:,}",
        _opt_state_line(job, abstract),
        *_quantize_lines(job, abstract),
    ]


def _quantize_lines(job: _build.Job, abstract: Any) -> list[str]:
    """QLoRA: what the frozen base's quantized weights take, against the same
    weights in the base's dtype."""
    if job.quantize is None:
        return []
    q = job.quantize
    size, count = quantize.quantized_bytes(abstract.model)
    weights = len(quantize.quantized_paths(abstract.model))
    itemsize = jax.numpy.dtype(job.config.model.param_dtype).itemsize
    fmt = sharding.format_bytes
    double = " (double quantization)" if q.double and q.kind != "int8" else ""
    return [
        f"quantize     {q.kind}{double}: {weights} weights, {count:,} parameters in "
        f"{fmt(size)} ({8 * size / max(count, 1):.2f} bits each; "
        f"{job.config.model.param_dtype}: {fmt(count * itemsize)})"
    ]


def _opt_state_line(job: _build.Job, abstract: Any) -> str:
    """The adapters' optimizer state against full fine-tuning's."""
    full = eqx.filter_eval_shape(
        lambda m: TrainState.create(m, job.optimizer, key=0), abstract.model
    )
    ours, theirs = _bytes(abstract.opt_state), _bytes(full.opt_state)
    fmt = sharding.format_bytes
    return (
        f"opt. state   {fmt(ours)} (full fine-tuning: {fmt(theirs)}; saved "
        f"{fmt(theirs - ours)})"
    )


def _unit(rows: Any) -> str:
    pairs = rows is not None and "chosen_tokens" in _rows.first_rows(rows, 1)
    return "pairs" if pairs else "rows"


def _task_lines(job: _build.Job) -> list[str]:
    """The task line (post-training runs only) and what the data skipped."""
    task = job.config.task
    if task.kind == "lm":
        return []
    line = f"task         {task.kind}"
    if task.kind == "grpo":
        line += _grpo_summary(task)
    if job.teacher is not None:
        line += _distill_summary(job)
    if job.reference is not None:
        line += f", reference {job.reference}"
    if job.template is not None:
        line += f"; chat template {type(job.template).__name__}"
    return [line, *(f"skipped      {note}" for note in job.notes)]


def _grpo_summary(t: Any) -> str:
    """What a GRPO step samples and how it learns from it."""
    return (
        f": {t.group_size} completions of up to {t.max_completion_len} tokens "
        f"per prompt, temperature {t.temperature:g}, rewards {t.rewards}, "
        f"loss {t.loss_type}, {t.passes} pass(es)"
    )


def _distill_summary(job: _build.Job) -> str:
    """The teacher (its parameters and bytes: frozen, on the student's mesh,
    not in the optimizer state nor the checkpoints) and the on-policy share."""
    t, teacher = job.config.task, job.abstract.model.teacher
    sampled = f"{t.lmbda:g} of the steps sampled from the student"
    if t.seq_kd:
        sampled += ", the others from the teacher"
    return (
        f": teacher {job.teacher.model_type} ({job.teacher.directory}), "
        f"{models.num_params(teacher):,} parameters, "
        f"{sharding.format_bytes(_bytes(teacher))} frozen; beta "
        f"{_distill.beta(job.config):g}; {sampled} (up to "
        f"{t.max_completion_len} tokens, temperature {t.temperature:g})"
    )


def _samples_lines(job: _build.Job, found: _samples.Prompts | None) -> list[str]:
    """`[log] samples`: the hook that generates during training."""
    if found is None:
        return []
    log = job.config.log
    t = log.samples_temperature
    how = "greedy" if t == 0 else f"temperature {t:g}"
    return [
        f"samples      {len(found.prompts)} prompts ({log.samples}) every "
        f"{log.samples_every} steps and at the end, up to "
        f"{log.samples_max_new_tokens} new tokens, {how} -> samples.jsonl"
    ]


def _sequence_lines(config: Config, ways: int) -> list[str]:
    m = config.model
    if ways == 1 and m.sequence_parallel is None:
        return []
    scheme = m.sequence_parallel or "none"
    return [
        f"sequence     axis of {ways} devices x {config.data.seq_len // ways} tokens "
        f"per device (of {config.data.seq_len}); attention {scheme}, layout "
        f"{m.sequence_layout}"
    ]


def report(config: Config) -> str:
    """The dry-run report of `config` (nothing is trained, allocated or written)."""
    planned = _plan.plan(config)
    job, placement = planned.job, planned.placement
    abstract = job.abstract
    table = sharding.describe(abstract, placement.state_shardings)
    batch = _memory.abstract_batch(job, planned.rows)
    memory = _memory.step_memory(job, placement, batch)
    lines = [
        *_run_lines(planned, abstract),
        "",
        sharding.format_table(table),
        "",
        *_memory_section(memory, abstract, table),
    ]
    return "\n".join(lines)


def _steps_line(config: Config) -> str:
    """Steps, batch, accumulation, optimizer and schedule."""
    optim = config.optim
    return (
        f"steps        {config.loop.steps} x batch {config.data.batch_size} "
        f"(accumulate {optim.accumulate}); optimizer {optim.name}, "
        f"lr {optim.lr:g} {optim.schedule}"
    )


def _devices_line(mesh: Any) -> str:
    """The devices and the mesh's axes."""
    axes = ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    platform = mesh.devices.flat[0].platform
    return f"devices      {mesh.devices.size} x {platform}; mesh {axes}"


def _cpu_lines(mesh: Any) -> list[str]:
    """On the CPU, the XLA settings `eqtrain.cpu.tune_cpu` chose for it."""
    if mesh.devices.flat[0].platform != "cpu":
        return []
    return [f"cpu          {describe_cpu()}"]


def _run_lines(planned: _plan.Plan, abstract: Any) -> list[str]:
    """The report's head: run directory, model, task, data, steps, compute,
    devices and memory options."""
    job, mesh = planned.job, planned.placement.mesh
    config = job.config
    num = models.num_params(abstract.model)
    return [
        f"run_dir      {config.run_dir} (nothing written: dry run)",
        f"model        {job.model_type}, {num:,} parameters "
        f"({config.model.param_dtype}){_experts(abstract.model)}",
        *_lora_lines(job, abstract),
        *_task_lines(job),
        *_samples_lines(job, planned.samples),
        _data_line(job, planned.rows, planned.eval_rows),
        _steps_line(config),
        f"compute      {job.flops_per_token:,.0f} training FLOPs per token "
        f"(forward + backward, data.seq_len {config.data.seq_len})",
        _devices_line(mesh),
        *_cpu_lines(mesh),
        *_sequence_lines(config, mesh.shape["sequence"]),
        _options_line(job),
    ]


def _data_line(job: _build.Job, rows: Any, eval_rows: Any) -> str:
    evals = 0 if eval_rows is None else _rows.num_rows(eval_rows)
    return (
        f"data         {_rows.num_rows(rows):,} train {_unit(rows)} x "
        f"{job.config.data.seq_len} tokens; {evals:,} eval {_unit(eval_rows)}; "
        f"tokenizer {type(job.tokenizer).__name__} ({job.tokenizer.vocab_size} ids)"
    )


def _memory_section(
    memory: _memory.StepMemory, abstract: Any, table: list[Any]
) -> list[str]:
    """`memory_lines` with the state's bytes per device from the sharding table."""
    params = [t for t in table if t.path.startswith("model.")]
    p_bytes = sum(t.bytes_per_device for t in params)
    o_bytes = sum(t.bytes_per_device for t in table if t.path.startswith("opt_state."))
    rest = sum(t.bytes_per_device for t in table) - p_bytes - o_bytes
    grads = _grad_bytes(abstract, params)
    return memory_lines(memory, p_bytes, o_bytes, rest, grads)


def _options_line(job: _build.Job) -> str:
    """The memory options in effect: loss chunking, tiled MLP, remat."""
    m = job.config.model
    loss = f"chunked, {job.loss_chunk} tokens" if job.loss_chunk else "full logits"
    if m.loss_chunk == "auto":
        loss += " (auto)"
    chunks = models.runtime_options(m)["mlp_chunks"]
    mlp = "untiled" if chunks == 1 else f"tiled in {chunks} pieces"
    remat = m.remat
    if remat == "custom":
        remat += f" (save {m.remat_save or '-'}; offload {m.remat_offload or '-'})"
    return f"memory opts  loss {loss}; MLP {mlp}; remat {remat}"


def _experts(model: Any) -> str:
    """`; E experts, top-k: N active per token` for a mixture-of-experts model."""
    c = getattr(model, "config", None)
    if not getattr(c, "num_experts", 0):
        return ""
    active = models.active_params(model)
    return (
        f"; {c.num_experts} experts, top-{c.num_experts_per_tok}: {active:,} "
        "active per token"
    )


def _grad_bytes(abstract: Any, params: list[Any]) -> int:
    """Per-device bytes of the gradients: one per trainable parameter, sharded
    like it (the share of the parameters' bytes that train)."""
    trained = models.num_params(abstract.params)
    total = models.num_params(abstract.model)
    p_bytes = sum(t.bytes_per_device for t in params)
    return int(p_bytes * trained / total) if total else 0


def memory_lines(
    memory: _memory.StepMemory, params: int, opt: int, rest: int, grads: int
) -> list[str]:
    """The dry run's memory section: the state's bytes from the sharding table,
    the step's from XLA's analysis of the compiled step."""
    fmt = sharding.format_bytes
    batch = max(0, memory.arguments - params - opt - rest)
    acts = max(0, memory.temp - grads)
    lines = [
        "memory per device (the compiled training step: XLA's memory analysis)",
        f"  parameters        {fmt(params)}",
        f"  optimizer state   {fmt(opt)}",
        f"  other state       {fmt(rest)}",
        f"  batch             {fmt(batch)}",
        f"  gradients         {fmt(grads)}  (one per trainable parameter)",
        f"  activations       {fmt(acts)}  (kept for the backward pass, and "
        "workspace; one micro-batch)",
        f"  peak              {fmt(memory.peak)}",
    ]
    if memory.host_temp:
        lines.append(f"  host memory       {fmt(memory.host_temp)}  (offloaded)")
    return lines


def budget_report(config: Config, budget: int, label: str | None = None) -> str:
    """`--memory-budget`: the longest `data.seq_len` whose step fits `budget`
    bytes per device, found by compiling a few lengths."""
    planned = _plan.plan(config)
    fmt = sharding.format_bytes
    lines = [
        f"longest data.seq_len within {fmt(budget)} per device (compiled, not run):"
    ]
    fit = _memory.longest_seq_len(
        planned.job.config, budget, planned.rows, say=lines.append
    )
    lines.append(_verdict(fit))
    return "\n".join(lines)


def _verdict(fit: _memory.Fit) -> str:
    """The search's last line: the length found, or what to change."""
    fmt = sharding.format_bytes
    if fit.seq_len is None:
        shortest = min(n for n, _ in fit.tried)
        return (
            f"none: even seq_len {shortest} needs "
            f"{fmt(dict(fit.tried)[shortest])} per device. Lower data.batch_size, "
            "raise optim.accumulate, turn on model.remat / mlp_chunks / loss_chunk, "
            "or shard with mesh.fsdp."
        )
    assert fit.peak is not None
    note = f" (stopped at {fit.limit})" if fit.limit else ""
    return f"-> data.seq_len = {fit.seq_len} ({fmt(fit.peak)} per device){note}"
