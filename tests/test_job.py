"""`eqtrain.job`: every config key has a consumer (a table: set the key, see the
effect on the assembled run), and the job's commands work in-process."""

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqtrain
from eqtrain import config as config_lib, job
from eqtrain.config import schema
from eqtrain.config._validate import _GRPO_KEYS as GRPO_KEYS


TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 60


@pytest.fixture(scope="module")
def text_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    (root / "train").mkdir()
    (root / "eval").mkdir()
    for i in range(3):
        (root / "train" / f"{i}.txt").write_text(TEXT * (i + 1))
    (root / "eval" / "0.txt").write_text(TEXT[::-1])
    (root / "train" / "skip.md").write_text("not read by the default pattern")
    return root


def tiny(text_dirs, tmp_path, *extra):
    return [
        f"run_dir={tmp_path / 'run'}",
        f"data.train={text_dirs / 'train'}",
        f"data.eval={text_dirs / 'eval'}",
        "model.hidden_size=32",
        "model.num_layers=1",
        "data.seq_len=16",
        "data.batch_size=8",
        "data.eval_rows=16",
        "loop.steps=4",
        "loop.eval_every=2",
        "checkpoint.every=2",
        "log.progress=none",
        "optim.warmup_steps=1",
        *extra,
    ]


def prepared(text_dirs, tmp_path, *extra):
    config = config_lib.load(overrides=tiny(text_dirs, tmp_path, *extra))
    p = job.prepare(config)
    p.close()
    p.fit_kwargs["checkpointer"].close()
    return p


def _hooks(p, cls):
    return [h.hook for h in p.fit_kwargs["hooks"] if isinstance(h.hook, cls)]


def _opt_kwargs(monkeypatch):
    seen = {}
    real = eqtrain.optim.build

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(eqtrain.optim, "build", spy)
    return seen


# -- one entry per key: (override, check(prepared)) -------------------------------
def step_jaxpr(p, batch=None):
    """The jaxpr of the run's own training step (`p.step`) on one of its batches."""
    batch = p.loader.peek() if batch is None else batch
    return eqx.filter_make_jaxpr(p.step.fn)(p.state, batch)[0].jaxpr


def equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs inside it (scan, cond, pjit...)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's own
                if hasattr(sub, "eqns"):
                    yield from equations(sub)


def micro_batches(p):
    """`(count, rows, seq_len)` of every `scan` in the step that runs over the
    token rows: the gradient accumulation's loop over its micro-batches."""
    out = set()
    for eqn in equations(step_jaxpr(p)):
        if eqn.primitive.name == "scan":
            for v in eqn.invars:
                shape = v.aval.shape
                if v.aval.dtype == jnp.int32 and len(shape) == 3:
                    out.add(shape)
    return out


def product_dtypes(p):
    """The input dtypes of every matrix product in the step, but the one that
    keeps the f32 rotary tables (`_rope.stored_once`, on the CPU)."""
    from eqtrain.models._rope import STORED_ONCE

    return {
        tuple(str(v.aval.dtype) for v in eqn.invars)
        for eqn in equations(step_jaxpr(p))
        if eqn.primitive.name == "dot_general"
        and STORED_ONCE not in str(eqn.source_info.name_stack)
    }


def mc(p):
    return p.job.model_config


def first_leaf(p, name):
    return getattr(p.state.model, name)


