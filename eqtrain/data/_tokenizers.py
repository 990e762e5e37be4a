"""Tokenizers with one small interface: a built-in byte-level tokenizer and HF
`tokenizers` tokenizers read from a local `tokenizer.json` (optional extra)."""

import json
import os
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
from jaxtyping import Int

from .._errors import ConfigError
from ._errors import DataError, PathLike, check_exists


@runtime_checkable
class Tokenizer(Protocol):
    """What the text pipelines need from a tokenizer.

    `encode` adds no special tokens: the pipelines add BOS/EOS themselves, where
    their documented formats put them. Special ids may be `None` where a tokenizer
    has no such token.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int | None: ...

    @property
    def pad_id(self) -> int | None: ...

    def encode(self, text: str) -> Int[np.ndarray, " n"]: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0-255 are the bytes, then PAD, BOS and EOS.

    Needs no file, works for any text, and `decode(encode(s)) == s` for every
    string. `decode` skips the special ids.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.encode("hé").tolist(), tok.vocab_size, tok.eos_id
        ([104, 195, 169], 259, 258)
        >>> tok.decode(tok.encode("hé"))
        'hé'
    """

    pad_id: int = 256
    bos_id: int = 257
    eos_id: int = 258
    vocab_size: int = 259

    def encode(self, text: str) -> Int[np.ndarray, " n"]:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def encode_with_offsets(
        self, text: str
    ) -> tuple[Int[np.ndarray, " n"], Int[np.ndarray, "n 2"]]:
        """`encode(text)` and each token's `[start, end)` character span in `text`
        (every byte of a character spans that character)."""
        widths = [len(char.encode("utf-8")) for char in text]
        starts = np.repeat(np.arange(len(text), dtype=np.int32), widths)
        return self.encode(text), np.stack([starts, starts + 1], axis=1)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids, np.int64).reshape(-1)
        return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


# Names by which tokenizer files commonly spell their special tokens, when no
# tokenizer_config.json says which is which.
_SPECIAL_NAMES = {
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "[BOS]", "<|startoftext|>"),
    "eos": ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[EOS]", "<|im_end|>"),
    "pad": ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>"),
}


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer read from a local `tokenizer.json`.

    Needs the optional `tokenizers` package (`pip install eqtrain[tokenizers]`).
    Build it with `HFTokenizer.from_file(path)`.

    Special tokens: `bos`/`eos`/`pad` given as arguments win; else those named in
    a `tokenizer_config.json` next to the file (`bos_token`, ...); else the first
    common spelling (`<s>`, `</s>`, `<|endoftext|>`, `<pad>`, `[PAD]`, ...) found in
    the vocabulary. `pad_id` falls back to `eos_id`: padding is masked out of the
    loss, so its id only has to exist.

    `directory` is the directory the file was read from (None when built from a
    tokenizer object): `eqtrain.data.chat_template(tok.directory)` reads the
    model's chat template from it.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        bos_id: int | None,
        eos_id: int | None,
        pad_id: int | None,
        directory: str | None = None,
    ):
        self._tok = tokenizer
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.directory = directory

    @classmethod
    def from_file(
        cls,
        path: PathLike,
        *,
        bos: str | None = None,
        eos: str | None = None,
        pad: str | None = None,
    ) -> "HFTokenizer":
        """Load `path` (a `tokenizer.json`, or a directory holding one).

        Raises:
            DataFileNotFoundError: the file does not exist.
            DataError: the file does not parse, or a named special token is not in
                its vocabulary.
        """
        tokenizers = _import_tokenizers()
        path = _tokenizer_file(path)
        tok = _parse(tokenizers, path)
        names = _config_names(os.path.dirname(path))
        ids = {}
        for kind, given in (("bos", bos), ("eos", eos), ("pad", pad)):
            ids[kind] = _special_id(tok, kind, given or names.get(kind), path)
        return cls(
            tok,
            bos_id=ids["bos"],
            eos_id=ids["eos"],
            pad_id=ids["pad"],
            directory=os.path.dirname(os.path.abspath(path)),
        )

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> Int[np.ndarray, " n"]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return np.asarray(ids, np.int32)

    def encode_with_offsets(
        self, text: str
    ) -> tuple[Int[np.ndarray, " n"], Int[np.ndarray, "n 2"]]:
        """`encode(text)` and each token's `[start, end)` character span in `text`
        (the `tokenizers` Encoding's offsets)."""
        encoding = self._tok.encode(text, add_special_tokens=False)
        offsets = np.asarray(encoding.offsets, np.int32).reshape(-1, 2)
        return np.asarray(encoding.ids, np.int32), offsets

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids, np.int64).reshape(-1).tolist()
        return self._tok.decode(ids, skip_special_tokens=True)

    def __repr__(self) -> str:
        return (
            f"HFTokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id})"
        )


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as error:
        raise ImportError(
            "HFTokenizer needs the optional `tokenizers` package: "
            "`pip install 'eqtrain[tokenizers]'` (or `pip install tokenizers`). "
            "The built-in `ByteTokenizer` needs nothing."
        ) from error
    return tokenizers


