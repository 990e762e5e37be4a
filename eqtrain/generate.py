"""Batched autoregressive sampling with a key/value cache, as a pure function of
the model pytree.

    prompts, lengths = left_pad([tokenizer.encode(t) for t in texts], pad_id=0)
    out = generate(model, prompts, lengths, max_new_tokens=64, key=jr.key(0),
                   sampling=Sampling(temperature=0.7, top_p=0.9),
                   stop_ids=(tokenizer.eos_id,))
    out.tokens   # [rows, 64]: the new tokens, `pad_id` after each row's end
    out.lengths  # [rows]: new tokens per row, its stop token included
    out.logprobs # [rows, 64]: log-probability of each sampled token (0 after the end)

The prompt runs through the model once (prefill, writing the cache); then a
`lax.while_loop` feeds one token per row at a time until every row has produced
a stop id or `max_new_tokens` tokens. Shapes are static: the cache holds
`prompt + max_new_tokens` slots, so a call compiles once per (batch, prompt
length, `max_new_tokens`) and `left_pad` rounds prompt lengths up to a multiple
of 16 to keep those few. Any model with `init_cache`, `cached_features` and
`head` generates (the decoder families and GPT-2; see `eqtrain.models.KVCache`).

Sampling follows transformers' order: logits / temperature, then top-k, top-p
and min-p filters, then a draw from an explicit key. `temperature = 0` is
greedy decoding. The log-probabilities are of the sampled token under
`softmax(logits / temperature)` before the filters (`temperature = 0`: under
`softmax(logits)`), which is what a policy-gradient loss compares its policy to.
"""

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._errors import ConfigError
from .losses import vocab_mask


_WANTED = {
    "temperature": ">= 0 (0: greedy)",
    "top_k": "an integer >= 0 (0: off)",
    "top_p": "in (0, 1] (1: off)",
    "min_p": "in [0, 1) (0: off)",
}


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits.

    Args:
        temperature: logits are divided by it; 0 is greedy (argmax).
        top_k: keep only the `top_k` most likely tokens (0: all).
        top_p: keep the smallest set of most likely tokens whose probabilities
            add up to at least `top_p` (1: all).
        min_p: keep tokens at least `min_p` times as likely as the most likely
            one (0: all).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        for name, ok in self._checks().items():
            if not ok:
                value = getattr(self, name)
                raise ConfigError(
                    f"sampling `{name}` must be {_WANTED[name]}; got {value!r}."
                )

    def _checks(self) -> dict[str, bool]:
        return {
            "temperature": self.temperature >= 0,
            "top_k": self.top_k >= 0 and int(self.top_k) == self.top_k,
            "top_p": 0 < self.top_p <= 1,
            "min_p": 0 <= self.min_p < 1,
        }

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling(temperature=0.0)


class Generation(NamedTuple):
    """What `generate` returns (see the module's docstring)."""

    tokens: Int[Array, "rows new"]
    lengths: Int[Array, " rows"]
    logprobs: Float[Array, "rows new"]


