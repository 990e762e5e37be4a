"""`eqtrain generate`: complete prompts with a run's model or a Hugging Face
directory's (`eqtrain.job.open_model`, `complete`, `stream_text`)."""

import contextlib
import json
import os
import secrets
import shutil
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Annotated, Any

import typer

from .._errors import ConfigError
from ._shared import errors, json_text


Source = Annotated[
    str,
    typer.Argument(
        help="An eqtrain run directory (its latest checkpoint), a Hugging "
        "Face model directory (config.json, safetensors, tokenizer.json) or a "
        "PEFT adapter directory (on the local base its adapter_config.json "
        "names)."
    ),
]
Prompt = Annotated[
    list[str] | None,
    typer.Option("--prompt", "-p", help="A prompt (repeatable)."),
]
File = Annotated[
    Path | None,
    typer.Option(
        help='A JSON Lines file of prompts: each line {"prompt": "..."} or '
        '{"messages": [...]} (with --chat); other columns are copied to the '
        "output."
    ),
]
Chat = Annotated[
    bool,
    typer.Option(
        "--chat",
        help="Apply the model's chat template (with the generation prompt); "
        "a --prompt is one user message.",
    ),
]
TemplateKwargs = Annotated[
    str | None,
    typer.Option(
        "--chat-template-kwargs",
        help="With --chat: variables for the chat template as a JSON object, e.g. "
        "'{\"enable_thinking\": false}' for Qwen3, given to every prompt's "
        "render as data.chat_template_kwargs is in training (over a run's own); "
        "a --file line's chat_template_kwargs win over them.",
    ),
]
MaxNewTokens = Annotated[int, typer.Option(help="The most new tokens per prompt.")]
Temperature = Annotated[
    float,
    typer.Option(help="0: greedy (transformers' default); above 0: sampling."),
]
TopK = Annotated[int, typer.Option(help="Sample from the k likeliest (0: off).")]
TopP = Annotated[float, typer.Option(help="Nucleus sampling: the top-p mass (1: off).")]
MinP = Annotated[
    float, typer.Option(help="Drop tokens below min-p x the likeliest (0: off).")
]
Seed = Annotated[int, typer.Option(help="The random seed of sampling.")]
BatchSize = Annotated[int, typer.Option(help="Prompts generated at once.")]
Out = Annotated[
    Path | None,
    typer.Option(
        help="Write JSON Lines here instead of standard output: all of them or "
        "none (a failure or Ctrl-C leaves an earlier file as it was)."
    ),
]
Step = Annotated[
    int | None,
    typer.Option(help="A run's checkpoint step (default: the latest)."),
]


def generate(
    source: Source,
    prompt: Prompt = None,
    file: File = None,
    chat: Chat = False,
    chat_template_kwargs: TemplateKwargs = None,
    max_new_tokens: MaxNewTokens = 128,
    temperature: Temperature = 0.0,
    top_k: TopK = 0,
    top_p: TopP = 1.0,
    min_p: MinP = 0.0,
    seed: Seed = 0,
    batch_size: BatchSize = 8,
    out: Out = None,
    step: Step = None,
) -> None:
    """Complete prompts with a run's model or a Hugging Face model. One --prompt
    prints its completion (streamed on a terminal); several prompts, --file or
    --out give JSON Lines: the prompt's columns, `completion`, `tokens` (new
    tokens) and `stop_reason` (`stop`: an end token; `length`: --max-new-tokens).
    Generation stops at the tokenizer's EOS, generation_config.json's
    eos_token_id and, with --chat, the template's end-of-turn token.
    Ctrl-C (or SIGTERM) ends it within a moment, even inside a batch: exit 130
    (143), and --out's file as it was before."""
    with errors(), _Output.of(out) as output, _interruptible(output):
        from .. import job  # after the signal guard: importing JAX takes seconds
        from ..generate import Sampling

        rows = _rows(prompt, file)
        kwargs = job.template_kwargs_option(chat_template_kwargs, chat=chat)
        if output is not None:
            output.open()  # a bad --out fails here, before the model loads
        m = job.with_template_kwargs(job.open_model(source, step=step), kwargs)
        stops = job.chat_stop_ids(m) if chat else m.stop_ids
        sampling = Sampling(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
        )
        options = job.Options(max_new_tokens, sampling, seed, stops, batch_size)
        prompts = [
            job.prompt_tokens(
                m,
                _prompt_of(r),
                chat=chat,
                tools=r.get("tools"),
                chat_template_kwargs=r.get("chat_template_kwargs"),
            )
            for r in rows
        ]
        if len(rows) == 1 and file is None and output is None:
            return _print_one(m, prompts[0], options)
        _write(rows, job.complete(m, prompts, options), output)


