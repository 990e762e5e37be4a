"""What `eqtrain generate` runs: a model, its tokenizer, chat template and stop
ids from a run directory or a Hugging Face directory (`open_model`), prompts
made into tokens (`prompt_tokens`), and batches of them completed
(`complete`) by `eqtrain.generate`."""

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.random as jr
import numpy as np

from .. import checkpoint, data as data_lib, hf
from .._errors import ConfigError
from ..cpu import generation_options
from ..generate import Sampling, generate, left_pad, stream
from ..post_training import rewards
from . import _open, _preflight, _resolve


# End-of-turn tokens that chat templates write after an answer; a template that
# spells one (and a tokenizer that has it as one id) stops generation there.
END_OF_TURN = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "</s>",
)


@dataclasses.dataclass(frozen=True)
class Generator:
    """A model ready to generate, with what it needs around it.

    Attributes:
        model: the model (a run's policy at its real vocabulary, or an HF
            directory's model).
        tokenizer: its tokenizer (`ByteTokenizer` or `HFTokenizer`).
        stop_ids: the tokenizer's EOS and an HF directory's
            generation_config.json `eos_token_id`s.
        source: the directory it came from.
        template: the chat template (run: the run's; HF directory: its own), or
            None when there is none.
        positions: the longest text the model can take (GPT-2's learned
            positions), or None: no limit.
    """

    model: Any
    tokenizer: Any
    stop_ids: tuple[int, ...]
    source: Path
    template: Any = None
    positions: int | None = None


def open_model(source: str | os.PathLike[str], *, step: int | None = None) -> Generator:
    """The model in `source`: an eqtrain run directory (its latest checkpoint,
    or checkpoint `step`), a Hugging Face directory (config.json, safetensors
    and a tokenizer.json, or a byte-level vocabulary) or a PEFT adapter
    directory on the local base it names."""
    path = Path(source)
    if not path.is_dir():
        raise ConfigError(
            f"{path} is not a directory; pass an eqtrain run directory or a "
            "Hugging Face model directory (config.json + safetensors)."
        )
    adapter = (path / "adapter_config.json").is_file()
    if not (path / "config.json").is_file() and not adapter:
        return _run_model(path, step)
    if step is not None:
        raise ConfigError(
            f"--step picks a checkpoint of a run, but {path} is a Hugging Face "
            "directory (it has one set of weights); drop --step."
        )
    if adapter and not (path / "config.json").is_file():
        return _adapter_model(path)
    return _hf_model(path)


def _adapter_model(path: Path) -> Generator:
    """A PEFT adapter directory's adapter on the base its adapter_config.json
    names (`base_model_name_or_path`, a local Hugging Face directory), as
    `peft.AutoPeftModelForCausalLM` loads it; the adapter directory's tokenizer
    and chat template where it has them (an eqtrain export, as TRL's), else the
    base's."""
    base = hf.adapter_base(path)
    if base is None or not (Path(base) / "config.json").is_file():
        named = "names no base model" if base is None else f"names the base {base},"
        where = "" if base is None else " which is not a Hugging Face directory here"
        raise ConfigError(
            f"{path} is a PEFT adapter whose adapter_config.json {named}{where}; "
            "set base_model_name_or_path there to the base model's directory, or "
            "generate from the run that trained it (eqtrain generate RUN) or from "
            "a merged export (eqtrain export RUN OUT --merged)."
        )
    own = path if (path / "tokenizer.json").is_file() else None
    m = _hf_model(Path(base), tokenizer_dir=own)
    try:
        model = hf.load_adapter(m.model, path)
    except (hf.HFFormatError, hf.HFFileNotFoundError) as e:
        raise ConfigError(f"cannot load the adapter {path}: {e}") from None
    template = _template(path) or m.template
    return dataclasses.replace(m, model=model, source=path, template=template)


