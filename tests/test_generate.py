"""`eqtrain.generate` against the models' own full forward, NumPy references of
transformers' sampling warpers, and itself (keys, stops, compiles, a mesh, bf16).

Greedy parity with transformers' `generate` is in test_generate_hf.py."""

import dataclasses
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
import pytest

from eqtrain import sharding
from eqtrain._errors import ConfigError
from eqtrain.generate import GREEDY, Sampling, filter_logits, generate, left_pad
from eqtrain.models import GPT2, GPT2Config, Llama, LlamaConfig


VOCAB = 50
NEW = 12
# different lengths, so the rows have different left paddings (16 - length);
# 8 rows, so that the sharded run (rows over 4 ways) shares the plain compile
PROMPTS = [
    [5, 17, 33, 8, 41, 9, 30, 3, 12, 47],
    [23, 4],
    [6, 1, 19, 44, 2, 38, 27, 11, 13, 31, 45, 7, 21, 36, 16, 24],
    [40, 3, 29, 9, 18],
    [7],
    [12, 8, 44, 30, 2, 2, 19, 25, 33, 6, 14, 49, 27],
    [31, 11, 5, 20, 9, 42, 38],
    [3, 46, 22, 15],
]
# one sampling for several tests: each distinct `Sampling` compiles anew
TOP_K = Sampling(temperature=1.0, top_k=10)
# initializer_range 0.2: logits far apart, so float rounding never flips an argmax
LLAMA = LlamaConfig(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
)  # fmt: skip
CONFIGS = {
    "llama": LLAMA,
    # a window of 4: every row's later tokens see only part of the prompt
    "window": dataclasses.replace(LLAMA, sliding_window=4),
    "moe": dataclasses.replace(
        LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
    ),
    "gpt2": GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        initializer_range=0.2,
    ),  # fmt: skip
}
_MODELS: dict[str, Any] = {}


def _model(name: str) -> Any:
    if name not in _MODELS:
        config = CONFIGS[name]
        cls = GPT2 if isinstance(config, GPT2Config) else Llama
        _MODELS[name] = cls(config, jr.key(1))
    return _MODELS[name]


@eqx.filter_jit
def _full_logits(model: Any, text: jax.Array) -> jax.Array:
    return jax.vmap(model)(text)


def _reference(model: Any, prompts: list[list[int]], new: np.ndarray) -> np.ndarray:
    """The full forward's logits `[rows, NEW, vocab]` before each new token:
    each row's prompt and new tokens, unpadded at the left (right padding does
    not reach earlier positions of a causal model)."""
    rows, n = new.shape
    width = max(len(p) for p in prompts) + n
    text = np.zeros((rows, width), np.int32)
    for r, p in enumerate(prompts):
        text[r, : len(p) + n] = np.concatenate([p, new[r]])
    logits = np.asarray(_full_logits(model, jnp.asarray(text)), np.float64)
    at = np.array([[len(p) - 1 + i for i in range(n)] for p in prompts])
    return np.take_along_axis(logits, at[:, :, None], axis=1)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _run(model: Any, prompts=PROMPTS, **kw: Any) -> Any:
    tokens, lengths = left_pad(prompts, pad_id=0)
    kw = {"max_new_tokens": NEW, "key": jr.key(0), **kw}
    return generate(model, tokens, lengths, **kw)


