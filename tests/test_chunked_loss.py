"""The chunked LM head and loss (`eqtrain._chunked`, `losses.chunked_*`): equal to
`causal_lm_loss` and `preference.sequence_logprobs` in value and gradient, with
no `[tokens, vocab]` intermediate; `features`/`head_weight` of the models."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import optax
import pytest

import eqtrain
from eqtrain import ConfigError, _chunked, lora, losses, sharding
from eqtrain.models import GPT2, GPT2Config, Llama, LlamaConfig, resize_vocab
from eqtrain.post_training import preference


LLAMA = LlamaConfig(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
GPT = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
RTOL, ATOL = 1e-5, 1e-6
# The two model cases, shared by several tests (one compile each): an untied
# Llama with z-loss, a tied GPT-2 padded to 72 ids (`vocab_size` masking).
CASES = {
    "llama": dict(z_loss=1e-2, vocab_size=None),
    "gpt2": dict(z_loss=1e-3, vocab_size=64),
}
NAIVE = {k: losses.causal_lm_loss_fn(**v) for k, v in CASES.items()}
CHUNKED = {k: losses.chunked_causal_lm_loss_fn(chunk=6, **v) for k, v in CASES.items()}


@functools.cache
def make(kind, **changes):
    if kind == "llama":
        return Llama(LlamaConfig(**{**vars(LLAMA), **changes}), jr.key(0))
    return resize_vocab(GPT2(GPT2Config(**{**vars(GPT), **changes}), jr.key(0)), 72)


def lm_batch(rows=8, seq=10, vocab=64, seed=0):
    """Packed rows, a random mask and one fully masked row (garbage targets
    included): 80 tokens in chunks of 6, the ragged last one of 2 tokens, chunk 2
    (tokens 12..17) all masked."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (rows, seq + 1)).astype(np.int32)
    mask = (rng.random((rows, seq)) < 0.7).astype(np.float32)
    mask[1] = 0.0
    targets = tokens[:, 1:].copy()
    targets[1] = -100
    segs = np.repeat([[1, 2]], rows, 0).repeat(seq // 2, 1).astype(np.int32)
    return {
        "tokens": tokens[:, :-1],
        "targets": targets,
        "loss_mask": mask,
        "segment_ids": segs,
    }


BATCH = lm_batch()


@eqx.filter_jit
def value_and_grads(loss_fn, model, batch, key=None):
    return eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, batch, key)


def assert_close(a, b, rtol=RTOL, atol=ATOL):
    a, b = eqx.filter(a, eqx.is_array), eqx.filter(b, eqx.is_array)
    assert jtu.tree_structure(a) == jtu.tree_structure(b)
    for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b), strict=True):
        x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def assert_finite(tree):
    # assert_allclose takes NaN == NaN: a comparison alone cannot catch NaN.
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jtu.tree_leaves(tree))


# -- models: features and head_weight ----------------------------------------------
@pytest.mark.parametrize("kind, tied", [("llama", False), ("gpt2", True)])
def test_call_is_features_times_head_weight(kind, tied):
    model = make(kind)
    tokens = jnp.asarray(BATCH["tokens"][0])
    logits, h = jax.jit(lambda m, t: (m(t), m.features(t)))(model, tokens)
    vocab = model.config.vocab_size
    assert h.shape == (10, 16) and model.head_weight().shape == (vocab, 16)
    table = model.embed_tokens if kind == "llama" else model.wte
    assert model.head_weight() is (table if tied else model.lm_head).weight
    np.testing.assert_allclose(logits, h @ model.head_weight().T, rtol=RTOL, atol=ATOL)


