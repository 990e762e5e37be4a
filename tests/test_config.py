"""eqtrain.config: TOML files and `--set` overrides, their errors, the checks
across fields, round trips through `to_toml`/`to_dict`, and the generated
CLI/config reference (docs/cli-reference.md). Pure Python: nothing compiles."""

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import typer.main
from hypothesis import assume, given, settings

import eqtrain
from eqtrain import config
from eqtrain.cli import app
from eqtrain.cli._reference import REGENERATE, reference_markdown
from eqtrain.config import Config


ConfigError = eqtrain.ConfigError
FIELDS = config.schema()
PROPERTY = settings(derandomize=True, deadline=None, max_examples=20)
REFERENCE = Path(__file__).parent.parent / "docs" / "cli-reference.md"


def write(tmp_path: Path, text: str, name: str = "run.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def get(cfg: Config, key: str) -> Any:
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def nested(values: dict[str, Any]) -> dict[str, Any]:
    """`{"optim.lr": 1e-4}` -> `{"optim": {"lr": 1e-4}}`."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        section, _, name = key.rpartition(".")
        (out.setdefault(section, {}) if section else out)[name] = value
    return out


def reread(cfg: Config) -> Config:
    """`cfg` written with `to_toml` and read back as a file would be."""
    return config.from_dict(tomllib.loads(config.to_toml(cfg)))


def is_valid(cfg: Config) -> bool:
    try:
        config.validate(cfg)
    except ConfigError:
        return False
    return True


# -- defaults and round trips ----------------------------------------------------
def test_load_without_a_file_is_the_defaults():
    cfg = config.load()
    assert cfg == Config()
    assert config.explicit(cfg) == frozenset()
    config.validate(Config())


@pytest.mark.parametrize("comments", [True, False])
def test_defaults_round_trip_through_toml(comments):
    text = config.to_toml(Config(), comments=comments)
    back = config.from_dict(tomllib.loads(text))
    assert back == Config()
    config.validate(back)


def test_to_dict_names_every_key():
    flat = {
        (f"{k}.{n}" if isinstance(v, dict) else k)
        for k, v in config.to_dict(Config()).items()
        for n in (v if isinstance(v, dict) else [None])
    }
    assert flat == set(FIELDS)


# Values the strategies favour for integers: divisors of one another, so that
# random configs pass `validate` (hidden % heads, batch % accumulate) often.
NICE_INTS = (-1, 1, 2, 4, 8, 16, 64, 128, 256)


def values_for(field: config.Field) -> st.SearchStrategy[Any]:
    """Valid values of `field`, as `from_dict` would receive them from TOML."""
    strategy: st.SearchStrategy[Any]
    if field.choices is not None:
        strategy = st.sampled_from(field.choices)
    elif field.type is bool:
        strategy = st.booleans()
    elif field.kind == "size":
        strategy = st.sampled_from(["5GB", "500MB", "2GiB", "1000", "1.5GB"])
    elif field.kind == "sources":  # as --set writes them, or [[data.sources]]
        strategy = st.sampled_from(
            ["", "a.jsonl=0.7, b=0.3", "web:c/d=2", [{"path": "x", "weight": 1.5}]]
        )
    elif field.kind == "table":  # a TOML table, or the JSON --set writes
        strategy = st.sampled_from(
            ["", {"enable_thinking": False}, '{"a": [1, "x"]}', {"n": {"m": 2.5}}]
        )
    elif field.key == "checkpoint.best":
        strategy = st.sampled_from(["eval/loss", "eval/accuracy"]) | st.text()
    elif field.type is int:
        low = -(2**31) if field.min is None else int(field.min)
        high = 2**40 if field.max is None else int(field.max)
        nice = [v for v in NICE_INTS if low <= v <= high]
        strategy = st.sampled_from(nice) | st.integers(low, high)
    elif field.type is float:
        strategy = st.floats(
            min_value=field.min if field.above is None else field.above,
            max_value=field.max if field.below is None else field.below,
            exclude_min=field.above is not None,  # exclusive bounds
            exclude_max=field.below is not None,
            allow_nan=False,
            allow_infinity=False,
        )
    else:
        strategy = st.text()
    return strategy | st.none() if field.optional else strategy


@st.composite
def changed_values(draw: st.DrawFn) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from(sorted(FIELDS)), min_size=1, max_size=25))
    return {key: draw(values_for(FIELDS[key])) for key in dict.fromkeys(keys)}


@PROPERTY
@given(changed_values())
def test_changed_configs_round_trip(values):
    cfg = config.from_dict(nested(values))
    assume(is_valid(cfg))
    assert config.explicit(cfg) == frozenset(values)
    # eqtrain writes a run's config.toml with to_toml and its checkpoint
    # manifests with to_dict; both must read back equal, and still valid.
    for back in (reread(cfg), config.from_dict(config.to_dict(cfg))):
        assert back == cfg
        config.validate(back)


def as_override(key: str, value: Any) -> str:
    """`--set` text for `value`: strings quoted, so they stay strings."""
    if value is None:
        text = "none"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = f'"{value}"'
    else:
        text = repr(value)
    return f"{key}={text}"


@PROPERTY
@given(changed_values())
def test_overrides_give_the_same_config_as_a_file(values):
    from_file = config.from_dict(nested(values))
    overrides = [as_override(k, v) for k, v in values.items()]
    assert config.apply_overrides(Config(), overrides) == from_file


STRINGS = [
    'say "hi"',
    "it's",
    "C:\\runs\\new\\t1",
    "\\u0041 is not an escape here",
    "naïve ünïcödé 日本語 🚀",
    "tab\there, newline\nthere",
    "del \x7f and nul \x00 and bell \x07",
    '"""',
    "'''",
    "# not a comment",
    "a = b",
    "[not.a.table]",
    "  spaces  ",
]