def _is_terminal() -> bool:
    return sys.stdout.isatty()


# -- prompts ----------------------------------------------------------------------
def _rows(prompts: list[str] | None, file: Path | None) -> list[dict[str, Any]]:
    """The rows to complete: each --prompt, then --file's lines."""
    rows = [{"prompt": p} for p in prompts or []]
    if file is not None:
        if not file.is_file():
            raise ConfigError(f"--file {file} does not exist (or is not a file).")
        lines = file.read_text(encoding="utf-8").splitlines()
        rows += [_row(file, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not rows:
        raise ConfigError("nothing to complete: pass --prompt TEXT or --file FILE.")
    return rows


def _row(file: Path, n: int, line: str) -> dict[str, Any]:
    """Line `n` of --file: a `prompt` string or a `messages` list (and more)."""
    try:
        row = json.loads(line)
    except ValueError as e:
        raise ConfigError(f"{file}, line {n}: not JSON ({e}).") from None
    if not isinstance(row, dict) or not (
        isinstance(row.get("prompt"), str) or isinstance(row.get("messages"), list)
    ):
        raise ConfigError(
            f'{file}, line {n}: each line must be {{"prompt": "..."}} or '
            '{"messages": [...]}.'
        )
    return row


def _prompt_of(row: dict[str, Any]) -> Any:
    return row["prompt"] if isinstance(row.get("prompt"), str) else row["messages"]


# -- output -----------------------------------------------------------------------
def _print_one(m: Any, prompt: Any, options: Any) -> None:
    """One completion as text, streamed on a terminal."""
    from .. import job

    if not _is_terminal():
        (done,) = job.complete(m, [prompt], options)
        typer.echo(done.text)
        return
    for piece in job.stream_text(m, prompt, options):
        if isinstance(piece, str):
            sys.stdout.write(piece)
            sys.stdout.flush()
    sys.stdout.write("\n")


def _write(rows: list[dict[str, Any]], done: Any, output: "_Output | None") -> None:
    """The completions as JSON Lines, on standard output or to `--out` (renamed
    into place once all are written)."""
    lines = (_line(row, c) for row, c in zip(rows, done, strict=True))
    if output is None:
        for line in lines:
            typer.echo(line)
        return
    for line in lines:
        output.write(line + "\n")
    output.commit()
    typer.echo(f"wrote {len(rows)} completions to {output.target}", err=True)


def _line(row: dict[str, Any], completion: Any) -> str:
    """A prompt's row with its completion, as one JSON line."""
    done = {
        "completion": completion.text,
        "tokens": len(completion.tokens),
        "stop_reason": completion.stop_reason,
    }
    return json_text({**row, **done}, ensure_ascii=False)


# -- --out, all or nothing ----------------------------------------------------------
class _Output:
    """`--out`'s file, written all or nothing: the lines go to a temporary file
    beside it, renamed over it (`os.replace`) once all are there. Until then the
    target is never opened, so a refused prompt, an error, running out of memory
    or Ctrl-C leaves an earlier file (even --file's own) as it was."""

    def __init__(self, target: Path):
        self.target = target
        self.temporary: Path | None = None
        self.file: IO[str] | None = None
        self.committed = False
        self.lock = threading.Lock()  # commit vs discard (the signal watcher's)

    @classmethod
    @contextlib.contextmanager
    def of(cls, target: Path | None) -> "Iterator[_Output | None]":
        """The `_Output` of `--out` (None without it), discarded unless committed."""
        if target is None:
            yield None
            return
        output = cls(target)
        try:
            yield output
        finally:
            output.discard()

    def open(self) -> None:
        """Check the target's directory and create the temporary file in it."""
        target = self.target
        if target.is_dir():
            raise ConfigError(f"--out {target} is a directory; name a file.")
        parent = target.parent
        if not parent.is_dir():
            what = "is not a directory" if parent.exists() else "does not exist"
            raise ConfigError(
                f"--out {target}: the directory {parent} {what}; create it, or "
                "choose another place. Nothing was generated."
            )
        name = f".{target.name}.{secrets.token_hex(4)}.tmp"
        try:
            self.file = open(parent / name, "x", encoding="utf-8")
            self.temporary = parent / name
            if target.exists():
                shutil.copymode(target, self.temporary)
        except OSError as e:
            raise self._failed(e) from None

    def write(self, text: str) -> None:
        assert self.file is not None
        try:
            self.file.write(text)
        except OSError as e:
            raise self._failed(e) from None

    def commit(self) -> None:
        """The temporary file, complete and on disk, renamed over the target."""
        assert self.file is not None and self.temporary is not None
        with self.lock:
            try:
                self.file.flush()
                os.fsync(self.file.fileno())
                self.file.close()
                os.replace(self.temporary, self.target)
            except OSError as e:
                raise self._failed(e) from None
            self.committed = True

    def discard(self) -> None:
        """Remove the temporary file (the target stays as it was)."""
        with self.lock:
            if self.committed or self.temporary is None:
                return
            with contextlib.suppress(OSError):
                if self.file is not None:
                    self.file.close()
                self.temporary.unlink()
            self.temporary = None

    def _failed(self, error: OSError) -> ConfigError:
        from .. import job

        if not job.is_write_error(error):
            raise error
        left = "left as it was" if self.target.exists() else "not written"
        return ConfigError(
            f"writing --out {self.target} failed: {error.strerror or error}; "
            f"{self.target} was {left}. Free some space or choose a writable "
            "place, and run the command again."
        )


# -- Ctrl-C -------------------------------------------------------------------------
@contextlib.contextmanager
def _interruptible(output: _Output | None) -> Iterator[None]:
    """SIGINT and SIGTERM end `generate` within a moment, wherever it is (a
    compiled batch does not return to Python before it ends): the signal guard
    (`eqtrain._fit._signals`) records the signal from its watchdog thread, and a
    thread of ours then discards --out's temporary file, says so in one line and
    exits 128 + the signal's number. Generation has nothing to save."""
    from .. import _fit

    with _fit.guarded() as guard:
        if guard is None:  # not the main thread: signals are not ours
            yield
            return
        done = threading.Event()
        watcher = threading.Thread(
            target=_watch,
            args=(guard, done, output),
            name="eqtrain-generate-signals",
            daemon=True,
        )
        watcher.start()
        try:
            yield
        finally:
            done.set()
            watcher.join()


def _watch(guard: Any, done: threading.Event, output: _Output | None) -> None:
    import signal

    while not done.wait(0.05):
        if guard.received is None:
            continue
        name = signal.Signals(guard.received).name
        text = f"error: interrupted by {name}."
        if output is not None:
            output.discard()
            state = "was written" if output.committed else "was left as it was"
            text = f"error: interrupted by {name}; {output.target} {state}."
        start = "\n" if _is_terminal() else ""  # after a streamed piece
        with contextlib.suppress(OSError):
            os.write(2, (start + text + "\n").encode())
        os._exit(128 + guard.received)