def test_lora_head_weight_includes_the_adapter_and_refuses_dropout():
    base = make("llama")
    spec = lora.LoRA(rank=2, targets=r"lm_head$")
    model = lora.apply(base, spec, key=jr.key(1))
    # A non-zero B, so the adapter changes the head.
    model = eqx.tree_at(lambda m: m.lm_head.lora_b, model, jnp.full((64, 2), 0.1))
    tokens = jnp.arange(6)
    got, want = eqx.filter_jit(
        lambda m: (m.features(tokens) @ m.head_weight().T, m(tokens))
    )(model)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-5)
    np.testing.assert_array_equal(
        lora.disable(model).head_weight(), base.lm_head.weight
    )
    # Gradients reach the adapter through head_weight.
    loss = losses.chunked_causal_lm_loss_fn(chunk=4)
    trainable = lora.trainable(model)
    batch = BATCH
    _, g1 = value_and_grads(loss, model, batch)
    _, g2 = value_and_grads(losses.causal_lm_loss, model, batch)
    assert_close(g1.lm_head, g2.lm_head, atol=1e-5)
    assert trainable.lm_head.lora_b and float(jnp.abs(g1.lm_head.lora_a).sum()) > 0
    dropped = lora.apply(
        base, lora.LoRA(rank=2, targets=r"lm_head$", dropout=0.1), key=jr.key(1)
    )
    eqx.filter_eval_shape(loss, dropped, batch)  # no key: evaluation, fine
    with pytest.raises(ConfigError, match="lm_head.*LoRA `targets`"):
        eqx.filter_eval_shape(loss, dropped, batch, jr.key(2))


# -- the loss equals causal_lm_loss ------------------------------------------------
@pytest.mark.parametrize(
    "kind", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)]
)
def test_chunked_loss_equals_causal_lm_loss(kind):
    model = make(kind)
    (l1, a1), g1 = value_and_grads(NAIVE[kind], model, BATCH)
    (l2, a2), g2 = value_and_grads(CHUNKED[kind], model, BATCH)
    assert a1.keys() == a2.keys() == {"accuracy", "weight", "z_loss"}
    assert_close((l1, a1), (l2, a2))
    assert_close(g1, g2)


def _naive_sums(h, w, t, m, z_loss, vocab_size):
    logits = losses.vocab_mask(h @ w.T, vocab_size)
    t = jnp.where(m > 0, t, 0)
    nll, log_z, correct = losses._token_cross_entropy(logits, t)
    total = jnp.sum(m * (nll + z_loss * jnp.square(log_z)))
    return total, jnp.sum(m * nll), jnp.sum(m * jnp.square(log_z)), jnp.sum(m * correct)


@pytest.mark.parametrize("chunk", [1, 4, 7, 30, 1000])
def test_kernel_chunk_sizes(chunk):
    h = jr.normal(jr.key(0), (30, 8))
    w = jr.normal(jr.key(1), (13, 8))
    # Garbage targets on masked rows only (unmasked ones at -100 made the sums NaN,
    # and assert_allclose takes NaN == NaN).
    t = jr.randint(jr.key(2), (30,), 0, 11).at[14:24].set(-100)
    m = jr.uniform(jr.key(3), (30,)).at[12:26].set(0.0)  # fractional weights too
    w = w.at[3].set(w[5]).at[11:].set(9.0)  # a tie for the max; padded rows

    def chunked(h, w):
        ce = losses.chunked_cross_entropy(
            h, w, t, m, chunk=chunk, z_loss=0.1, vocab_size=11
        )
        return ce.total, tuple(ce)

    naive = lambda h, w: (
        _naive_sums(h, w, t, m, 0.1, 11)[0],
        _naive_sums(h, w, t, m, 0.1, 11),
    )
    grad = lambda f: jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(h, w)
    got = grad(chunked)
    assert_finite(got)
    assert_close(grad(naive), got)


def test_all_masked_is_zero_with_zero_gradients():
    h, w = jr.normal(jr.key(0), (9, 8)), jr.normal(jr.key(1), (11, 8))
    t, m = jnp.full(9, -100), jnp.zeros(9)
    f = lambda h, w: losses.chunked_cross_entropy(h, w, t, m, chunk=4, z_loss=0.1)
    ce = f(h, w)
    dh, dw = jax.grad(lambda h, w: f(h, w).total, (0, 1))(h, w)
    assert all(float(x) == 0.0 for x in ce)
    assert not np.any(np.asarray(dh)) and not np.any(np.asarray(dw))


