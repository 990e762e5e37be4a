"""Every documented setting runs (issue 26).

The cases are generated from the config schema: every value of a key with a
closed set (choices, booleans, `auto`), every optional key toggled (set when
unset by default, unset otherwise), the documented bounds (`min`, `max`) of
every number and the documented word forms of path keys (`stdlib`, `none`,
`auto`, ...); then the pairs of sections that interact. Each case goes through
the real CLI (`eqtrain fit --set ...`, in-process) and must either train or stop
with a one-paragraph config error (exit 2, no traceback) *before any data is
read*; a refusal must be one listed in `REFUSED`, so that a documented value
that is refused (as `optim.lr = 0` once was) fails here.

The default suite runs every case up to the point where the data would be read
(everything the config alone decides); `-m slow` trains each case 2 steps.

A new schema key is covered automatically, or fails `test_every_key_is_covered`
until it is given a case, a companion or a reason to skip.
"""

import itertools
import json
from pathlib import Path

import jax.random as jr
import pytest
from typer.testing import CliRunner

from eqtrain import config as config_lib, hf, lora, models
from eqtrain.cli import app
from eqtrain.config import schema
from eqtrain.config._validate import _GRPO_KEYS as GRPO_KEYS
from eqtrain.job import _rows


FIELDS = schema()
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "data"
TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 40

# The tiny run every case starts from (`--set` forms); `{root}` is the data's
# directory, `{run}` the case's run directory.
BASE = {
    "run_dir": "{run}",
    "data.train": "{root}/train",
    "data.eval": "{root}/eval",
    "model.hidden_size": "32",
    "model.num_layers": "1",
    "data.seq_len": "16",
    "data.batch_size": "8",
    "data.eval_rows": "8",
    "loop.steps": "2",
    "loop.eval_every": "1",
    "checkpoint.every": "1",
    "log.progress": "none",
    "optim.warmup_steps": "0",
}
ARCH_KEYS = [f"model.{k}" for k in config_lib.ARCH_KEYS]

# -- the values a key documents -------------------------------------------------
# Path and free-text keys: the word forms their help documents, and a sample.
FORMS = {
    "data.train": ["stdlib"],
    "data.sources": ["{root}/train=0.7,stdlib=0.3"],
    "data.cache": ["auto", "{run}/cache"],
    "data.eval": ["auto", "none"],
    "data.tokenizer": ["auto", "byte"],
    "data.chat_template": ["auto", "builtin"],
    # a table (here as its JSON string), none, and a name every render sets
    "data.chat_template_kwargs": ['{"enable_thinking": false}', '""', '{"tools": []}'],
    "checkpoint.resume": ["auto", "never"],
    "optim.no_decay": ['""'],  # "empty: decay all"
    "export.max_shard_size": ["1MB"],
    "distributed.resources_per_worker": ["CPU=2"],
    "lora.targets": ["q_proj"],
    "model.quantize_skip": ["lm_head|up_proj"],
    "seed": ["7"],
}
# What an optional key that is unset by default is set to, to toggle it on.
SAMPLES = {
    "model.init_from": "{root}/hf",
    "model.adapter_from": "{root}/adapter",
    "model.quantize": "nf4",
    "model.vocab_size": "300",
    "model.intermediate_size": "48",
    "model.head_dim": "16",
    "model.max_seq_len": "64",
    "model.norm_eps": "1e-3",
    "model.sliding_window": "8",
    "model.sequence_parallel": "ring",
    "model.expert_size": "16",
    "model.shared_expert_size": "16",
    "model.router_aux_loss_coef": "0.01",
    "model.capacity_factor": "1.25",
    "data.max_prompt_len": "8",
    "optim.warmup_steps": "1",
    "optim.final_lr": "1e-4",
    "optim.decay_steps": "1",
    "optim.b1": "0.8",
    "optim.b2": "0.9",
    "optim.eps": "1e-6",
    "optim.momentum": "0.9",
    "loop.time_limit": "1h",
    "loop.ema": "0.9",
    "checkpoint.every_minutes": "5",
    "checkpoint.keep_every": "1",
    "checkpoint.best": "eval/loss",
    "distributed.ray_address": "auto",
    "log.wandb_project": "eqtrain-test",
    "log.wandb_name": "tiny",
    "log.peak_flops": "1e12",
    "log.samples": "{root}/samples.txt",
    "task.beta": "0.2",
    "task.format_regex": "[0-9]+",
    "task.epsilon_high": "0.28",
    "task.teacher": "{root}/hf",
    "lora.alpha": "8",
    "lora.train_also": "norm",
    "export.dtype": "bfloat16",
    "export.adapter": "true",
}
# Larger values where the bound alone says little (a value > 1 of a count).
MORE = {
    "lora.rank": ["4"],
    "mesh.sequence": ["2"],
    "mesh.expert": ["2"],
    "model.num_experts": ["4"],
    "model.mlp_chunks": ["2"],
    "model.loss_chunk": ["8"],
    "model.attention_chunk": ["8"],
    "optim.accumulate": ["2"],
    "task.epsilon": ["0.1"],
    "task.group_size": ["4"],
    "task.passes": ["2"],
    "export.every": ["1"],
    "distributed.processes": ["2"],
}
# Keys given no generated case, and why.
SKIPPED = {
    "run_dir": "every case sets it (a fresh run directory each)",
    "data.text_column": "a column name of the data's files: test_job.py's "
    "test_data_sources",
    "data.pattern": "a glob over the data's files: test_job.py's test_data_sources",
}


