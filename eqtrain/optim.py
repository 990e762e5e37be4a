"""Optimizer builder: `build` assembles an optax optimizer (clipping, learning-rate
schedule, masked decoupled weight decay) from flat options, the keys of the CLI's
`[optim]` table. The learning rate is injected so `train_step` can log it.
"""

import functools
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import PyTree

from ._errors import ConfigError
from ._names import did_you_mean


OPTIMIZERS = ("adamw", "adam", "lion", "sgd", "adafactor")
"""The values `build` accepts for `name`."""

SCHEDULES = ("constant", "linear", "cosine", "wsd")
"""The values `build` and `schedule` accept for the schedule's name."""

DEFAULT_NO_DECAY = r"(norm|bias|embed|wte|wpe|ln_)"
"""Parameters whose dotted path matches this (`re.search`) get no weight decay:
norms, biases and embeddings, under the names eqtrain's models and Hugging Face use
(`input_layernorm`, `norm`, `embed_tokens`, `wte`, `wpe`, `ln_1`, `c_attn.bias`)."""

# The optimizer-specific options each optimizer reads; any other one given (not
# None/False) is an error rather than silently ignored.
_EXTRAS = {
    "adamw": ("b1", "b2", "eps"),
    "adam": ("b1", "b2", "eps"),
    "lion": ("b1", "b2"),
    "sgd": ("momentum", "nesterov"),
    "adafactor": ("b1", "eps"),
}


def _choice(field: str, value: str, allowed: tuple[str, ...]) -> str:
    if value in allowed:
        return value
    raise ConfigError(
        f"`optim.{field}` must be one of {', '.join(map(repr, allowed))}; "
        f"got {value!r}.{did_you_mean(value, allowed)}"
    )


def _compile(no_decay: str) -> re.Pattern[str] | None:
    """The compiled `no_decay` pattern, or `None` for "" (decay everything)."""
    if not no_decay:
        return None
    try:
        return re.compile(no_decay)
    except re.error as e:
        raise ConfigError(
            f"`optim.no_decay` is not a valid regular expression ({e}); got "
            f"{no_decay!r}. Example: {DEFAULT_NO_DECAY!r}, or '' to decay every "
            "parameter."
        ) from e


def param_path(path: tuple[Any, ...]) -> str:
    """A JAX key path as a dotted string, e.g. `"layers.self_attn.q_proj.weight"`.

    Attribute names and dict keys appear as they are, list and tuple positions as
    numbers (`"mlp.layers.0.bias"`).

    Example:
        >>> import jax
        >>> [param_path(p) for p, _ in jax.tree_util.tree_leaves_with_path(
        ...     {"h": [{"bias": 0}]})]
        ['h.0.bias']
    """
    return jax.tree_util.keystr(path, simple=True, separator=".")


def decay_mask(params: PyTree, no_decay: str = DEFAULT_NO_DECAY) -> PyTree[bool]:
    """Which parameters weight decay applies to: `True` = decayed.

    Args:
        params: any pytree of parameters, e.g. `eqx.filter(model, eqx.is_array)`;
            `None` leaves (frozen or non-array parts) stay `None`.
        no_decay: regular expression searched (`re.search`) in each leaf's dotted
            path (see `param_path`); matching leaves are not decayed. `""` decays
            every leaf.

    Returns:
        A pytree of Python bools shaped like `params`.

    Example:
        >>> mask = decay_mask({"ln_f": {"bias": 0.0}, "proj": {"weight": 0.0}})
        >>> mask
        {'ln_f': {'bias': False}, 'proj': {'weight': True}}
    """
    pattern = _compile(no_decay)

    def decayed(path: tuple[Any, ...], _: Any) -> bool:
        return pattern is None or pattern.search(param_path(path)) is None

    return jax.tree_util.tree_map_with_path(decayed, params)


def _warmed_up(
    main: optax.Schedule, lr: float | int, warmup_steps: int
) -> optax.Schedule:
    """`main` preceded by a linear warmup from 0 to `lr` (none if `warmup_steps`
    is 0); `main` sees the step count from the end of the warmup."""
    if warmup_steps == 0:
        return main
    warmup = optax.linear_schedule(0.0, lr, warmup_steps)
    return optax.join_schedules([warmup, main], [warmup_steps])


def _check_schedule(
    name: str,
    lr: float | int,
    total_steps: int | None,
    warmup_steps: int,
    final_lr: float | int,
    decay_steps: int | None,
) -> None:
    if not lr >= 0:  # 0: a frozen run (e.g. to debug the pipeline)
        raise ConfigError(f"`optim.lr` must be >= 0; got {lr!r}.")
    if warmup_steps < 0:
        raise ConfigError(f"`optim.warmup_steps` must be >= 0; got {warmup_steps}.")
    _check_total_steps(name, total_steps, warmup_steps)
    _check_final_lr(name, lr, final_lr)
    if decay_steps is not None and name != "wsd":
        raise ConfigError(
            f"`optim.decay_steps` applies only to schedule 'wsd'; got "
            f"decay_steps={decay_steps} with schedule {name!r}. Remove it, or use "
            "schedule 'wsd'."
        )


