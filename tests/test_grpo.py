"""GRPO: advantages and the clipped loss against NumPy re-implementations and
TRL's own `GRPOTrainer._compute_loss`; the loss function's gradient on a tiny
Llama; the reward functions."""

import dataclasses
import functools
import math
from collections import defaultdict
from types import SimpleNamespace

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from eqtrain import ConfigError, lora
from eqtrain.models import Llama, LlamaConfig
from eqtrain.post_training import grpo, preference, rewards


RNG = np.random.default_rng(0)
ROWS, SEQ, G = 6, 7, 3
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
LOW, HIGH, MAX_LEN = 0.2, 0.28, 9


def close(ours, theirs, tol=2e-6):
    np.testing.assert_allclose(np.asarray(ours, np.float64), theirs, rtol=tol, atol=tol)


def random_inputs(seed=0):
    """Per-token log-probs whose ratios land on both sides of both clip bounds, a
    mask with prompt positions, short completions and one all-padding row, and
    garbage at masked positions."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((ROWS, SEQ), np.float32)
    for i, (start, stop) in enumerate([(2, 7), (2, 4), (3, 7), (2, 2), (1, 6), (2, 5)]):
        mask[i, start:stop] = 1
    logps = -rng.uniform(0.1, 4.0, (ROWS, SEQ)).astype(np.float32)
    old = (logps + rng.normal(0, 0.3, (ROWS, SEQ))).astype(np.float32)
    ref = (logps + rng.normal(0, 0.5, (ROWS, SEQ))).astype(np.float32)
    old[mask == 0] = rng.uniform(-50, 5, int((mask == 0).sum()))
    adv = rng.normal(size=ROWS).astype(np.float32)
    return logps, old, ref, adv, mask


# -- advantages ---------------------------------------------------------------------
def np_std(v):
    v = v[~np.isnan(v)]
    return float(np.std(v, ddof=1)) if len(v) > 1 else math.nan


def np_advantages(r, group, scale):
    r = r.astype(np.float64)
    adv, group_std = np.zeros_like(r), np.zeros_like(r)
    for g in range(len(r) // group):
        part = slice(g * group, (g + 1) * group)
        v = r[part]
        mean = np.mean(v[~np.isnan(v)]) if (~np.isnan(v)).any() else math.nan
        group_std[part] = np_std(v) if group > 1 else 0.0
        divisor = {"group": group_std[part], "batch": np_std(r), "none": None}[scale]
        a = v - mean if divisor is None else (v - mean) / (divisor + 1e-4)
        adv[part] = np.where(np.isnan(a), 0.0, a)
    metrics = {
        "reward": np.mean(r[~np.isnan(r)]),
        "reward_std": np_std(r),
        "frac_reward_zero_std": np.mean(np.abs(group_std) <= 1e-8),
    }
    return adv, metrics


def reward_batch():
    """Four groups of three: all equal, one NaN (unscorable), 0/1, random; and a
    fifth group with every reward NaN."""
    r = np.array(
        [0.5, 0.5, 0.5, 1.0, np.nan, 0.0, 0.0, 1.0, 1.0, *RNG.normal(size=3)],
        np.float32,
    )
    return np.concatenate([r, np.full(3, np.nan, np.float32)])


@pytest.mark.parametrize("scale", grpo.SCALES)
def test_group_advantages_match_numpy(scale):
    r = reward_batch()
    fn = jax.jit(functools.partial(grpo.group_advantages, group_size=G, scale=scale))
    adv, metrics = fn(r)
    want, want_metrics = np_advantages(r, G, scale)
    close(adv, want, tol=1e-5)
    assert np.all(np.asarray(adv)[[0, 1, 2, 4, 12, 13, 14]] == 0)
    for name, value in want_metrics.items():
        close(metrics[name], value, tol=1e-5)


def test_group_advantages_group_of_one_and_errors():
    adv, metrics = grpo.group_advantages(np.array([1.0, 2.0], np.float32), 1)
    close(adv, [0.0, 0.0])
    close(metrics["frac_reward_zero_std"], 1.0)
    with pytest.raises(ConfigError, match="divide the 5 rewards"):
        grpo.group_advantages(np.zeros(5, np.float32), 2)
    with pytest.raises(ConfigError, match="`scale` must be one of"):
        grpo.group_advantages(np.zeros(4, np.float32), 2, scale="std")


# -- the loss -----------------------------------------------------------------------
def np_loss(
    logps,
    old,
    adv,
    mask,
    *,
    beta,
    ref,
    loss_type,
    importance_sampling_level,
    kl_bias_correction=True,
):
    """The surrogate written out row by row in float64."""
    level = importance_sampling_level
    rows, seq = mask.shape
    per_token = np.zeros((rows, seq))
    low, high, kl = (np.zeros((rows, seq)) for _ in range(3))
    for i in range(rows):
        on = mask[i] > 0
        log_ratio = np.where(on, logps[i].astype(np.float64) - old[i], 0.0)
        if level == "sequence":
            log_ratio = np.full(seq, log_ratio.sum() / max(on.sum(), 1))
        ratio = np.exp(log_ratio)
        clipped = np.clip(ratio, 1 - LOW, 1 + HIGH)
        per_token[i] = -np.minimum(ratio * adv[i], clipped * adv[i])
        low[i] = (ratio < 1 - LOW) & (adv[i] < 0)
        high[i] = (ratio > 1 + HIGH) & (adv[i] > 0)
        d = np.where(on, ref[i].astype(np.float64) - logps[i], 0.0)
        kl[i] = (np.exp(d) - d - 1) * (ratio if kl_bias_correction else 1.0)
    per_token = per_token + beta * kl
    tokens = mask.sum()
    if loss_type == "grpo":
        loss = np.mean((per_token * mask).sum(1) / np.maximum(mask.sum(1), 1))
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (rows * MAX_LEN)
    else:
        loss = (per_token * mask).sum() / tokens
    if level == "sequence":  # one ratio per row: row means
        mean = lambda x: x[:, 0].mean()
    else:
        mean = lambda x: (x * mask).sum() / tokens
    metrics = {
        "clip_ratio/low_mean": mean(low),
        "clip_ratio/high_mean": mean(high),
        "clip_ratio/region_mean": mean(np.maximum(low, high)),
        "weight": tokens if loss_type in ("bnpo", "dapo") else rows,
    }
    if beta:
        metrics["kl"] = (kl * mask).sum() / tokens
    return loss, metrics


def ours(logps, old, adv, mask, ref, **options):
    fn = functools.partial(
        grpo.grpo_token_loss,
        epsilon_low=LOW,
        epsilon_high=HIGH,
        max_completion_length=MAX_LEN,
        **options,
    )
    return jax.jit(fn)(logps, old, adv, mask, ref_logps=ref)


@pytest.mark.parametrize("level", grpo.LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_token_loss_matches_numpy(loss_type, level):
    logps, old, ref, adv, mask = random_inputs()
    for beta, bias in ((0.0, True), (0.04, True), (0.04, False)):
        options = dict(beta=beta, loss_type=loss_type, importance_sampling_level=level)
        options["kl_bias_correction"] = bias
        loss, metrics = ours(logps, old, adv, mask, ref, **options)
        want, want_metrics = np_loss(logps, old, adv, mask, ref=ref, **options)
        close(loss, want, tol=1e-5)
        assert set(metrics) == set(want_metrics)
        for name, value in want_metrics.items():
            close(metrics[name], value, tol=1e-5)
    if level == "token":  # the inputs reach both clip bounds
        assert 0 < want_metrics["clip_ratio/low_mean"] < 1
        assert 0 < want_metrics["clip_ratio/high_mean"] < 1


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_weight_makes_accumulation_equal_one_batch(loss_type):
    """Micro-batch losses averaged by `weight` (as `eqtrain.step` accumulates
    them) equal the loss of the whole batch; the gradient is combined the same
    way, so it does too."""
    logps, old, ref, adv, mask = random_inputs(seed=2)
    options = dict(beta=0.04, loss_type=loss_type)
    whole, _ = ours(logps, old, adv, mask, ref, **options)
    parts = [
        ours(logps[i], old[i], adv[i], mask[i], ref[i], **options)
        for i in (slice(0, 2), slice(2, ROWS))
    ]
    total = sum(float(loss) * float(m["weight"]) for loss, m in parts)
    close(total / sum(float(m["weight"]) for _, m in parts), float(whole), tol=1e-6)


def test_grpo_token_loss_errors():
    logps, old, ref, adv, mask = random_inputs()
    with pytest.raises(ConfigError, match="`loss_type` must be one of"):
        grpo.grpo_token_loss(logps, old, adv, mask, loss_type="ppo")
    with pytest.raises(ConfigError, match="max_completion_length"):
        grpo.grpo_token_loss(logps, old, adv, mask, loss_type="dr_grpo")
    with pytest.raises(ConfigError, match="needs `ref_logps`"):
        grpo.grpo_token_loss(logps, old, adv, mask, beta=0.1)
    with pytest.raises(ConfigError, match="`epsilon_high` must be >= 0"):
        grpo.grpo_token_loss(logps, old, adv, mask, epsilon_high=-0.1)


# -- parity with TRL ----------------------------------------------------------------
def trl_loss(logps, old, adv, mask, ref, *, beta, loss_type, level, bias=True):
    """TRL's `GRPOTrainer._compute_loss` on these per-token log-probs, and its
    gradient with respect to them: a trainer made without `__init__`, holding
    only what that method reads (TRL's defaults, `use_bias_correction_kl` =
    `bias`), whose log-prob method returns ours."""
    torch = pytest.importorskip("torch")
    trl = pytest.importorskip("trl")
    t = lambda x: torch.tensor(np.asarray(x))
    policy = t(logps).requires_grad_(True)
    trainer = trl.GRPOTrainer.__new__(trl.GRPOTrainer)
    metrics = {"train": defaultdict(list)}
    accelerator = SimpleNamespace(
        num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x
    )
    args = SimpleNamespace(
        use_bias_correction_kl=bias, delta=None, steps_per_generation=1
    )
    attributes = dict(
        _get_per_token_logps_and_entropies=lambda *a, **k: (
            policy,
            torch.zeros(mask.shape),
            None,
        ),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=LOW,
        epsilon_high=HIGH,
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=MAX_LEN,
        accelerator=accelerator,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=metrics,
        args=args,
    )
    for name, value in attributes.items():
        object.__setattr__(trainer, name, value)
    rows, seq = mask.shape
    inputs = dict(
        prompt_ids=torch.zeros(rows, 1, dtype=torch.long),
        prompt_mask=torch.ones(rows, 1, dtype=torch.long),
        completion_ids=torch.zeros(rows, seq, dtype=torch.long),
        completion_mask=t(mask.astype(np.int64)),
        advantages=t(adv),
        old_per_token_logps=t(old),
        ref_per_token_logps=t(ref),
        num_items_in_batch=t(mask.sum()),
    )
    loss = trainer._compute_loss(None, inputs)
    loss.backward()
    loss = loss.detach()
    grad = (policy.grad * inputs["completion_mask"]).numpy()
    return float(loss), {k: v[0] for k, v in metrics["train"].items()}, grad


@pytest.mark.parametrize("level", grpo.LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_token_loss_and_gradient_equal_trls(loss_type, level):
    """At TRL 1.16's defaults (the ratio-weighted KL) and with its switch off,
    for every loss type, token and sequence (GSPO) ratios: loss and gradient
    with respect to the policy's log-probs within 1e-6."""
    logps, old, ref, adv, mask = random_inputs(seed=1)
    options = dict(loss_type=loss_type, importance_sampling_level=level)
    fn = functools.partial(
        grpo.grpo_token_loss,
        epsilon_low=LOW,
        epsilon_high=HIGH,
        max_completion_length=MAX_LEN,
    )

    def loss_and_grad(logps, beta, bias):
        def f(x):
            return fn(
                x,
                old,
                adv,
                mask,
                ref_logps=ref,
                beta=beta,
                kl_bias_correction=bias,
                **options,
            )

        return jax.value_and_grad(f, has_aux=True)(logps)

    loss_and_grad = jax.jit(loss_and_grad, static_argnums=(1, 2))
    for beta, bias in ((0.0, True), (0.04, True), (0.04, False)):
        theirs, their_metrics, their_grad = trl_loss(
            logps,
            old,
            adv,
            mask,
            ref,
            beta=beta,
            loss_type=loss_type,
            level=level,
            bias=bias,
        )
        (loss, metrics), grad = loss_and_grad(logps, beta, bias)
        close(loss, theirs, tol=1e-6)
        close(np.asarray(grad) * mask, their_grad, tol=1e-6)
        names = ["clip_ratio/low_mean", "clip_ratio/high_mean"]
        names += ["clip_ratio/region_mean"] + (["kl"] if beta else [])
        for name in names:
            close(metrics[name], their_metrics[name], tol=1e-5)
        assert ("kl" in metrics) == ("kl" in their_metrics)