def _text(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def values(key, *, bounds=True):
    """The `--set` values of `key` its schema documents (without `bounds`: the
    closed sets, toggles and word forms only)."""
    field = FIELDS[key]
    out = list(map(_text, field.choices or ()))
    if field.type is bool or field.kind == "auto_bool":
        out += ["true", "false"]
    if field.kind in ("auto_int", "auto_bool"):
        out.append("auto")
    if field.optional:
        out.append(SAMPLES[key] if field.default is None else "none")
    for bound in (field.min, field.max) if bounds else ():
        if bound is not None and field.kind not in ("names",):
            out.append(_text(bound))
    out += FORMS.get(key, []) + (MORE.get(key, []) if bounds else [])
    if field.kind == "names":
        out += NAMES.get(key, ["layer_input", '["layer_input", "query"]'])
    return list(dict.fromkeys(out))  # once each, in order


# -- companions: what a key needs to mean anything --------------------------------
# chats and pairs need longer rows than BASE's 16 tokens (else every row is
# skipped, rightly, once the data is read)
SFT = [
    "task.kind=sft",
    "data.train={root}/sft.jsonl",
    "data.eval={root}/sft_eval.jsonl",
    "data.seq_len=64",
]
PC = [
    "task.kind=sft",
    "data.train={root}/pc.jsonl",
    "data.eval=none",
    "loop.eval_every=-",  # its default: nothing to evaluate, so no evaluations
]
PREF = [
    "data.train={root}/preference.jsonl",
    "data.eval={root}/preference_eval.jsonl",
    "data.seq_len=64",
]
GRPO = [
    "task.kind=grpo",
    "data.train={root}/grpo.jsonl",
    "data.eval=none",
    "loop.eval_every=-",
    "task.max_completion_len=4",
    "task.group_size=2",
]
GRPO_CHAT = [
    *GRPO[:1],
    "data.train={root}/grpo_chat.jsonl",
    *GRPO[2:],
    "data.seq_len=64",
]
DISTILL = [
    "task.kind=distill",
    "task.teacher={root}/hf",
    *PC[1:],
    "task.max_completion_len=4",
]
# The names a `names` key documents (default: activation names, for remat)
NAMES = {
    "task.rewards": ["exact_answer", '["exact_answer", "format"]'],
    "task.reward_weights": ["2", '["1", "0.5"]'],
}
LORA = ["lora.rank=4"]
HF_BASE = ["model.init_from={root}/hf", *(f"{k}=-" for k in ARCH_KEYS)]


def companions(key, value):
    """The other settings `key = value` needs (`KEY=-`: drop KEY from the base)."""
    section, name = key.split(".", 1) if "." in key else ("", key)
    if key == "task.kind":
        return {"lm": [], "sft": SFT, "grpo": GRPO, "distill": DISTILL}.get(value, PREF)
    if key == "task.rewards" and "format" in value:
        return [*GRPO, "task.format_regex=[0-9]+"]
    if key == "task.reward_weights" and value.startswith("["):
        return [*GRPO, "task.rewards=exact_answer,format", "task.format_regex=.*"]
    if section == "task" and name in ("teacher", "lmbda", "seq_kd"):
        return DISTILL
    if section == "task" and name in GRPO_KEYS:
        return GRPO
    if key == "data.format":
        return {
            "chat": SFT,
            "prompt_completion": PC,
            "preference": ["task.kind=dpo", *PREF],
        }.get(value, [])
    if key == "task.reference":
        return ["task.kind=dpo", *PREF] + (LORA if value == "adapters_off" else [])
    if section == "task":  # beta, label_smoothing, orpo_lambda, simpo_gamma
        kind = {"orpo_lambda": "orpo", "simpo_gamma": "simpo"}.get(name, "dpo")
        return [f"task.kind={kind}", *PREF]
    if key in (
        "data.chat_template",
        "data.chat_template_kwargs",
        "data.max_prompt_len",
        "data.pack",
    ):
        return SFT
    if section == "lora" and key != "lora.rank":
        return LORA
    if key in ("export.adapter", "export.merged"):
        return LORA if value != "false" else []
    if key == "export.ema" and value == "true":
        return ["loop.ema=0.9"]
    if key in ("model.remat_save", "model.remat_offload"):
        return ["model.remat=custom"]
    if key == "model.remat" and value == "custom":
        return ["model.remat_save=layer_input"]
    if key == "model.sequence_parallel" and value != "none":
        return ["mesh.sequence=2"]
    if key == "model.sequence_layout" and value == "zigzag":
        return ["mesh.sequence=2", "model.sequence_parallel=ring"]
    if key == "mesh.sequence" and value != "1":
        return ["model.sequence_parallel=ring"]
    if key in ("mesh.fsdp", "mesh.tensor") and value == "-1":
        return ["mesh.data=1"]
    if key in ("optim.decay_steps",):
        return ["optim.schedule=wsd"]
    if key == "optim.momentum" and value != "none":
        return ["optim.name=sgd"]
    if key == "optim.nesterov" and value == "true":
        return ["optim.name=sgd", "optim.momentum=0.9"]
    if key == "model.init_from":
        return HF_BASE[1:]
    if key == "model.adapter_from":
        return HF_BASE
    if key == "checkpoint.best_mode":
        return ["checkpoint.best=eval/loss"]
    if key.startswith("model.quantize"):  # frozen in 4/8 bits: adapters train;
        # rows of whole 64-value blocks
        on = [] if key == "model.quantize" else ["model.quantize=nf4"]
        return ["lora.rank=2", "model.hidden_size=64", *on]
    if key.startswith("log.samples_"):  # they shape the samples of log.samples
        return ["log.samples={root}/samples.txt"]
    if key in ("log.wandb_project", "log.wandb_name"):
        # never the network: wandb writes nothing (see also the env fixture)
        return ["log.wandb_project=eqtrain-test", "log.wandb_mode=disabled"]
    if key == "log.wandb_mode":
        return ["log.wandb_project=eqtrain-test"] if value != "online" else []
    if key == "model.shared_expert_size" and value != "none":
        return ["model.arch=qwen2_moe", "model.num_experts=4"]
    if key == "model.norm_topk_prob" and value == "false":  # not Mixtral's rule
        return ["model.arch=qwen3_moe", "model.num_experts=4"]
    if key in MOE_KEYS or (key == "mesh.expert" and value != "1"):
        return ["model.num_experts=4"]
    if key == "model.arch" and value in ("mixtral", "qwen2_moe", "qwen3_moe"):
        # a mixture of experts has experts (and Qwen2-MoE a shared one)
        shared = ["model.shared_expert_size=16"] if value == "qwen2_moe" else []
        return ["model.num_experts=4", *shared]
    if key == "model.num_heads" and value == "1":
        return ["model.num_kv_heads=1"]
    if key == "model.hidden_size" and value == "1":  # heads of 2 (RoPE: even)
        return ["model.num_heads=1", "model.num_kv_heads=1", "model.head_dim=2"]
    if key == "model.max_seq_len" and value == "2":
        return ["data.seq_len=2"]
    if key == "data.eval" and value == "none":  # an explicit eval_every is refused
        return ["loop.eval_every=-"]
    if key == "optim.accumulate" and value != "1":  # micro-batches of 8 devices
        return ["data.batch_size=16"]
    return []


# the mixture-of-experts keys: they need experts (each alone on a dense model is
# refused, by test_moe_keys_on_a_dense_model_are_refused)
MOE_KEYS = {
    "model.experts_per_token",
    "model.expert_size",
    "model.shared_expert_size",
    "model.norm_topk_prob",
    "model.router_aux_loss_coef",
    "model.router_z_loss_coef",
    "model.capacity_factor",
    "model.moe_impl",
}


# -- refusals: (key, value) -> a fragment of the one-paragraph error -------------
REFUSED = {
    # cuDNN's kernel needs a GPU; the tests run on the CPU
    ("model.attention_impl", "cudnn"): "needs a CUDA GPU with cuDNN",
    ("distributed.processes", "2"): "needs a launcher",
    # the byte tokenizer's 259 ids do not fit a vocabulary of 1
    ("model.vocab_size", "1"): "does not fit the model's vocabulary of 1",
    # one row cannot split over the 8 simulated devices (it runs on one device)
    ("data.batch_size", "1"): "must split evenly over the 8 devices",
    # nor one eval row (this crashed in the first evaluation, after a step)
    ("data.eval_rows", "1"): "an eval batch (1 rows",
    # the template is always given the record's tools
    ("data.chat_template_kwargs", '{"tools": []}'): "sets 'tools'",
}


def generated(*, bounds=True):
    """Every (key, value) case of the schema."""
    cases = []
    for key in FIELDS:
        if key in SKIPPED:
            continue
        for value in values(key, bounds=bounds):
            cases.append((key, value))
    return cases


CASES = generated()
# The default suite's share (its time): the closed sets, toggles and forms.
CLOSED = generated(bounds=False)

# -- pairs of the sections that interact --------------------------------------------
EVAL_SOURCES = ["auto", "none", "{root}/eval"]
EVAL_EVERY = ["0", "1", None]  # None: the default (100)
BEST = [None, "eval/loss"]
KINDS = config_lib.schema()["task.kind"].choices
FORMATS = config_lib.schema()["data.format"].choices
MESHES = [
    [],
    ["mesh.fsdp=2"],
    ["mesh.tensor=2"],
    ["mesh.data=1", "mesh.fsdp=-1"],
    ["mesh.sequence=2"],
    ["mesh.sequence=2", "mesh.tensor=2"],
]
SCHEMES = [None, *config_lib.schema()["model.sequence_parallel"].choices]


def _data_for(kind, fmt):
    if kind == "lm":
        return []
    if kind == "grpo":
        return (GRPO_CHAT if fmt == "chat" else GRPO)[1:]
    if kind == "distill":
        data = SFT[1:] if fmt == "chat" else PC[1:]
        return ["task.teacher={root}/hf", "task.max_completion_len=4", *data]
    if kind != "sft":
        return PREF
    return PC[1:] if fmt == "prompt_completion" else SFT[1:]


def pairs():
    out = []
    for source, every, best in itertools.product(EVAL_SOURCES, EVAL_EVERY, BEST):
        sets = [f"data.eval={source}"]
        sets += [] if every is None else [f"loop.eval_every={every}"]
        sets += [] if best is None else [f"checkpoint.best={best}"]
        out.append(("eval", (["loop.eval_every=-"] if every is None else []) + sets))
    for kind, fmt, rank in itertools.product(KINDS, FORMATS, ["0", "4"]):
        sets = [f"task.kind={kind}", f"data.format={fmt}", f"lora.rank={rank}"]
        out.append(("task", _data_for(kind, fmt) + sets))
    for mesh, scheme in itertools.product(MESHES, SCHEMES):
        sets = list(mesh) + (
            [] if scheme is None else [f"model.sequence_parallel={scheme}"]
        )
        out.append(("mesh", sets))
    return out


PAIRS = pairs()


# -- running a case through the CLI ----------------------------------------------------
class DataRead(Exception):
    """The run got past every check the config alone decides: it reads its data."""


def _first(path, n):
    return "".join(path.read_text().splitlines(keepends=True)[:n])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Tiny data of every kind, a tiny Hugging Face Llama and a PEFT adapter."""
    root = tmp_path_factory.mktemp("settings")
    (root / "train").mkdir()
    (root / "eval").mkdir()
    for i in range(3):
        (root / "train" / f"{i}.txt").write_text(TEXT * (i + 1))
    (root / "eval" / "0.txt").write_text(TEXT[::-1])
    (root / "samples.txt").write_text("def f(x):\nclass A:\n")  # log.samples
    for name in ("sft", "preference"):
        (root / f"{name}.jsonl").write_text(_first(EXAMPLES / f"{name}.jsonl", 48))
        (root / f"{name}_eval.jsonl").write_text(
            _first(EXAMPLES / f"{name}_eval.jsonl", 16)
        )
    pc = [
        {"prompt": f"What is {i} plus 1?", "completion": f" {i + 1}."}
        for i in range(48)
    ]
    grpo = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(16)]
    (root / "grpo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in grpo))
    chats = [
        {"messages": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
        for r in grpo
    ]
    (root / "grpo_chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    (root / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pc))
    cfg = models.LlamaConfig(
        vocab_size=259,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = models.Llama(cfg, jr.key(0))
    hf.export(model, cfg, root / "hf")
    adapted = lora.apply(model, lora.LoRA(rank=2), key=jr.key(1))
    hf.export_adapter(adapted, root / "adapter")
    return root


@pytest.fixture
def no_network(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("WANDB_SILENT", "true")


def overrides(root, run, sets):
    """`BASE` with `sets` applied (`KEY=-` drops KEY), as `--set` values."""
    merged = dict(BASE)
    for item in sets:
        key, _, value = item.partition("=")
        if value == "-":
            merged.pop(key, None)
        else:
            merged.pop(key, None)  # later wins, and goes last
            merged[key] = value
    return [
        f"{k}={v.replace('{root}', str(root)).replace('{run}', str(run))}"
        for k, v in merged.items()
    ]


def fit(root, run, sets, monkeypatch, *, train):
    """`eqtrain fit` with `sets` on the tiny run, in-process. Without `train` the
    data is never read (`DataRead` is raised where it would be)."""
    reads = []
    real = _rows.train_rows

    def spy(job):
        reads.append(job.config.data.train)
        if not train:
            raise DataRead
        return real(job)

    monkeypatch.setattr(_rows, "train_rows", spy)
    args = ["fit"]
    for item in overrides(root, run, sets):
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    return result, reads


def outcome(result, reads, *, train):
    """ "trained", "reads data" or the one-paragraph error; fails the test on
    anything else (a traceback, an error after the data was read, exit 1)."""
    described = f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    if result.exit_code == 2:
        err = result.stderr
        lines = err.splitlines()
        assert lines and lines[-1].startswith("error: "), described
        assert sum(line.startswith("error: ") for line in lines) == 1, described
        assert "Traceback" not in err, described
        assert not reads, f"a config error after the data was read: {described}"
        return lines[-1]
    if not train:
        assert isinstance(result.exception, DataRead), described
        return "reads data"
    assert result.exit_code == 0, described
    assert "stopped: max_steps" in result.stdout, described
    return "trained"


def _case_id(case):
    key, value = case
    return f"{key}={value}"


def check_case(root, tmp_path, monkeypatch, case, *, train):
    key, value = case
    sets = [*companions(key, value), f"{key}={value}"]
    result, reads = fit(root, tmp_path / "run", sets, monkeypatch, train=train)
    got = outcome(result, reads, train=train)
    refused = REFUSED.get(case)
    if refused is None:
        assert not got.startswith("error: "), f"{key}={value} is documented: {got}"
    else:
        assert got.startswith("error: ") and refused in got, (case, got)


def check_pair(root, tmp_path, monkeypatch, pair, *, train):
    section, sets = pair
    result, reads = fit(root, tmp_path / "run", sets, monkeypatch, train=train)
    got = outcome(result, reads, train=train)
    if got.startswith("error: "):  # refused: the message names a key it involves
        keys = {s.partition("=")[0] for s in sets} | {"mesh", "sequence"}
        assert any(k in got for k in keys), (sets, got)


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("case", CLOSED, ids=_case_id)
def test_every_setting_passes_its_checks(root, tmp_path, monkeypatch, case):
    check_case(root, tmp_path, monkeypatch, case, train=False)


@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p[0] + ":" + ",".join(p[1]))
def test_interacting_settings_pass_their_checks(root, tmp_path, monkeypatch, pair):
    check_pair(root, tmp_path, monkeypatch, pair, train=False)


@pytest.mark.slow
@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("case", [c for c in CASES if c not in CLOSED], ids=_case_id)
def test_every_bound_passes_its_checks(root, tmp_path, monkeypatch, case):
    check_case(root, tmp_path, monkeypatch, case, train=False)


@pytest.mark.slow
@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_setting_trains(root, tmp_path, monkeypatch, case):
    check_case(root, tmp_path, monkeypatch, case, train=True)


@pytest.mark.slow
@pytest.mark.usefixtures("no_network")
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: p[0] + ":" + ",".join(p[1]))
def test_interacting_settings_train(root, tmp_path, monkeypatch, pair):
    check_pair(root, tmp_path, monkeypatch, pair, train=True)


def test_every_key_is_covered():
    """Each schema key has generated cases, or a reason to have none."""
    assert not set(SKIPPED) - set(FIELDS), "SKIPPED names keys the schema lacks"
    covered = {key for key, _ in CASES}
    missing = [k for k in FIELDS if k not in covered and k not in SKIPPED]
    assert not missing, f"config keys without a generated case or a reason: {missing}"
    assert not set(SAMPLES) - set(FIELDS) and not set(FORMS) - set(FIELDS)


# -- the settings issue 26 found broken, through the CLI ----------------------------
@pytest.mark.usefixtures("no_network")
def test_no_eval_data_trains_with_the_default_eval_every(root, tmp_path, monkeypatch):
    # data.eval = none with loop.eval_every's default (100) read the data, then
    # stopped in the loop: "`eval_every` needs both `eval_step=` and `eval_data=`".
    sets = ["data.eval=none", "loop.eval_every=-"]
    result, reads = fit(root, tmp_path / "run", sets, monkeypatch, train=True)
    assert outcome(result, reads, train=True) == "trained"
    # An explicit interaction that cannot work is refused before any data.
    sets += ["checkpoint.best=eval/loss"]
    result, reads = fit(root, tmp_path / "run2", sets, monkeypatch, train=True)
    assert "`checkpoint.best`" in outcome(result, reads, train=True)


@pytest.mark.usefixtures("no_network")
def test_lora_on_an_imported_run_asks_for_init_from(root, tmp_path, monkeypatch):
    run = tmp_path / "imported"
    done = CliRunner().invoke(app, ["import", str(root / "hf"), str(run)])
    assert done.exit_code == 0, done.output
    reads = []
    monkeypatch.setattr(_rows, "train_rows", lambda job: reads.append(1) or {})
    args = ["fit", str(run / "config.toml"), "--set", "lora.rank=4"]
    args += ["--set", f"data.train={root / 'train'}", "--set", "log.progress=none"]
    result = CliRunner().invoke(app, args)
    got = outcome(result, reads, train=True)
    assert "mismatched" not in got
    assert "set model.init_from to the model's Hugging Face directory" in got


@pytest.mark.usefixtures("no_network")
def test_moe_keys_on_a_dense_model_are_refused(root, tmp_path, monkeypatch):
    # without model.num_experts, a router option would do nothing: refused by name
    sets = ["model.capacity_factor=1.25"]
    result, reads = fit(root, tmp_path / "run", sets, monkeypatch, train=False)
    got = outcome(result, reads, train=False)
    assert "`model.capacity_factor` applies to mixture-of-experts models" in got
    sets = ["mesh.expert=2"]
    result, reads = fit(root, tmp_path / "run2", sets, monkeypatch, train=False)
    assert "mesh.expert = 2 splits" in outcome(result, reads, train=False)
