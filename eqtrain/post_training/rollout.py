"""Online policy optimisation as one training step: sample completions from the
current policy, score them on the host, and train on them (GRPO).

`grpo_step(inner, rollout)` wraps any `TrainStep` whose loss is
`grpo.grpo_loss_fn`. Each call, inside one compiled program:

1. repeats each prompt of the batch `group_size` times and samples a completion
   for every row with `eqtrain.generate` from the policy (the key is split off
   the state's key, so a resumed run samples the same completions); from 32
   rows on, finished rows leave the decode batch (`generate(shrink=True)`), so
   the rollout costs the tokens generated rather than rows x the longest;
2. hands the completions to `rollout.score` on the host (an `io_callback`:
   decode, call the reward functions), which returns one reward per row;
3. normalises the rewards within each group (`grpo.group_advantages`), builds
   the rows (prompt and completion, the completion's targets masked in), takes
   the sampling policy's log-probs when the batch is trained on more than once,
   and runs `passes` updates of `inner` on it.

One call is one step of the loop (`state.step` advances by one); the optimizer
advances `passes` times, so its schedule counts updates. The host callback
blocks only this step's device program: `eqtrain.fit` keeps dispatching ahead.

    loss_fn = grpo.grpo_loss_fn(loss_type="dapo")
    step = rollout.grpo_step(eqtrain.train_step(loss_fn, optimizer),
                             rollout.Rollout(group_size=8, max_new_tokens=64,
                                             score=my_scorer, stop_ids=(eos,)))
    eqtrain.fit(state, step, prompt_batches, num_steps=200)

A batch holds `prompt` (`[prompts, length]` int32, left-padded: `generate.left_pad`),
`prompt_len` (`[prompts]`) and `index` (`[prompts]`, whatever identifies the prompt
to `score`, e.g. its row in the data file).
"""

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.random as jr
import numpy as np
from jax.experimental import io_callback
from jaxtyping import Array, Float, Int

from .._errors import ConfigError
from ..generate import Generation, Sampling, generate
from . import grpo, rewards as rewards_lib
from .preference import WithReference


Scorer = Callable[[np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, dict]]
"""`score(index [rows], tokens [rows, new], lengths [rows]) -> (rewards [rows],
{name: [rows]})`, on the host, numpy in and out (float32)."""