CONSUMERS = {
    "model.arch": ("model.arch=gpt2", lambda p: type(p.state.model).__name__ == "GPT2"),
    "model.vocab_size": ("model.vocab_size=300", lambda p: mc(p).vocab_size == 300),
    "model.hidden_size": (
        "model.hidden_size=64",
        lambda p: p.state.model.embed_tokens.weight.shape[1] == 64,
    ),
    "model.intermediate_size": (
        "model.intermediate_size=48",
        lambda p: p.state.model.layers.mlp.up_proj.weight.shape[1] == 48,
    ),
    "model.num_layers": (
        "model.num_layers=3",
        lambda p: p.state.model.layers.mlp.up_proj.weight.shape[0] == 3,
    ),
    "model.num_heads": ("model.num_heads=2", lambda p: mc(p).num_attention_heads == 2),
    "model.num_kv_heads": (
        "model.num_kv_heads=1",
        lambda p: p.state.model.layers.self_attn.k_proj.weight.shape[1] == 8,
    ),
    "model.head_dim": (
        "model.head_dim=16",
        lambda p: p.state.model.layers.self_attn.q_proj.weight.shape[1] == 64,
    ),
    "model.max_seq_len": (
        "model.max_seq_len=64",
        lambda p: mc(p).max_position_embeddings == 64,
    ),
    "model.rope_theta": ("model.rope_theta=5e5", lambda p: mc(p).rope_theta == 5e5),
    "model.norm_eps": ("model.norm_eps=1e-3", lambda p: mc(p).rms_norm_eps == 1e-3),
    "model.tie_embeddings": (
        "model.tie_embeddings=false",
        lambda p: p.state.model.lm_head is not None,
    ),
    "model.attention_bias": (
        "model.attention_bias=true",
        lambda p: p.state.model.layers.self_attn.q_proj.bias is not None,
    ),
    "model.mlp_bias": (
        "model.mlp_bias=true",
        lambda p: p.state.model.layers.mlp.up_proj.bias is not None,
    ),
    "model.sliding_window": (
        "model.sliding_window=8",
        lambda p: mc(p).sliding_window == 8 and p.job.model_type == "mistral",
    ),
    "model.init_std": (
        "model.init_std=0.5",
        lambda p: 0.3 < float(jnp.std(p.state.model.embed_tokens.weight)) < 0.7,
    ),
    "model.param_dtype": (
        "model.param_dtype=bfloat16",
        lambda p: p.state.model.embed_tokens.weight.dtype == jnp.bfloat16,
    ),
    "model.remat": ("model.remat=full", lambda p: mc(p).remat == "full"),
    "model.scan_layers": ("model.scan_layers=false", lambda p: not mc(p).scan_layers),
    "data.seq_len": (
        "data.seq_len=8",
        lambda p: next(iter(p.loader))["tokens"].shape == (8, 8),
    ),
    "data.batch_size": ("data.batch_size=16", lambda p: p.loader.batch_size == 16),
    "data.eval_rows": (
        "data.eval_rows=8",
        lambda p: p.fit_kwargs["evaluation"].data.num_batches == 1,
    ),
    "data.shuffle": ("data.shuffle=false", lambda p: p.loader.shuffle is False),
    "data.prefetch": ("data.prefetch=0", lambda p: p.loader.prefetch == 0),
    "seed": (
        "seed=3",
        lambda p: (
            p.loader.seed == 3
            and np.array_equal(
                jax.random.key_data(p.state.key), jax.random.key_data(jax.random.key(3))
            )
        ),
    ),
    "optim.accumulate": (  # the step scans 2 micro-batches of 8 rows of 16
        "optim.accumulate=2",  # (weighting: test_accumulate_weighs_tokens)
        lambda p: micro_batches(p) == {(2, 8, 16)},
    ),
    "loop.steps": ("loop.steps=7", lambda p: p.fit_kwargs["num_steps"] == 7),
    "loop.eval_every": (
        "loop.eval_every=3",
        lambda p: p.fit_kwargs["evaluation"].every == 3,
    ),
    "loop.eval_at_end": (
        "loop.eval_at_end=false",
        lambda p: p.fit_kwargs["evaluation"].at_end is False,
    ),
    "loop.time_limit": (
        "loop.time_limit=1h",
        lambda p: p.fit_kwargs["stop"].time_limit == 3600.0,
    ),
    "loop.kill_switch": (
        "loop.kill_switch=HALT",
        lambda p: p.fit_kwargs["stop"].kill_switch.name == "HALT",
    ),
    "checkpoint.every": (
        "checkpoint.every=3",
        lambda p: p.fit_kwargs["checkpointer"].policy.every_steps == 3,
    ),
    "checkpoint.every_minutes": (
        "checkpoint.every_minutes=5",
        lambda p: p.fit_kwargs["checkpointer"].policy.every_minutes == 5,
    ),
    "checkpoint.keep_last": (
        "checkpoint.keep_last=7",
        lambda p: p.fit_kwargs["checkpointer"].policy.keep_last == 7,
    ),
    "checkpoint.keep_every": (
        "checkpoint.keep_every=4",
        lambda p: p.fit_kwargs["checkpointer"].policy.keep_every == 4,
    ),
    "checkpoint.best": (
        "checkpoint.best=eval/loss",
        lambda p: p.fit_kwargs["checkpointer"].policy.best == "eval/loss",
    ),
    "checkpoint.best_mode": (
        "checkpoint.best_mode=max",
        lambda p: p.fit_kwargs["checkpointer"].policy.best_mode == "max",
    ),
    "checkpoint.async_save": (
        "checkpoint.async_save=false",
        lambda p: p.fit_kwargs["checkpointer"].async_save is False,
    ),
    "mesh.data": ("mesh.data=2", lambda p: p.placement.mesh.shape["data"] == 2),
    "mesh.fsdp": ("mesh.fsdp=4", lambda p: p.placement.mesh.shape["fsdp"] == 4),
    "mesh.tensor": ("mesh.tensor=2", lambda p: p.placement.mesh.shape["tensor"] == 2),
    "log.every": (
        "log.every=5",
        lambda p: any(
            h.n == 5 and isinstance(h.hook, eqtrain.hooks.JsonlWriter)
            for h in p.fit_kwargs["hooks"]
        ),
    ),
    "log.progress": (
        "log.progress=lines",
        lambda p: _hooks(p, eqtrain.hooks.ConsoleLogger),
    ),
    "log.tensorboard": (
        "log.tensorboard=true",
        lambda p: _hooks(p, eqtrain.hooks.TensorBoardWriter),
    ),
    "log.peak_flops": (
        "log.peak_flops=1e12",
        lambda p: p.fit_kwargs["peak_flops"] == 1e12 * jax.device_count(),
    ),
    "export.hf": (
        "export.hf=out",
        lambda p: any(
            str(h.out_dir).endswith("out") for h in _hooks(p, eqtrain.hf.export_hook)
        ),
    ),
    "export.dtype": (
        "export.dtype=bfloat16",
        lambda p: (
            _hooks(p, eqtrain.hf.export_hook)[0].export_kwargs["dtype"] == "bfloat16"
        ),
    ),
    "export.every": (
        "export.every=2",
        lambda p: any(h.per_step for h in _hooks(p, eqtrain.hf.export_hook)),
    ),
    "export.max_shard_size": (
        "export.max_shard_size=1MB",
        lambda p: (
            _hooks(p, eqtrain.hf.export_hook)[0].export_kwargs["max_shard_size"]
            == "1MB"
        ),
    ),
}


