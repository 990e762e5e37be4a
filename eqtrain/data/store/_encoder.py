"""Tokenizers as data a worker can rebuild: a JSON spec of a `ByteTokenizer` or an
`HFTokenizer`, and the `Encoder` that a store's builder (in this process, a worker
process or a Ray task) makes from it.
"""

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from .._errors import DataError
from .._files import json_sha256


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
    from .._tokenizers import ByteTokenizer, HFTokenizer

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


SPAN_CHARS = 1 << 20
"""Characters encoded at once: a longer document is encoded in spans of at most
this many, so a worker's memory does not grow with its longest document."""
_WINDOW = 256
"""Characters on each side of a cut that `Encoder._joins` encodes."""
_TRIES = 16
"""Cuts of an HF tokenizer's span tried before the first candidate is taken."""


class Encoder:
    """Encodes batches of documents into one flat stream with EOS after each.

    A document longer than `SPAN_CHARS` is encoded in spans. For the byte
    tokenizer the ids are exactly those of the whole document. For an HF
    tokenizer a span ends at a line break (else a space, else where a word
    ends), from `SPAN_CHARS` backwards, at the first place where encoding a
    window of text on both sides gives the same ids whole as in two halves (so
    the cut falls between two of the tokenizer's pre-tokens); when none of 16
    places passes, the first is taken, and the tokens next to that cut may
    differ from those of the whole document.
    """

    def __init__(self, spec: Mapping[str, Any]):
        self.eos = int(spec["eos"])
        self.kind = spec["kind"]
        if self.kind == "hf":
            self._batch = _batch_encoder(spec["json"])

    def encode(self, docs: Sequence[str]) -> tuple[list[np.ndarray], list[int]]:
        """Token ids (with EOS after each document) and each document's length."""
        short = [d for d in docs if len(d) <= SPAN_CHARS]
        encoded = iter(self._ids(short) if short else ())
        pieces = [
            next(encoded) if len(d) <= SPAN_CHARS else self._long(d) for d in docs
        ]
        out = [_with_eos(p, self.eos) for p in pieces]
        return out, [len(ids) for ids in out]

    def _ids(self, texts: Sequence[str]) -> list[Any]:
        """The ids of each of `texts`, encoded together."""
        if self.kind == "byte":
            return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]
        return [e.ids for e in self._batch(list(texts), add_special_tokens=False)]

    def _long(self, doc: str) -> np.ndarray:
        """The ids of a document longer than `SPAN_CHARS`, encoded span by span."""
        out, start = [], 0
        while start < len(doc):
            stop = self._cut(doc, start)
            out.append(np.asarray(self._ids([doc[start:stop]])[0], np.uint32))
            start = stop
        return np.concatenate(out)

    def _cut(self, doc: str, start: int) -> int:
        """Where the span of `doc` from `start` ends (see the class docstring)."""
        limit = start + SPAN_CHARS
        if limit >= len(doc):
            return len(doc)
        if self.kind == "byte":
            return limit
        candidates = _cuts(doc, start + SPAN_CHARS // 2, limit)
        first = None
        for cut in itertools.islice(candidates, _TRIES):
            first = cut if first is None else first
            if self._joins(doc, cut):
                return cut
        return limit if first is None else first

    def _joins(self, doc: str, cut: int) -> bool:
        """Whether the text around `cut` encodes to the same ids whole and cut."""
        left, right = doc[max(cut - _WINDOW, 0) : cut], doc[cut : cut + _WINDOW]
        whole, a, b = self._ids([left + right, left, right])
        return list(whole) == list(a) + list(b)


def _cuts(doc: str, low: int, high: int) -> Iterator[int]:
    """Places in `doc[low:high]` to end a span, best first, each from `high`
    backwards: after a line break between two characters that are not
    whitespace, then before such a space, then wherever a run of letters and
    digits, of whitespace or of other characters ends."""
    for mark, after in (("\n", 1), (" ", 0)):
        at = high
        while (at := doc.rfind(mark, low, at)) > low:
            before, following = doc[at - 1], doc[at + 1 : at + 2]
            if not before.isspace() and following and not following.isspace():
                yield at + after
    kind = lambda c: (c.isspace(), c.isalnum())  # noqa: E731
    for cut in range(high, low, -1):
        if kind(doc[cut - 1]) != kind(doc[cut]):
            yield cut


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