# -- against the full forward --------------------------------------------------------
# default-suite time: the MoE and GPT-2 cases are slow (test_generate_hf.py's
# fast cases check both against transformers)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n in ("moe", "gpt2") else n
        for n in CONFIGS
    ],
)
@pytest.mark.tuned  # re-run under each CPU setting (test_tuned_settings.py)
def test_greedy_equals_the_full_forward(name):
    model = _model(name)
    out = _run(model)
    tokens = np.asarray(out.tokens)
    logits = _reference(model, PROMPTS, tokens)
    np.testing.assert_array_equal(tokens, logits.argmax(-1), err_msg=name)
    np.testing.assert_array_equal(np.asarray(out.lengths), NEW)
    # greedy log-probs: of softmax(logits)
    want = np.take_along_axis(_log_softmax(logits), tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs), want, rtol=1e-4, atol=1e-5)
    assert len({tuple(r) for r in tokens}) == len(PROMPTS), "degenerate rows"


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_are_of_the_tempered_full_forward(temperature):
    """Sampled tokens' log-probabilities under softmax(logits / temperature),
    before the filters (top-k here)."""
    model = _model("llama")
    sampling = dataclasses.replace(TOP_K, temperature=temperature)
    out = _run(model, sampling=sampling, key=jr.key(3))
    tokens = np.asarray(out.tokens)
    logits = _reference(model, PROMPTS, tokens)
    logp = _log_softmax(logits / temperature)
    want = np.take_along_axis(logp, tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logprobs), want, rtol=1e-4, atol=1e-5)
    # and each token was among the 10 most likely
    rank = (logits > np.take_along_axis(logits, tokens[..., None], -1)).sum(-1)
    assert rank.max() < 10


# -- the filters against transformers' warpers, in NumPy -----------------------------
def _warp(scores: np.ndarray, s: Sampling) -> np.ndarray:
    """transformers' TemperatureLogitsWarper, TopK, TopP and MinP (generation/
    logits_process.py, min_tokens_to_keep=1), in that order, in NumPy."""
    x = scores.astype(np.float64) / s.temperature
    if s.top_k:
        k = min(s.top_k, x.shape[-1])
        kth = -np.sort(-x, axis=-1)[:, k - 1 : k]
        x = np.where(x < kth, -np.inf, x)
    if s.top_p < 1:
        order = np.argsort(x, axis=-1, kind="stable")  # ascending
        sorted_x = np.take_along_axis(x, order, -1)
        cum = np.cumsum(np.exp(_log_softmax(sorted_x)), axis=-1)
        remove = cum <= 1 - s.top_p
        remove[:, -1] = False  # keep at least one
        drop = np.zeros_like(remove)
        np.put_along_axis(drop, order, remove, -1)
        x = np.where(drop, -np.inf, x)
    if s.min_p:
        probs = np.exp(_log_softmax(x))
        drop = probs < s.min_p * probs.max(-1, keepdims=True)
        drop[np.arange(len(x)), probs.argmax(-1)] = False
        x = np.where(drop, -np.inf, x)
    return x


FILTERS = [
    Sampling(temperature=1.0),
    Sampling(temperature=0.7, top_k=5),
    Sampling(top_k=1),
    Sampling(top_k=VOCAB + 3),
    Sampling(top_p=0.5),
    Sampling(temperature=1.3, top_p=0.9),
    Sampling(top_p=1e-6),  # only the most likely token
    Sampling(min_p=0.1),
    Sampling(temperature=0.5, min_p=0.3),
    Sampling(temperature=0.8, top_k=20, top_p=0.8, min_p=0.05),
]


