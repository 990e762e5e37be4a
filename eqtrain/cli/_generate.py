"""`eqtrain generate`: complete prompts with a run's model or a Hugging Face
directory's (`eqtrain.job.open_model`, `complete`, `stream_text`)."""

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from .._errors import ConfigError
from ._shared import errors, json_text


Source = Annotated[
    str,
    typer.Argument(
        help="An eqtrain run directory (its latest checkpoint) or a Hugging "
        "Face model directory (config.json, safetensors, tokenizer.json)."
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
    typer.Option(help="Write JSON Lines here instead of standard output."),
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
    eos_token_id and, with --chat, the template's end-of-turn token."""
    from .. import job
    from ..generate import Sampling

    with errors():
        rows = _rows(prompt, file)
        m = job.open_model(source, step=step)
        stops = job.chat_stop_ids(m) if chat else m.stop_ids
        sampling = Sampling(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
        )
        options = job.Options(max_new_tokens, sampling, seed, stops, batch_size)
        prompts = [job.prompt_tokens(m, _prompt_of(r), chat=chat) for r in rows]
        if len(rows) == 1 and file is None and out is None:
            return _print_one(m, prompts[0], options)
        _write(rows, job.complete(m, prompts, options), out)


def _is_terminal() -> bool:
    return sys.stdout.isatty()


# -- prompts ----------------------------------------------------------------------
def _rows(prompts: list[str] | None, file: Path | None) -> list[dict[str, Any]]:
    """The rows to complete: each --prompt, then --file's lines."""
    rows = [{"prompt": p} for p in prompts or []]
    if file is not None:
        rows += _read_file(file)
    if not rows:
        raise ConfigError("nothing to complete: pass --prompt TEXT or --file FILE.")
    return rows


def _read_file(file: Path) -> list[dict[str, Any]]:
    if not file.is_file():
        raise ConfigError(f"--file {file} does not exist (or is not a file).")
    lines = file.read_text(encoding="utf-8").splitlines()
    return [_row(file, n, line) for n, line in enumerate(lines, 1) if line.strip()]


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


def _write(rows: list[dict[str, Any]], done: Any, out: Path | None) -> None:
    """The completions as JSON Lines, on standard output or to `out`."""
    lines = (_line(row, c) for row, c in zip(rows, done, strict=True))
    if out is None:
        for line in lines:
            typer.echo(line)
        return
    with open(out, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
            f.flush()
    typer.echo(f"wrote {len(rows)} completions to {out}", err=True)


def _line(row: dict[str, Any], completion: Any) -> str:
    """A prompt's row with its completion, as one JSON line."""
    done = {
        "completion": completion.text,
        "tokens": len(completion.tokens),
        "stop_reason": completion.stop_reason,
    }
    return json_text({**row, **done}, ensure_ascii=False)
