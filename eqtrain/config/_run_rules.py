"""The rules of `validate` (`_validate`) about how a run trains and what it
writes: its mesh and batches, evaluation and the best checkpoint, LoRA, exports
and Ray. Each rule takes the config and the keys a file or `--set` changed, and
raises `ConfigError` for one inconsistency."""

import re

from .._errors import ConfigError
from .._names import did_you_mean
from ._config import Config
from ._resolve import eval_metrics, eval_source, lora_on
from ._units import parse_resources


# -- devices and batches ----------------------------------------------------------
def _mesh_sizes(config: Config) -> dict[str, int]:
    """The mesh axes that may take the devices the others leave (-1)."""
    mesh = config.mesh
    return {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}


def mesh_no_zero(config: Config, given: frozenset[str]) -> None:
    zero = [k for k, v in _mesh_sizes(config).items() if v == 0]
    if zero:
        raise ConfigError(
            f"`mesh.{zero[0]}` must be a device count >= 1, or -1 for the devices "
            "the other axes leave; got 0."
        )


def mesh_one_rest(config: Config, given: frozenset[str]) -> None:
    rest = [k for k, v in _mesh_sizes(config).items() if v == -1]
    if len(rest) > 1:
        keys = " and ".join(f"`mesh.{k}`" for k in rest)
        raise ConfigError(f"{keys} are both -1; at most one mesh axis takes the rest.")


def batches_split(config: Config, given: frozenset[str]) -> None:
    batch, accumulate = config.data.batch_size, config.optim.accumulate
    if batch % accumulate:
        raise ConfigError(
            f"`data.batch_size` ({batch}) must be divisible by `optim.accumulate` "
            f"({accumulate}): each step splits its batch into that many micro-batches."
        )


# -- [loop] and checkpoint.best ---------------------------------------------------
def eval_every_with_eval(config: Config, given: frozenset[str]) -> None:
    set_ = "loop.eval_every" in given and config.loop.eval_every
    if config.data.eval == "none" and set_:
        raise ConfigError(
            "`loop.eval_every` is set but `data.eval` is 'none': there is "
            "nothing to evaluate. Set data.eval or loop.eval_every = 0."
        )


def best_is_eval(config: Config, given: frozenset[str]) -> None:
    best = config.checkpoint.best
    if best is not None and not best.startswith("eval/"):
        raise ConfigError(
            f"`checkpoint.best` ({best!r}) must be an evaluation metric "
            "such as 'eval/loss' (train metrics are too noisy to rank by)."
        )


def best_is_reported(config: Config, given: frozenset[str]) -> None:
    best, metrics = config.checkpoint.best, eval_metrics(config)
    if best is not None and best not in metrics:
        names = ", ".join(f"'{m}'" for m in metrics)
        raise ConfigError(
            f"`checkpoint.best` ({best!r}) is not a metric this run "
            f"produces: its evaluations report {names}. A misspelt name would "
            "keep no best checkpoint at all." + did_you_mean(best, metrics, code=True)
        )


def best_has_eval(config: Config, given: frozenset[str]) -> None:
    best, data = config.checkpoint.best, config.data
    if best is not None and eval_source(config) == "none":
        raise ConfigError(
            f"`checkpoint.best` ({best!r}) ranks checkpoints by an "
            f"evaluation metric, but the run has no eval data (data.eval = "
            f"{data.eval!r} with data.train = {data.train!r}). "
            "Set data.eval to a file or directory, or unset checkpoint.best."
        )


def best_on_eval_steps(config: Config, given: frozenset[str]) -> None:
    every, eval_every = config.checkpoint.every, config.loop.eval_every
    off = eval_every == 0 or every == 0 or every % eval_every
    if config.checkpoint.best is not None and off:
        raise ConfigError(
            "`checkpoint.best` ranks checkpoints by an evaluation metric, so "
            "checkpoints must be saved on evaluation steps: make "
            f"`checkpoint.every` ({every}) a positive multiple of "
            f"`loop.eval_every` ({eval_every})."
        )


# -- [lora] and [export] ----------------------------------------------------------
def adapter_has_base(config: Config, given: frozenset[str]) -> None:
    m = config.model
    if m.adapter_from is not None and m.init_from is None:
        raise ConfigError(
            f"`model.adapter_from` ({m.adapter_from!r}) continues a PEFT "
            "adapter on its base model: set `model.init_from` to that base's "
            "Hugging Face directory."
        )


def lora_keys_need_lora(config: Config, given: frozenset[str]) -> None:
    other = sorted(k for k in given if k.startswith("lora."))
    if other and not lora_on(config):
        raise ConfigError(
            f"`{other[0]}` is set but `lora.rank` is 0 (LoRA off): set "
            "lora.rank (e.g. 8) to train adapters, or remove it."
        )


def adapter_exports_need_lora(config: Config, given: frozenset[str]) -> None:
    for key in ("export.adapter", "export.merged"):
        if getattr(config.export, key.split(".")[1]) and not lora_on(config):
            raise ConfigError(
                f"`{key}` exports LoRA adapters, but LoRA is off (lora.rank = "
                "0): set lora.rank, or remove it."
            )


def lora_patterns(config: Config, given: frozenset[str]) -> None:
    """`lora.targets` and `lora.train_also` are regular expressions."""
    lora = config.lora
    if lora_on(config):
        _regex("targets", lora.targets)
        _regex("train_also", lora.train_also)


def _regex(key: str, pattern: str | None) -> None:
    if pattern is None:
        return
    try:
        re.compile(pattern)
    except re.error as e:
        raise ConfigError(
            f"`lora.{key}` is not a valid regex: {pattern!r} ({e})."
        ) from None


def lora_exports_something(config: Config, given: frozenset[str]) -> None:
    """With LoRA on, a named export directory gets an adapter or a model."""
    e = config.export
    nothing = e.adapter is False and not e.merged
    if lora_on(config) and nothing and e.hf is not None and "export.hf" in given:
        raise ConfigError(
            "`export.hf` is set, but with LoRA on and export.adapter = false "
            "and export.merged = false there is nothing to export: set one of "
            'them, or export.hf = "".'
        )


def export_ema(config: Config, given: frozenset[str]) -> None:
    if config.export.ema and config.loop.ema is None:
        raise ConfigError(
            "`export.ema` exports the EMA weights, but `loop.ema` is unset: set "
            "loop.ema (e.g. 0.999) or export.ema = false."
        )


def export_every(config: Config, given: frozenset[str]) -> None:
    if config.export.every and config.export.hf is None:
        raise ConfigError(
            "`export.every` is set but `export.hf` is empty: name the export "
            "directory or set export.every = 0."
        )


# -- [distributed] ----------------------------------------------------------------
def resources(config: Config, given: frozenset[str]) -> None:
    parse_resources(config.distributed.resources_per_worker)


def ray_address(config: Config, given: frozenset[str]) -> None:
    address = config.distributed.ray_address
    if address is None or address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(
            f"`distributed.ray_address` must be `auto`, `HOST:PORT` or "
            f"`ray://HOST:PORT`; got {address!r}. `ray status` on the head node "
            "prints the address; leave it unset to start a local Ray."
        )
