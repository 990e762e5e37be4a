"""SFT then DPO with `eqtrain fit` on tiny random `transformers` models of the
decoder families, each with its real chat template and a tiny `tokenizers`
tokenizer holding that template's special tokens:

- Gemma 2 (`<start_of_turn>user ... <end_of_turn>`, the assistant is `model`),
  whose template refuses a system message: such data fails before any work with
  one paragraph that names the file, the template's reason and the first row;
- Qwen3 (ChatML, with its empty `<think>` block on the answer to the last query),
  in chats of three exchanges (its template rewrites earlier turns);
- Phi-3 (`<|user|>\\n...<|end|>\\n<|assistant|>\\n`, EOS after the last turn),
  three exchanges too.

Each run starts from `model.init_from` (a `save_pretrained` directory with the
tokenizer and its template), learns only the answers and their end of turn, and
exports a model that transformers loads with a tokenizer whose
`apply_chat_template` gives the tokens the run trained on; DPO then starts from
the SFT export. The default suite runs gemma2; `slow` runs qwen3 and phi3."""

import copy
import dataclasses
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from eqtrain import ConfigError, config as config_lib, data, job
from eqtrain.job import _build, _rows

from . import _hf_families as fam


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

LOG2 = math.log(2.0)

# -- the templates, verbatim from the models' tokenizer_config.json -------------------
# google/gemma-2-2b-it (Gemma 1 and CodeGemma use the same)
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
# Qwen/Qwen3-0.6B: ChatML with tools, a namespace, string methods and the think
# block (an empty one on an answer after the last user query)
QWEN3 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""  # noqa: E501
# microsoft/Phi-3-mini-4k-instruct: EOS closes a conversation without a generation
# prompt
PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}"
    "{% else %}{{ eos_token }}{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class Family:
    template: str
    specials: tuple[str, ...]  # the tokenizer's special tokens, ids 0, 1, ...
    names: dict  # bos_token / eos_token / pad_token of tokenizer_config.json
    learned: str  # the text after each answer that is learned with it
    turns: int  # user/assistant exchanges per chat
    overrides: dict = dataclasses.field(default_factory=dict)  # model config
    think: str = ""  # the text before the last answer that is learned with it
    last: str | None = None  # the text learned after the last answer (`learned`)

    def answers(self, messages):
        """The learned text of each assistant turn of `messages`."""
        out = [m["content"] for m in messages if m["role"] == "assistant"]
        tail = self.learned if self.last is None else self.last
        return [a + self.learned for a in out[:-1]] + [self.think + out[-1] + tail]