def _logits(rows: int = 64) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.normal(0, 2, (rows, VOCAB)).astype(np.float32)
    # ties: repeated values (at the top-k / top-p boundaries for some rows)
    x[: rows // 2, 10:20] = x[: rows // 2, :1]
    x[rows // 4 : rows // 2, ::3] = 0.5
    return x


@pytest.mark.parametrize("s", FILTERS, ids=str)
def test_filters_equal_transformers_warpers(s):
    x = _logits()
    ours = np.asarray(filter_logits(jnp.asarray(x), s), np.float64)
    theirs = _warp(x, s)
    kept, want = np.isfinite(ours), np.isfinite(theirs)
    assert kept.any(axis=-1).all()
    # Tied logits at a top-p boundary: both keep the same number of tokens, but
    # the order among equals is the sort's (transformers sorts ascending, we
    # descending), so which of the tied tokens stay may differ.
    np.testing.assert_array_equal(kept.sum(-1), want.sum(-1))
    differ = kept != want
    for r in np.flatnonzero(differ.any(-1)):
        tied = x[r][differ[r]]
        assert s.top_p < 1 and np.all(tied == tied[0]), (r, x[r][differ[r]])
        assert set(x[r][kept[r]]) == set(x[r][want[r]])
    both = kept & want
    np.testing.assert_allclose(ours[both], theirs[both], rtol=1e-6)


def test_top_p_keeps_the_token_that_crosses_p():
    probs = np.array([[0.5, 0.25, 0.125, 0.0625, 0.0625]])
    x = jnp.asarray(np.log(probs), jnp.float32)
    kept = lambda p: np.isfinite(np.asarray(filter_logits(x, Sampling(top_p=p))))[0]
    assert kept(0.5).tolist() == [1, 0, 0, 0, 0]
    assert kept(0.6).tolist() == [1, 1, 0, 0, 0]  # 0.5 < 0.6: the 0.25 crosses it
    assert kept(0.8).tolist() == [1, 1, 1, 0, 0]
    assert kept(0.1).tolist() == [1, 0, 0, 0, 0]  # at least one
    assert kept(1.0).all()


@pytest.mark.slow
def test_sampled_frequencies_follow_the_filtered_distribution():
    """The first new token of many copies of one prompt: its counts against the
    filtered softmax of the model's logits (a chi-square bound), nothing outside
    the kept set; `vocab_size` (a padded head, `resize_vocab`) masks the ids from
    it on before the filters."""
    model = _model("llama")
    rows, prompt, real = 4096, PROMPTS[0], 40
    s = Sampling(temperature=1.5, top_p=0.9, min_p=0.05)
    # the greedy test's shapes (one compile): the prompt in the first row
    tokens = np.asarray(_run(model).tokens)
    logits = _reference(model, PROMPTS, tokens)[0, 0]
    assert np.exp(_log_softmax(logits))[real:].sum() > 0.05  # the mask matters
    probs = np.exp(_log_softmax(_warp(logits[None, :real], s)))[0]
    kept = np.flatnonzero(probs > 0)
    assert 4 <= len(kept) <= 30
    out = _run(
        model, [prompt] * rows, sampling=s, max_new_tokens=1, key=jr.key(7),
        vocab_size=real,
    )  # fmt: skip
    counts = np.bincount(np.asarray(out.tokens)[:, 0], minlength=VOCAB)
    assert counts.sum() - counts[kept].sum() == 0
    expected = rows * probs[kept]
    chi2 = ((counts[kept] - expected) ** 2 / expected).sum()
    df = len(kept) - 1
    assert chi2 < df + 6 * np.sqrt(2 * df), (chi2, df)  # about 1e-5 by chance


def test_the_same_key_gives_the_same_tokens():
    model = _model("llama")
    a, b = (_run(model, sampling=TOP_K, key=jr.key(11)) for _ in range(2))
    c = _run(model, sampling=TOP_K, key=jr.key(12))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))
    assert (np.asarray(a.tokens) != np.asarray(c.tokens)).mean() > 0.3
    # greedy ignores the key
    g1, g2 = (_run(model, sampling=GREEDY, key=jr.key(k)) for k in (1, 2))
    np.testing.assert_array_equal(np.asarray(g1.tokens), np.asarray(g2.tokens))


# -- stops, compiles -----------------------------------------------------------------
class _Count:
    """A counter, hashed by identity (a static field of `Counted`)."""

    def __init__(self) -> None:
        self.n = 0

    def add(self) -> None:
        self.n += 1