def _check_total_steps(name: str, total_steps: int | None, warmup_steps: int) -> None:
    if total_steps is None and name != "constant":
        raise ConfigError(
            f"`optim.schedule = {name!r}` decays the LR until `total_steps`, which "
            "was not given. Pass `total_steps` (the number of training steps), or "
            "use schedule 'constant'."
        )
    if total_steps is not None and total_steps < 1:
        raise ConfigError(f"`optim.total_steps` must be >= 1; got {total_steps}.")
    if total_steps is not None and not 0 <= warmup_steps < total_steps:
        raise ConfigError(
            f"`optim.warmup_steps` must be smaller than `total_steps`; got "
            f"warmup_steps={warmup_steps} and total_steps={total_steps}."
        )


def _check_final_lr(name: str, lr: float | int, final_lr: float | int) -> None:
    if name == "constant" and final_lr != 0:
        raise ConfigError(
            f"`optim.final_lr` applies to the 'linear', 'cosine' and 'wsd' "
            f"schedules; with 'constant' the LR stays at `optim.lr`. Got "
            f"final_lr={final_lr!r}: remove it, or choose a decaying schedule."
        )
    if not 0 <= final_lr <= lr:
        raise ConfigError(
            f"`optim.final_lr` must be between 0 and `optim.lr` ({lr!r}); "
            f"got {final_lr!r}."
        )


