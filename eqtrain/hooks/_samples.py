"""`SamplesWriter`: a hook that generates from the current model at its steps
(`eqtrain.generate`) and appends the completions to a JSON Lines file, and to
TensorBoard's text tab."""

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import jax.random as jr
import numpy as np

from .._errors import ConfigError
from .._hooks import StepInfo
from ..generate import GREEDY, Sampling, generate, left_pad
from ._jsonl import cut_after
from ._scalars import require
from ._tensorboard import summary_writer


def _check_prompts(prompts: Sequence[Any], tokens: Sequence[np.ndarray]) -> None:
    if len(prompts) != len(tokens) or not prompts:
        raise ConfigError("`SamplesWriter` needs one token list per prompt.")


class SamplesWriter:
    """Complete the same prompts from the model of each step it is called at.

    Each call appends one line per prompt to `path`: `{"step", "prompt",
    "completion"}`, and with `tensorboard` writes each completion as the text
    summary `samples/<i>` (prompt and completion, as Markdown) at the step.
    The prompts are padded once, so generation compiles once (the first call)
    and every later call reuses it; the hook reads the new tokens back (its
    one wait for the device). It declares `uses_state`: it sees the exact
    model of its step. Called again at the same step (`at_end` after an
    `every` call), it does nothing.

    Args:
        prompts: what each prompt was (a string or messages), as written.
        tokens: each prompt's token ids (as the model reads them).
        decode: token ids -> text (the run's tokenizer's `decode`).
        path: the JSON Lines file (appended to; its directory is created).
        max_new_tokens: the most new tokens per prompt.
        stop_ids: a completion ends at one of these (not written).
        sampling: `GREEDY` by default; samples use the key `fold_in(key(seed),
            step)`.
        pick: the model to generate with, from a state's model (e.g. the policy
            of a `preference.WithReference`).
        vocab_size: the real vocabulary of a padded head (see `generate`).
        mesh: the mesh the model lies on (see `generate`).
        multiple: the padded prompts' length is a multiple of it (`left_pad`).
        tensorboard: a TensorBoard log directory, or None.
        start: the step a resumed run starts from: `path`'s lines after it are
            dropped on the first call (None: keep them).
        write: False: generate (every process takes part) but write nothing.
        compiler_options: XLA options for generation's compilation (see
            `generate`).
    """

    uses_state = True

    def __init__(
        self,
        prompts: Sequence[Any],
        tokens: Sequence[np.ndarray],
        *,
        decode: Callable[[np.ndarray], str],
        path: str | os.PathLike[str],
        max_new_tokens: int,
        stop_ids: Sequence[int] = (),
        sampling: Sampling = GREEDY,
        seed: int = 0,
        pick: Callable[[Any], Any] = lambda model: model,
        vocab_size: int | None = None,
        mesh: Any = None,
        multiple: int = 16,
        tensorboard: str | os.PathLike[str] | None = None,
        start: int | None = None,
        write: bool = True,
        compiler_options: dict[str, Any] | None = None,
    ):
        _check_prompts(prompts, tokens)
        self.prompts = list(prompts)
        self.tokens, self.lengths = left_pad(tokens, pad_id=0, multiple=multiple)
        self.decode = decode
        self.stop_ids = tuple(int(i) for i in stop_ids)
        self.options = dict(
            max_new_tokens=max_new_tokens, sampling=sampling, vocab_size=vocab_size,
            mesh=mesh, stop_ids=self.stop_ids, compiler_options=compiler_options,
        )  # fmt: skip
        self.key = jr.key(seed)
        self.pick = pick
        self.out = _Out(self.prompts, Path(path), tensorboard, start) if write else None
        self._last: int | None = None

    def __call__(self, info: StepInfo) -> None:
        if info.step == self._last or (
            info.stop_reason is None and info.metrics.get("halted")
        ):
            return
        self._last = info.step
        texts = self.complete(info.state.model, info.step)
        if self.out is not None:
            self.out.append(info.step, texts)

    def complete(self, model: Any, step: int) -> list[str]:
        """The prompts' completions by `model` (a state's model), with the key
        of `step`."""
        out = generate(
            self.pick(model), self.tokens, self.lengths,
            key=jr.fold_in(self.key, step), **self.options,
        )  # fmt: skip
        tokens, lengths = out.tokens, out.lengths
        if not tokens.is_fully_addressable:  # rows on other processes' devices
            from jax.experimental import multihost_utils

            tokens, lengths = multihost_utils.process_allgather(
                (tokens, lengths), tiled=True
            )
        rows = zip(np.asarray(tokens), np.asarray(lengths), strict=True)
        return [self.decode(self._strip(row[:n])) for row, n in rows]

    def _strip(self, ids: np.ndarray) -> np.ndarray:
        stopped = len(ids) > 0 and int(ids[-1]) in self.stop_ids
        return ids[:-1] if stopped else ids

    def close(self) -> None:
        if self.out is not None:
            self.out.close()


class _Out:
    """Where `SamplesWriter`'s completions go: a JSON Lines file (cut after
    `start` when first opened), and TensorBoard's text tab when `tensorboard`
    names a log directory."""

    def __init__(
        self,
        prompts: list[Any],
        path: Path,
        tensorboard: str | os.PathLike[str] | None,
        start: int | None,
    ):
        self.prompts, self.path = prompts, path
        self.tensorboard, self.start = tensorboard, start
        self._file: IO[str] | None = None
        self._writer: Any = None

    def append(self, step: int, texts: list[str]) -> None:
        file = self._open()
        for prompt, text in zip(self.prompts, texts, strict=True):
            record = {"step": step, "prompt": prompt, "completion": text}
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
        file.flush()
        if self.tensorboard is not None:
            self._text(step, texts)

    def _open(self) -> IO[str]:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.start is not None:
                cut_after(self.path, self.start)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        return self._file

    def _text(self, step: int, texts: list[str]) -> None:
        writer = self._summary_writer()
        for i, (prompt, text) in enumerate(zip(self.prompts, texts, strict=True)):
            shown = prompt if isinstance(prompt, str) else json.dumps(prompt)
            markdown = f"**prompt:** {shown}\n\n**completion:** {text}"
            writer.add_text(f"samples/{i}", markdown, step)
        writer.flush()

    def _summary_writer(self) -> Any:
        if self._writer is None:
            module = require("tensorboardX", "SamplesWriter", "tensorboard")
            self._writer = summary_writer(
                module, self.tensorboard, self.start, filename_suffix=".samples"
            )
        return self._writer

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