# -- the model: log-probs, entropy, the loss function's gradient ---------------------
TINY = LlamaConfig(
    vocab_size=16,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
)
MODEL = Llama(TINY, jr.key(0))


def model_batch(seed=0, rows=4, seq=6, prompt=2):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 16, (rows, seq)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    mask = np.zeros((rows, seq), np.float32)
    mask[:, prompt - 1 : seq - 1] = 1
    mask[1, 3:] = 0  # a short completion
    targets = np.where(mask > 0, targets, -100).astype(np.int32)
    advantages = rng.normal(size=rows).astype(np.float32)
    return {
        "tokens": tokens,
        "targets": targets,
        "completion_mask": mask,
        "advantages": advantages,
    }


def log_softmax_np(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_token_logprobs_and_entropy():
    b = model_batch()
    logits = np.asarray(jax.vmap(MODEL)(b["tokens"]), np.float64)
    safe = np.where(b["targets"] >= 0, b["targets"], 0)

    def want(z):
        logp = log_softmax_np(z)
        picked = np.take_along_axis(logp, safe[..., None], -1)[..., 0]
        plogp = np.exp(logp) * np.where(np.isinf(logp), 0.0, logp)
        return picked, -plogp.sum(-1)

    # (chunk, temperature, vocab_size): 12 of 16 ids real, as a padded vocabulary
    cases = [(None, 1.0, None), (None, 0.7, 12), (5, 1.0, None), (5, 0.7, 12)]

    @eqx.filter_jit
    def run(model):
        out = [
            grpo.token_logprobs_and_entropy(
                model, b["tokens"], b["targets"], chunk=c, temperature=t, vocab_size=v
            )
            for c, t, v in cases
        ]
        return out, grpo.token_logprobs(model, b["tokens"], b["targets"])

    out, plain = run(MODEL)
    real = np.arange(16) < 12
    for (_, t, v), (logp, ent) in zip(cases, out, strict=True):
        z = logits if v is None else np.where(real, logits, -np.inf)
        want_logp, want_ent = want(z / t)
        close(logp, want_logp, tol=1e-5)
        close(ent, want_ent, tol=1e-5)
    close(plain, want(logits)[0], tol=1e-5)


def policy_gradient_weights(batch, loss_type):
    """d loss / d logp of the plain policy gradient `-A * logp` aggregated as
    `loss_type` says (per token, `[rows, seq]`)."""
    m = batch["completion_mask"]
    w = -batch["advantages"][:, None] * m
    if loss_type == "grpo":
        return w / np.maximum(m.sum(1, keepdims=True), 1) / m.shape[0]
    if loss_type == "dr_grpo":
        return w / (m.shape[0] * MAX_LEN)
    return w / m.sum()


def test_gradient_at_ratio_one_is_the_policy_gradient():
    """Without `old_logps` (ratio 1 exactly), and with the sampler's log-probs
    stored, the gradient is `-A * grad logp` aggregated as the loss type says,
    for every loss type, with and without `chunk`."""
    b = model_batch()
    old = eqx.filter_jit(grpo.token_logprobs)(MODEL, b["tokens"], b["targets"])
    # "bnpo" shares "dapo"'s code (and is checked against NumPy and TRL above).
    cases = [(t, None, False) for t in ("grpo", "dapo", "dr_grpo")]
    cases += [("grpo", 4, True)]

    @eqx.filter_jit
    def run(model, batch, old):
        logp = lambda m: grpo.token_logprobs(m, batch["tokens"], batch["targets"])
        _, vjp = eqx.filter_vjp(logp, model)
        out = []
        for t, chunk, stored in cases:
            fn = grpo.grpo_loss_fn(
                loss_type=t, max_completion_length=MAX_LEN, chunk=chunk
            )
            data = {**batch, "old_logps": old} if stored else batch
            (_, aux), g = eqx.filter_value_and_grad(fn, has_aux=True)(model, data)
            (want,) = vjp(jnp.asarray(policy_gradient_weights(b, t)))
            out.append((aux, g, want))
        return out

    mask = b["completion_mask"]
    for (t, _, _), (aux, g, want) in zip(cases, run(MODEL, b, old), strict=True):
        for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(want), strict=True):
            close(x, np.asarray(y, np.float64), tol=2e-5)
        close(aux["clip_ratio/region_mean"], 0.0)
        close(aux["weight"], mask.sum() if t in ("dapo", "bnpo") else mask.shape[0])
        assert "entropy" in aux and "kl" not in aux