class Counted(eqx.Module):
    """A model that counts `cached_features` calls: traced (Python) and run
    (`jax.debug.callback`, once per prefill or decode step). Instances with the
    same counters share their compiles."""

    model: Any
    traces: _Count = eqx.field(static=True)
    runs: _Count = eqx.field(static=True)

    def init_cache(self, *args: Any) -> Any:
        return self.model.init_cache(*args)

    def cached_features(self, *args: Any, **kw: Any) -> Any:
        self.traces.add()
        jax.debug.callback(self.runs.add)
        return self.model.cached_features(*args, **kw)

    def head(self, x: jax.Array) -> jax.Array:
        return self.model.head(x)


def test_stop_ids_end_rows_and_pad_after():
    model = _model("llama")
    full = np.asarray(_run(model).tokens)
    # the most frequent token past the first: rows stop at different steps
    stop = int(np.bincount(full[:, 1:].ravel()).argmax())
    other = int(full[0, -1]) if full[0, -1] != stop else int(full[0, -2])
    out = _run(model, stop_ids=(stop, other), pad_id=VOCAB + 1)
    hit = (full == stop) | (full == other)
    first = np.where(hit.any(1), hit.argmax(1), NEW - 1)
    assert len(set(first)) > 1, "the rows should stop at different steps"
    np.testing.assert_array_equal(np.asarray(out.lengths), first + 1)
    keep = np.arange(NEW)[None] <= first[:, None]
    np.testing.assert_array_equal(
        np.asarray(out.tokens), np.where(keep, full, VOCAB + 1)
    )
    logprobs = np.asarray(out.logprobs)
    np.testing.assert_array_equal(logprobs[~keep], 0.0)
    assert (logprobs[keep] < 0).all()


STOPPING = {"stop_ids": (0,), "pad_id": -1}


@pytest.fixture(scope="module")
def dead_run() -> tuple[Any, Any, tuple[_Count, _Count]]:
    """A model whose every logit is 0 (its final norm zeroed): argmax is token 0,
    a stop id (`STOPPING`), at once. Its output, the model and its counters
    (traces, runs), which the tests below share with one compile."""
    base = _model("llama")
    dead = eqx.tree_at(lambda m: m.norm.weight, base, jnp.zeros_like(base.norm.weight))
    counters = (_Count(), _Count())
    model = Counted(dead, *counters)
    out = _run(model, **STOPPING)
    jax.effects_barrier()
    return out, model, counters


def test_the_loop_ends_when_every_row_has_stopped(dead_run):
    """One prefill and no decode step when every row stops at once; the same
    program on the real weights decodes until its last row stops."""
    out, model, (_, runs) = dead_run
    np.testing.assert_array_equal(np.asarray(out.lengths), 1)
    np.testing.assert_array_equal(np.asarray(out.tokens)[:, 0], 0)
    np.testing.assert_array_equal(np.asarray(out.tokens)[:, 1:], -1)
    np.testing.assert_allclose(np.asarray(out.logprobs)[:, 0], -np.log(VOCAB))
    start = runs.n
    assert start >= 1  # the fixture's run: 1 (later tests add theirs)
    live = eqx.tree_at(lambda m: m.model, model, _model("llama"))
    out = _run(live, **STOPPING)
    jax.effects_barrier()
    longest = int(np.asarray(out.lengths).max())
    assert longest > 1
    assert runs.n - start == 1 + (longest - 1)  # a prefill, then a step per token


def test_a_second_call_of_the_same_shapes_does_not_retrace(dead_run):
    """Traces counted as the model's Python calls: the first call of these
    shapes and settings traced once (prefill and decode); later ones with other
    prompts of the same padded width, another key, numpy or jax inputs, other
    weights of the same shapes reuse it."""
    _, model, (traces, _) = dead_run
    assert traces.n == 2
    other = [[int(t) % 7 + 1 for t in p] for p in PROMPTS]
    tokens, lengths = left_pad(other, pad_id=0)
    generate(
        model, jnp.asarray(tokens), lengths, max_new_tokens=NEW, key=jr.key(5),
        **STOPPING,
    )  # fmt: skip
    _run(model, other, key=jr.key(1), **STOPPING)
    _run(eqx.tree_at(lambda m: m.model, model, Llama(LLAMA, jr.key(9))), **STOPPING)
    assert traces.n == 2