def test_masked_rows_contribute_exactly_zero_even_if_not_finite():
    h = jr.normal(jr.key(0), (9, 8))
    w = jr.normal(jr.key(1), (11, 8))
    t = jnp.arange(9) % 11
    m = jnp.ones(9).at[3:6].set(0.0)
    bad = h.at[3:6].set(jnp.nan)  # a whole chunk of 3: masked, not finite
    f = lambda h, w: losses.chunked_cross_entropy(h, w, t, m, chunk=3).total
    v1, (dh1, dw1) = jax.value_and_grad(f, argnums=(0, 1))(h, w)
    v2, (dh2, dw2) = jax.value_and_grad(f, argnums=(0, 1))(bad, w)
    assert float(v1) == float(v2) and np.isfinite(float(v1))
    np.testing.assert_array_equal(dw1, dw2)
    np.testing.assert_array_equal(dh2[3:6], 0.0)


def test_bf16_kernel_keeps_dtypes_and_matches():
    h = jr.normal(jr.key(0), (30, 8)).astype(jnp.bfloat16)
    w = jr.normal(jr.key(1), (13, 8)).astype(jnp.bfloat16)
    t = jr.randint(jr.key(2), (30,), 0, 13)
    m = jnp.ones(30).at[:5].set(0.0)
    chunked = lambda h, w: losses.chunked_cross_entropy(h, w, t, m, chunk=8).total
    naive = lambda h, w: _naive_sums(h, w, t, m, 0.0, None)[0]
    v1, g1 = jax.jit(jax.value_and_grad(naive, (0, 1)))(h, w)
    v2, g2 = jax.jit(jax.value_and_grad(chunked, (0, 1)))(h, w)
    assert v2.dtype == jnp.float32
    assert g2[0].dtype == g2[1].dtype == jnp.bfloat16
    # The plain loss rounds the logits to bf16 first; these stay f32.
    assert_close((v1, g1), (v2, g2), rtol=2e-2, atol=5e-2)


@pytest.mark.slow  # the default suite's time; the kernel's bf16 test stays
def test_train_step_with_bf16_precision():
    model = make("llama")
    opt = optax.sgd(0.1)
    state = eqtrain.TrainState.create(model, opt, key=0)
    batch = BATCH
    out = []
    for loss_fn in (NAIVE["llama"], CHUNKED["llama"]):
        step = eqtrain.train_step(loss_fn, opt, precision="bf16")
        out.append(jax.jit(step)(state, batch)[1])
    np.testing.assert_allclose(out[0]["loss"], out[1]["loss"], rtol=1e-2)
    np.testing.assert_allclose(out[0]["grad_norm"], out[1]["grad_norm"], rtol=5e-2)
    assert out[0]["weight"] == out[1]["weight"]


def test_eval_path_equals_train_path():
    # The undifferentiated call runs the custom_vjp's primal (no gradient work).
    model, loss_fn = make("gpt2"), CHUNKED["gpt2"]
    evaluated = eqx.filter_jit(loss_fn)(model, BATCH)
    trained, _ = value_and_grads(loss_fn, model, BATCH)
    assert_close(evaluated, trained)


@pytest.mark.parametrize(
    "kind, axes",
    [("llama", (2, 2, 2)), pytest.param("gpt2", (1, 2, 4), marks=pytest.mark.slow)],
)
def test_sharded_fsdp_and_tensor_parallel(kind, axes):
    model, batch = make(kind), BATCH
    (l1, a1), g1 = value_and_grads(NAIVE[kind], model, batch)
    mesh = sharding.make_mesh(dict(zip(("data", "fsdp", "tensor"), axes, strict=True)))
    opt = optax.sgd(0.1)
    state = eqtrain.TrainState.create(model, opt, key=0)
    rules = sharding.rules_for(model, mesh, fsdp_min_size=256)
    state_sh = sharding.state_shardings(state, mesh, rules, optimizer=opt)
    placed = sharding.shard(state, state_sh).model
    placed_batch = jax.device_put(batch, sharding.batch_sharding(mesh))
    (l2, a2), g2 = value_and_grads(CHUNKED[kind], placed, placed_batch)
    head = placed.head_weight()
    assert len(head.sharding.device_set) == 8 and not head.sharding.is_fully_replicated
    assert_close((l1, a1), (l2, a2))
    assert_close(g1, g2, atol=1e-5)  # sums over 8 devices in another order