@pytest.mark.parametrize("text", STRINGS)
@pytest.mark.parametrize("key", ["data.train", "optim.no_decay", "log.wandb_name"])
def test_strings_round_trip(text, key):
    cfg = config.from_dict(nested({key: text}))
    assert get(cfg, key) == text
    assert get(reread(cfg), key) == text
    assert reread(cfg) == cfg
    quoted = config.apply_overrides(Config(), [f'{key}="{text}"'])
    assert get(quoted, key) == text


@pytest.mark.parametrize(
    "key", [k for k, f in FIELDS.items() if f.optional and f.default is not None]
)
def test_unset_keys_with_a_default_round_trip(key):
    # TOML has no null: to_toml must not let these read back as their default.
    cfg = config.apply_overrides(Config(), [f"{key}=none"])
    assert get(cfg, key) is None
    assert get(reread(cfg), key) is None
    assert get(config.from_dict(config.to_dict(cfg)), key) is None


def test_resolved_configs_reload(tmp_path):
    # `eqtrain config --set model.arch=gpt2 > run.toml` states the Llama-only
    # keys at their defaults; that must not count as setting them.
    cfg = config.load(None, ["model.arch=gpt2", "data.eval=none", "loop.eval_every=0"])
    path = write(tmp_path, config.to_toml(cfg))
    assert config.load(path) == cfg
    config.validate(config.from_dict(config.to_dict(cfg)))


def test_init_from_configs_reload(tmp_path):
    # A run's config.toml holds the architecture read from init_from's
    # config.json; `eqtrain fit run/config.toml` must accept it again.
    base = Config()
    model = dataclasses.replace(base.model, init_from="/hf", hidden_size=32)
    cfg = dataclasses.replace(base, model=dataclasses.replace(model, num_layers=1))
    text = config.to_toml(cfg)
    assert "# hidden_size = 32  (from model.init_from)" in text
    back = config.load(write(tmp_path, text))
    assert back.model == dataclasses.replace(base.model, init_from="/hf")


