"""`eqtrain data prepare`: the tokenized stores of a config's text sources, built
(or checked) before any run, and the per-source counts a run reports."""

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .. import data as data_lib
from .._errors import ConfigError
from ..config import Config, validate
from . import _build


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

    Raises:
        ConfigError: task.kind is not lm (post-training data is tokenized with
            its chat template at the start of a run), or a source is missing or
            malformed.
    """
    validate(config)
    if config.task.kind != "lm":
        raise ConfigError(
            f"`eqtrain data prepare` builds stores of plain text for task.kind = "
            f"'lm'; task.kind = {config.task.kind!r} reads its records at the start "
            "of the run (they are tokenized with the chat template then)."
        )
    job = _build.build(config)
    cache = config.data.cache
    workers = config.data.workers
    settings = dict(
        cache_dir=None if cache == "auto" else str(Path(cache).absolute()),
        workers=None if workers == "auto" else workers,
        text_column=config.data.text_column,
        pattern=config.data.pattern,
        executor=executor,
        verify=verify,
    )
    if say is not None:
        settings["say"] = say
    jobs = [
        ("train", name, path, key) for name, path, _, key in _build.text_sources(config)
    ]
    eval_source = _eval_source(config)
    if eval_source is not None:
        jobs.append(("eval", "eval", eval_source, "data.eval"))
    out = []
    for split, name, path, key in jobs:
        source = path
        if path == "stdlib":
            source = "stdlib" if split == "train" else "stdlib:eval"
        elif not Path(path).exists():
            raise ConfigError(f"`{key}` names {path!r}, which does not exist.")
        else:
            source = str(Path(path).absolute())
        try:
            store = data_lib.prepare(source, job.tokenizer, **settings)
        except data_lib.DataError as e:
            raise ConfigError(f"`{key}` ({path}): {e}") from None
        out.append(
            {
                "split": split,
                "name": name,
                "source": path,
                "store": str(store.directory),
                "documents": store.num_documents,
                "tokens": store.num_tokens,
                "parts": store.num_parts,
            }
        )
    return out


def _eval_source(config: Config) -> str | None:
    source = config.data.eval
    if source == "auto":
        source = "stdlib" if config.data.train == "stdlib" else "none"
    if source == "none" or config.loop.eval_every == 0 and not config.loop.eval_at_end:
        return None
    return source


def tokens_per_source(
    rows: Any, position: Mapping[str, int], batch_size: int
) -> dict[str, int]:
    """Training tokens each source of a mixture has given up to the loader
    `position` (`{}` for one source): rows by the mixture's schedule times the
    row width."""
    mixture = getattr(rows, "source", rows)
    if not isinstance(mixture, data_lib.Mixture):
        return {}
    consumed = position["epoch"] * mixture.num_rows + position["index"] * batch_size
    width = mixture.sources[0].seq_len
    return {k: v * width for k, v in mixture.rows_per_source(consumed).items()}