# -- sequence log-probs ------------------------------------------------------------
def test_chunked_sequence_logprobs_equals_sequence_logprobs():
    h = jr.normal(jr.key(0), (2, 3, 7, 8))
    w = jr.normal(jr.key(1), (13, 8)).at[11:].set(5.0)  # padded rows: masked out
    t = jr.randint(jr.key(2), (2, 3, 7), 0, 11)
    mask = jr.bernoulli(jr.key(3), 0.6, (2, 3, 7)).at[0, 1].set(False)

    def naive(h, w):
        logits = jnp.einsum("...d,vd->...v", h, w)
        return preference.sequence_logprobs(logits, t, mask, vocab_size=11)

    def chunked(h, w):
        return losses.chunked_sequence_logprobs(h, w, t, mask, chunk=5, vocab_size=11)

    (lp1, n1), (lp2, n2) = jax.jit(naive)(h, w), jax.jit(chunked)(h, w)
    assert lp2.shape == n2.shape == (2, 3) and float(lp2[0, 1]) == 0.0
    assert_close((lp1, n1), (lp2, n2))
    # A cotangent per sequence, as DPO gives: the backward recomputes the chunks.
    c = jr.normal(jr.key(4), (2, 3))
    grad = lambda f: jax.jit(jax.grad(lambda h, w: jnp.sum(c * f(h, w)[0]), (0, 1)))(
        h, w
    )
    assert_close(grad(naive), grad(chunked))


# -- logit transforms: Granite's scale, Gemma 2/3's final soft-cap -----------------
def _transform(z, logit_scale=1.0, softcap=None):
    """The plain transforms, as a model's head applies them to full logits."""
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
    return z


TRANSFORMS = {
    "both": dict(logit_scale=0.25, softcap=3.0),
    "scale": dict(logit_scale=0.25),
    "softcap": dict(softcap=3.0),
}


def _kernel_inputs():
    # Logits of a few units (std ~5.7), so that the soft-cap bends them without
    # saturating; padded rows 11, 12 with huge logits that the mask must drop.
    h = 2.0 * jr.normal(jr.key(0), (30, 8))
    w = jr.normal(jr.key(1), (13, 8)).at[11:].set(9.0)
    t = jr.randint(jr.key(2), (30,), 0, 11).at[14:24].set(-100)  # masked rows
    m = jr.uniform(jr.key(3), (30,)).at[12:26].set(0.0)
    return h, w, t, m