# -- --set typing ------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("optim.lr=1e-4", "optim.lr", 1e-4),
        ("optim.lr=1", "optim.lr", 1.0),
        ("loop.steps=10_000", "loop.steps", 10_000),
        ("loop.steps=1e4", "loop.steps", 10_000),
        ("loop.steps= 42 ", "loop.steps", 42),
        ("loop.time_limit=2h30m", "loop.time_limit", 9000.0),
        ("loop.time_limit=90", "loop.time_limit", 90.0),
        ("loop.time_limit=1.5h", "loop.time_limit", 5400.0),
        ("loop.time_limit=1e4", "loop.time_limit", 10_000.0),
        ("loop.time_limit=none", "loop.time_limit", None),
        ("optim.b1=null", "optim.b1", None),
        ("optim.clip_norm=", "optim.clip_norm", None),
        ("model.num_kv_heads=None", "model.num_kv_heads", None),
        ("export.hf=", "export.hf", None),
        ('export.hf="none"', "export.hf", "none"),
        ("log.wandb_name='null'", "log.wandb_name", "null"),
        ('data.train="2h30m"', "data.train", "2h30m"),
        ("data.train=a=b", "data.train", "a=b"),
        ("run_dir=runs/x", "run_dir", "runs/x"),
        ("seed=-3", "seed", -3),
        ("export.max_shard_size=500MB", "export.max_shard_size", "500MB"),
        ("model.arch=gpt2", "model.arch", "gpt2"),
        # A list as TOML writes it (the reference's own example), or commas.
        ('model.remat_save=["layer_input"]', "model.remat_save", "layer_input"),
        ("model.remat_offload=['query', \"key\"]", "model.remat_offload", "query,key"),
        ("model.remat_save=layer_input,query", "model.remat_save", "layer_input,query"),
        ("model.remat_save=[]", "model.remat_save", ""),
    ],
)
def test_set_values_are_typed_by_the_schema(override, key, expected):
    value = get(config.apply_overrides(Config(), [override]), key)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    "text, expected",
    [(t, True) for t in ("true", "True", "yes", "on", "1")]
    + [(t, False) for t in ("false", "FALSE", "no", "off", "0")],
)
def test_set_booleans(text, expected):
    cfg = config.apply_overrides(Config(), [f"data.shuffle={text}"])
    assert cfg.data.shuffle is expected


def test_later_overrides_win_and_apply_on_top_of_the_file(tmp_path):
    path = write(tmp_path, "[optim]\nlr = 0.5\nname = 'sgd'\n")
    cfg = config.load(path, ["optim.lr=0.1", "optim.lr=0.2"])
    assert (cfg.optim.lr, cfg.optim.name) == (0.2, "sgd")


# -- TOML files --------------------------------------------------------------------
def test_toml_tables_and_native_types(tmp_path):
    path = write(
        tmp_path,
        """
        run_dir = "runs/toml"
        seed = 7

        [loop]
        steps = 10_000
        time_limit = "2h30m"

        [optim]
        lr = 1e-4
        final_lr = 0        # an int for a float key
        warmup_steps = 1e3  # an integral float for an int key
        clip_norm = "none"  # unset, though the default is not

        [export]
        max_shard_size = 1000
        """,
    )
    cfg = config.load(path)
    assert (cfg.run_dir, cfg.seed, cfg.loop.steps) == ("runs/toml", 7, 10_000)
    assert cfg.loop.time_limit == 9000.0
    assert cfg.optim.lr == 1e-4
    assert cfg.optim.final_lr == 0.0 and type(cfg.optim.final_lr) is float
    assert cfg.optim.warmup_steps == 1000 and type(cfg.optim.warmup_steps) is int
    assert cfg.optim.clip_norm is None
    assert cfg.export.max_shard_size == "1000"  # bytes, as the string field holds
    assert cfg.model == Config().model