# -- a mesh, bf16 --------------------------------------------------------------------
@pytest.mark.tuned  # re-run under each CPU setting (test_tuned_settings.py)
def test_a_sharded_run_equals_one_device():
    assert jax.device_count() == 8, (
        "needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
    )
    model = _model("llama")
    prompts = PROMPTS  # 8 rows: 2 per (data, fsdp) shard
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sharding.rules_for(model, mesh, fsdp_min_size=1)
    placed = sharding.shard(model, sharding.state_shardings(model, mesh, rules))
    assert not placed.layers.self_attn.q_proj.weight.sharding.is_fully_replicated
    one = _run(model, prompts)
    out = _run(placed, prompts, mesh=mesh)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(one.tokens))
    np.testing.assert_allclose(
        np.asarray(out.logprobs), np.asarray(one.logprobs), rtol=1e-4, atol=1e-5
    )
    # the cache, [layers, rows, kv_heads, slots, head_dim] = [2, 8, 2, 28, 8], is
    # held per device as [2, 2, 1, 28, 8]: rows over data x fsdp, heads over tensor
    from eqtrain.generate import _generate, _settings

    tokens, lengths = left_pad(prompts, pad_id=0)
    settings = _settings(NEW, GREEDY, (), 0, None, mesh)
    args = (placed, jnp.asarray(tokens), jnp.asarray(lengths), jr.key(0))
    lowered = _generate.lower(*args, settings).lowered
    hlo = lowered.compile().as_text()
    assert "f32[2,2,1,28,8]" in hlo and "f32[2,8,2,28,8]" not in hlo


def test_bf16_parameters_generate():
    config = dataclasses.replace(LLAMA, param_dtype="bfloat16")
    model = Llama(config, jr.key(1))
    assert model.init_cache(1, 4, jnp.zeros(1, jnp.int32)).k.dtype == jnp.bfloat16
    out = _run(model, sampling=TOP_K)
    logprobs = np.asarray(out.logprobs)
    assert out.logprobs.dtype == jnp.float32
    assert np.isfinite(logprobs).all() and (logprobs < 0).all()
    assert np.asarray(out.tokens).max() < VOCAB


# -- bad inputs ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, kw",
    [
        ("temperature", {"temperature": -0.1}),
        ("top_k", {"top_k": -1}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
        ("min_p", {"min_p": 1.0}),
        ("min_p", {"min_p": -0.2}),
    ],
)
def test_bad_sampling_values_name_the_field(field, kw):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        Sampling(**kw)


def test_bad_inputs_name_the_field():
    model = _model("llama")
    tokens, lengths = left_pad(PROMPTS, pad_id=0)
    call = lambda t, n, **kw: generate(model, t, n, key=jr.key(0), **kw)
    with pytest.raises(ConfigError, match="`max_new_tokens`"):
        call(tokens, lengths, max_new_tokens=0)
    with pytest.raises(ConfigError, match="`lengths`"):
        call(tokens, lengths[:2], max_new_tokens=2)
    with pytest.raises(ConfigError, match="`prompts`"):
        call(tokens[0], lengths[:1], max_new_tokens=2)
    for wrong in (0, tokens.shape[1] + 1):  # no prompt, or more than the width
        with pytest.raises(ConfigError, match="row 1 has"):
            call(
                tokens,
                np.where(np.arange(len(lengths)) == 1, wrong, lengths),
                max_new_tokens=2,
            )
    with pytest.raises(ConfigError, match="prompt"):
        left_pad([[1, 2], []], pad_id=0)
    with pytest.raises(ConfigError, match="prompt"):
        left_pad([], pad_id=0)


