"""`[data]`: what the run trains and evaluates on, and how it becomes rows."""

import dataclasses

from ._schema import (
    DATA_FORMATS,
    setting,
)


@dataclasses.dataclass(frozen=True)
class DataConfig:
    train: str = setting(
        "stdlib",
        "Training text: `stdlib` (the Python standard library's sources, built "
        "in), a directory of text files, or a file (.txt, .json/.jsonl, .parquet, "
        ".csv).",
        kind="path",
    )
    eval: str = setting(
        "auto",
        "Evaluation text, as `train`; `auto`: the standard library's held-out "
        "files when train = `stdlib`, else none; `none`: no evaluation.",
        kind="path",
    )
    format: str = setting(
        "auto",
        "What the data files hold: `text` (plain text, for task.kind = lm), "
        "`chat` (a `messages` column of role/content turns), `prompt_completion` "
        "(`prompt` and `completion` columns) or `preference` (`prompt`, `chosen`, "
        "`rejected`); strings or message lists. `auto`: text for lm, else read "
        "from the columns.",
        choices=DATA_FORMATS,
    )
    text_column: str = setting(
        "text", "Column holding the text in .json/.jsonl/.parquet/.csv files."
    )
    chat_template: str = setting(
        "auto",
        "How conversations become tokens: a `.jinja` file (one template for every "
        "record), `builtin` (eqtrain's own template), or `auto`: the tokenizer "
        "directory's templates when it has some, else builtin. They are read as "
        "transformers reads them: chat_template.jinja (the default) with "
        "additional_chat_templates/<name>.jinja, else tokenizer_config.json's "
        "chat_template (a string, or a list of {name, template}); a record with "
        "tools is rendered with the `tool_use` one where there is one.",
        kind="path",
    )
    chat_template_kwargs: str = setting(
        "",
        "Variables given to the chat template in every render of every record "
        "(TRL's `chat_template_kwargs`; transformers' `apply_chat_template(..., "
        "**kwargs)`): a table, `chat_template_kwargs = {enable_thinking = false}` "
        "for Qwen3, or a JSON object (`--set 'data.chat_template_kwargs="
        "{\"enable_thinking\": false}'`). A record's own chat_template_kwargs "
        "field wins over these, key by key. messages, tools, documents and "
        "add_generation_prompt are refused (every render sets them). A template "
        "that does not read a variable ignores it; the builtin template reads "
        "none. Empty: none.",
        kind="table",
    )
    max_prompt_len: int | None = setting(
        None,
        "Prompts longer than this many tokens keep only their end; a row whose "
        "prompt and completion still exceed seq_len + 1 tokens is skipped. Unset: "
        "data.seq_len // 2.",
        min=1,
    )
    pack: bool = setting(
        True,
        "SFT: pack several examples into each row (segment ids keep attention and "
        "loss within each); false: one example per row, padded.",
    )
    pattern: str = setting(
        "**/*.txt", "Glob of the files read from a directory of text files."
    )
    tokenizer: str = setting(
        "auto",
        "`byte` (UTF-8 bytes + 3 specials, 259 ids), a `tokenizer.json` file or a "
        "directory holding one; `auto`: init_from's tokenizer.json when it has "
        "one, else `byte`.",
        kind="path",
    )
    seq_len: int = setting(128, "Tokens per training row.", min=2)
    batch_size: int = setting(
        16,
        "Rows per optimizer step (the global batch; split into optim.accumulate "
        "micro-batches).",
        min=1,
    )
    eval_rows: int = setting(
        128, "At most this many rows of the eval text are evaluated.", min=1
    )
    sources: str = setting(
        "",
        "A mixture for task.kind = lm, in place of `train`: several sources with "
        "weights, as `[[data.sources]]` tables with `path` and `weight` (and an "
        'optional `name`), or `--set data.sources="web.jsonl=0.7,code=0.3"`. '
        "Each batch's rows follow the weights; each source repeats or is read "
        "partially as its weight asks.",
        kind="sources",
    )
    cache: str = setting(
        "auto",
        "Where tokenized stores are kept (one per source, named by the content of "
        "the files, the tokenizer and the settings; reused by later runs). `auto`: "
        "$EQTRAIN_DATA_CACHE, else ~/.cache/eqtrain/data. For task.kind = lm.",
        kind="path",
    )
    workers: int | str = setting(
        "auto",
        "Processes that tokenize when a store is prepared; `auto`: the CPU count.",
        min=1,
        kind="auto_int",
    )
    shuffle: bool = setting(True, "Shuffle the training rows every epoch.")
    prefetch: int = setting(2, "Batches prepared ahead in a background thread.", min=0)