def test_explicit_tracks_the_file_and_the_overrides(tmp_path):
    path = write(tmp_path, "seed = 1\n[optim]\nlr = 0.1\n[mesh]\n")
    cfg = config.load(path, ["loop.steps=5", "optim.lr=0.2"])
    assert config.explicit(cfg) == {"seed", "optim.lr", "loop.steps"}
    assert config.explicit(config.load(None, ["model.arch=llama"])) == {"model.arch"}
    # A field, not a hidden attribute: `replace` keeps it, `==` and the TOML ignore it.
    resized = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=8))
    assert config.explicit(resized) == config.explicit(cfg)
    assert cfg == dataclasses.replace(cfg, _explicit=frozenset())
    assert "_explicit" not in config.to_dict(cfg)
    assert "explicit" not in config.to_toml(cfg) and "_explicit" not in repr(cfg)
    assert "_explicit" not in config.schema()


# -- errors --------------------------------------------------------------------------
FILE_ERRORS = {
    "[optim]\nlrr = 1e-4": r"unknown key `lrr` in \[optim\].* Did you mean `lr`\?",
    "lr = 1e-4": r"unknown key `lr` in .* Did you mean `optim.lr`\?",
    "sed = 1": r"unknown key `sed` in .* Did you mean `seed`\?",
    "[optimm]\nlr = 1": r"unknown key `optimm` in .* Did you mean `optim`\?",
    "[loop]\nlr = 1": r"unknown key `lr` in \[loop\].* Did you mean `optim.lr`\?",
    '[loop]\nsteps = "ten"': r"`loop.steps` in .*: expected an integer; got 'ten'",
    "[loop]\nsteps = 1.5": r"`loop.steps` in .*: expected an integer; got 1.5",
    "[loop]\nsteps = true": r"`loop.steps` in .*: expected an integer; got True",
    "[loop]\nsteps = 'none'": r"`loop.steps` in .*: expected an integer",
    "[optim]\nlr = 'fast'": r"`optim.lr` in .*: expected a number; got 'fast'",
    "[model]\ntie_embeddings = 1": r"`model.tie_embeddings` .*expected true or false",
    "[model]\narch = 3": r"`model.arch` in .*: expected a string; got 3",
    "[loop]\nsteps = 0": r"`loop.steps` must be >= 1; got 0\.",
    "[optim]\nb1 = 2": r"`optim.b1` must be < 1; got 2.0\.",
    "[optim]\nlr = nan": r"`optim.lr` must be a finite number; got nan\.",
    "[optim]\nlr = inf": r"`optim.lr` must be a finite number; got inf\.",
    "[loop]\ntime_limit = '2h30'": r"`loop.time_limit` in .*'30' has no unit",
    "[optim]\nschedule = 'cosin'": r"`optim.schedule` must be one of .*; got 'cosin'\. "
    r"Did you mean `cosine`\?",
    "model = 3": r"`model` in .* must be a table \(a `\[model\]` section\); got 3",
    "[model.extra]\nx = 1": r"`model.extra` in .* is a table, but \[model\] has no",
    "[loop]\ntime_limit = 'soon'": r"`loop.time_limit` in .*: expected a duration",
    "[loop]\ntime_limit = true": r"`loop.time_limit` in .*: expected seconds or a",
    "[loop]\ntime_limit = -5": r"`loop.time_limit` must be >= 0; got -5.0\.",
    "[export]\nmax_shard_size = 'lots'": r"`export.max_shard_size` in .*: expected",
    "[export]\nmax_shard_size = -5": r"`export.max_shard_size` in .*: expected bytes",
}