@pytest.mark.parametrize("chunk", [4, 7, 1000])
@pytest.mark.parametrize("which", list(TRANSFORMS))
@pytest.mark.parametrize("z_loss, vocab_size", [(0.0, None), (0.1, 11)])
def test_kernels_with_logit_transforms_equal_full_logits(
    which, chunk, z_loss, vocab_size
):
    opts = TRANSFORMS[which]
    h, w, t, m = _kernel_inputs()
    full = lambda h, w: losses.vocab_mask(_transform(h @ w.T, **opts), vocab_size)
    grad = lambda f: jax.jit(jax.value_and_grad(f, (0, 1), has_aux=True))(h, w)

    def naive(h, w):
        nll, log_z, correct = losses._token_cross_entropy(
            full(h, w), jnp.where(m > 0, t, 0)
        )
        total = nll + z_loss * jnp.square(log_z)
        sums = tuple(jnp.sum(m * x) for x in (total, nll, jnp.square(log_z), correct))
        return sums[0], sums

    def chunked(h, w):
        ce = losses.chunked_cross_entropy(
            h, w, t, m, chunk=chunk, z_loss=z_loss, vocab_size=vocab_size, **opts
        )
        return ce.total, tuple(ce)

    (v1, s1), g1 = grad(naive)
    (v2, s2), g2 = grad(chunked)
    assert_finite((v2, s2, g2))
    assert_close((v1, s1, g1), (v2, s2, g2))
    # The transforms matter here: the plain logits give another loss.
    plain = losses.chunked_cross_entropy(
        h, w, t, m, chunk=chunk, z_loss=z_loss, vocab_size=vocab_size
    )
    assert abs(float(plain.total) - float(v2)) > 1e-2 * abs(float(v2))

    # Per-token log-probs, with a cotangent per token (zeros included).
    tv = jnp.where(m > 0, t, 0)
    c = jr.normal(jr.key(4), (30,)).at[5:9].set(0.0)

    def naive_logp(h, w):
        logp = jax.nn.log_softmax(full(h, w), axis=-1)
        logp = jnp.take_along_axis(logp, tv[:, None], axis=-1)[:, 0]
        return jnp.sum(c * logp), logp

    def chunked_logp(h, w):
        logp = losses.chunked_token_logprobs(
            h, w, tv, chunk=chunk, vocab_size=vocab_size, **opts
        )
        return jnp.sum(c * logp), logp

    got = grad(chunked_logp)
    assert_finite(got)
    assert_close(grad(naive_logp), got)


def test_default_logit_transforms_add_no_ops():
    # Explicit defaults trace to exactly the plain kernels (bit-identical results),
    # for the loss and the log-probs, forward and backward.
    h, w, t, m = _kernel_inputs()
    tv = jnp.where(m > 0, t, 0)
    ce = lambda **o: (
        lambda h, w: (
            losses.chunked_cross_entropy(
                h, w, t, m, chunk=7, z_loss=0.1, vocab_size=11, **o
            ).total
        )
    )
    lp = lambda **o: (
        lambda h, w: jnp.sum(
            losses.chunked_token_logprobs(h, w, tv, chunk=7, vocab_size=11, **o)
        )
    )
    for f in (ce, lp):
        jaxprs = [
            str(jax.make_jaxpr(jax.value_and_grad(f(**o), (0, 1)))(h, w))
            for o in ({}, dict(logit_scale=1.0, softcap=None), dict(logit_scale=1))
        ]
        assert jaxprs[0] == jaxprs[1] == jaxprs[2]
        assert "tanh" not in jaxprs[0]
        with_cap = str(jax.make_jaxpr(jax.grad(f(softcap=3.0), (0, 1)))(h, w))
        assert "tanh" in with_cap


def test_bad_logit_transforms_are_refused():
    h, w, t = jnp.ones((2, 2)), jnp.ones((3, 2)), jnp.zeros(2, jnp.int32)
    ce = functools.partial(losses.chunked_cross_entropy, h, w, t, jnp.ones(2), chunk=2)
    lp = functools.partial(losses.chunked_token_logprobs, h, w, t, chunk=2)
    for f in (ce, lp):
        with pytest.raises(ConfigError, match="`softcap` must be None or"):
            f(softcap=0.0)
        with pytest.raises(ConfigError, match="`logit_scale` must be a finite"):
            f(logit_scale=-1.0)
    with pytest.raises(ConfigError, match="not traced arrays"):
        jax.jit(lambda s: _chunked._transforms(1.0, s))(3.0)


class CappedLM(eqx.Module):
    """A tiny LM whose head scales and soft-caps its logits (the Granite and Gemma
    2/3 heads), with the chunked losses' `features`/`head_weight`/`logit_options`."""

    embed: jax.Array
    head: jax.Array
    logit_scale: float = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True)

    def features(self, tokens, *, key=None, **rows):
        return 2.0 * jnp.tanh(self.embed[tokens])

    def head_weight(self, *, key=None):
        return self.head

    def logit_options(self):
        return {"logit_scale": self.logit_scale, "softcap": self.softcap}

    def __call__(self, tokens, *, key=None, **rows):
        z = self.features(tokens) @ self.head_weight().T
        return _transform(z, self.logit_scale, self.softcap)