@pytest.mark.parametrize("key", sorted(CONSUMERS))
def test_each_key_takes_effect(key, text_dirs, tmp_path):
    override, check = CONSUMERS[key]
    extra = [override]
    if key == "checkpoint.best":
        extra.append("checkpoint.every=2")
    if key == "model.head_dim":
        extra.append("model.num_heads=4")
    if key == "mesh.data":
        extra.append("mesh.fsdp=-1")
    if key == "optim.accumulate":  # micro-batches of 8 over 8 devices
        extra.append("data.batch_size=16")
    p = prepared(text_dirs, tmp_path, *extra)
    assert check(p), f"{override} had no visible effect"


# Keys whose consumers are shown by dedicated tests below (or in test_cli.py).
ELSEWHERE = {
    "run_dir": "test_run_writes_where_told",
    "model.init_from": "test_init_from_hf_round_trip (test_cli.py: import)",
    "data.train": "test_data_sources",
    "data.eval": "test_data_sources",
    "data.text_column": "test_data_sources",
    "data.pattern": "test_data_sources",
    "data.sources": "test_data_store.py: test_fit_on_a_mixture_logs_each_source_...",
    "data.cache": "test_data_store.py: test_data_prepare_uses_data_workers_and_...",
    "data.workers": "test_data_store.py: test_data_prepare_uses_data_workers_and_...",
    "data.tokenizer": "test_tokenizer_file_and_mismatch",
    "optim.*": "test_optim_section_reaches_the_builder",
    "loop.precision": "test_loop_step_options",
    "loop.nonfinite": "test_loop_step_options",
    "loop.ema": "test_loop_step_options",
    "checkpoint.resume": "test_resume_never_and_path",
    "log.wandb_project": "test_wandb_hook",
    "log.wandb_mode": "test_wandb_hook",
    "log.wandb_name": "test_wandb_hook",
    "export.ema": "test_loop_step_options",
    "mesh.sequence": "test_sequence.py: test_sequence_keys_reach_the_run",
    "model.sequence_parallel": "test_sequence.py: test_sequence_keys_reach_the_run",
    "model.sequence_layout": "test_sequence.py: test_sequence_keys_reach_the_run",
    "model.adapter_from": "test_lora_job.py: test_adapter_from_continues_a_peft...",
    "model.quantize": "test_quant.py: test_quantize_keys_reach_the_run",
    "task.prompt_buckets": "test_prompt_buckets.py: test_prompt_buckets_reach_the_run",
    "model.quantize_skip": "test_quant.py: test_quantize_keys_reach_the_run",
    "model.quantize_double": "test_quant.py: test_quantize_keys_reach_the_run",
    **{
        f"model.{name}": "test_moe.py: test_moe_keys_reach_the_run"
        for name in (
            "num_experts",
            "experts_per_token",
            "expert_size",
            "shared_expert_size",
            "norm_topk_prob",
            "router_aux_loss_coef",
            "router_z_loss_coef",
            "capacity_factor",
            "moe_impl",
        )
    },
    "mesh.expert": "test_moe.py: test_moe_keys_reach_the_run",
    "lora.rank": "test_lora_job.py: test_lora_keys_reach_the_run",
    "lora.alpha": "test_lora_job.py: test_lora_keys_reach_the_run",
    "lora.dropout": "test_lora_job.py: test_lora_keys_reach_the_run",
    "lora.targets": "test_lora_job.py: test_lora_keys_reach_the_run",
    "lora.rslora": "test_lora_job.py: test_lora_keys_reach_the_run",
    "lora.train_also": "test_lora_job.py: test_lora_keys_reach_the_run",
    "export.adapter": "test_lora_job.py: test_lora_keys_reach_the_run",
    "export.merged": "test_lora_job.py: test_lora_keys_reach_the_run",
    "task.kind": "test_post_training.py: test_task_kind_and_data_keys_reach_the_rows",
    **{
        f"task.{name}": "test_grpo_job.py: test_grpo_keys_reach_the_run"
        for name in GRPO_KEYS
    },
    **{
        f"log.{name}": "test_generate_cli.py: test_samples_during_training"
        for name in (
            "samples",
            "samples_every",
            "samples_max_new_tokens",
            "samples_temperature",
        )
    },
    "task.eval_temperature": "test_grpo_eval.py: "
    "test_eval_temperature_reaches_the_eval_rollout",
    **{
        f"task.{name}": "test_distill.py: test_a_distillation_run_through_eqtrain_fit, "
        "test_on_policy_steps"
        for name in ("teacher", "lmbda", "seq_kd")
    },
    "task.beta": "test_post_training.py: test_task_keys_reach_the_loss",
    "task.label_smoothing": "test_post_training.py: test_task_keys_reach_the_loss",
    "task.orpo_lambda": "test_post_training.py: test_task_keys_reach_the_loss",
    "task.simpo_gamma": "test_post_training.py: test_task_keys_reach_the_loss",
    "task.reference": "test_post_training.py: test_task_keys_reach_the_loss, "
    "test_dpo_step_one_is_log_2_in_every_reference_mode",
    "data.format": "test_post_training.py: test_task_kind_and_data_keys_reach_the_rows",
    "data.chat_template": "test_post_training.py: test_task_kind_and_data_keys_...",
    "data.chat_template_kwargs": "test_chat_template_kwargs.py: "
    "test_the_config_key_reaches_the_jobs_template_and_rows_key",
    "data.max_prompt_len": "test_post_training.py: test_task_kind_and_data_keys_...",
    "data.pack": "test_post_training.py: test_task_kind_and_data_keys_reach_the_rows",
    "model.remat_save": "test_memory.py: test_memory_keys_reach_the_job",
    "model.remat_offload": "test_memory.py: test_memory_keys_reach_the_job",
    "model.mlp_chunks": "test_memory.py: test_memory_keys_reach_the_job",
    "model.attention_chunk": "test_memory.py: test_memory_keys_reach_the_job",
    "model.attention_impl": "test_memory.py: test_memory_keys_reach_the_job",
    "model.loss_chunk": "test_memory.py: test_memory_keys_reach_the_job, "
    "test_dry_run_reports_the_compiled_step",
    **{
        f"distributed.{name}": "test_ray.py: test_distributed_keys_reach_the_plan"
        for name in (
            "processes",
            "ray_address",
            "resources_per_worker",
            "placement",
            "max_restarts",
            "restart_delay",
        )
    },
}