_NAME_THEM = (
    "Fix or remove it (or, in Python, name the special tokens with `bos=`, `eos=`, "
    "`pad=`)."
)


def _tokenizer_file(path: PathLike) -> str:
    """`path`, or the `tokenizer.json` in the directory `path`; it must exist."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    check_exists(path, "tokenizer file")
    return path


def _parse(tokenizers: Any, path: str) -> Any:
    """The `tokenizers.Tokenizer` of a `tokenizer.json`."""
    try:
        return tokenizers.Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises a bare Exception
        raise DataError(
            f"could not parse the tokenizer file {path}: {error}. It must be a "
            "Hugging Face `tokenizer.json` (as written by `Tokenizer.save` or "
            "`save_pretrained`), not a vocab/merges/sentencepiece file."
        ) from error


def _config_names(directory: str) -> dict[str, str]:
    """Special-token names from a `tokenizer_config.json` next to the file."""
    path = os.path.join(directory, "tokenizer_config.json")
    config = read_config(path, _NAME_THEM)
    names = {k: token_content(config.get(f"{k}_token")) for k in ("bos", "eos", "pad")}
    return {kind: name for kind, name in names.items() if name is not None}


def read_config(path: str, advice: str) -> dict[str, Any]:
    """The JSON object in `path` ({} when there is no such file, or it holds no
    object); a file that does not parse is a DataError ending with `advice`."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError) as error:
        raise DataError(f"could not parse {path}: {error}. {advice}") from error
    return value if isinstance(value, dict) else {}


def token_content(value: Any) -> str | None:
    """A special token's string in a tokenizer config: the value itself, or the
    `content` of an AddedToken written as a dict; None for anything else."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_id(tok: Any, kind: str, name: str | None, path: str) -> int | None:
    """The id of the `kind` token `name`, else of the first of its usual names."""
    if name is not None:
        return _named_id(tok, kind, name, path)
    found = (tok.token_to_id(candidate) for candidate in _SPECIAL_NAMES[kind])
    return next((int(token_id) for token_id in found if token_id is not None), None)


def _named_id(tok: Any, kind: str, name: str, path: str) -> int:
    token_id = tok.token_to_id(name)
    if token_id is None:
        raise DataError(
            f"the {kind} token {name!r} is not in the vocabulary of {path}. Pass "
            f"`{kind}=` with a token the tokenizer has."
        )
    return int(token_id)


def require_id(tokenizer: Tokenizer, kind: str, purpose: str) -> int:
    """`tokenizer.<kind>_id`, or a `ConfigError` saying `purpose` needs one."""
    value = getattr(tokenizer, f"{kind}_id")
    if value is None:
        raise ConfigError(
            f"{purpose} needs a tokenizer with a {kind.upper()} token, but "
            f"{tokenizer!r} has none. Name one (e.g. `HFTokenizer.from_file(path, "
            f"{kind}='</s>')`) or use `ByteTokenizer()`."
        )
    return int(value)