def test_reference_modes():
    """With the reference equal to the policy the KL term is 0 in every mode (and
    so is its gradient); another reference gives `grpo_token_loss` of its
    log-probs."""
    b = model_batch(seed=1)
    adapted = lora.apply(MODEL, lora.LoRA(rank=2), key=jr.key(1))
    other = Llama(TINY, jr.key(7))
    tokens, targets = b["tokens"], b["targets"]

    @eqx.filter_jit
    def run(model, adapted, other):
        policy_logps = grpo.token_logprobs(model, tokens, targets)
        cases = {
            "adapters_off": (adapted, b),
            "precomputed": (model, {**b, "ref_logps": policy_logps}),
            "other": (preference.WithReference(model, other), b),
        }
        out = {}
        for name, (m, batch) in cases.items():
            reference = "copy" if name == "other" else name
            fn = grpo.grpo_loss_fn(beta=0.1, reference=reference, entropy=False)
            out[name] = fn(m, batch)
        plain = grpo.grpo_loss_fn(entropy=False)
        grad = lambda fn, m: eqx.filter_value_and_grad(fn, has_aux=True)(m, b)
        copy_fn = grpo.grpo_loss_fn(beta=0.1, reference="copy", entropy=False)
        ((base, _), plain_g), (out["copy"], copy_g) = (
            grad(plain, model),
            grad(copy_fn, preference.with_reference(model)),
        )
        other_logps = grpo.token_logprobs(other, tokens, targets)
        return out, (plain_g, copy_g), base, policy_logps, other_logps

    out, (plain_g, copy_g), base, policy_logps, other_logps = run(MODEL, adapted, other)
    for name in ("copy", "adapters_off", "precomputed"):
        close(out[name][1]["kl"], 0.0)
        close(out[name][0], float(base), tol=1e-6)
    leaves = zip(jax.tree.leaves(copy_g.policy), jax.tree.leaves(plain_g), strict=True)
    for x, y in leaves:
        close(x, np.asarray(y, np.float64), tol=2e-5)
    assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(copy_g.reference))
    want, want_aux = grpo.grpo_token_loss(
        policy_logps,
        policy_logps,
        b["advantages"],
        b["completion_mask"],
        beta=0.1,
        ref_logps=other_logps,
    )
    loss, aux = out["other"]
    close(loss, float(want), tol=1e-5)
    close(aux["kl"], float(want_aux["kl"]), tol=1e-5)
    assert float(aux["kl"]) > 0


