"""A run's rows: the tokenized stores of its text sources (task.kind = lm), the
SFT, preference or prompt rows of its record files, its eval rows, and the
positions a sequence-parallel model reads (`planned`: all of them). Each
reader names the config key of a source that is missing or malformed."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .. import data as data_lib, models
from .._errors import ConfigError
from ..config import PREFERENCE_TASKS, Config, eval_source, parse_sources
from . import _grpo
from ._build import Job


Rows = dict[str, np.ndarray]

_TEXT_FILES = (
    "'stdlib', a directory of text files or a .txt/.json/.jsonl/.parquet/.csv "
    "file (also .gz or .zst)"
)
_RECORD_FILES = (".jsonl", ".json", ".parquet", ".csv")
_COLUMNS = {
    "chat": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("chosen", "rejected"),
}
_SFT_FORMATS = ("chat", "prompt_completion")


# -- sources ------------------------------------------------------------------------
def check_sources(config: Config) -> None:
    """Every data source the run will read exists (`ConfigError` naming the key
    otherwise), said before any of them is read or tokenized."""
    keys = [(key, path) for _, path, _, key in text_sources(config)]
    source = eval_source(config)
    if source != "none" and (config.loop.eval_every or config.loop.eval_at_end):
        keys.append(("data.eval", source))
    lm = config.task.kind == "lm"
    wanted = _TEXT_FILES if lm else f"a {'/'.join(_RECORD_FILES)} file of records"
    for key, path in keys:
        if path != "stdlib" and not Path(path).exists():
            raise ConfigError(
                f"`{key}` names {path!r}, which does not exist. Pass {wanted}."
            )


def text_sources(config: Config) -> list[tuple[str, str, float, str]]:
    """The training text sources: `(name, path, weight, key)` for each entry of
    `data.sources`, or the one `data.train`."""
    entries = parse_sources(config.data.sources)
    if not entries:
        return [("train", config.data.train, 1.0, "data.train")]
    out, seen = [], set()
    for i, (path, weight, name) in enumerate(entries):
        name = name or _source_name(path)
        while name in seen:
            name = f"{name}_{i}"
        seen.add(name)
        out.append((name, path, weight, f"data.sources[{i}]"))
    return out


def _source_name(path: str) -> str:
    """A metric-friendly name of a source: its file or directory name, without
    suffixes."""
    name = Path(path.rstrip("/")).name or path
    return name.split(".", 1)[0] or name


def store(job: Job, source: str, split: str, key: str) -> data_lib.Store:
    """The tokenized store of the text source `source` (the config key `key`):
    opened at once when it was prepared before, else prepared now (in parallel,
    with a progress line). `stdlib` is the built-in corpus's `split`."""
    if source == "stdlib":
        source = "stdlib" if split == "train" else "stdlib:eval"
    elif not Path(source).exists():
        raise ConfigError(
            f"`{key}` names {source!r}, which does not exist. Pass {_TEXT_FILES}."
        )
    data = job.config.data
    try:
        return data_lib.prepare(
            source,
            job.tokenizer,
            cache_dir=None if data.cache == "auto" else data.cache,
            workers=None if data.workers == "auto" else data.workers,
            text_column=data.text_column,
            pattern=data.pattern,
        )
    except data_lib.DataError as e:
        raise ConfigError(f"`{key}` ({source}): {e}") from None


# -- rows -------------------------------------------------------------------------
def num_rows(rows: Any) -> int:
    """Rows (or preference pairs) in `rows` (a dict of arrays or a row source)."""
    if hasattr(rows, "num_rows"):
        return int(rows.num_rows)
    return len(next(iter(rows.values())))


def first_rows(rows: Any, n: int) -> Rows:
    """The first `n` rows of `rows` as a dict of arrays."""
    if hasattr(rows, "take"):
        return rows.take(np.arange(min(n, num_rows(rows))))
    return {k: v[:n] for k, v in rows.items()}


def train_rows(job: Job) -> Any:
    """The training rows of `data.train` (`tokens`, `targets`, `loss_mask`, ...;
    pairs for preference tasks): for task.kind = lm a row source over the
    tokenized stores (a `Mixture` with `data.sources`), else a dict of arrays.
    Fewer than one batch of them is an error saying how many there are."""
    kind = job.config.task.kind
    if kind == "lm":
        rows = _text_rows(job)
    elif kind == "grpo":
        rows = _bucketed(job, grpo_rows(job, job.config.data.train, "data.train"))
    else:
        rows = post_rows(job, job.config.data.train, "data.train")
    _check_one_batch(job, rows)
    return rows


