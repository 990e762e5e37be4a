"""A model's named chat templates (`default`, `tool_use`, `rag`) survive every
copy eqtrain makes of its tokenizer files: `eqtrain import` into a run
directory, a run's record of `model.init_from`, and `eqtrain export` back to
Hugging Face format, whichever layout the source had (`tokenizer_config.json`'s
list, or transformers 5's `chat_template.jinja` with
`additional_chat_templates/<name>.jinja`). Each copy is written in transformers
5's layout and checked against `transformers` loaded from it; a name that would
put a file outside the directory is refused before anything is written. A tiny
Llama, imported and exported at step 0: nothing is trained."""

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

import eqtrain.config as config_lib
from eqtrain import _files, job
from eqtrain.data import DataError, read_chat_templates, write_chat_templates
from eqtrain.job import _resolve, _rundir

from .test_chat_templates_named import CHAT, DEFAULT, RAG, TOOL_USE, TOOLS
from .test_cli import assert_clean_error, inproc
from .test_generate_cli import write_tokenizer
from .test_run_identity import hf_dir


transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

TEMPLATES = {"default": DEFAULT, "tool_use": TOOL_USE, "rag": RAG}
LAYOUTS = ("config", "files")
EXTRA = "additional_chat_templates"


def model_dir(path, templates, layout):
    """A tiny Llama in Hugging Face format with test_generate_cli's word-level
    tokenizer and the named `templates`, as Hermes ships them (`"config"`: a
    list in tokenizer_config.json) or as transformers 5 saves them (`"files"`)."""
    hf_dir(path)
    write_tokenizer(path, template=False)
    if layout == "config":
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        tokenizer_config["chat_template"] = [
            {"name": name, "template": text} for name, text in templates.items()
        ]
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
        return path
    (path / EXTRA).mkdir()
    for name, text in templates.items():
        file = "chat_template.jinja" if name == "default" else f"{EXTRA}/{name}.jinja"
        (path / file).write_text(text, encoding="utf-8")
    return path


def hf_of(directory):
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def rendered(directory, tools=None):
    """transformers' text of `CHAT` (with `tools`) from `directory`."""
    return hf_of(directory).apply_chat_template(CHAT, tools=tools, tokenize=False)