def _hf_model(path: Path, tokenizer_dir: Path | None = None) -> Generator:
    """A Hugging Face directory's model, tokenizer, end ids and chat template;
    the tokenizer from `tokenizer_dir`'s tokenizer.json where given (an
    adapter directory's own)."""
    try:
        name = hf.tokenizer_for(tokenizer_dir or path)
        model, _ = hf.load(path)
    except (hf.HFFormatError, hf.HFFileNotFoundError) as e:
        raise ConfigError(
            f"cannot load the Hugging Face directory {path}: {e}"
        ) from None
    tokenizer = _tokenizer(name)
    _check_vocab(tokenizer_dir or path, tokenizer, model.config.vocab_size)
    stops = _ids(tokenizer.eos_id, *hf.generation_eos(path))
    return Generator(model, tokenizer, stops, path, _template(path), _positions(model))


def _template(path: Path) -> Any:
    """The directory's chat template, or None."""
    text = data_lib.read_chat_template(path)
    return None if text is None else data_lib.chat_template(path)


def _check_vocab(path: Path, tokenizer: Any, vocab: int) -> None:
    if tokenizer.vocab_size <= vocab:
        return
    which = (
        "has no tokenizer.json, and the byte tokenizer's"
        if isinstance(tokenizer, data_lib.ByteTokenizer)
        else "has a tokenizer.json whose"
    )
    raise ConfigError(
        f"{path} {which} {tokenizer.vocab_size} ids do not fit the model's "
        f"vocabulary of {vocab}; add the model's tokenizer.json there."
    )


def _tokenizer(name: str) -> Any:
    if name == "byte":
        return data_lib.ByteTokenizer()
    return data_lib.HFTokenizer.from_file(name)


def _run_model(path: Path, step: int | None) -> Generator:
    if step is not None:
        path = _step_dir(path, step)
    with rewards.imports_deferred():  # a GRPO run's: generation scores nothing
        job, state = _open.restore_run(path)
    model = job.exported(state.model)  # the policy, at its real vocabulary
    template = job.template
    if template is None:
        template = _resolve.chat_template_of(job.config)
    stops = _ids(job.tokenizer.eos_id)
    return Generator(model, job.tokenizer, stops, path, template, _positions(model))


def _step_dir(run_dir: Path, step: int) -> Path:
    steps = checkpoint.list_steps(run_dir)
    if step not in steps:
        have = ", ".join(map(str, steps)) or "none"
        raise ConfigError(
            f"the run at {run_dir} has no checkpoint of step {step} (it has: "
            f"{have}); pick one of those with --step, or leave it out (the latest)."
        )
    return run_dir / "checkpoints" / str(step)


def _positions(model: Any) -> int | None:
    return getattr(getattr(model, "config", None), "n_positions", None)


def _ids(*ids: int | None) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def chat_stop_ids(m: Generator) -> tuple[int, ...]:
    """`m.stop_ids` and the end-of-turn tokens its chat template writes (its
    `eos_token`, and those of `END_OF_TURN` it spells) that are one token."""
    template = m.template
    names = [getattr(template, "special_tokens", {}).get("eos_token")]
    source = getattr(template, "source", "") or ""
    names += [name for name in END_OF_TURN if name in source]
    found = [_single_id(m.tokenizer, name) for name in names if name]
    return _ids(*m.stop_ids, *found)


OPTION = "--chat-template-kwargs"


def template_kwargs_option(text: str | None, *, chat: bool) -> dict[str, Any]:
    """`eqtrain generate --chat-template-kwargs`'s JSON object, checked as a
    record's `chat_template_kwargs` is (`{}` when not given)."""
    if text is None:
        return {}
    if not chat:
        raise ConfigError(
            f"{OPTION} needs --chat: its variables are the chat template's, which "
            "a text prompt does not go through. Add --chat, or drop it."
        )
    try:
        return data_lib.check_template_kwargs(text, field=OPTION)
    except data_lib.DataError as e:
        raise ConfigError(str(e)) from None


def with_template_kwargs(m: Generator, kwargs: Mapping[str, Any]) -> Generator:
    """`m` with a Jinja chat template given `kwargs` in every render, over its
    own (a run's `data.chat_template_kwargs`); a prompt's own
    `chat_template_kwargs` still win. eqtrain's built-in template reads no
    variables, and a model without a template is refused by the first prompt."""
    if not kwargs or not isinstance(m.template, data_lib.JinjaChatTemplate):
        return m
    return dataclasses.replace(m, template=m.template.with_kwargs(dict(kwargs)))


def _single_id(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text)
    return int(ids[0]) if len(ids) == 1 else None