def _text_rows(job: Job) -> Any:
    """The LM rows of the training stores: one store's, or their `Mixture`."""
    config = job.config
    sources = text_sources(config)
    try:
        parts = [
            store(job, path, "train", key).lm_rows(config.data.seq_len)
            for _, path, _, key in sources
        ]
    except data_lib.DataError as e:
        raise ConfigError(f"the training data: {e}") from None
    if len(parts) == 1 and not config.data.sources:
        return parts[0]
    weights, names = [w for _, _, w, _ in sources], [n for n, *_ in sources]
    return data_lib.Mixture(parts, weights, names=names)


def _check_one_batch(job: Job, rows: Any) -> None:
    data, n = job.config.data, num_rows(rows)
    if n >= data.batch_size:
        return
    what = "pairs" if "chosen_tokens" in first_rows(rows, 1) else "rows"
    # the skip report explains a small count (e.g. a template's refusals)
    skipped = " ".join(n for n in job.notes if n.startswith("data.train "))
    raise ConfigError(
        f"the training data has {n} {what} of {data.seq_len} tokens, "
        f"fewer than one batch (`data.batch_size` = {data.batch_size}). "
        + (f"{skipped.rstrip('.')}. " if skipped else "")
        + "Lower data.batch_size or data.seq_len, or add data."
    )


def _bucketed(job: Job, rows: data_lib.PostRows) -> Any:
    """GRPO's training prompts in buckets of `task.prompt_buckets` widths
    (`data.PromptBuckets`); as they are when only one width is left."""
    config = job.config
    width = int(rows.settings["width"])
    widths = data_lib.bucket_widths(width, config.task.prompt_buckets)
    if len(widths) == 1:
        return rows
    return data_lib.PromptBuckets(rows, rows.lengths(), widths, config.data.batch_size)


def grpo_rows(
    job: Job,
    source: str,
    key: str,
    *,
    verify: bool = False,
    say: Callable[[str], None] | None = None,
) -> data_lib.PostRows:
    """GRPO's prompt rows of the file `source`, from its store (`_grpo.rows`)."""
    path = _record_file(job.config, source, key)
    options = _store_options(job, path, verify=verify, say=say)
    for name in ("seq_len", "max_prompt_len"):  # the prompts' width decides
        options.pop(name)
    return _grpo.rows(job, source, key, options)


def post_rows(
    job: Job,
    source: str,
    key: str,
    *,
    verify: bool = False,
    say: Callable[[str], None] | None = None,
) -> data_lib.PostRows:
    """The SFT or preference rows of the file `source` (the config key `key`),
    from its post-training store: opened when it was prepared before (nothing
    read, nothing tokenized), else prepared now in worker processes
    (`data.workers`); skipped records are noted in `job.notes`."""
    config = job.config
    path = _record_file(config, source, key)
    preference = config.task.kind in PREFERENCE_TASKS

    def resolve(columns: list[str]) -> dict[str, Any]:  # when the store is built
        fmt = _record_format(config, columns, key, source)
        return {} if preference else {"format": fmt}

    try:
        rows = data_lib.prepare_post(
            path,
            job.tokenizer,
            kind="preference" if preference else "sft",
            format=None if preference else config.data.format,
            pack=config.data.pack,
            resolve=resolve,
            **_store_options(job, path, verify=verify, say=say),
        )
    except data_lib.DataError as e:
        raise ConfigError(f"`{key}` ({source}): {e}") from None
    if rows.report.skipped:
        job.notes.append(_skip_note(f"{key} ({path.name})", rows.report))
    return rows


def _store_options(
    job: Job, path: Path, *, verify: bool, say: Callable[[str], None] | None
) -> dict[str, Any]:
    """What `data.prepare_post` takes from the job: the settings, the store's
    identity, the cache and the workers."""
    data = job.config.data
    return dict(
        seq_len=data.seq_len,
        template=job.template,
        max_prompt_len=data.max_prompt_len,
        identity=_post_identity(job, path),
        cache_dir=None if data.cache == "auto" else data.cache,
        workers=None if data.workers == "auto" else data.workers,
        verify=verify,
        say=say,
    )


def _record_file(config: Config, source: str, key: str) -> Path:
    path = Path(source)
    if not path.is_file() or path.suffix.lower() not in _RECORD_FILES:
        what = "does not exist" if not path.exists() else "is not such a file"
        raise ConfigError(
            f"`{key}` names {source!r}, which {what}: task.kind = "
            f"{config.task.kind!r} reads records from a "
            f"{'/'.join(_RECORD_FILES)} file."
        )
    return path


def _post_identity(job: Job, path: Path) -> dict[str, Any]:
    """What the cached rows of a record file depend on."""
    config, template = job.config, job.template
    return {
        "kind": "post",
        "source": data_lib.fingerprint(path),
        "tokenizer": data_lib.tokenizer_identity(job.tokenizer),
        "template": data_lib.template_identity(template),
        "eqtrain": _version(),  # the rows follow eqtrain's pipelines
        "settings": [
            config.task.kind,
            config.data.format,
            config.data.seq_len,
            config.data.max_prompt_len,
            config.data.pack,
        ],
    }