def test_mixture_of_experts_through_batch_features():
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
    )
    model = Llama(config, jr.key(3))
    assert model.routes_batch
    b = model_batch(seed=2)

    @eqx.filter_jit
    def run(model):
        logp = [
            grpo.token_logprobs(model, b["tokens"], b["targets"], chunk=c)
            for c in (None, 3)
        ]
        return logp, grpo.grpo_loss_fn(chunk=3, entropy=False)(model, b)

    logp, (loss, aux) = run(model)
    close(logp[1], np.asarray(logp[0], np.float64), tol=1e-5)
    assert "moe/aux_loss" in aux


def test_loss_fn_errors():
    with pytest.raises(ConfigError, match="needs a reference model"):
        grpo.grpo_loss_fn(beta=0.1)
    with pytest.raises(ConfigError, match="`temperature` must be > 0"):
        grpo.grpo_loss_fn(temperature=0.0)
    with pytest.raises(ConfigError, match="`chunk` must be None or an int"):
        grpo.grpo_loss_fn(chunk=0)
    b = model_batch()
    with pytest.raises(ConfigError, match=r"\['advantages'\] missing"):
        grpo.grpo_loss_fn()(MODEL, {k: v for k, v in b.items() if k != "advantages"})
    with pytest.raises(ConfigError, match="reference='copy' reads the frozen copy"):
        eqx.filter_eval_shape(grpo.grpo_loss_fn(beta=0.1, reference="copy"), MODEL, b)
    capped = Llama(dataclasses.replace(TINY, final_logit_softcapping=5.0), jr.key(0))
    with pytest.raises(ConfigError, match="final logit soft-cap"):
        eqx.filter_eval_shape(
            functools.partial(grpo.token_logprobs, chunk=4, temperature=0.5),
            capped,
            b["tokens"],
            b["targets"],
        )