def prompt_tokens(
    m: Generator,
    prompt: str | Sequence[Any],
    *,
    chat: bool,
    tools: Any = None,
    chat_template_kwargs: Any = None,
) -> np.ndarray:
    """A prompt's token ids: with `chat`, the chat template's render of the
    messages (a string is one user message) with the generation prompt, the
    row's `tools` (function definitions, or a JSON string of them, as a record's
    `tools` in training data) and its `chat_template_kwargs` (extra template
    variables, over the template's own `kwargs`); otherwise the tokenizer's BOS
    (when it has one) and the text's tokens, as eqtrain's prompt/completion data
    starts (refused with tools or template variables, which only a chat template
    reads)."""
    if chat:
        messages = (
            [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        )
        return _chat_tokens(m, list(messages), tools, chat_template_kwargs)
    if not isinstance(prompt, str):
        raise ConfigError(
            "a prompt of messages needs --chat (the chat template makes them text)."
        )
    if _checked_tools(m, tools) is not None:
        raise ConfigError(
            "a prompt with 'tools' needs --chat: only the chat template writes the "
            "tool definitions into the prompt."
        )
    if _checked_kwargs(m, chat_template_kwargs):
        raise ConfigError(
            "a prompt with 'chat_template_kwargs' needs --chat: they are variables "
            "of the chat template, which a text prompt does not go through."
        )
    bos = m.tokenizer.bos_id
    ids = np.asarray(m.tokenizer.encode(prompt), np.int32)
    return ids if bos is None else np.concatenate([np.int32([bos]), ids])


def _chat_tokens(
    m: Generator, messages: list[Any], tools: Any, kwargs: Any
) -> np.ndarray:
    template, tokenizer = m.template, m.tokenizer
    if template is None:
        raise ConfigError(
            f"--chat needs a chat template, but {m.source} has none (no "
            "chat_template.jinja and no chat_template in tokenizer_config.json); "
            "drop --chat, or add the model's template there."
        )
    tools, kwargs = _checked_tools(m, tools), _checked_kwargs(m, kwargs)
    extra = {"tools": tools} | ({"chat_template_kwargs": kwargs} if kwargs else {})
    try:
        if isinstance(template, data_lib.JinjaChatTemplate):
            text = template.render(messages, add_generation_prompt=True, **extra)
            return np.asarray(tokenizer.encode(text), np.int32)
        # eqtrain's built-in one (it refuses tools, and reads no variables)
        ids, _ = template.encode(messages, tokenizer, **extra)
    except data_lib.DataError as e:
        raise ConfigError(f"the chat template of {m.source}: {e}") from None
    header = np.asarray(tokenizer.encode("<|assistant|>\n"), np.int32)
    return np.concatenate([np.asarray(ids, np.int32), header])


def _checked_tools(m: Generator, tools: Any) -> list[dict[str, Any]] | None:
    """A prompt's `tools` as the chat template is given them (None: none)."""
    try:
        return data_lib.check_tools(tools)
    except data_lib.DataError as e:
        raise ConfigError(f"a prompt for {m.source}: {e}") from None


def _checked_kwargs(m: Generator, kwargs: Any) -> dict[str, Any]:
    """A prompt's `chat_template_kwargs` as the chat template is given them."""
    try:
        return data_lib.check_template_kwargs(kwargs)
    except data_lib.DataError as e:
        raise ConfigError(f"a prompt for {m.source}: {e}") from None


@dataclasses.dataclass(frozen=True)
class Completion:
    """One prompt's new tokens, its text and why it ended (`stop`: a stop id;
    `length`: `max_new_tokens`)."""

    tokens: np.ndarray
    text: str
    stop_reason: str


@dataclasses.dataclass(frozen=True)
class Options:
    """How `complete` and `stream_text` generate."""

    max_new_tokens: int = 128
    sampling: Sampling = Sampling(temperature=0.0)
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    batch_size: int = 8

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                value = getattr(self, name)
                flag = name.replace("_", "-")
                raise ConfigError(f"--{flag} must be >= 1; got {value}.")


def check_fits(m: Generator, prompts: Sequence[np.ndarray], options: Options) -> int:
    """The `left_pad` multiple that keeps GPT-2's padded prompts within its
    positions, or `ConfigError` when a prompt and `max_new_tokens` do not fit."""
    if m.positions is None:
        return 16
    longest = max(len(p) for p in prompts)
    if longest + options.max_new_tokens > m.positions:
        raise ConfigError(
            f"a prompt of {longest} tokens and --max-new-tokens "
            f"{options.max_new_tokens} need {longest + options.max_new_tokens} "
            f"positions, more than the model's {m.positions} (GPT-2's learned "
            "positions, n_positions); shorten the prompt or --max-new-tokens."
        )
    padded = -(-longest // 16) * 16
    return 16 if padded + options.max_new_tokens <= m.positions else 1


def complete(
    m: Generator, prompts: Sequence[np.ndarray], options: Options
) -> Iterator[Completion]:
    """The completions of `prompts` (token ids), `options.batch_size` at a time,
    in order. Batch i samples with `fold_in(key(seed), i)`. Running out of
    memory is a `ConfigError` naming the options that lower it."""
    multiple = check_fits(m, prompts, options)
    key = jr.key(options.seed)
    size = options.batch_size
    for i in range(0, len(prompts), size):
        batch = prompts[i : i + size]
        tokens, lengths = left_pad(batch, pad_id=0, multiple=multiple)
        with _out_of_memory_said(options, batch):
            out = generate(
                m.model, tokens, lengths, max_new_tokens=options.max_new_tokens,
                key=jr.fold_in(key, i // size), sampling=options.sampling,
                stop_ids=options.stop_ids, compiler_options=generation_options(),
            )  # fmt: skip
            done = np.asarray(out.tokens), np.asarray(out.lengths)
        for row, n in zip(*done, strict=True):
            yield _completion(m, row[:n], options)


@contextlib.contextmanager
def _out_of_memory_said(
    options: Options, prompts: Sequence[np.ndarray]
) -> Iterator[None]:
    """The device (or host) running out of memory in the block, as a
    `ConfigError` that says what lowers generation's memory (as `eqtrain fit`
    says what lowers training's)."""
    try:
        yield
    except Exception as e:
        if not _preflight.is_out_of_memory(e):
            raise
        first = next((ln for ln in str(e).splitlines() if ln.strip()), "")[:200]
        longest = max(len(p) for p in prompts)
        raise ConfigError(
            f"generation ran out of memory ({first or type(e).__name__}). A batch "
            "holds a cache of every layer's keys and values for the prompt and "
            "the new tokens of each of its prompts: lower --batch-size (now "
            f"{options.batch_size}) or --max-new-tokens (now "
            f"{options.max_new_tokens}), or shorten the longest prompt "
            f"({longest} tokens)."
        ) from e


def _completion(m: Generator, ids: np.ndarray, options: Options) -> Completion:
    stopped = len(ids) > 0 and int(ids[-1]) in options.stop_ids
    text = m.tokenizer.decode(ids[:-1] if stopped else ids)
    return Completion(ids, text, "stop" if stopped else "length")


def stream_text(
    m: Generator, prompt: np.ndarray, options: Options
) -> Iterator[str | Completion]:
    """The completion of one prompt as pieces of text while it is generated,
    then the whole `Completion`: the tokens of `complete([prompt])`."""
    multiple = check_fits(m, [prompt], options)
    pieces = stream(
        m.model, prompt, max_new_tokens=options.max_new_tokens,
        key=jr.fold_in(jr.key(options.seed), 0), sampling=options.sampling,
        stop_ids=options.stop_ids, multiple=multiple,
        compiler_options=generation_options(),
    )  # fmt: skip
    with _out_of_memory_said(options, [prompt]):
        yield from _decoded(m, pieces, options)


def _decoded(
    m: Generator, pieces: Iterator[np.ndarray], options: Options
) -> Iterator[str | Completion]:
    """The new text after each piece of tokens (held back in the middle of a
    character), then the rest and the whole `Completion`."""
    ids = np.zeros(0, np.int32)
    shown = ""
    for piece in pieces:
        ids = np.concatenate([ids, piece])
        text = _completion(m, ids, options).text
        if not text.endswith("\ufffd"):  # not in the middle of a character
            yield text[len(shown) :]
            shown = text
    done = _completion(m, ids, options)
    if done.text != shown:
        yield done.text[len(shown) :]
    yield done