def _skip_note(where: str, report: data_lib.SkipReport) -> str:
    """The run's note of skipped records, with a hint when they are many."""
    note = f"{where}: {report}"
    if report.skipped * 5 <= report.total:
        return note
    # many skipped: e.g. a seq_len too short for the data
    top = max(report.reasons, key=report.reasons.__getitem__)
    check = (
        "the data against data.chat_template"
        if "chat template" in top
        else "data.seq_len and data.max_prompt_len"
    )
    share = report.skipped / report.total
    return note + f". That is {share:.0%} of the data: check {check}."


def _version() -> str:
    import eqtrain

    return eqtrain.__version__


def _record_format(config: Config, columns: list[str], key: str, source: str) -> str:
    """`data.format` (`auto`: from the file's `columns`), checked against the
    task."""
    fmt = config.data.format
    if fmt == "auto":  # the columns say
        fmt = data_lib.infer_format(dict.fromkeys(columns))
    else:
        _check_columns(columns, fmt, key, source)
    kind = config.task.kind
    wanted = ("preference",) if kind in PREFERENCE_TASKS else _SFT_FORMATS
    if fmt not in wanted:
        raise ConfigError(
            f"`{key}` ({source}) holds {fmt!r} data (from its columns), but "
            f"task.kind = {kind!r} trains on {' or '.join(wanted)} data. Use "
            "another file, or set data.format / task.kind."
        )
    return fmt


def _check_columns(have: list[str], fmt: str, key: str, source: str) -> None:
    """An explicit `data.format` whose columns the file lacks is a config error
    (not every row skipped as "missing")."""
    missing = [c for c in _COLUMNS.get(fmt, ()) if c not in have]
    if missing:
        raise ConfigError(
            f"data.format = {fmt!r} reads the column(s) {list(_COLUMNS[fmt])}, but "
            f"`{key}` ({source}) has {have}; it holds "
            f"{_format_of(have)} data. Set data.format to match "
            "(or `auto`), or use another file."
        )


def _format_of(columns: list[str]) -> str:
    try:
        return repr(data_lib.infer_format(dict.fromkeys(columns)))
    except data_lib.DataError:
        return "no known"


def eval_rows(job: Job) -> Rows | None:
    """The evaluation rows of `data.eval` (at most `data.eval_rows`), or None.
    Whole batches only (one compiled shape): a last, short one is dropped, or
    for task.kind = grpo padded (`_grpo.padded_eval_rows`: every prompt counts)."""
    config = job.config
    source = eval_source(config)
    if source == "none" or config.loop.eval_every == 0 and not config.loop.eval_at_end:
        return None
    if config.task.kind == "lm":
        rows = _eval_text_rows(job, source)
    elif config.task.kind == "grpo":
        rows = grpo_rows(job, source, "data.eval")
        n = min(config.data.eval_rows, num_rows(rows))
        batch = min(config.data.batch_size, n)
        return _grpo.padded_eval_rows(first_rows(rows, n), batch)
    else:
        rows = post_rows(job, source, "data.eval")
    n = min(config.data.eval_rows, num_rows(rows))
    n -= n % min(config.data.batch_size, n)  # whole batches: one compiled shape
    return first_rows(rows, n)


def _eval_text_rows(job: Job, source: str) -> Any:
    try:
        return store(job, source, "eval", "data.eval").lm_rows(job.config.data.seq_len)
    except data_lib.DataError as e:
        raise ConfigError(f"`data.eval` ({source}): {e}") from None


def planned(job: Job) -> tuple[Any, Rows | None]:
    """The run's training and eval rows (None without evaluation), with the
    positions a sequence-parallel model reads: every source checked to exist
    before any is read."""
    check_sources(job.config)
    train, evals = train_rows(job), eval_rows(job)
    return sequence_rows(job, train), None if evals is None else sequence_rows(
        job, evals
    )


def sequence_rows(job: Job, rows: Any) -> Any:
    """LM rows with the global `positions` a sequence-parallel model reads, in the
    configured layout (`eqtrain.models.sequence_rows`); other rows unchanged."""
    m = job.config.model
    if m.sequence_parallel is None or "tokens" not in first_rows(rows, 1):
        return rows
    ways = job.config.mesh.sequence

    def positioned(rows: Rows) -> Rows:
        return models.sequence_rows(rows, layout=m.sequence_layout, ways=ways)

    if hasattr(rows, "take"):  # a row source: each batch as it is read
        return data_lib.MappedRows(rows, positioned)
    return positioned(rows)