# -- finished rows leave the batch (`shrink`) ----------------------------------------
# 32 rows (`SHRINK_FROM`) of random prompts; a fifth of the vocabulary stops a row,
# so sampled lengths spread from 1 to the limit and the batch shrinks twice
SHRINK_PROMPTS = [
    np.random.default_rng(3).integers(1, VOCAB, n).tolist()
    for n in np.random.default_rng(4).integers(1, 16, 32)
]
SHRINK_STOPS = tuple(range(40, 50))


def _shrunk(model: Any, stages: tuple[int, ...], sampling: Sampling, **kw: Any) -> Any:
    """`generate`'s compiled body with the batch sizes `stages`."""
    from eqtrain.generate import _generate, _settings

    tokens, lengths = left_pad(SHRINK_PROMPTS, pad_id=0)
    s = _settings(32, sampling, SHRINK_STOPS, 0, None, kw.get("mesh"))
    s = dataclasses.replace(s, stages=stages)
    args = (jnp.asarray(tokens), jnp.asarray(lengths), jr.key(5))
    return _generate(model, *args, s)


def test_shrink_stages():
    from eqtrain.generate import SHRINK_FROM, _stages

    assert SHRINK_FROM == 32 and _stages(31) == ()
    assert _stages(32) == (32, 8, 2) and _stages(64) == (64, 16, 4)
    assert _stages(1000) == (1000, 250, 63)


def test_shrinking_greedy_equals_every_row_decoded():
    model = _model("llama")
    tokens, lengths = left_pad(SHRINK_PROMPTS, pad_id=0)
    kw = dict(max_new_tokens=32, key=jr.key(5), stop_ids=SHRINK_STOPS)
    one = generate(model, tokens, lengths, **kw)
    out = generate(model, tokens, lengths, shrink=True, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(one.tokens))
    np.testing.assert_array_equal(np.asarray(out.lengths), np.asarray(one.lengths))
    np.testing.assert_allclose(
        np.asarray(out.logprobs), np.asarray(one.logprobs), rtol=1e-5, atol=1e-6
    )


def test_a_shrinking_batchs_samples_do_not_depend_on_its_stages():
    """Each row draws with its own key: the same tokens whether the batch
    shrinks (as `shrink=True` does), shrinks otherwise, or never does."""
    model = _model("llama")
    runs = [_shrunk(model, stages, TOP_K) for stages in ((32, 8, 2), (32, 16), (32,))]
    lengths = np.asarray(runs[0].lengths)
    # every stage was reached: steps with at most 8, then at most 2 rows live
    assert lengths.min() < 4 and np.sort(lengths)[-3] < lengths.max()
    for run in runs[1:]:
        np.testing.assert_array_equal(
            np.asarray(run.tokens), np.asarray(runs[0].tokens)
        )
        np.testing.assert_array_equal(np.asarray(run.lengths), lengths)
        # (a smaller batch may round its products differently: f32 tolerance)
        np.testing.assert_allclose(
            np.asarray(run.logprobs), np.asarray(runs[0].logprobs), rtol=1e-5, atol=1e-5
        )
    # after its stop token a row holds padding and log-probability 0
    tokens, logprobs = np.asarray(runs[0].tokens), np.asarray(runs[0].logprobs)
    after = np.arange(32)[None, :] >= lengths[:, None]
    assert (tokens[after] == 0).all() and (logprobs[after] == 0).all()


def test_a_shrinking_batch_on_a_mesh_equals_one_device():
    model = _model("llama")
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sharding.rules_for(model, mesh, fsdp_min_size=1)
    placed = sharding.shard(model, sharding.state_shardings(model, mesh, rules))
    one = _shrunk(model, (32, 8, 2), TOP_K)
    out = _shrunk(placed, (32, 8, 2), TOP_K, mesh=mesh)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(one.tokens))
    np.testing.assert_allclose(
        np.asarray(out.logprobs), np.asarray(one.logprobs), rtol=1e-4, atol=1e-5
    )