@pytest.mark.parametrize("text, match", FILE_ERRORS.items())
def test_file_errors_name_the_key(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        config.load(write(tmp_path, text))


def test_errors_name_the_file_and_the_field_help(tmp_path):
    path = write(tmp_path, "[loop]\nsteps = 'ten'\n")
    with pytest.raises(ConfigError) as info:
        config.load(path)
    assert str(path) in str(info.value)
    assert FIELDS["loop.steps"].help in str(info.value)


def test_malformed_toml(tmp_path):
    path = write(tmp_path, "[optim\nlr = 1e-4\n")
    with pytest.raises(ConfigError, match=rf"^{path} is not valid TOML: "):
        config.load(path)


def test_unclosed_string(tmp_path):
    path = write(tmp_path, 'run_dir = "runs/x\n')
    with pytest.raises(ConfigError, match="is not valid TOML"):
        config.read_toml(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope.toml does not exist"):
        config.load(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match=r"is a directory; pass a TOML file"):
        config.load(tmp_path)


def test_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('run_dir = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        config.load(path)


OVERRIDE_ERRORS = {
    "optim.lr": r"--set takes `key=value`.*got 'optim.lr'",
    "=3": r"--set takes `key=value`",
    "optim.lrr=1": r"unknown key `lrr` in \[optim\] of --set.* Did you mean `lr`\?",
    "lr=1": r"unknown key `lr` in --set.* Did you mean `optim.lr`\?",
    "optimm.lr=1": r"unknown section `\[optimm\]` in --set.* Did you mean `optim`",
    "loop.steps=ten": r"`loop.steps` in --set: expected an integer; got 'ten'",
    "loop.steps=1.5": r"`loop.steps` in --set: expected an integer; got 1.5",
    "loop.steps=none": r"`loop.steps` in --set: expected an integer",
    "loop.steps=": r"`loop.steps` in --set: expected an integer",
    "optim.lr=fast": r"`optim.lr` in --set: expected a number; got 'fast'",
    "data.shuffle=maybe": r"`data.shuffle` in --set: expected true or false",
    "optim.b1=1.5": r"`optim.b1` must be < 1; got 1.5\.",
    "optim.name=adamww": r"`optim.name` must be one of .*Did you mean `adamw`\?",
    "loop.time_limit=2x": r"`loop.time_limit` in --set: expected a duration like",
    "loop.time_limit=-5m": r"`loop.time_limit` in --set: expected a duration like",
    "loop.time_limit=h": r"`loop.time_limit` in --set: expected a duration like",
    "loop.time_limit=nan": r"`loop.time_limit` in --set: expected a finite number",
    "loop.time_limit=inf": r"`loop.time_limit` in --set: expected a finite number",
    "optim.lr=inf": r"`optim.lr` must be a finite number; got inf\. Peak learning",
    "optim.lr=-inf": r"`optim.lr` must be a finite number; got -inf\.",
    "loop.time_limit=2h30": r"`loop.time_limit` in --set: .*'30' has no unit",
    "loop.time_limit=1.5.5m": r"`loop.time_limit` in --set: .*cannot read '1.5.5m'",
    "loop.time_limit=3s2h": r"`loop.time_limit` in --set: .*largest to smallest",
    "export.max_shard_size=lots": r"`export.max_shard_size` in --set: expected bytes",
    "model.remat_save=[layer_input]": r"`model.remat_save` in --set: expected a TOML",
    "model.remat_save=[1]": r"`model.remat_save` in --set: expected a list of names",
}


@pytest.mark.parametrize("override, match", OVERRIDE_ERRORS.items())
def test_override_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        config.load(None, [override])


@pytest.mark.parametrize(
    "text",
    ["", "   ", "2x", "1h-5m", "m", "1e", "1h30x", "2h30", "1.5.5m", "3s2h", "1m1m"]
    + ["inf", "nan", "1h30.5", float("inf")],
)
def test_bad_durations(text):
    with pytest.raises(ValueError, match="duration"):
        config.parse_duration(text)


# -- checks across fields ----------------------------------------------------------
INVALID = [
    (
        ["model.init_from=/hf", "model.hidden_size=64"],
        r"`model.hidden_size` cannot be set together with `model.init_from` \('/hf'\)",
    ),
    (
        ["model.init_from=/hf", "model.arch=gpt2", "model.num_layers=2"],
        r"`model.arch`, `model.num_layers` cannot be set together with `model.init",
    ),
    (
        ["model.arch=gpt2", "model.num_kv_heads=4"],
        r"`model.num_kv_heads` applies to the architectures .*model.arch is 'gpt2'",
    ),
    (
        ["model.arch=gpt2", "model.rope_theta=5e5"],
        r"`model.rope_theta` applies to the architectures",
    ),
    (
        ["model.hidden_size=100", "model.num_heads=3"],
        r"`model.hidden_size` \(100\) must be divisible by `model.num_heads` \(3\)",
    ),
    (
        ["model.num_heads=4", "model.num_kv_heads=3"],
        r"`model.num_heads` \(4\) must be a multiple of `model.num_kv_heads` \(3\)",
    ),
    (
        ["data.seq_len=256", "model.max_seq_len=128"],
        r"`data.seq_len` \(256\) exceeds `model.max_seq_len` \(128\)",
    ),
    (["mesh.fsdp=-1"], r"`mesh.data` and `mesh.fsdp` are both -1"),
    (
        ["mesh.data=2", "mesh.fsdp=-1", "mesh.tensor=-1"],
        r"`mesh.fsdp` and `mesh.tensor` are both -1",
    ),
    (["mesh.tensor=0"], r"`mesh.tensor` must be a device count >= 1"),
    (
        ["data.batch_size=16", "optim.accumulate=3"],
        r"`data.batch_size` \(16\) must be divisible by `optim.accumulate` \(3\)",
    ),
    (
        ["data.eval=none", "loop.eval_every=50"],
        r"`loop.eval_every` is set but `data.eval` is 'none'",
    ),
    (
        ["checkpoint.best=loss"],
        r"`checkpoint.best` \('loss'\) must be an evaluation metric",
    ),
    (
        ["checkpoint.best=eval/loss", "checkpoint.every=150"],
        r"`checkpoint.every` \(150\) a positive multiple of `loop.eval_every` \(100\)",
    ),
    (
        ["checkpoint.best=eval/loss", "loop.eval_every=0"],
        r"`checkpoint.best` ranks checkpoints .*`loop.eval_every` \(0\)",
    ),
    (
        ["checkpoint.best=eval/loss", "checkpoint.every=0"],
        r"`checkpoint.best` ranks checkpoints .*`checkpoint.every` \(0\)",
    ),
    (
        ["checkpoint.best=eval/los", "checkpoint.every=100"],
        r"`checkpoint.best` \('eval/los'\) is not a metric this run produces: its "
        r"evaluations report 'eval/loss', 'eval/accuracy'.*Did you mean `eval/loss`",
    ),
    (
        ["checkpoint.best=eval/loss", "checkpoint.every=100", "data.eval=none"],
        r"`checkpoint.best` \('eval/loss'\) .* but the run has no eval data",
    ),
    (
        ["checkpoint.best=eval/loss", "checkpoint.every=100", "data.train=t.txt"],
        r"no eval data \(data.eval = 'auto' with data.train = 't.txt'\)",
    ),
    (
        ["export.ema=true"],
        r"`export.ema` exports the EMA weights, but `loop.ema` is unset",
    ),
    (
        ["export.every=10", "export.hf="],
        r"`export.every` is set but `export.hf` is empty",
    ),
]


@pytest.mark.parametrize("overrides, match", INVALID)
def test_validate_names_the_keys(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config.load(None, overrides)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.init_from=/hf", "model.remat=full", "model.param_dtype=bfloat16"],
        ["model.init_from=/hf", "model.hidden_size=128"],  # restating a default
        ["model.arch=gpt2", "model.num_heads=8", "model.hidden_size=64"],
        ["model.arch=gpt2"],
        ["model.arch=gpt2", "model.tie_embeddings=false"],  # an untied GPT-2 head
        ["model.num_heads=3", "model.head_dim=16", "model.num_kv_heads=1"],
        ["mesh.data=2", "mesh.fsdp=-1"],
        ["checkpoint.best=eval/loss", "checkpoint.every=200", "loop.eval_every=50"],
        ["checkpoint.best=eval/accuracy", "checkpoint.best_mode=max"],
        ["checkpoint.best=eval/loss", "data.train=t.txt", "data.eval=e.txt"],
        ["export.ema=true", "loop.ema=0.999"],
        ["export.hf=", "export.every=0"],
        ["data.eval=none", "loop.eval_every=0"],
        ["data.seq_len=64", "model.max_seq_len=64"],
    ],
)
def test_validate_accepts(overrides):
    config.load(None, overrides)


def test_validate_reads_explicit_keys_only():
    # A Llama-only key at a non-default value is fine when nothing set it
    # explicitly (e.g. a model section resolved from an HF config.json).
    model = dataclasses.replace(Config().model, arch="gpt2", num_kv_heads=4)
    config.validate(dataclasses.replace(Config(), model=model))


# -- durations -----------------------------------------------------------------------
@PROPERTY
@given(st.integers(0, 1000), st.integers(0, 59), st.integers(0, 59))
def test_parse_duration_hms(h, m, s):
    assert config.parse_duration(f"{h}h{m}m{s}s") == h * 3600 + m * 60 + s
    assert config.parse_duration(f" {h}h {m}m {s}s ") == h * 3600 + m * 60 + s


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("90", 90.0),
        ("45s", 45.0),
        ("10m", 600.0),
        ("10min", 600.0),
        ("2h30m", 9000.0),
        ("1.5h", 5400.0),
        ("1d", 86400.0),
        ("500ms", 0.5),
        ("1_000s", 1000.0),
        ("2H", 7200.0),
        ("1h30m15s", 5415.0),
        ("1.5m", 90.0),
        (30, 30.0),
        (2.5, 2.5),
    ],
)
def test_parse_duration_examples(text, seconds):
    assert config.parse_duration(text) == seconds


