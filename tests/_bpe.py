"""A tiny byte-level BPE tokenizer for the chat tests: lossless, so the text a
mask marks can be decoded and read back."""

from pathlib import Path


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
