"""The chat tests' tokenizer helpers: a tiny byte-level BPE (lossless, so the
text a mask marks can be decoded and read back), transformers' ids of a chat,
and the text a mask marks."""

from pathlib import Path
from typing import Any

import numpy as np


def byte_bpe(path: Path, texts: list[str], specials: list[str], vocab: int) -> Path:
    """Train a byte-level BPE of `vocab` tokens on `texts`, with `specials` as its
    special tokens, and save it as the `tokenizer.json` file `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


def chat_ids(hf: Any, template: Any, messages: list, **kwargs: Any) -> list[int]:
    """transformers' ids of `messages` through `template`'s source (`hf`: a
    `PreTrainedTokenizerFast`; `kwargs`: `apply_chat_template`'s, e.g. `tools`)."""
    out = hf.apply_chat_template(
        messages,
        chat_template=template.source,
        tokenize=True,
        return_dict=True,
        **kwargs,
    )
    return [int(i) for i in out["input_ids"]]


def learned_text(ids: Any, mask: Any, hf: Any) -> list[str]:
    """The decoded text of each run of consecutive learned tokens."""
    mask = np.asarray(mask, np.int64)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    ids = [int(i) for i in ids]
    return [hf.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def assert_same_rows(
    tok: Any, template: Any, messages: list[Any], **field: Any
) -> None:
    """A conversation's `sft_rows` with a record field that says "none" (`tools`,
    `chat_template_kwargs`) equal its rows without the field."""
    from eqtrain.data import sft_rows

    def rows(record: dict[str, Any]) -> dict[str, Any]:
        kw = dict(format="chat", template=template, seq_len=512)
        return sft_rows([record], tok, **kw)[0]

    without = rows({"messages": messages})
    with_field = rows({"messages": messages, **field})
    assert with_field.keys() == without.keys()
    for key in without:
        np.testing.assert_array_equal(with_field[key], without[key])
