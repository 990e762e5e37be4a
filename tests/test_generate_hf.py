"""Greedy generation against transformers' `generate(do_sample=False)`: the same
32 new tokens, float32, for every decoder family, the mixture-of-experts
families and GPT-2, from a batch of two prompts of different lengths (left
padding), past every sliding window (8) and rope switch (32).

The default run keeps one case per kind of model (a sliding-window decoder, an
MoE, GPT-2); every other variant is `slow`."""

import pytest


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.random as jr  # noqa: E402
import numpy as np  # noqa: E402

from eqtrain import hf  # noqa: E402
from eqtrain.generate import generate, left_pad  # noqa: E402

from . import _hf_families as F, test_hf_moe as M  # noqa: E402


torch.set_num_threads(1)
NEW = 32
PROMPTS = [[5, 17, 33, 8, 41, 9, 60, 3, 12, 77], [23, 4, 90, 15]]
FAST = ["mistral", "qwen3_moe", "gpt2"]
DECODERS = list(F.VARIANTS)
EXPERTS = list(M.VARIANTS)
ALL = DECODERS + EXPERTS + ["gpt2"]
F_SWITCHING = ["llama-dynamic", "llama-longrope", "phi3", "phi3-partial"]


def _hf(variant):
    if variant == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=101, n_positions=64, n_embd=32, n_layer=2, n_head=4,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        )  # fmt: skip
        with torch.random.fork_rng():  # its init draws from the global generator
            torch.manual_seed(0)
            model = transformers.GPT2LMHeadModel(config)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        return model.eval()
    if variant in EXPERTS:
        return M.hf_model(variant)
    return F.hf_model(variant)


def _theirs(model, prompts, use_cache=True):
    """transformers' greedy tokens, `[rows, NEW]`, never stopping early."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False,
            max_new_tokens=NEW, pad_token_id=0, use_cache=use_cache,
        )  # fmt: skip
    return out[:, width:].numpy()


def _check(variant, tmp_path):
    theirs_model = _hf(variant)
    theirs_model.generation_config.eos_token_id = None  # all 32 tokens
    theirs_model.save_pretrained(tmp_path)
    model, _ = hf.load(tmp_path)
    # transformers computes these ropes from the longest position of the whole
    # batch, eqtrain per row: they agree on one row (docs/generation.md)
    prompts = PROMPTS[:1] if variant in F_SWITCHING else PROMPTS
    tokens, lengths = left_pad(prompts, pad_id=0)
    run = lambda stop: generate(
        model, tokens, lengths, max_new_tokens=NEW, key=jr.key(0),
        stop_ids=stop, pad_id=0,
    )  # fmt: skip
    # transformers' Llama keeps the keys cached before a longrope switch (its
    # Phi-3 recomputes them, as eqtrain does): compare with its uncached run
    theirs = _theirs(theirs_model, prompts, use_cache=variant != "llama-longrope")
    ours = np.asarray(run(()).tokens)
    np.testing.assert_array_equal(ours, theirs, err_msg=variant)
    assert len({tuple(r) for r in ours[:, 8:]}) > 1 or len(ours) == 1, "degenerate"
    # stopping at the most frequent token: the same prefix, then padding
    stop = int(np.bincount(ours.ravel()).argmax())
    stopped = run((stop,))
    hit = ours == stop
    first = np.where(hit.any(axis=1), hit.argmax(axis=1), NEW - 1)
    np.testing.assert_array_equal(np.asarray(stopped.lengths), first + 1)
    keep = np.arange(NEW)[None] <= first[:, None]
    np.testing.assert_array_equal(np.asarray(stopped.tokens), np.where(keep, ours, 0))


def test_the_fast_cases_cover_each_kind():
    assert FAST[0] in DECODERS and F.VARIANTS[FAST[0]][1].get("sliding_window")
    assert FAST[1] in EXPERTS


@pytest.mark.parametrize("variant", FAST)
def test_greedy_tokens_equal_transformers(variant, tmp_path):
    _check(variant, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [v for v in ALL if v not in FAST])
def test_greedy_tokens_equal_transformers_every_variant(variant, tmp_path):
    _check(variant, tmp_path)