# -- rewards ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "completion,answer,want",
    [
        ("so the total is \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}", 1.0),
        ("First 3, then \\boxed{ 7 }.", "7", 1.0),
        ("Work: 4 + 5 = 9\n#### 1,000\n", "1000", 1.0),
        ("Natalia sold 48 ... #### 72", "She sold ... #### 72", 1.0),
        ("The Answer:  Paris.\nmore text 12", "paris", 1.0),
        ("we get 12 apples, then 13.5", "13.50", 1.0),
        ("we get 12 apples, then 13.5", "12", 0.0),
        ("no numbers here\n\n  Blue Whale  \n", "blue whale", 1.0),
        ("", "x", 0.0),
    ],
)
def test_exact_answer(completion, answer, want):
    assert rewards.exact_answer(["p"], [completion], answer=[answer]) == [want]


def test_exact_answer_needs_the_answer_column():
    with pytest.raises(ConfigError, match="`answer` column"):
        rewards.exact_answer(["p"], ["c"], solution=["1"])


def test_format_regex():
    reward = rewards.format_regex(r"<think>.*</think>\s*\S.*")
    got = reward(
        prompts=["p"] * 3,
        completions=[
            "<think>a\nb</think>\n42",
            "42 <think>x</think>",
            "<think></think>",
        ],
    )
    assert got == [1.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match="bad pattern"):
        rewards.format_regex("(")