def test_every_key_is_covered():
    covered = set(CONSUMERS) | set(ELSEWHERE)
    missing = [
        k
        for k in schema()
        if k not in covered and not (k.startswith("optim.") and "optim.*" in covered)
    ]
    assert not missing, f"config keys without a consumer test: {missing}"


def test_optim_section_reaches_the_builder(text_dirs, tmp_path, monkeypatch):
    seen = _opt_kwargs(monkeypatch)
    prepared(
        text_dirs,
        tmp_path,
        "optim.name=lion",
        "optim.lr=1e-4",
        "optim.schedule=wsd",
        "optim.decay_steps=2",
        "optim.final_lr=0",
        "optim.weight_decay=0.2",
        "optim.no_decay=norm",
        "optim.clip_norm=0.5",
        "optim.b1=0.8",
        "optim.b2=0.9",
        "loop.steps=9",
    )
    expected = dict(
        lr=1e-4,
        schedule="wsd",
        decay_steps=2,
        final_lr=0.0,
        weight_decay=0.2,
        no_decay="norm",
        clip_norm=0.5,
        b1=0.8,
        b2=0.9,
        total_steps=9,
        warmup_steps=1,
    )
    assert {k: seen[k] for k in expected} == expected
    assert seen.get("name", "lion") == "lion"
    seen.clear()
    prepared(
        text_dirs,
        tmp_path,
        "optim.name=sgd",
        "optim.momentum=0.9",
        "optim.nesterov=true",
    )
    assert (seen["momentum"], seen["nesterov"]) == (0.9, True)
    seen.clear()
    prepared(
        text_dirs, tmp_path, "optim.name=adam", "optim.eps=1e-6", "optim.weight_decay=0"
    )
    assert seen["eps"] == 1e-6


