"""Tokenizers as data a worker can rebuild: a JSON spec of a `ByteTokenizer` or an
`HFTokenizer`, and the `Encoder` that a store's builder (in this process, a worker
process or a Ray task) makes from it.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._errors import DataError
from ._files import json_sha256


def tokenizer_spec(tokenizer: Any) -> dict[str, Any]:
    """What a worker needs to encode exactly as `tokenizer.encode` does: `byte`, or
    a `tokenizers` JSON (from `HFTokenizer`), with the EOS id that ends documents.

    Raises:
        DataError: the tokenizer has no EOS id, or is neither kind.
    """
    eos = getattr(tokenizer, "eos_id", None)
    if eos is None:
        raise DataError(
            f"{tokenizer!r} has no EOS token, and the store ends every document with "
            "EOS. Use a tokenizer with one (or name it: HFTokenizer.from_file(path, "
            "eos=...))."
        )
    from ._tokenizers import ByteTokenizer, HFTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return {"kind": "byte", "eos": int(eos), "vocab_size": 259}
    if isinstance(tokenizer, HFTokenizer):
        return _hf_spec(tokenizer, int(eos))
    raise DataError(
        f"the store can tokenize with a ByteTokenizer or an HFTokenizer; got "
        f"{type(tokenizer).__name__}. Tokenize in memory (chunk_documents) instead."
    )


def _hf_spec(tokenizer: Any, eos: int) -> dict[str, Any]:
    """An `HFTokenizer`'s spec: its whole `tokenizers` JSON."""
    return {
        "kind": "hf",
        "eos": eos,
        "vocab_size": int(tokenizer.vocab_size),
        "json": tokenizer._tok.to_str(),
    }


def tokenizer_key(spec: Mapping[str, Any]) -> str:
    """A short, stable name of a tokenizer spec (sha256 of its JSON)."""
    return json_sha256(spec)


def _with_eos(ids: Any, eos: int) -> np.ndarray:
    """`ids` as uint32, followed by `eos`."""
    out = np.empty(len(ids) + 1, np.uint32)
    out[:-1] = ids
    out[-1] = eos
    return out


def _batch_encoder(text: str) -> Any:
    """The batch encoder (the fast one where there is one) of a `tokenizers` JSON."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_str(text)
    return getattr(tok, "encode_batch_fast", None) or tok.encode_batch


class Encoder:
    """Encodes batches of documents into one flat stream with EOS after each."""

    def __init__(self, spec: Mapping[str, Any]):
        self.eos = int(spec["eos"])
        self.kind = spec["kind"]
        if self.kind == "hf":
            self._batch = _batch_encoder(spec["json"])

    def encode(self, docs: Sequence[str]) -> tuple[list[np.ndarray], list[int]]:
        """Token ids (with EOS after each document) and each document's length."""
        if self.kind == "byte":
            pieces = [np.frombuffer(d.encode("utf-8"), np.uint8) for d in docs]
        else:
            pieces = [e.ids for e in self._batch(list(docs), add_special_tokens=False)]
        out = [_with_eos(p, self.eos) for p in pieces]
        return out, [len(ids) for ids in out]


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