@dataclasses.dataclass(frozen=True)
class Rollout:
    """How `grpo_step` samples and scores.

    Attributes:
        group_size: completions per prompt (TRL's `num_generations`).
        max_new_tokens: the longest completion (TRL's `max_completion_length`).
        score: the host scorer (`Scorer`; `text_scorer` builds one).
        reward_names: the names of the per-function rewards `score` returns,
            reported as `rewards/{name}/mean` and `/std`.
        sampling: temperature and filters (`generate.Sampling`).
        stop_ids: a completion ends after one of these (EOS, end of turn).
        pad_id: fills a completion after its end.
        scale: how advantages are scaled (`grpo.group_advantages`).
        passes: updates on each sampled batch (TRL's `num_iterations`); with more
            than one, the sampling policy's log-probs are kept for the ratio.
        vocab_size: a padded model's real vocabulary (never sampled beyond).
        failures: where an exception of `score` goes (the first one; see
            `grpo_step`), read by the caller once `fit` has stopped.
        mesh: the mesh the step runs on (None: one device). Each device's rows
            are then scored by the process that holds it (a host callback per
            device inside `shard_map`), so nothing is gathered to one device,
            and a run of several processes scores in each of them.
    """

    group_size: int
    max_new_tokens: int
    score: Scorer
    reward_names: tuple[str, ...] = ()
    sampling: Sampling = Sampling()
    stop_ids: tuple[int, ...] = ()
    pad_id: int = 0
    scale: str = "group"
    passes: int = 1
    vocab_size: int | None = None
    failures: list[Exception] = dataclasses.field(
        default_factory=list, compare=False, repr=False
    )
    mesh: Any = None

    def __post_init__(self) -> None:
        for name in ("group_size", "max_new_tokens", "passes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"`{name}` must be an integer >= 1; got {value!r}.")
        if self.scale not in grpo.SCALES:
            raise ConfigError(
                f"`scale` must be one of {grpo.SCALES}; got {self.scale!r}."
            )

    @property
    def loss_temperature(self) -> float:
        """The temperature the loss divides logits by: the sampling one (1 when
        greedy)."""
        return self.sampling.temperature or 1.0


def text_scorer(
    tokenizer: Any,
    prompts: Sequence[Any],
    columns: Mapping[str, Sequence[Any]],
    rewards: Sequence[tuple[str, Any, float]],
) -> Scorer:
    """A `Scorer` over text: completions decoded with `tokenizer` (up to their
    length, a final stop token left out), prompt `index` looked up in `prompts`
    and `columns` (one entry per prompt), then `rewards.score`."""
    columns = {k: list(v) for k, v in columns.items()}

    def score(index: np.ndarray, tokens: np.ndarray, lengths: np.ndarray) -> Any:
        rows = [int(i) for i in index]
        pieces = zip(tokens, lengths, strict=True)
        texts = [tokenizer.decode(t[: int(n)]) for t, n in pieces]
        picked = {k: [v[i] for i in rows] for k, v in columns.items()}
        return rewards_lib.score(rewards, [prompts[i] for i in rows], texts, picked)

    return score


class _Clock:
    """The host time at which the device started a step's sampling (set by a
    callback at the step's start, read by the scoring callback after it)."""

    started = 0.0

    def start(self, _: Any) -> np.ndarray:
        self.started = time.perf_counter()
        return np.zeros((), np.int32)


def _rows(
    prompt: Int[Array, "rows prompt"],
    prompt_len: Int[Array, " rows"],
    completion: Int[Array, "rows new"],
    length: Int[Array, " rows"],
) -> dict[str, Array]:
    """The training rows of prompt + completion: tokens and targets (shifted),
    the completion's targets masked in, segment ids and positions that leave the
    left padding out."""
    width, new = prompt.shape[1], completion.shape[1]
    text = jnp.concatenate([prompt, completion], axis=1)
    index = jnp.arange(width + new - 1)
    pads = (width - prompt_len)[:, None]
    done = width + length[:, None] - 1  # last completion target + 1
    mask = (index[None] >= width - 1) & (index[None] < done)
    return {
        "tokens": text[:, :-1],
        "targets": text[:, 1:],
        "completion_mask": mask.astype(jnp.float32),
        "segment_ids": (index[None] >= pads).astype(jnp.int32),
        "positions": jnp.maximum(index[None] - pads, 0).astype(jnp.int32),
    }


def _reward_metrics(
    per_fn: Float[Array, "fns rows"], names: Sequence[str]
) -> dict[str, Array]:
    out = {}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = jnp.nanmean(per_fn[i])
        out[f"rewards/{name}/std"] = jnp.nanstd(per_fn[i])
    return out


def _length_metrics(lengths: Array, tokens: Array, rollout: Rollout) -> dict:
    n = lengths.astype(jnp.float32)
    last = jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)[:, 0]
    stopped = jnp.isin(last, jnp.asarray(rollout.stop_ids or (-1,), jnp.int32))
    return {
        "completions/mean_length": jnp.mean(n),
        "completions/min_length": jnp.min(n),
        "completions/max_length": jnp.max(n),
        "completions/clipped_ratio": jnp.mean((~stopped).astype(jnp.float32)),
    }


def sample_and_score(
    model: Any, batch: Mapping[str, Any], key: Any, rollout: Rollout
) -> tuple[dict[str, Array], dict[str, Array]]:
    """Step 1 and 2 of `grpo_step` (see the module docstring): the training
    batch (`grpo.grpo_loss_fn`'s keys, with `advantages`) and its metrics."""
    clock = _Clock()
    prompt, prompt_len, index = _repeated(batch, rollout.group_size)
    _, (started,) = _on_hosts(rollout, _start_clock(clock), index)
    started = jnp.max(started)
    key = jr.fold_in(key, started)  # sampling waits for the clock
    out = _complete(model, prompt, prompt_len, key, rollout)
    total, per_fn, times, failed = _score(rollout, clock, index, out, started)
    advantages, metrics = grpo.group_advantages(
        total, rollout.group_size, scale=rollout.scale
    )
    data = _rows(prompt, prompt_len, out.tokens, out.lengths)
    data["advantages"] = advantages
    metrics |= _reward_metrics(per_fn, rollout.reward_names)
    metrics |= _length_metrics(out.lengths, out.tokens, rollout)
    metrics |= {"time/generate": times[0], "time/reward": times[1]}
    metrics["scoring_failed"] = failed
    return data, metrics