def _run(text_dirs, tmp_path, *extra):
    config = config_lib.load(overrides=tiny(text_dirs, tmp_path, *extra))
    return job.run(config, echo=lambda s: None)


def test_run_writes_where_told(text_dirs, tmp_path):
    result = _run(text_dirs, tmp_path)
    run_dir = tmp_path / "run"
    assert result.run_dir == run_dir
    assert result.fit.stop_reason.kind == "max_steps"
    assert (run_dir / "config.toml").exists()
    written = config_lib.load(run_dir / "config.toml")
    assert written == result.config
    assert eqtrain.checkpoint.list_steps(run_dir) == [2, 4]
    manifest = eqtrain.checkpoint.read_manifest(run_dir)
    assert manifest["config"]["loop"]["steps"] == 4
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in lines if "step_time" in r] == [1, 2, 3, 4]
    assert "eval/loss" in lines[-1]
    model, _ = eqtrain.hf.load(run_dir / "hf")
    assert eqtrain.models.num_params(model) == eqtrain.models.num_params(
        result.fit.state.model
    )


def test_evaluations_between_logged_steps_reach_the_metrics(text_dirs, tmp_path):
    """log.every = 3, loop.eval_every = 2: step 2's evaluation is written on a
    line of its own (it once went nowhere), and 3's line has no eval metrics."""
    _run(text_dirs, tmp_path, "log.every=3")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").open()]
    evals = {r["step"]: "eval/loss" in r for r in lines}
    assert evals == {2: True, 3: False, 4: True}