def assert_layout(directory):
    """`directory` holds `TEMPLATES` as transformers 5 saves them."""
    assert (directory / "chat_template.jinja").read_text() == DEFAULT
    assert sorted(p.name for p in (directory / EXTRA).iterdir()) == [
        "rag.jinja",
        "tool_use.jinja",
    ]
    assert (directory / EXTRA / "tool_use.jinja").read_text() == TOOL_USE


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    return {layout: model_dir(root / layout, TEMPLATES, layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def imported(sources, tmp_path_factory):
    """Each source imported as a run directory (`eqtrain import`)."""
    root = tmp_path_factory.mktemp("imported")
    for layout, source in sources.items():
        inproc("import", source, root / layout, "--set", "data.seq_len=16", check_rc=0)
    return {layout: root / layout for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_import_carries_every_named_template(sources, imported, layout):
    source, run = sources[layout], imported[layout]
    assert read_chat_templates(source) == TEMPLATES == hf_of(source).chat_template
    assert_layout(run)
    assert read_chat_templates(run) == TEMPLATES
    assert hf_of(run).chat_template == TEMPLATES  # transformers loads the same
    # fine-tuning the run renders records with tools with its tool_use template
    config = config_lib.load(run / "config.toml", [])
    template = _resolve.chat_template_of(config)
    assert (template.source, template.tool_use) == (DEFAULT, TOOL_USE)
    assert template.templates == TEMPLATES


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_init_from_record_carries_every_named_template(sources, tmp_path, layout):
    config = config_lib.load(None, [f"model.init_from={sources[layout]}"])
    _rundir.record_init_from(config, tmp_path)
    record = tmp_path / _rundir.RECORD
    assert_layout(record)
    assert read_chat_templates(record) == TEMPLATES
    assert hf_of(record).chat_template == TEMPLATES
    # a record made again from a base with fewer templates has only those
    fewer = model_dir(tmp_path / "fewer", {"default": RAG}, layout)
    config = config_lib.load(None, [f"model.init_from={fewer}"])
    _rundir.record_init_from(config, tmp_path)
    assert read_chat_templates(record) == {"default": RAG}
    assert not (record / EXTRA).exists()


def test_export_carries_every_named_template(sources, imported, tmp_path):
    """The export of a run imported from tokenizer_config.json's list: transformers
    loads the three templates from it and renders tools with tool_use, as it does
    from the original directory."""
    back = tmp_path / "back"
    inproc("export", imported["config"], back, check_rc=0)
    assert_layout(back)
    assert hf_of(back).chat_template == TEMPLATES
    assert read_chat_templates(back) == TEMPLATES
    with_tools = rendered(back, TOOLS)
    assert with_tools == rendered(sources["config"], TOOLS)
    assert with_tools.startswith("<|im_start|>system\n# Tools\n")  # tool_use's
    assert rendered(back) == rendered(sources["config"]) != with_tools
    # transformers 4 reads the list in tokenizer_config.json
    listed = json.loads((back / "tokenizer_config.json").read_text())["chat_template"]
    assert {t["name"]: t["template"] for t in listed} == TEMPLATES
    # an export with named templates is an export: --overwrite replaces it whole
    assert _files.foreign_files(back) == []
    inproc("export", imported["files"], back, "--overwrite", check_rc=0)
    assert_layout(back)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back"]


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft
def test_a_lora_runs_adapter_exports_carry_the_tokenizer(sources, tmp_path):
    """A LoRA run's adapter exports (the run's own at its end, and `eqtrain
    export`'s) hold the run's tokenizer and named templates beside PEFT's files,
    as a TRL trainer's `save_model` writes its tokenizer with an adapter, and
    name their base by its absolute path: transformers loads the same tokenizer
    and templates from the directory, `peft.AutoPeftModelForCausalLM` the
    adapted model (the run's logits), and `eqtrain generate` runs on it."""
    peft = pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    source, run = sources["config"], tmp_path / "run"
    sets = [f"run_dir={run}", f"model.init_from={source}", "lora.rank=4"]
    sets += ["loop.steps=1", "data.seq_len=16", "data.batch_size=8", "data.eval=none"]
    inproc("fit", *[a for s in sets for a in ("--set", s)], check_rc=0)
    inproc("export", run, tmp_path / "back", check_rc=0)
    text = "hello world the quick brown fox"
    ids = np.asarray(hf_of(source)(text)["input_ids"], np.int32)
    tokens = jnp.asarray(ids)
    logits = np.asarray(job.open_model(run).model(tokens))
    for adapter in (run / "hf", tmp_path / "back"):
        assert (adapter / "adapter_model.safetensors").is_file()
        assert_layout(adapter)
        assert hf_of(adapter).chat_template == TEMPLATES
        assert hf_of(adapter)(text)["input_ids"] == ids.tolist()
        assert rendered(adapter, TOOLS) == rendered(source, TOOLS)
        config = peft.PeftConfig.from_pretrained(str(adapter))
        assert (config.peft_type, config.r) == ("LORA", 4)
        assert config.base_model_name_or_path == str(source.resolve())
        m = job.open_model(adapter)  # eqtrain generate's: base + adapter
        assert m.template.templates == TEMPLATES
        np.testing.assert_allclose(np.asarray(m.model(tokens)), logits, atol=1e-5)
    theirs = peft.AutoPeftModelForCausalLM.from_pretrained(str(run / "hf")).eval()
    with torch.no_grad():
        out = theirs(torch.from_numpy(ids.astype(np.int64))[None]).logits[0]
    np.testing.assert_allclose(out.numpy(), logits, atol=1e-4)
    done = inproc(
        "generate", run / "hf", "--chat", "-p", "hello", "--max-new-tokens", "2"
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("base", [None, "{missing}"])
def test_an_adapter_without_its_base_is_one_paragraph(sources, tmp_path, base):
    """`eqtrain generate` on an adapter whose base_model_name_or_path names no
    local Hugging Face directory says so, and what to do."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    missing = str(tmp_path / "nowhere")
    settings = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": []}
    settings["base_model_name_or_path"] = base and base.format(missing=missing)
    (adapter / "adapter_config.json").write_text(json.dumps(settings))
    done = inproc("generate", adapter, "-p", "hi")
    said = "names no base model" if base is None else f"names the base {missing},"
    assert_clean_error(done, said, "eqtrain export RUN OUT --merged")


def test_a_folder_of_templates_with_other_files_is_not_an_export(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / EXTRA).mkdir()
    (tmp_path / EXTRA / "tool_use.jinja").write_text(TOOL_USE)
    assert _files.foreign_files(tmp_path) == []
    (tmp_path / EXTRA / "notes.txt").write_text("mine")
    assert _files.foreign_files(tmp_path) == [f"{EXTRA}/"]


@pytest.mark.parametrize("name", ["../escape", "a/b", "a\\b", "", "nul\0"])
def test_a_name_that_is_not_a_file_name_is_refused(tmp_path, name):
    target = tmp_path / "out"
    target.mkdir()
    with pytest.raises(DataError, match="cannot be written as a file"):
        write_chat_templates(target, {"default": DEFAULT, name: RAG})
    assert list(target.iterdir()) == []  # every name is checked first
    # an import of a model that lists one fails by name and leaves nothing
    source = model_dir(tmp_path / "src", {"default": DEFAULT, name: RAG}, "config")
    with pytest.raises(DataError, match=re.escape(f"named {name!r}")):
        job.import_hf(source, tmp_path / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_dots_stay_in_a_file_name(tmp_path):
    """`<name>.jinja` keeps dots in the name a file of the folder (transformers
    writes `v1..2` as it is)."""
    written = write_chat_templates(tmp_path, {"default": DEFAULT, "v1..2": RAG})
    assert (tmp_path / EXTRA / "v1..2.jinja").read_text() == RAG
    assert len(written) == 2