def _complete(
    model: Any, prompt: Array, prompt_len: Array, key: Array, rollout: Rollout
) -> Generation:
    """The rows' completions as `rollout` samples them; finished rows leave the
    decode batch (`generate(shrink=True)`, from 32 rows on)."""
    return generate(
        model,
        prompt,
        prompt_len,
        max_new_tokens=rollout.max_new_tokens,
        key=key,
        sampling=rollout.sampling,
        stop_ids=rollout.stop_ids,
        pad_id=rollout.pad_id,
        vocab_size=rollout.vocab_size,
        shrink=True,
    )


def _repeated(batch: Mapping[str, Any], g: int) -> tuple[Array, Array, Array]:
    """The batch's `prompt`, `prompt_len` and `index`, each row `g` times."""
    names = ("prompt", "prompt_len", "index")
    return tuple(jnp.repeat(jnp.asarray(batch[n], jnp.int32), g, axis=0) for n in names)


def _row_axes(mesh: Any, rows: int) -> tuple[str, ...]:
    """The mesh's batch axes (of more than one device) that split `rows` evenly;
    () when there are none (one device, or rows that do not divide)."""
    from ..sharding import BATCH_AXES, axis_sizes, batch_divisor

    if mesh is None:
        return ()
    axes = tuple(a for a in BATCH_AXES if axis_sizes(mesh)[a] > 1)
    return axes if axes and rows % batch_divisor(mesh) == 0 else ()


def _on_hosts(
    rollout: Rollout, fn: Callable[..., tuple[tuple, tuple]], *rows: Array
) -> tuple[tuple, tuple]:
    """`fn(*rows)`, a host callback on `[rows, ...]` arrays that returns
    `(per_row, per_call)` results, run per device on the device's rows when the
    rows split over the mesh (`_row_axes`), else once on the whole batch. The
    per-row results come back `[rows, ...]`; the per-call ones stacked, one per
    call (`[calls, ...]`)."""

    def stacked(*r: Array) -> tuple[tuple, tuple]:
        per_row, per_call = fn(*r)
        return per_row, tuple(x[None] for x in per_call)

    axes = _row_axes(rollout.mesh, rows[0].shape[0])
    if not axes:
        return stacked(*rows)
    from jax.sharding import PartitionSpec as P

    spec = P(axes)
    per_row, per_call = jax.eval_shape(stacked, *rows)
    out_specs = (tuple(spec for _ in per_row), tuple(spec for _ in per_call))
    return jax.shard_map(
        stacked,
        mesh=rollout.mesh,
        in_specs=tuple(spec for _ in rows),
        out_specs=out_specs,
        check_vma=False,
    )(*rows)


def _start_clock(clock: _Clock) -> Callable[[Array], tuple[tuple, tuple]]:
    def start(index: Array) -> tuple[tuple, tuple]:
        shape = jax.ShapeDtypeStruct((), jnp.int32)
        return (), (io_callback(clock.start, shape, index),)

    return start


def _score(
    rollout: Rollout, clock: _Clock, index: Array, out: Generation, started: Array
) -> Any:
    """`(total, per_fn, clock, failed)` of the completions, from the host: each
    device's rows by the process that holds it (`_on_hosts`).

    The host callback never raises (an exception inside a compiled program's
    callback can abort a multi-device process): a failure goes to
    `rollout.failures`, and after one (this one or an earlier one) the rewards
    are NaN and `failed` is 1, which is how the step learns it (in every
    process: the flag is the maximum over devices)."""
    after = jnp.broadcast_to(started, index.shape)  # after the clock's start
    (total, per_fn), (times, failed) = _on_hosts(
        rollout, _host_score(rollout, clock), index, out.tokens, out.lengths, after
    )
    return total, per_fn.T, jnp.max(times, axis=0), jnp.max(failed)