def left_pad(
    prompts: Sequence[Sequence[int] | np.ndarray], *, pad_id: int, multiple: int = 16
) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens [rows, length], lengths [rows])`: the prompts right-aligned in
    one int32 array, `pad_id` before them, `length` the longest prompt rounded
    up to a multiple of `multiple` (so that calls compile for few lengths)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("every prompt needs at least one token (got an empty one).")
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = -(-int(lengths.max()) // multiple) * multiple
    tokens = np.full((len(prompts), width), pad_id, np.int32)
    for r, p in enumerate(prompts):
        tokens[r, width - len(p) :] = np.asarray(p, np.int32)
    return tokens, lengths


def filter_logits(
    logits: Float[Array, "rows vocab"], sampling: Sampling
) -> Float[Array, "rows vocab"]:
    """`logits / temperature` with the tokens that top-k, top-p and min-p drop
    set to -inf (f32)."""
    x = logits.astype(jnp.float32) / jnp.float32(sampling.temperature)
    if sampling.top_k and sampling.top_k < x.shape[-1]:
        x = _top_k(x, sampling.top_k)
    if sampling.top_p < 1:
        x = _top_p(x, sampling.top_p)
    if sampling.min_p > 0:
        x = _min_p(x, sampling.min_p)
    return x


def _top_k(x: Array, k: int) -> Array:
    kth = jax.lax.top_k(x, k)[0][..., -1:]
    return jnp.where(x < kth, -jnp.inf, x)


def _top_p(x: Array, top_p: float) -> Array:
    order = jnp.argsort(-x, axis=-1)
    sorted_x = jnp.take_along_axis(x, order, axis=-1)
    probs = jax.nn.softmax(sorted_x, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the likelier tokens
    drop = _unsorted(before >= top_p, order)
    return jnp.where(drop, -jnp.inf, x)


def _unsorted(values: Array, order: Array) -> Array:
    """`values`, given in the order `order` sorts each row into, back in the
    row's own order."""
    rows = jnp.arange(values.shape[0])[:, None]
    return jnp.zeros_like(values).at[rows, order].set(values)


def _min_p(x: Array, min_p: float) -> Array:
    probs = jax.nn.softmax(x, axis=-1)
    floor = min_p * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(probs < floor, -jnp.inf, x)


def sample(
    logits: Float[Array, "rows vocab"], key: PRNGKeyArray, sampling: Sampling
) -> tuple[Int[Array, " rows"], Float[Array, " rows"]]:
    """One token per row and its log-probability (see the module docstring)."""
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        scaled = logits
    else:
        scaled = logits / jnp.float32(sampling.temperature)
        filtered = filter_logits(logits, sampling)
        token = jr.categorical(key, filtered, axis=-1).astype(jnp.int32)
    logp = jax.nn.log_softmax(scaled, axis=-1)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]


# `generate(shrink=True)` shrinks batches of this many rows or more.
SHRINK_FROM = 32


class _Loop(NamedTuple):
    step: Int[Array, ""]
    token: Int[Array, " rows"]
    cache: Any
    done: Any
    tokens: Int[Array, "rows new"]
    logprobs: Float[Array, "rows new"]
    lengths: Int[Array, " rows"]
    # each batch row's row of the call, when rows leave the batch (else None)
    rows: Int[Array, " rows"] | None = None


def _traced(args: Any) -> bool:
    """Whether any array among `args` is a tracer: the call is being traced
    into another compiled function."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`eqx.filter_jit(fn)`, compiled with the XLA options its caller passes
    as `options=` (`generate`'s `compiler_options`), one compilation per set
    of options. Traced inside another compiled function (generation inside a
    GRPO step) it becomes part of that one, without options: JAX accepts them
    only at the top level (`jax.jit(compiler_options=)`)."""
    versions: dict[tuple[tuple[str, Any], ...], Any] = {}

    def jitted(options: Mapping[str, Any] | None) -> Any:
        key = tuple(sorted((options or {}).items()))
        if key not in versions:
            versions[key] = eqx.filter_jit(fn, compiler_options=dict(key) or None)
        return versions[key]

    @functools.wraps(fn)
    def call(*args: Any, options: Mapping[str, Any] | None = None) -> Any:
        return jitted(None if _traced(args) else options)(*args)

    call.lower = lambda *args, options=None: jitted(options).lower(*args)  # type: ignore[attr-defined]
    return call


@dataclasses.dataclass(frozen=True)
class _Settings:
    """What a compiled generation is specialised to (hashable: a static jit
    argument)."""

    max_new_tokens: int
    sampling: Sampling
    stop_ids: tuple[int, ...]
    pad_id: int
    vocab_size: int | None
    mesh: Any
    # the decode batch's sizes as rows finish (`_stages`); () keeps every row
    stages: tuple[int, ...] = ()


def _cache_spec(mesh: Any, cache: Any) -> Any:
    """The cache's sharding on `mesh`: rows over the batch axes, key/value
    heads over `tensor` (like the attention heads), where they divide."""
    from .sharding import BATCH_AXES

    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    rows_axes = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
    ways = int(np.prod([sizes[a] for a in rows_axes])) if rows_axes else 1
    rows = rows_axes if rows_axes and cache.k.shape[1] % ways == 0 else None
    heads = "tensor" if cache.k.shape[2] % sizes.get("tensor", 1) == 0 else None
    return NamedSharding(mesh, P(None, rows, heads, None, None))


def _constrain(cache: Any, mesh: Any) -> Any:
    """`cache` with its keys and values constrained to `_cache_spec` on `mesh`."""
    if mesh is None:
        return cache
    spec = _cache_spec(mesh, cache)
    k = jax.lax.with_sharding_constraint(cache.k, spec)
    v = jax.lax.with_sharding_constraint(cache.v, spec)
    return eqx.tree_at(lambda c: (c.k, c.v), cache, (k, v))


def _pick(
    model: Any,
    h: Array,
    key: PRNGKeyArray,
    step: Array,
    s: _Settings,
    rows: Array | None = None,
) -> tuple[Array, Array]:
    """The token (and its log-probability) drawn after hidden state `h`, with
    the key of new token number `step`; given `rows` (the call's row of each
    batch row), each row draws with its own key, so a row's tokens do not
    depend on which rows share its batch."""
    logits = vocab_mask(model.head(h), s.vocab_size)
    key = jr.fold_in(key, step)
    if rows is None:
        return sample(logits, key, s.sampling)
    keys = jax.vmap(jr.fold_in, (None, 0))(key, rows)
    one = lambda k, x: sample(x[None], k, s.sampling)
    token, logp = jax.vmap(one)(keys, logits)
    return token[:, 0], logp[:, 0]


def _prefill(
    model: Any,
    prompts: Int[Array, "rows prompt"],
    lengths: Int[Array, " rows"],
    key: PRNGKeyArray,
    s: _Settings,
) -> _Loop:
    """The prompts through the model into a new cache, and the first new token."""
    rows, width = prompts.shape
    cache = model.init_cache(rows, width + s.max_new_tokens, width - lengths)
    cache = _constrain(cache, s.mesh)
    hidden, cache = model.cached_features(prompts, cache, 0, prefill=True)
    ids = jnp.arange(rows, dtype=jnp.int32) if s.stages else None
    token, logp = _pick(model, hidden[:, -1], key, jnp.int32(0), s, ids)
    new = s.max_new_tokens
    return _Loop(
        step=jnp.int32(1),
        token=token,
        cache=_constrain(cache, s.mesh),
        done=jnp.isin(token, _stops(s)),
        tokens=jnp.full((rows, new), s.pad_id, jnp.int32).at[:, 0].set(token),
        logprobs=jnp.zeros((rows, new), jnp.float32).at[:, 0].set(logp),
        lengths=jnp.ones((rows,), jnp.int32),
        rows=ids,
    )


def _stops(s: _Settings) -> Array:
    return jnp.asarray(s.stop_ids, jnp.int32).reshape(-1)


def _hidden(
    model: Any, prompts: Array, st: _Loop, slot: Array, s: _Settings
) -> tuple[Array, Any]:
    """The hidden state of the last token fed at `slot`, and the cache after it:
    one decode step, or at a rope switch the whole text so far through an
    empty cache (as transformers' Phi-3 does)."""
    # the slot (position) where a longrope model recomputes its cache
    switch = getattr(model, "rope_switch", None)
    if switch is not None and not switch < prompts.shape[1] + s.max_new_tokens - 1:
        switch = None  # no row reaches it

    def decode(st: _Loop, slot: Array) -> tuple[Array, Any]:
        h, cache = model.cached_features(st.token[:, None], st.cache, slot)
        return h[:, 0], cache

    def redo(st: _Loop, slot: Array) -> tuple[Array, Any]:
        text = jnp.concatenate([prompts, st.tokens], axis=1)
        text = text[:, : prompts.shape[1] + s.max_new_tokens]
        empty = eqx.tree_at(lambda c: (c.k, c.v), st.cache, replace_fn=jnp.zeros_like)
        h, cache = model.cached_features(text, empty, 0, prefill=True, last=slot)
        return jax.lax.dynamic_index_in_dim(h, slot, 1, keepdims=False), cache

    if switch is None:
        return decode(st, slot)
    crossing = jnp.any(slot - st.cache.pads == switch)
    return jax.lax.cond(crossing, redo, decode, st, slot)


def _advance(
    model: Any, prompts: Array, key: PRNGKeyArray, st: _Loop, s: _Settings
) -> _Loop:
    """One new token per row (`pad_id` for the rows already done)."""
    slot = prompts.shape[1] + st.step - 1
    h, cache = _hidden(model, prompts, st, slot, s)
    token, logp = _pick(model, h, key, st.step, s, st.rows)
    live = ~st.done
    token = jnp.where(live, token, s.pad_id)
    at = lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, st.step, 1)
    return _Loop(
        step=st.step + 1,
        token=token,
        cache=_constrain(cache, s.mesh),
        done=st.done | jnp.isin(token, _stops(s)),
        tokens=at(st.tokens, token),
        logprobs=at(st.logprobs, jnp.where(live, logp, 0.0)),
        lengths=st.lengths + live.astype(jnp.int32),
        rows=st.rows,
    )


def _run_until(
    model: Any, prompts: Array, key: PRNGKeyArray, st: _Loop, limit: Array, s: _Settings
) -> _Loop:
    """Advance until every row is done, or `limit` new tokens per row exist."""
    limit = jnp.minimum(limit, s.max_new_tokens)
    more = lambda st: (st.step < limit) & ~jnp.all(st.done)
    return jax.lax.while_loop(more, lambda st: _advance(model, prompts, key, st, s), st)


def _stages(rows: int) -> tuple[int, ...]:
    """The sizes the decode batch takes as rows finish: every row, then a
    quarter, then a sixteenth (at least one); batches under `SHRINK_FROM` rows
    keep theirs (too few rows to gain what a smaller batch saves). Each size is
    one more compiled decode step, so there are at most three."""
    if rows < SHRINK_FROM:
        return ()
    return (rows, -(-rows // 4), -(-rows // 16))


def _run_shrinking(
    model: Any, prompts: Array, key: PRNGKeyArray, st: _Loop, s: _Settings
) -> Generation:
    """Decode with the batch shrinking through `s.stages`: when no more rows are
    live than the next size holds, the live rows (their cache, prompt and state)
    move into a batch of that size, so the cost of a step follows the rows still
    generating, not the rows of the call."""
    out = Generation(tokens=st.tokens, lengths=st.lengths, logprobs=st.logprobs)
    following = (*s.stages[1:], 0)
    for size in following:
        more = lambda st, n=size: (st.step < s.max_new_tokens) & (jnp.sum(~st.done) > n)
        advance = lambda st, p=prompts: _advance(model, p, key, st, s)
        st = jax.lax.while_loop(more, advance, st)
        out = Generation(
            tokens=out.tokens.at[st.rows].set(st.tokens),
            lengths=out.lengths.at[st.rows].set(st.lengths),
            logprobs=out.logprobs.at[st.rows].set(st.logprobs),
        )
        if size:
            keep = jnp.argsort(st.done, stable=True)[:size]  # the live rows first
            st, prompts = _take(st, keep, s), prompts[keep]
    return out


def _take(st: _Loop, keep: Array, s: _Settings) -> _Loop:
    """The rows `keep` of the decode state (their cache rows included)."""
    cache = st.cache
    cache = eqx.tree_at(
        lambda c: (c.k, c.v, c.pads),
        cache,
        (cache.k[:, keep], cache.v[:, keep], cache.pads[keep]),
    )
    by_row = lambda a: a[keep]
    return _Loop(
        step=st.step,
        token=by_row(st.token),
        cache=_constrain(cache, s.mesh),
        done=by_row(st.done),
        tokens=by_row(st.tokens),
        logprobs=by_row(st.logprobs),
        lengths=by_row(st.lengths),
        rows=by_row(st.rows),
    )


@_compiled
def _generate(
    model: Any,
    prompts: Int[Array, "rows prompt"],
    lengths: Int[Array, " rows"],
    key: PRNGKeyArray,
    s: _Settings,
) -> Generation:
    st = _prefill(model, prompts, lengths, key, s)
    if s.stages:
        return _run_shrinking(model, prompts, key, st, s)
    st = _run_until(model, prompts, key, st, jnp.int32(s.max_new_tokens), s)
    return Generation(tokens=st.tokens, lengths=st.lengths, logprobs=st.logprobs)


def generate(
    model: Any,
    prompts: Int[Array, "rows prompt"] | np.ndarray,
    lengths: Int[Array, " rows"] | np.ndarray,
    *,
    max_new_tokens: int,
    key: PRNGKeyArray,
    sampling: Sampling = GREEDY,
    stop_ids: Sequence[int] = (),
    pad_id: int = 0,
    vocab_size: int | None = None,
    mesh: Any = None,
    compiler_options: Mapping[str, Any] | None = None,
    shrink: bool = False,
) -> Generation:
    """Sample up to `max_new_tokens` tokens after each prompt (see the module
    docstring).

    Args:
        model: a language model with a cache (`eqtrain.models.Decoder`, `GPT2`,
            either with LoRA adapters); no dropout is applied.
        prompts: `[rows, length]` token ids, each prompt right-aligned with
            padding before it (`left_pad` makes them).
        lengths: each prompt's real length (`<= length`, at least 1).
        max_new_tokens: the most tokens generated per row.
        key: the randomness of sampling (unused when greedy). The same key,
            prompts and model give the same tokens.
        sampling: temperature and filters (`GREEDY` by default).
        stop_ids: a row ends after producing one of these (e.g. EOS and
            end-of-turn ids); it is included in the row's tokens and length.
        pad_id: fills the tokens after a row's end.
        vocab_size: the real vocabulary of a model with a padded head
            (`models.resize_vocab`): padded ids are never produced.
        mesh: the device mesh the model lies on: the cache is sharded over it
            (rows over the batch axes, key/value heads over `tensor`).
        compiler_options: XLA options for the compilation
            (`jax.jit(compiler_options=)`), e.g. `eqtrain.cpu.generation_options()`
            (`eqtrain generate` passes them); ignored when traced inside
            another compiled function.
        shrink: finished rows leave the decode batch. With `SHRINK_FROM` (32)
            rows or more, once no more than a quarter of the batch is still
            generating, those rows go on in a batch a quarter the size (then a
            sixteenth), so decoding costs what the rows still generating cost
            (rollouts whose completion lengths vary). Each row then draws its
            tokens with its own key (`fold_in(key, row)`), so its tokens do not
            depend on the batch: greedy tokens equal those without `shrink`;
            sampled ones are another draw. Compiles one decode step per batch
            size (at most 3).
    """
    settings = _settings(max_new_tokens, sampling, stop_ids, pad_id, vocab_size, mesh)
    prompts, lengths = _arrays(prompts, lengths)
    if shrink:
        settings = dataclasses.replace(settings, stages=_stages(prompts.shape[0]))
    options = compiler_options
    return _generate(model, prompts, lengths, key, settings, options=options)


def _settings(
    max_new_tokens: int,
    sampling: Sampling,
    stop_ids: Sequence[int],
    pad_id: int,
    vocab_size: int | None,
    mesh: Any,
) -> _Settings:
    if max_new_tokens < 1:
        raise ConfigError(f"`max_new_tokens` must be >= 1; got {max_new_tokens}.")
    stops = tuple(int(i) for i in stop_ids)
    return _Settings(
        int(max_new_tokens), sampling, stops, int(pad_id), vocab_size, mesh
    )


def _arrays(
    prompts: Array | np.ndarray, lengths: Array | np.ndarray
) -> tuple[Array, Array]:
    prompts = jnp.asarray(prompts, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    if prompts.ndim != 2 or lengths.shape != (prompts.shape[0],):
        raise ConfigError(
            f"`prompts` must be [rows, length] and `lengths` [rows]; got shapes "
            f"{prompts.shape} and {lengths.shape}."
        )
    if not isinstance(lengths, jax.core.Tracer):  # known here: check the values
        _check_lengths(np.asarray(lengths), prompts.shape[1])
    return prompts, lengths


def _check_lengths(lengths: np.ndarray, width: int) -> None:
    bad = np.flatnonzero((lengths < 1) | (lengths > width))
    if bad.size:
        raise ConfigError(
            f"`lengths` must be between 1 and the prompts' width "
            f"({width}); row {int(bad[0])} has {int(lengths[bad[0]])}."
        )


@_compiled
def _stream_start(
    model: Any, prompts: Array, lengths: Array, key: PRNGKeyArray, s: _Settings
) -> _Loop:
    return _prefill(model, prompts, lengths, key, s)


@_compiled
def _stream_more(
    model: Any, prompts: Array, key: PRNGKeyArray, st: _Loop, chunk: int, s: _Settings
) -> _Loop:
    return _run_until(model, prompts, key, st, st.step + chunk, s)


def stream(
    model: Any,
    prompt: Sequence[int] | np.ndarray,
    *,
    max_new_tokens: int,
    key: PRNGKeyArray,
    sampling: Sampling = GREEDY,
    stop_ids: Sequence[int] = (),
    pad_id: int = 0,
    vocab_size: int | None = None,
    chunk: int = 8,
    multiple: int = 16,
    compiler_options: Mapping[str, Any] | None = None,
) -> Iterator[np.ndarray]:
    """The new tokens of one prompt, yielded as they are made: first the prompt's
    first token (after a compiled prefill), then up to `chunk` tokens per
    compiled call, until a stop id (included) or `max_new_tokens`.

    The tokens are `generate`'s for the same prompt (padded by `left_pad`), key
    and settings: both run the same prefill and decode step. Each piece is an
    int32 array of token ids; together they are the row's `lengths` tokens.

    Args:
        prompt: the prompt's token ids (at least one).
        chunk: new tokens per compiled call after the first (each call returns
            to the host, so smaller is smoother and a little slower).
        multiple: the padded prompt's length is a multiple of it (`left_pad`'s).
        max_new_tokens, key, sampling, stop_ids, pad_id, vocab_size,
            compiler_options: as `generate`'s.
    """
    if chunk < 1:
        raise ConfigError(f"`chunk` must be >= 1; got {chunk}.")
    s = _settings(max_new_tokens, sampling, stop_ids, pad_id, vocab_size, None)
    prompts, lengths = _arrays(*left_pad([prompt], pad_id=pad_id, multiple=multiple))
    options = compiler_options
    st = _stream_start(model, prompts, lengths, key, s, options=options)
    more = lambda st: _stream_more(
        model, prompts, key, st, int(chunk), s, options=options
    )
    yield from _pieces(st, more, s.max_new_tokens)


def _pieces(
    st: _Loop, more: Callable[[_Loop], _Loop], max_new_tokens: int
) -> Iterator[np.ndarray]:
    """The row's tokens not yet yielded after each call of `more`, until it is
    done."""
    sent = 0
    while True:
        step, done = int(st.step), bool(st.done[0])
        end = int(st.lengths[0])
        if end > sent:
            yield np.asarray(st.tokens[0, sent:end])
            sent = end
        if done or step >= max_new_tokens:
            return
        st = more(st)