def test_load_reward(tmp_path, monkeypatch):
    assert rewards.load_reward("exact_answer") is rewards.exact_answer
    assert rewards.load_reward("os.path:join") is __import__("os").path.join
    (tmp_path / "my_rewards.py").write_text(
        "class K:\n    @staticmethod\n    def f(**kw):\n        return []\nVALUE = 3\n"
    )
    (tmp_path / "broken_rewards.py").write_text("import not_a_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert callable(rewards.load_reward("my_rewards:K.f"))
    cases = {
        "nonsense": "neither a built-in",
        "no_such_module_xyz.sub:f": "no module 'no_such_module_xyz.sub'",
        "my_rewards:missing": "'my_rewards' has no 'missing'",
        "my_rewards:VALUE": "'my_rewards:VALUE' is a int, not a callable",
    }
    for spec, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            rewards.load_reward(spec)
    with pytest.raises(ModuleNotFoundError):  # the module's own import is its bug
        rewards.load_reward("broken_rewards:f")


def test_score():
    prompts, completions = ["p1", "p1", "p2"], ["#### 4", "#### 5", "####"]

    def maybe(prompts, completions, answer, **_):
        return [None, 2.0, None]

    def never(prompts, completions, **_):
        return [None, None, None]

    funcs = [
        ("exact", rewards.exact_answer, 1.0),
        ("maybe", maybe, 0.5),
        ("never", never, 3.0),
    ]
    total, per = rewards.score(funcs, prompts, completions, {"answer": ["4", "4", "1"]})
    assert total.dtype == np.float32
    close(total, [1.0, 1.0, 0.0])
    close(per["maybe"], [np.nan, 2.0, np.nan])
    total, _ = rewards.score([("never", never, 1.0)], prompts, completions)
    assert np.isnan(total).all()

    def bad(values):
        return lambda prompts, completions, **_: values

    errors = {
        "returned 2 values for 3 completions": [1.0, 2.0],
        r"returned inf for row 1": [0.0, math.inf, 0.0],
        r"returned 'x' for row 2": [0.0, 1.0, "x"],
        "returned a float": 1.0,
    }
    for message, values in errors.items():
        with pytest.raises(ConfigError, match=f"reward 'broken' {message}"):
            rewards.score([("broken", bad(values), 1.0)], prompts, completions)
    with pytest.raises(ConfigError, match="'answer' has 2 entries for 3"):
        rewards.score(funcs, prompts, completions, {"answer": ["4", "4"]})
    with pytest.raises(ConfigError, match="names must differ"):
        rewards.score([funcs[0], funcs[0]], prompts, completions)


def test_the_configs_choices_are_the_losss():
    from eqtrain.config import _schema

    assert set(_schema.GRPO_LOSSES) == set(LOSS_TYPES)
    assert _schema.IMPORTANCE_LEVELS == grpo.LEVELS
    assert _schema.REWARD_SCALES == grpo.SCALES