def _host_score(rollout: Rollout, clock: _Clock) -> Callable[..., Any]:
    """The scoring callback of some rows: `(total [rows], per_fn [rows, fns],
    clock [2], failed [])`."""
    fns = max(len(rollout.reward_names), 1)

    def on_device(index: Array, tokens: Array, lengths: Array, after: Array) -> Any:
        rows = tokens.shape[0]
        shapes = (
            jax.ShapeDtypeStruct((rows,), jnp.float32),
            jax.ShapeDtypeStruct((rows, fns), jnp.float32),
            jax.ShapeDtypeStruct((2,), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.int32),
        )
        total, per_fn, times, failed = io_callback(
            _call(rollout, clock, rows, fns), shapes, index, tokens, lengths, after
        )
        return (total, per_fn), (times, failed)

    return on_device


def _call(rollout: Rollout, clock: _Clock, rows: int, fns: int) -> Callable[..., Any]:
    def call(index: Any, tokens: Any, lengths: Any, after_start: Any) -> Any:
        del after_start  # orders this call after the clock's start
        t0 = time.perf_counter()
        failed = bool(rollout.failures)
        if not failed:
            try:
                tokens, lengths = np.asarray(tokens), np.asarray(lengths)
                total, per_fn = _scores(rollout, index, tokens, lengths)
            except Exception as e:
                rollout.failures.append(e)
                failed = True
        if failed:
            total = np.full(rows, np.nan, np.float32)
            per_fn = np.zeros((fns, rows), np.float32)
        clock_ = np.array(
            [t0 - clock.started, time.perf_counter() - t0], np.float32
        )  # generation (from the step's start), scoring
        return total, per_fn.T.copy(), clock_, np.asarray(failed, np.int32)

    return call


def _scores(rollout: Rollout, index: Any, tokens: Any, lengths: Any) -> Any:
    """`(total [rows], per_fn [fns, rows])` of `rollout.score`, as float32. The
    lengths it gets leave a final stop token out (what is decoded for the rewards)."""
    last = tokens[np.arange(len(tokens)), np.maximum(lengths - 1, 0)]
    kept = np.where(np.isin(last, list(rollout.stop_ids)), lengths - 1, lengths)
    total, per = rollout.score(np.asarray(index), tokens, kept)
    total = np.asarray(total, np.float32).reshape(len(tokens))
    per_fn = np.stack(
        [np.asarray(per[n], np.float32) for n in rollout.reward_names]
        or [np.zeros(len(tokens), np.float32)]
    )
    return total, per_fn


def grpo_step(inner: Any, rollout: Rollout) -> Callable[..., Any]:
    """The online step `step(state, batch) -> (state, metrics)` around `inner`
    (a `TrainStep` whose loss is `grpo.grpo_loss_fn`); see the module docstring.

    When `rollout.score` raises, the exception goes to `rollout.failures`, the
    step returns the state unchanged with `metrics["halted"] = 1`, and `fit`
    stops there (as for `nonfinite="stop"`), its last checkpoint the last good
    state; raise `rollout.failures[0]` after it.
    Metrics: `inner`'s (of the last pass) and `reward`, `reward_std`,
    `frac_reward_zero_std`, `rewards/{name}/mean|std`,
    `completions/{mean,min,max}_length`, `completions/clipped_ratio`,
    `time/generate`, `time/reward` (seconds, host clock)."""

    def step(state: Any, batch: Mapping[str, Any]) -> tuple[Any, dict[str, Array]]:
        key, sample_key = jr.split(state.key)
        state = dataclasses.replace(state, key=key)
        policy = _sampling_policy(state.model)
        data, rollout_metrics = sample_and_score(policy, batch, sample_key, rollout)
        if rollout.passes > 1:
            data["old_logps"] = _old_logps(policy, data, rollout)
        before = state
        for _ in range(rollout.passes):
            state, metrics = inner(state, data)
        state = dataclasses.replace(state, step=before.step + 1)
        # scoring failed: the state stays as it was and the loop stops (`halted`)
        failed = rollout_metrics.pop("scoring_failed") > 0
        state = jax.tree.map(lambda a, b: jnp.where(failed, b, a), state, before)
        halted = jnp.maximum(metrics.get("halted", 0), failed.astype(jnp.int32))
        return state, {**metrics, **rollout_metrics, "halted": halted}

    return step