def test_loop_step_options(text_dirs, tmp_path):
    result = _run(
        text_dirs,
        tmp_path,
        "loop.precision=bf16",
        "loop.nonfinite=skip",
        "loop.ema=0.5",
        "export.ema=true",
        "loop.steps=2",
    )
    state = result.fit.state
    assert state.ema is not None
    assert "halted" not in result.fit.metrics  # nonfinite="stop" reports it
    exported, _ = eqtrain.hf.load(tmp_path / "run" / "hf")
    np.testing.assert_array_equal(
        np.asarray(exported.embed_tokens.weight),
        np.asarray(state.ema_model.embed_tokens.weight),
    )
    # bf16: the run's step multiplies in bfloat16 (float32 parameters, cast
    # inside the step); without it, every product is float32
    bf16 = product_dtypes(prepared(text_dirs, tmp_path / "a", "loop.precision=bf16"))
    assert ("bfloat16", "bfloat16") in bf16
    assert ("float32", "float32") not in bf16
    assert result.fit.state.model.embed_tokens.weight.dtype == jnp.float32
    fp32 = product_dtypes(prepared(text_dirs, tmp_path / "b"))
    assert fp32 == {("float32", "float32")}


def _copy(state):
    return jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, state)


def test_accumulate_weighs_tokens(text_dirs, tmp_path):
    """The run's step with optim.accumulate=2 on a batch whose two micro-batches
    hold different numbers of real tokens (8 rows of 16, 8 rows of 2) equals one
    big batch: each micro-batch weighted by its tokens, which the plain mean of
    the two micro-batch losses would not give."""
    one = prepared(text_dirs, tmp_path / "one", "data.batch_size=16")
    two = prepared(
        text_dirs, tmp_path / "two", "data.batch_size=16", "optim.accumulate=2"
    )
    batch = {k: np.asarray(v) for k, v in one.loader.peek().items()}
    mask = np.ones(batch["targets"].shape, np.float32)
    mask[8:, 2:] = 0.0
    batch["loss_mask"] = mask
    s1, m1 = one.step(_copy(one.state), batch)
    s2, m2 = two.step(_copy(two.state), batch)
    np.testing.assert_allclose(float(m2["loss"]), float(m1["loss"]), rtol=1e-6)
    for x, y in zip(
        jax.tree.leaves(s2.params), jax.tree.leaves(s1.params), strict=True
    ):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)
    loss = eqx.filter_jit(lambda m, b: one.job.loss_fn(m, b, None)[0])
    halves = [loss(one.state.model, {k: v[:8] for k, v in batch.items()})]
    halves.append(loss(one.state.model, {k: v[8:] for k, v in batch.items()}))
    assert abs(np.mean(halves) - float(m1["loss"])) > 1e-3  # weighting matters here


def test_data_sources(text_dirs, tmp_path):
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(
        "\n".join(json.dumps({"body": TEXT, "other": 1}) for _ in range(4)) + "\n"
    )
    p = prepared(
        text_dirs,
        tmp_path,
        f"data.train={jsonl}",
        "data.text_column=body",
        "data.eval=none",
        "loop.eval_every=0",
    )
    assert p.fit_kwargs["evaluation"] is None
    assert p.loader.num_batches > 0
    with pytest.raises(eqtrain.EqtrainError, match="body2"):
        prepared(text_dirs, tmp_path, f"data.train={jsonl}", "data.text_column=body2")
    # the pattern decides which files of a directory are read
    with pytest.raises(eqtrain.ConfigError, match="7 rows of 4 tokens"):
        prepared(text_dirs, tmp_path, "data.pattern=*.md", "data.seq_len=4")
    with pytest.raises(eqtrain.ConfigError, match="data.train"):
        prepared(text_dirs, tmp_path, f"data.train={tmp_path / 'nope'}")


