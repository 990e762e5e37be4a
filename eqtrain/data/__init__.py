"""Data for eqtrain: sources, tokenizers, text pipelines and a deterministic,
resumable `Loader` with per-process slicing and prefetch.

    docs = stdlib_corpus("train")                        # the built-in corpus
    rows = chunk_documents(docs, ByteTokenizer(), seq_len=256)
    loader = Loader(rows, batch_size=16, seed=0)         # resumable: loader.position

Corpora larger than memory: a tokenized store on disk, prepared once (in
parallel, resumable) and read by index arithmetic:

    store = prepare("corpus.jsonl", tok)                 # cached by content
    loader = Loader(store.lm_rows(seq_len=1024), batch_size=16, seed=0)

Post-training (SFT, preference pairs) with the model's own chat template:

    template = chat_template(tok.directory)              # Jinja, or the built-in one
    rows, report = sft_rows(records, tok, seq_len=512, format="chat", template=template)
    pairs, report = preference_rows(records, tok, seq_len=512, template=template)
"""

from ._buckets import (
    PromptBuckets as PromptBuckets,
    bucket_widths as bucket_widths,
)
from ._chat import (
    MASK_RULE as MASK_RULE,
    BuiltinChatTemplate as BuiltinChatTemplate,
    ChatTemplate as ChatTemplate,
    JinjaChatTemplate as JinjaChatTemplate,
    chat_template as chat_template,
    check_template_kwargs as check_template_kwargs,
    check_tools as check_tools,
    read_chat_template as read_chat_template,
    read_chat_templates as read_chat_templates,
    template_identity as template_identity,
)
from ._chat_files import (
    copy_chat_templates as copy_chat_templates,
    write_chat_templates as write_chat_templates,
)
from ._corpus import stdlib_corpus as stdlib_corpus, stdlib_files as stdlib_files
from ._errors import (
    DataError as DataError,
    DataFileNotFoundError as DataFileNotFoundError,
    DataWarning as DataWarning,
)
from ._files import default_cache as default_cache
from ._loader import Loader as Loader
from ._mixture import Mixture as Mixture
from ._post import preference_rows as preference_rows, sft_rows as sft_rows
from ._records import SkipReport as SkipReport, infer_format as infer_format
from ._rows_cache import (
    cached_rows as cached_rows,
    tokenizer_identity as tokenizer_identity,
)
from ._sources import (
    column as column,
    from_files as from_files,
    load_text_dir as load_text_dir,
    read_text as read_text,
    text_column as text_column,
)
from ._stream import fingerprint as fingerprint
from ._text import (
    chat_examples as chat_examples,
    chunk_documents as chunk_documents,
    collate as collate,
    encode_chat as encode_chat,
    pack as pack,
)
from ._tokenizers import (
    ByteTokenizer as ByteTokenizer,
    HFTokenizer as HFTokenizer,
    Tokenizer as Tokenizer,
)
from .store import (
    LMRows as LMRows,
    MappedRows as MappedRows,
    PostRows as PostRows,
    Store as Store,
    prepare as prepare,
    prepare_post as prepare_post,
    record_columns as record_columns,
)