def _sampling_policy(model: Any) -> Any:
    """The model that samples: the policy (of a `WithReference`), no gradient."""
    policy = model.policy if isinstance(model, WithReference) else model
    return jax.lax.stop_gradient(policy)


def _old_logps(policy: Any, data: dict[str, Array], rollout: Rollout) -> Array:
    """The sampling policy's log-probs of the rows' targets, for the ratio of
    the passes after the first."""
    return grpo.token_logprobs(
        policy,
        data["tokens"],
        data["targets"],
        temperature=rollout.loss_temperature,
        vocab_size=rollout.vocab_size,
        segment_ids=data["segment_ids"],
        positions=data["positions"],
    )


# -- evaluation ---------------------------------------------------------------------
_EVAL_KEY = 0x6576616C  # folded into the state's key: not the next step's samples


def grpo_eval_step(rollout: Rollout) -> Callable[..., dict[str, Array]]:
    """An evaluation step `step(state, batch) -> metrics` for `eqtrain.evaluate`
    (or `fit`'s `Evaluation`): `rollout.group_size` completions of each held-out
    prompt by the current policy, drawn at `rollout.sampling` (greedy with
    `temperature=0`, where one completion per prompt says all), and scored by
    `rollout.score`. Nothing is trained and the state is unchanged; the key is
    derived from the state's, so a state gives the same completions each time.

    The batch is `grpo_step`'s (`prompt`, `prompt_len`, `index`), with an
    optional `valid` ([prompts] float, 0 on the rows that pad a last batch to
    the compiled shape). Metrics, over the valid completions: `reward` (the mean
    total reward), `rewards/{name}/mean`, `completions/{mean,min,max}_length`,
    `completions/clipped_ratio` and `weight` (how many): `evaluate` averages
    them over the batches by `weight`, the `min_`/`max_` ones by min/max. A
    failing reward function is recorded in `rollout.failures` (the rewards are
    then NaN), as in `grpo_step`."""

    def step(state: Any, batch: Mapping[str, Any]) -> dict[str, Array]:
        policy = _sampling_policy(state.model)
        key = jr.fold_in(state.key, _EVAL_KEY)
        g = rollout.group_size
        prompt, prompt_len, index = _repeated(batch, g)
        valid = batch.get("valid", jnp.ones(batch["index"].shape, jnp.float32))
        valid = jnp.repeat(jnp.asarray(valid, jnp.float32), g) > 0
        out = _complete(policy, prompt, prompt_len, key, rollout)
        started = jnp.zeros((), jnp.int32)  # no clock: nothing is timed here
        total, per_fn, _, _ = _score(rollout, _Clock(), index, out, started)
        return _eval_metrics(total, per_fn, out, valid, rollout)

    return step


def _eval_metrics(
    total: Array, per_fn: Array, out: Generation, valid: Array, rollout: Rollout
) -> dict[str, Array]:
    """`grpo_eval_step`'s metrics over the `valid` rows."""

    def mean(x: Array, ok: Array = valid) -> Array:
        return jnp.sum(jnp.where(ok, x, 0.0)) / jnp.maximum(jnp.sum(ok), 1)

    n = out.lengths.astype(jnp.float32)
    last = jnp.take_along_axis(out.tokens, (out.lengths - 1)[:, None], axis=1)[:, 0]
    stopped = jnp.isin(last, jnp.asarray(rollout.stop_ids or (-1,), jnp.int32))
    metrics = {
        "reward": mean(total),
        "completions/mean_length": mean(n),
        "completions/min_length": jnp.min(jnp.where(valid, n, jnp.inf)),
        "completions/max_length": jnp.max(jnp.where(valid, n, -jnp.inf)),
        "completions/clipped_ratio": mean((~stopped).astype(jnp.float32)),
        "weight": jnp.sum(valid).astype(jnp.float32),
    }
    for i, name in enumerate(rollout.reward_names):  # NaN: the function had none
        metrics[f"rewards/{name}/mean"] = mean(per_fn[i], valid & ~jnp.isnan(per_fn[i]))
    return metrics