def test_tokenizer_file_and_mismatch(text_dirs, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator([TEXT], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    p = prepared(text_dirs, tmp_path, f"data.tokenizer={path}")
    assert mc(p).vocab_size == tok.get_vocab_size()
    with pytest.raises(eqtrain.ConfigError, match="does not fit the model"):
        small = tok.get_vocab_size() - 1
        prepared(
            text_dirs, tmp_path, f"data.tokenizer={path}", f"model.vocab_size={small}"
        )
    with pytest.raises(eqtrain.ConfigError, match="data.tokenizer"):
        prepared(text_dirs, tmp_path, f"data.tokenizer={tmp_path / 'missing.json'}")


def test_resume_never_and_path(text_dirs, tmp_path):
    _run(text_dirs, tmp_path)
    with pytest.raises(eqtrain.EqtrainError, match="resume='never'"):
        prepared(text_dirs, tmp_path, "checkpoint.resume=never")
    other = tmp_path / "other"
    p = prepared(
        text_dirs,
        tmp_path,
        f"run_dir={other}",
        f"checkpoint.resume={tmp_path / 'run' / 'checkpoints' / '2'}",
    )
    assert p.resumed_from == 2 and int(p.state.step) == 2
    assert (
        p.loader.position
        == eqtrain.checkpoint.restore(
            tmp_path / "run" / "checkpoints" / "2", p.state
        ).data_position
    )


def test_wandb_hook(text_dirs, tmp_path):
    p = prepared(
        text_dirs,
        tmp_path,
        "log.wandb_project=proj",
        "log.wandb_mode=offline",
        "log.wandb_name=tiny",
    )
    logger = _hooks(p, eqtrain.hooks.WandbLogger)[0]
    kwargs = logger.init_kwargs
    assert (kwargs["project"], kwargs["mode"], kwargs["name"]) == (
        "proj",
        "offline",
        "tiny",
    )
    assert kwargs["config"]["loop"]["steps"] == 4


def test_errors_come_before_any_work(text_dirs, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(eqtrain.ConfigError, match="cannot be created"):
        prepared(text_dirs, tmp_path, f"run_dir={blocker / 'run'}")
    with pytest.raises(eqtrain.ConfigError, match="mesh"):
        prepared(text_dirs, tmp_path, "mesh.data=3")
    with pytest.raises(eqtrain.ConfigError, match="micro-batch"):
        prepared(text_dirs, tmp_path, "mesh.data=8", "data.batch_size=4")
    assert not (tmp_path / "run").exists()


def test_dry_run_report(text_dirs, tmp_path):
    config = config_lib.load(overrides=tiny(text_dirs, tmp_path, "mesh.fsdp=2"))
    text = job.report(config)
    assert "parameters" in text and "fsdp=2" in text
    assert "model.layers.mlp.up_proj.weight" in text
    assert "memory per device" in text
    assert not (tmp_path / "run").exists()


def test_eval_export_info_in_process(text_dirs, tmp_path):
    result = _run(text_dirs, tmp_path)
    run_dir = tmp_path / "run"
    metrics = job.evaluate_run(run_dir)
    assert metrics["step"] == 4
    assert metrics["eval/loss"] == pytest.approx(
        result.fit.metrics["eval/loss"], rel=1e-6
    )
    out = job.export_run(run_dir, tmp_path / "export", dtype="bfloat16")
    model, _ = eqtrain.hf.load(out)
    assert model.embed_tokens.weight.dtype == jnp.bfloat16
    info = job.run_info(run_dir)
    assert info["steps_trained"] == 4
    assert [c["step"] for c in info["checkpoints"]] == [2, 4]
    assert dataclasses.asdict(result.config.loop) == info["config"]["loop"]


@pytest.mark.slow  # default-suite time: the one-story test reads both logs
def test_tensorboard_and_jsonl_from_a_run(text_dirs, tmp_path):
    pytest.importorskip("tensorboardX")
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator"
    )
    result = _run(text_dirs, tmp_path, "log.tensorboard=true", "log.every=2")
    events = event_accumulator.EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    steps = [e.step for e in events.Scalars("train/loss")]
    assert steps == [2, 4]
    history = {h["step"]: h["loss"] for h in result.fit.history}
    np.testing.assert_allclose(losses, [history[2], history[4]], rtol=1e-6)
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 4]
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in logged if "step_time" in r] == [2, 4]
    assert all("learning_rate" in r for r in logged if "step_time" in r)
