"""`eqtrain data prepare`: the tokenized stores of a config's text sources, built
(or checked) before any run, and the per-source counts a run reports."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import data as data_lib
from .._errors import ConfigError
from ..config import Config, eval_source, validate
from . import _build, _rows


def prepare_data(
    config: Config,
    *,
    executor: str = "auto",
    verify: bool = True,
    say: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Prepare the tokenized store of every text source of `config` (the
    training sources, and the eval source when there is one), checking the
    committed parts' sha256 (`verify`) and rebuilding damaged ones. Returns one
    summary per store: `{"split", "name", "source", "store", "documents",
    "tokens", "parts"}`.

    For post-training tasks (sft, dpo/ipo/orpo/simpo, grpo, ...) it prepares the
    post-training store of the record files instead (encoded with the run's
    chat template, in local worker processes; `executor="ray"` builds them
    locally too): one summary per store, `{"split", "name", "source", "store",
    "kind", "rows", "records", "skipped", "tokens", "parts"}`.

    Raises:
        ConfigError: a source is missing or malformed.
    """
    validate(config)
    if config.task.kind != "lm":
        return _prepare_post(config, verify=verify, say=say)
    tokenizer = _build.build(config).tokenizer
    settings = _store_settings(config, executor=executor, verify=verify, say=say)
    out = []
    for split, name, path, key in _stores_of(config):
        source = _store_source(split, path, key)
        store = _prepare_store(source, tokenizer, settings, key, path)
        out.append(_summary(split, name, path, store))
    return out


def _summary(split: str, name: str, path: str, store: data_lib.Store) -> dict[str, Any]:
    """What `prepare_data` says of one store."""
    return {
        "split": split,
        "name": name,
        "source": path,
        "store": str(store.directory),
        "documents": store.num_documents,
        "tokens": store.num_tokens,
        "parts": store.num_parts,
    }


def _store_settings(config: Config, **options: Any) -> dict[str, Any]:
    """`data.prepare`'s settings from `[data]` (and `options`; `say` if given)."""
    data = config.data
    settings = dict(
        cache_dir=None if data.cache == "auto" else str(Path(data.cache).absolute()),
        workers=None if data.workers == "auto" else data.workers,
        text_column=data.text_column,
        pattern=data.pattern,
        **options,
    )
    if settings.get("say") is None:
        settings.pop("say", None)
    return settings


def _prepare_post(
    config: Config, *, verify: bool, say: Callable[[str], None] | None
) -> list[dict[str, Any]]:
    """The post-training stores of `config`'s record files (training, and eval
    when the run evaluates), as a run's first start prepares them."""
    built = _build.build(config)
    _rows.check_sources(config)
    sources = [("train", config.data.train, "data.train")]
    source = eval_source(config)
    if source != "none" and (config.loop.eval_every or config.loop.eval_at_end):
        sources.append(("eval", source, "data.eval"))
    out = []
    for split, path, key in sources:
        read = _rows.grpo_rows if config.task.kind == "grpo" else _rows.post_rows
        rows = read(built, path, key, verify=verify, say=say)
        out.append(_post_summary(split, path, rows))
    return out


def _post_summary(split: str, path: str, rows: data_lib.PostRows) -> dict[str, Any]:
    """What `prepare_data` says of one post-training store."""
    parts = rows.meta["parts"]
    return {
        "split": split,
        "name": split,
        "source": path,
        "store": str(rows.directory),
        "kind": rows.kind,
        "rows": rows.num_rows,
        "records": rows.report.total,
        "skipped": rows.report.total - rows.report.kept,
        "tokens": sum(p["tokens"] for p in parts),
        "parts": len(parts),
    }


def _stores_of(config: Config) -> list[tuple[str, str, str, str]]:
    """`(split, name, path, key)` of every store the config reads."""
    stores = [
        ("train", name, path, key) for name, path, _, key in _rows.text_sources(config)
    ]
    eval_source = _eval_source(config)
    if eval_source is not None:
        stores.append(("eval", "eval", eval_source, "data.eval"))
    return stores