FAMILIES = {
    # each answer learns all its template writes after it up to the next turn
    "gemma2": Family(
        GEMMA,
        ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"),
        {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"},
        learned="<end_of_turn>\n",
        turns=2,
        overrides=dict(num_hidden_layers=2),  # a sliding and a global layer
    ),
    # three exchanges: their templates change earlier turns as a chat goes on
    # (Qwen3's think block is on the last answer only, Phi-3's EOS at the end)
    "qwen3": Family(
        QWEN3,
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"),
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        learned="<|im_end|>\n",
        turns=3,
        think="<think>\n\n</think>\n\n",  # (what Qwen3 writes when not thinking)
    ),
    "phi3": Family(
        PHI3,
        ("<unk>", "<s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>")
        + ("<|system|>",),
        {
            "bos_token": "<s>",
            "eos_token": "<|endoftext|>",
            "pad_token": "<|endoftext|>",
        },
        learned="<|end|>\n",
        turns=3,
        last="<|end|>\n<|endoftext|>",
    ),
}
CORPUS = [
    "Hello there, how are you? I am fine, thank you.",
    "What is two plus two? It is four. What is 12 plus 30? It is 42.",
    "You are a helpful assistant. Answer briefly, in one sentence.",
]


def _chats(n, turns, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        messages = []
        for t in range(turns):
            a, b = (int(x) for x in rng.integers(0, 50, 2))
            messages += [
                {"role": "user", "content": f"{a} plus {b}? ({i}.{t})"},
                {"role": "assistant", "content": f"It is {a + b}."},
            ]
        rows.append({"messages": messages})
    return rows


def _pairs(n, seed=1):
    """Conversational preference pairs: one user turn, two answers."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(0, 50, 2))
        wrong = ["No.", "Ask again later.", f"It is {a}."][i % 3]
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"{a} plus {b}? ({i})"}],
                "chosen": [{"role": "assistant", "content": f"It is {a + b}."}],
                "rejected": [{"role": "assistant", "content": wrong}],
            }
        )
    return rows


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _base(tmp_path, name):
    """A transformers directory as a Hub model has it: `save_pretrained` weights
    (vocab sized to the tokenizer, special ids its own), `tokenizer.json` and a
    `tokenizer_config.json` with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    family = FAMILIES[name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=list(family.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    base = tmp_path / "base"
    base.mkdir()
    tok.save(str(base / "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": family.template,
        **family.names,
    }
    (base / "tokenizer_config.json").write_text(json.dumps(settings))

    model_type, kwargs = fam.VARIANTS[name]
    ids = {
        f"{kind}_token_id": tok.token_to_id(family.names[f"{kind}_token"])
        for kind in ("bos", "eos", "pad")
        if f"{kind}_token" in family.names
    }
    config = transformers.AutoConfig.for_model(
        model_type,
        **copy.deepcopy(
            {
                **kwargs,
                **family.overrides,
                "vocab_size": tok.get_vocab_size(),
                "bos_token_id": None,
                **ids,
            }
        ),
    )
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    fam._randomize(model, seed=0)
    model.save_pretrained(base, safe_serialization=True)
    return base


def _settings(run_dir, train, base, *extra):
    return [
        f"run_dir={run_dir}",
        f"data.train={train}",
        f"model.init_from={base}",
        "data.seq_len=128",
        "data.batch_size=8",
        "loop.eval_every=0",
        "checkpoint.every=0",
        "log.progress=none",
        "optim.warmup_steps=0",
        *extra,
    ]


def _config(*args):
    """The run's `Config`, as `eqtrain fit --set ...` reads it."""
    return config_lib.load(None, _settings(*args))


def _fit(*args):
    """`eqtrain fit --set ...` on one CPU device (not the tests' 8 simulated ones:
    a plain machine's run, and a faster compile); the logged losses."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    sets = [x for s in _settings(*args) for x in ("--set", s)]
    done = subprocess.run(
        [sys.executable, "-m", "eqtrain.cli", "fit", *sets],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = (args[0] / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if "loss" in r]


def _ids(out):
    ids = out if isinstance(out, list) else out["input_ids"]
    return [int(i) for i in ids]


def _learned_runs(targets, loss_mask, tok):
    """The decoded text of each run of consecutive learned targets."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], loss_mask > 0, [0]])))
    return [
        tok._tok.decode(targets[a:b].tolist(), skip_special_tokens=False)
        for a, b in zip(edges[::2], edges[1::2], strict=True)
    ]


def _check_export(out, family, messages, trained_ids):
    """transformers loads `out` (no missing keys) with a tokenizer whose template
    renders `messages` to `trained_ids`, with and without a generation prompt."""
    model = fam.load(out)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(theirs)
    assert (out / "chat_template.jinja").read_text() == family.template
    assert _ids(theirs.apply_chat_template(messages, tokenize=True)) == trained_ids
    text = theirs.apply_chat_template(messages, tokenize=False)
    assert text == theirs.decode(trained_ids, skip_special_tokens=False)
    prompt = theirs.apply_chat_template(
        messages[:1], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith(prompt)
    logits = fam.hf_logits(model, np.asarray(trained_ids)[None])
    assert np.isfinite(logits).all()


@pytest.mark.parametrize(
    "name",
    # default-suite time: test_post_training's SFT-then-DPO from an HF directory
    # keeps its chat template by default; the families' templates are slow
    [pytest.param(n, marks=pytest.mark.slow) for n in ("gemma2", "qwen3", "phi3")],
)
def test_sft_then_dpo_with_the_familys_chat_template(name, tmp_path):
    family = FAMILIES[name]
    base = _base(tmp_path, name)
    chats = _write(tmp_path / "chat.jsonl", _chats(32, family.turns))
    messages = _chats(1, family.turns)[0]["messages"]
    hub = transformers.AutoTokenizer.from_pretrained(base)

    # SFT: the rows are the model's template, learning the answers alone
    sft = (tmp_path / "sft", chats, base, "task.kind=sft", "loop.steps=2")
    built = _build.build(_config(*sft))
    assert isinstance(built.template, data.JinjaChatTemplate)
    assert built.template.source == family.template
    ours, _ = built.template.encode(messages, built.tokenizer)
    assert ours.tolist() == _ids(hub.apply_chat_template(messages, tokenize=True))
    # one chat per row: the learned targets are each answer and its end of turn
    unpacked = _config(
        tmp_path / "rows", chats, base, "task.kind=sft", "data.pack=false"
    )
    rows = _rows.train_rows(_build.build(unpacked))
    for i, row in enumerate(_chats(4, family.turns)):
        runs = _learned_runs(rows["targets"][i], rows["loss_mask"][i], built.tokenizer)
        assert runs == family.answers(row["messages"])
    losses = _fit(*sft)
    assert len(losses) == 2 and np.isfinite(losses).all()
    out = tmp_path / "sft" / "hf"
    _check_export(out, family, messages, ours.tolist())

    # DPO from the SFT export, its template again
    pairs = _write(tmp_path / "pairs.jsonl", _pairs(16))
    dpo = (tmp_path / "dpo", pairs, out, "task.kind=dpo", "loop.steps=2")
    rows = _rows.train_rows(_build.build(_config(*dpo)))
    first = _pairs(1)[0]
    prompt = _ids(hub.apply_chat_template(first["prompt"], add_generation_prompt=True))
    assert rows["chosen_tokens"][0][: len(prompt)].tolist() == prompt
    for side in ("chosen", "rejected"):
        runs = _learned_runs(
            rows[f"{side}_targets"][0], rows[f"{side}_mask"][0], built.tokenizer
        )
        assert runs == family.answers(first[side])
    losses = _fit(*dpo)
    assert losses[0] == pytest.approx(LOG2, abs=1e-6)  # the policy is its reference
    assert len(losses) == 2 and np.isfinite(losses).all()
    _check_export(tmp_path / "dpo" / "hf", family, messages, ours.tolist())


def test_gemma_template_refuses_system_messages_before_any_work(tmp_path):
    """Gemma's template raises on a system message: a file of such chats is an
    error of one paragraph naming the file, the template's reason and the first
    row, before any work (no run directory); a file where some chats have one
    trains on the others and says how many it skipped."""
    base = _base(tmp_path, "gemma2")
    system = {"role": "system", "content": "You are terse."}
    rows = [{"messages": [system, *r["messages"]]} for r in _chats(8, 1)]
    bad = _write(tmp_path / "system.jsonl", rows)
    with pytest.raises(ConfigError) as caught:
        job.run(_config(tmp_path / "bad", bad, base, "task.kind=sft"))
    message = str(caught.value)
    assert "\n" not in message.strip()
    assert "data.train" in message and "system.jsonl" in message
    assert "System role not supported" in message and "row 0" in message
    assert "Check the rows against the chat template" in message
    assert not (tmp_path / "bad").exists()

    mixed = _write(tmp_path / "mixed.jsonl", rows[:2] + _chats(8, 1))
    config = _config(
        tmp_path / "mixed", mixed, base, "task.kind=sft", "data.pack=false"
    )
    built = _build.build(config)
    rows = _rows.train_rows(built)
    assert len(rows["tokens"]) == 8 and rows["loss_mask"].sum() > 0
    (note,) = built.notes
    assert "2 of 10 rows skipped" in note and "System role not supported" in note
