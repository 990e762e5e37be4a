"""The tokenized store: a source tokenized once into flat `.tokens`/`.ends`
parts under the data cache, keyed by content, built in parallel (worker
processes or Ray tasks) and resumably (each part committed by its ledger entry),
then read back by index arithmetic (`Store`, `LMRows`).

`prepare` opens the complete store of a source or builds it (`_prepare`);
`_builder` runs the parts not committed yet where `_workers` says (this
process, `python -m eqtrain.data.store._worker`, or Ray); `_parts` is one part
on disk; `_encoder` is the tokenizer as data a worker rebuilds.

`prepare_post` does the same for post-training records (SFT examples,
preference pairs, GRPO prompts: `_post_store`, `_post_parts`), read back as
rows by index (`PostRows`, `_post_rows`).
"""

from ._post_rows import PostRows as PostRows
from ._post_store import (
    prepare_post as prepare_post,
    record_columns as record_columns,
)
from ._prepare import prepare as prepare
from ._store import LMRows as LMRows, MappedRows as MappedRows, Store as Store