def _store_source(split: str, path: str, key: str) -> str:
    """What `data.prepare` reads: the built-in corpus's split, or the absolute
    path of an existing source."""
    if path == "stdlib":
        return "stdlib" if split == "train" else "stdlib:eval"
    if not Path(path).exists():
        raise ConfigError(f"`{key}` names {path!r}, which does not exist.")
    return str(Path(path).absolute())


def _prepare_store(
    source: str, tokenizer: Any, settings: dict[str, Any], key: str, path: str
) -> data_lib.Store:
    try:
        return data_lib.prepare(source, tokenizer, **settings)
    except data_lib.DataError as e:
        raise ConfigError(f"`{key}` ({path}): {e}") from None


def _eval_source(config: Config) -> str | None:
    source = eval_source(config)  # task.kind = lm here
    if source == "none" or config.loop.eval_every == 0 and not config.loop.eval_at_end:
        return None
    return source


def mixture_of(rows: Any) -> data_lib.Mixture | None:
    """The `Mixture` under a run's training rows, or None (one source)."""
    while rows is not None and not isinstance(rows, data_lib.Mixture):
        rows = getattr(rows, "__dict__", {}).get("source")
    return rows


def tokens_per_source(rows: Any, steps: int, batch_size: int) -> dict[str, int]:
    """Training tokens each source of a mixture gave to the first `steps` steps
    (`{}` for one source): the rows of the batches the loader yielded (each
    epoch's last, partial batch is dropped) times the row width."""
    mixture = mixture_of(rows)
    if mixture is None or steps <= 0:
        return {}
    per_epoch = mixture.num_rows // batch_size  # batches, drop_last
    epochs, index = divmod(steps, per_epoch)
    counts = dict.fromkeys(mixture.names, 0)

    def add(start: int, stop: int) -> None:
        high, low = mixture.rows_per_source(stop), mixture.rows_per_source(start)
        for name in counts:
            counts[name] += high[name] - low[name]

    for epoch in range(epochs):
        add(epoch * mixture.num_rows, epoch * mixture.num_rows + per_epoch * batch_size)
    add(epochs * mixture.num_rows, epochs * mixture.num_rows + index * batch_size)
    width = mixture.sources[0].seq_len
    return {name: count * width for name, count in counts.items()}


class SourceTokens:
    """A hook that adds `data/tokens/<source>` (training tokens from each source of
    a mixture so far) to the step's metrics, for the writers that follow it."""

    uses_state = False

    def __init__(self, rows: Any, batch_size: int):
        self.rows, self.batch_size = rows, batch_size

    def __call__(self, info: Any) -> None:
        if info.stop_reason is not None:
            return
        for name, count in tokens_per_source(
            self.rows, info.step, self.batch_size
        ).items():
            info.metrics[f"data/tokens/{name}"] = count


def source_tokens(config: Config, steps: int) -> list[dict[str, Any]] | None:
    """For a run with `data.sources`: each source's name, path, weight and the
    training tokens it gave to the first `steps` steps (None without a mixture,
    or when a source's store is gone: nothing is tokenized to answer)."""
    if not config.data.sources or config.task.kind != "lm":
        return None
    sources = _rows.text_sources(config)
    parts = _existing_rows(config, [path for _, path, _, _ in sources])
    if parts is None:
        return None
    weights, names = [w for _, _, w, _ in sources], [n for n, *_ in sources]
    mixture = data_lib.Mixture(parts, weights, names=names)
    tokens = tokens_per_source(mixture, steps, config.data.batch_size)
    return [
        {"name": name, "path": path, "weight": weight, "tokens": tokens.get(name, 0)}
        for name, path, weight, _ in sources
    ]


def _existing_rows(config: Config, paths: list[str]) -> list[Any] | None:
    """The LM rows of each source's store, opened (never built); None if one
    is gone or unreadable."""
    tokenizer = _build.build(config).tokenizer
    cache, parts = config.data.cache, []
    for path in paths:
        try:
            store = data_lib.prepare(
                path if path == "stdlib" else str(Path(path).absolute()),
                tokenizer,
                cache_dir=None if cache == "auto" else cache,
                text_column=config.data.text_column,
                pattern=config.data.pattern,
                build=False,
            )
        except (data_lib.DataError, ConfigError, OSError):
            return None
        if store is None:
            return None
        parts.append(store.lm_rows(config.data.seq_len))
    return parts