def _wsd_decay_steps(
    total_steps: int, warmup_steps: int, decay_steps: int | None
) -> int:
    if decay_steps is None:
        decay_steps = max(1, total_steps // 10)
    if not 1 <= decay_steps <= total_steps - warmup_steps:
        raise ConfigError(
            f"`optim.decay_steps` must be between 1 and total_steps - warmup_steps "
            f"({total_steps - warmup_steps}); got {decay_steps}."
        )
    return decay_steps


def schedule(
    name: str = "constant",
    *,
    lr: float | int,
    total_steps: int | None = None,
    warmup_steps: int = 0,
    final_lr: float | int = 0.0,
    decay_steps: int | None = None,
) -> optax.Schedule:
    """The learning-rate schedule `step -> lr` that `build` uses, made of optax's.

    Every schedule starts with a linear warmup from 0 to `lr` over `warmup_steps`
    (none when 0), then:

    - `"constant"`: stays at `lr`;
    - `"linear"`: falls linearly to `final_lr` at `total_steps`;
    - `"cosine"`: follows a half cosine down to `final_lr` at `total_steps`;
    - `"wsd"` (warmup-stable-decay): stays at `lr`, then falls linearly to
      `final_lr` over the last `decay_steps` steps.

    After `total_steps` the decaying schedules stay at `final_lr`.

    Args:
        name: one of `SCHEDULES`.
        lr: the peak learning rate, >= 0 (0: nothing trains).
        total_steps: the number of training steps; required except for
            `"constant"`.
        warmup_steps: length of the linear warmup; smaller than `total_steps`.
        final_lr: the learning rate at `total_steps`, between 0 and `lr`.
        decay_steps: `"wsd"` only: length of the final decay (default 10% of
            `total_steps`, at least 1).

    Example:
        >>> sched = schedule("cosine", lr=1.0, total_steps=10, warmup_steps=2)
        >>> [round(float(sched(s)), 3) for s in (0, 1, 2, 6, 10, 20)]
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    _choice("schedule", name, SCHEDULES)
    _check_schedule(name, lr, total_steps, warmup_steps, final_lr, decay_steps)
    if name == "constant":
        return _warmed_up(optax.constant_schedule(lr), lr, warmup_steps)
    assert total_steps is not None  # checked above; narrows the type
    steps = total_steps - warmup_steps
    if name == "linear":
        main = optax.linear_schedule(lr, final_lr, steps)
    elif name == "cosine":
        main = _cosine(lr, final_lr, steps)
    else:
        decay = _wsd_decay_steps(total_steps, warmup_steps, decay_steps)
        main = _wsd(lr, final_lr, steps, decay)
    return _warmed_up(main, lr, warmup_steps)


def _cosine(lr: float | int, final_lr: float | int, steps: int) -> optax.Schedule:
    alpha = final_lr / lr if lr else 0.0  # lr = 0: final_lr is 0 too
    return optax.cosine_decay_schedule(lr, steps, alpha=alpha)


def _wsd(
    lr: float | int, final_lr: float | int, steps: int, decay: int
) -> optax.Schedule:
    """Stable at `lr`, then linear to `final_lr` over the last `decay` steps."""
    return optax.join_schedules(
        [optax.constant_schedule(lr), optax.linear_schedule(lr, final_lr, decay)],
        [steps - decay],
    )


_schedule = schedule  # `build` has an argument of the same name


def _check_options(name: str, weight_decay: float | int, **extras: Any) -> None:
    """Reject options the chosen optimizer would not use, and bad values."""
    _check_applicable(name, extras)
    _check_ranges(extras)
    if weight_decay < 0:
        raise ConfigError(f"`optim.weight_decay` must be >= 0; got {weight_decay!r}.")
    if name == "adam" and weight_decay > 0:
        raise ConfigError(
            f"`optim.weight_decay` is not supported with optimizer 'adam'; got "
            f"weight_decay={weight_decay!r}. Use name 'adamw' for Adam with "
            "decoupled weight decay."
        )


def _check_applicable(name: str, extras: dict[str, Any]) -> None:
    """Reject an option (given: not None/False) that optimizer `name` ignores."""
    for field, value in extras.items():
        given = value is not None and value is not False  # 0.0 counts as given
        if given and field not in _EXTRAS[name]:
            users = [n for n, fields in _EXTRAS.items() if field in fields]
            raise ConfigError(
                f"`optim.{field}` does not apply to optimizer {name!r} (it is used "
                f"by {', '.join(map(repr, users))}); got {field}={value!r}. Remove "
                "it, or choose one of those optimizers."
            )


def _check_ranges(extras: dict[str, Any]) -> None:
    for field in ("b1", "b2", "momentum"):
        value = extras[field]
        if value is not None and not 0 <= value < 1:
            raise ConfigError(f"`optim.{field}` must be in [0, 1); got {value!r}.")
    if extras["eps"] is not None and extras["eps"] < 0:
        raise ConfigError(f"`optim.eps` must be >= 0; got {extras['eps']!r}.")
    if extras["nesterov"] and extras["momentum"] is None:
        raise ConfigError(
            "`optim.nesterov = true` needs `optim.momentum` (e.g. 0.9); plain SGD "
            "has no momentum to look ahead with."
        )


class _Options(NamedTuple):
    """What `build` hands each optimizer besides the learning rate (`None`:
    optax's default)."""

    weight_decay: float | int
    mask: Any
    b1: float | int | None
    b2: float | int | None
    eps: float | int | None
    momentum: float | int | None
    nesterov: bool

    @property
    def moments(self) -> dict[str, float | int]:
        """`b1`, `b2` and `eps`, those given."""
        given = (("b1", self.b1), ("b2", self.b2), ("eps", self.eps))
        return {k: v for k, v in given if v is not None}


def _adamw(learning_rate: Any, o: _Options) -> optax.GradientTransformation:
    return optax.adamw(
        learning_rate, **o.moments, weight_decay=o.weight_decay, mask=o.mask
    )


def _adam(learning_rate: Any, o: _Options) -> optax.GradientTransformation:
    return optax.adam(learning_rate, **o.moments)


def _lion(learning_rate: Any, o: _Options) -> optax.GradientTransformation:
    return optax.lion(
        learning_rate, **o.moments, weight_decay=o.weight_decay, mask=o.mask
    )


def _adafactor(learning_rate: Any, o: _Options) -> optax.GradientTransformation:
    # optax adds adafactor's decay after the LR scaling; multiplying the rate
    # by the LR makes it decoupled decay in the same sense as adamw's.
    decay = learning_rate * o.weight_decay if o.weight_decay else None
    return optax.adafactor(
        learning_rate,
        momentum=o.b1,
        eps=1e-30 if o.eps is None else o.eps,
        weight_decay_rate=decay,
        weight_decay_mask=o.mask,
    )


def _sgd(learning_rate: Any, o: _Options) -> optax.GradientTransformation:
    if not o.weight_decay:
        return optax.sgd(learning_rate, momentum=o.momentum, nesterov=o.nesterov)
    # SGDW (Loshchilov & Hutter, 2019): the decay skips the momentum and, like
    # adamw's, is multiplied by the learning rate.
    trace = optax.identity()
    if o.momentum is not None:
        trace = optax.trace(o.momentum, o.nesterov)
    return optax.chain(
        trace,
        optax.add_decayed_weights(o.weight_decay, o.mask),
        optax.scale_by_learning_rate(learning_rate),
    )


_OPTIMIZERS = {
    "adamw": _adamw,
    "adam": _adam,
    "lion": _lion,
    "sgd": _sgd,
    "adafactor": _adafactor,
}


def build(
    name: str = "adamw",
    *,
    lr: float | int = 1e-3,
    schedule: str = "constant",
    total_steps: int | None = None,
    warmup_steps: int = 0,
    final_lr: float | int = 0.0,
    decay_steps: int | None = None,
    weight_decay: float | int = 0.0,
    no_decay: str = DEFAULT_NO_DECAY,
    clip_norm: float | int | None = 1.0,
    b1: float | int | None = None,
    b2: float | int | None = None,
    eps: float | int | None = None,
    momentum: float | int | None = None,
    nesterov: bool = False,
) -> optax.GradientTransformation:
    """Build the optimizer: global-norm clipping, then `name` with a learning-rate
    schedule and masked decoupled weight decay.

    The optimizer is wrapped in `optax.inject_hyperparams`, so its state holds the
    learning rate of the last update and `train_step` reports it as
    `metrics["learning_rate"]` (equal to `schedule(...)(step)`). Only the learning
    rate is injected: the other options are fixed when the optimizer is built.

    Args:
        name: one of `OPTIMIZERS`: `"adamw"`, `"adam"`, `"lion"`, `"sgd"`,
            `"adafactor"`.
        lr: the peak learning rate, >= 0 (0: nothing trains).
        schedule: `"constant"`, `"linear"`, `"cosine"` or `"wsd"`; see `schedule`.
        total_steps: the number of training steps; required by the decaying
            schedules.
        warmup_steps: length of the linear warmup from 0 to `lr`.
        final_lr: the learning rate at `total_steps` (decaying schedules).
        decay_steps: `"wsd"` only: length of the final decay.
        weight_decay: decoupled weight decay, multiplied by the learning rate
            (each step `p -= lr * weight_decay * p` besides the update), on the
            parameters `no_decay` does not match. Not accepted for `"adam"`.
        no_decay: regular expression of the parameter paths that get no weight
            decay (see `decay_mask`); `""` decays every parameter.
        clip_norm: clip the gradients to this global norm first; `None` or 0
            disables clipping.
        b1: first-moment decay (adamw, adam, lion; adafactor's momentum, off by
            default). `None` keeps the optimizer's own default.
        b2: second-moment decay (adamw, adam, lion).
        eps: the denominator's epsilon (adamw, adam, adafactor).
        momentum: sgd only; `None` is plain SGD.
        nesterov: sgd only; Nesterov momentum (needs `momentum`).

    Returns:
        An `optax.GradientTransformation`, for `TrainState.create` and
        `train_step`.

    Raises:
        ConfigError: for an unknown name or schedule, an option the optimizer or
            schedule does not use, or a value out of range.

    Example:
        >>> opt = build("adamw", lr=3e-4, schedule="cosine", total_steps=10_000,
        ...             warmup_steps=500, weight_decay=0.1)
        >>> build("adamw", schedule="cosin")
        Traceback (most recent call last):
        ...
        eqtrain._errors.ConfigError: `optim.schedule` must be one of 'constant', \
'linear', 'cosine', 'wsd'; got 'cosin'. Did you mean 'cosine'?
    """
    _choice("name", name, OPTIMIZERS)
    extras = dict(b1=b1, b2=b2, eps=eps, momentum=momentum, nesterov=nesterov)
    _check_options(name, weight_decay, **extras)
    _check_clip_norm(clip_norm)
    lr_schedule = _schedule(
        schedule,
        lr=lr,
        total_steps=total_steps,
        warmup_steps=warmup_steps,
        final_lr=final_lr,
        decay_steps=decay_steps,
    )
    options = _Options(weight_decay, _mask(no_decay, weight_decay), **extras)
    tx = _injected(_OPTIMIZERS[name], options, lr_schedule)
    if clip_norm:
        tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
    return tx


def _check_clip_norm(clip_norm: float | int | None) -> None:
    if clip_norm is not None and clip_norm < 0:
        raise ConfigError(
            f"`optim.clip_norm` must be > 0, or 0/None to disable clipping; "
            f"got {clip_norm!r}."
        )


def _mask(no_decay: str, weight_decay: float | int) -> Any:
    """The weight-decay mask (`decay_mask` of `no_decay`), or None: every
    parameter decays, or none does."""
    if _compile(no_decay) is None or not weight_decay:
        return None
    return functools.partial(decay_mask, no_decay=no_decay)


def _injected(
    optimizer: Callable[[Any, _Options], optax.GradientTransformation],
    options: _Options,
    lr_schedule: optax.Schedule,
) -> optax.GradientTransformation:
    """`optimizer` with its learning rate injected from `lr_schedule` (in its
    state, for the logs)."""

    def inner(learning_rate: Any) -> optax.GradientTransformation:
        return optimizer(learning_rate, options)

    # f32 hyperparameters even for bf16 parameters: the logged LR is the schedule's.
    return optax.inject_hyperparams(inner, hyperparam_dtype=jnp.float32)(
        learning_rate=lr_schedule
    )