def test_model_logit_options_reach_the_chunked_losses():
    # The chunked loss and DPO's chunked log-probs equal the plain ones on the
    # model's own (scaled, soft-capped) logits.
    model = CappedLM(
        jr.normal(jr.key(0), (64, 16)),
        jr.normal(jr.key(1), (64, 16)),
        logit_scale=0.25,
        softcap=3.0,
    )
    chunked = losses.chunked_causal_lm_loss_fn(chunk=6)
    want = value_and_grads(losses.causal_lm_loss, model, BATCH)
    got = value_and_grads(chunked, model, BATCH)
    assert_finite(got)
    assert_close(want, got)
    # Without the options the chunked loss would be of the plain logits.
    plain = eqx.filter_jit(chunked)(
        CappedLM(model.embed, model.head, logit_scale=1.0, softcap=None), BATCH
    )
    assert abs(float(plain[0]) - float(got[0][0])) > 1e-2

    # Preference log-probs: `preference` passes the options as well.
    pairs = {
        "chosen_tokens": BATCH["tokens"][:4],
        "rejected_tokens": BATCH["tokens"][4:],
        "chosen_targets": BATCH["targets"][:4],
        "rejected_targets": BATCH["targets"][4:],
        "chosen_mask": BATCH["loss_mask"][:4],
        "rejected_mask": BATCH["loss_mask"][4:],
    }
    logps = eqx.filter_jit(
        lambda m, chunk: preference.pair_logprobs(m, pairs, chunk=chunk)
    )
    assert_close(logps(model, None), logps(model, 5), atol=1e-5)


# -- no [tokens, vocab] intermediate -----------------------------------------------
def test_no_tokens_by_vocab_intermediate():
    n, v, d = 1024, 4096, 64
    h = jax.ShapeDtypeStruct((n, d), jnp.float32)
    w = jax.ShapeDtypeStruct((v, d), jnp.float32)
    t = jax.ShapeDtypeStruct((n,), jnp.int32)
    m = jax.ShapeDtypeStruct((n,), jnp.float32)

    def naive(h, w, t, m):
        logits = (h @ w.T)[None]
        batch = {"targets": t[None], "loss_mask": m[None], "tokens": t[None]}
        return losses.causal_lm_loss(lambda _, key: logits[0], batch)[0]

    def chunked(h, w, t, m):
        return losses.chunked_cross_entropy(h, w, t, m, chunk=128).total

    def temp(f):
        grad = jax.jit(jax.grad(f, argnums=(0, 1)))
        return grad.lower(h, w, t, m).compile().memory_analysis().temp_size_in_bytes

    big = f"[{n},{v}]"
    assert big in str(jax.make_jaxpr(jax.grad(naive, argnums=(0, 1)))(h, w, t, m))
    for f in (chunked, jax.grad(chunked, argnums=(0, 1))):
        assert big not in str(jax.make_jaxpr(f)(h, w, t, m))
    # [N, V] f32 is 16 MiB; the chunked temporaries are a few [128, V] blocks.
    assert temp(chunked) < n * v * 4 // 4 < temp(naive)


def test_bad_chunk_is_refused():
    with pytest.raises(ConfigError, match="`chunk` must be a positive int"):
        losses.chunked_causal_lm_loss_fn(chunk=0)
    with pytest.raises(ConfigError, match="`z_loss` must be >= 0"):
        losses.chunked_causal_lm_loss_fn(z_loss=-1.0)
    with pytest.raises(ConfigError, match="`chunk` must be a positive int"):
        losses.chunked_cross_entropy(
            jnp.ones((2, 2)),
            jnp.ones((3, 2)),
            jnp.zeros(2, jnp.int32),
            jnp.ones(2),
            chunk=-1,
        )