# -- the generated reference ---------------------------------------------------------
def test_reference_doc_is_up_to_date():
    expected = reference_markdown()
    actual = REFERENCE.read_text(encoding="utf-8") if REFERENCE.exists() else ""
    assert actual == expected, (
        f"{REFERENCE} is out of date with the config schema or the CLI; "
        f"regenerate it with `{REGENERATE}`."
    )


def test_reference_names_every_key_and_command():
    text = reference_markdown()
    for key in FIELDS:
        assert f"| `{key}` |" in text, key
    group = typer.main.get_command(app)
    commands = getattr(group, "commands", {})
    assert commands
    leaves = []
    for name, command in commands.items():
        subcommands = getattr(command, "commands", None)  # a group: `eqtrain data`
        if subcommands:
            leaves += [(f"{name} {sub}", c) for sub, c in subcommands.items()]
        else:
            leaves.append((name, command))
    assert any(" " in name for name, _ in leaves)  # `eqtrain data prepare`
    for name, command in leaves:
        assert f"### `eqtrain {name}`" in text, name
        for param in command.params:
            if param.param_type_name == "option" and not param.hidden:
                for opt in param.opts:
                    assert f"`{opt}`" in text, (name, opt)


def test_reference_ignores_the_terminal(monkeypatch):
    expected = reference_markdown()
    monkeypatch.setenv("COLUMNS", "40")
    monkeypatch.setenv("TERM", "dumb")
    assert reference_markdown() == expected


# -- defaults that depend on other keys ----------------------------------------------
@given(steps=st.integers(1, 10**7), lr=st.floats(1e-8, 10.0))
@settings(derandomize=True, deadline=None, max_examples=20)
def test_optim_resolved_declares_the_dependent_defaults(steps, lr):
    optim = dataclasses.replace(Config().optim, lr=lr)
    resolved = optim.resolved(steps)
    assert resolved.warmup_steps == steps // 20  # 5% of the steps, rounded down
    assert resolved.final_lr == lr / 10
    constant = dataclasses.replace(optim, schedule="constant").resolved(steps)
    assert constant.final_lr == 0.0
    given = dataclasses.replace(optim, warmup_steps=3, final_lr=1e-5).resolved(steps)
    assert (given.warmup_steps, given.final_lr) == (3, 1e-5)
    assert optim.warmup_steps is None and optim.final_lr is None  # a new section
    fields = config.schema()
    assert "5% of the steps" in fields["optim.warmup_steps"].help
    assert "lr / 10" in fields["optim.final_lr"].help
