"""From a `Config` to the pieces of a run: tokenizer, model config, data rows,
optimizer, loss and state builders. Everything that can be wrong with the config
or its files fails here, before any compilation."""

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.random as jr
import numpy as np

from .. import (
    data as data_lib,
    hf,
    lora as lora_lib,
    models,
    optim,
    preference,
    sharding,
)
from .._errors import ConfigError
from .._files import set_default_mode
from .._state import TrainState
from ..config import (
    AUTO_LOSS_CHUNK,
    LOSS_CHUNK_MIN_VOCAB,
    PREFERENCE_TASKS,
    Config,
    eval_source,
    explicit,
    lora_on,
    parse_sources,
    reference_mode,
)
from ..losses import causal_lm_loss, causal_lm_loss_fn, chunked_causal_lm_loss_fn
from . import _grpo


Rows = dict[str, np.ndarray]


@dataclasses.dataclass
class Job:
    """The pieces of a run, built from its config (no arrays allocated yet).

    Attributes:
        config: the resolved config (architecture fields filled in from
            `model.init_from` when it is set).
        tokenizer: a `ByteTokenizer` or `HFTokenizer`.
        model_config: the model's config (`LlamaConfig`, `GPT2Config`).
        model_type: the Hugging Face `model_type` an export writes.
        optimizer: the optax transformation from the `optim` section.
        loss_fn: the loss the steps differentiate.
        lora: the LoRA adapters the run trains (`[lora]`, or `model.adapter_from`'s
            adapter_config.json), or None: every weight trains.
        reference: a DPO/IPO run's reference model (`copy`, `adapters_off` or
            `precomputed`; `task.reference` resolved), else None.
        template: the chat template of post-training data (None for plain text).
        notes: what the data pipelines skipped, said at the start of the run.
        vocab_size: the real vocabulary when the model's embedding and head are
            padded to split over the tensor-parallel axis (`model_config` has the
            padded size), else None.
        loss_chunk: tokens per chunk of the chunked head + loss
            (`model.loss_chunk` resolved), 0: the plain loss over full logits.
    """

    config: Config
    tokenizer: Any
    model_config: Any
    model_type: str
    optimizer: Any
    loss_fn: Callable[..., Any] = causal_lm_loss
    lora: lora_lib.LoRA | None = None
    reference: str | None = None
    template: Any = None
    notes: list[str] = dataclasses.field(default_factory=list)
    vocab_size: int | None = None
    loss_chunk: int = 0
    _base_hash: dict[str, Any] | None = dataclasses.field(default=None, repr=False)
    prompts: Any = None  # task.kind = "grpo": the prompts' host side (_grpo.Prompts)
    rollout: Any = None  # task.kind = "grpo": its `rollout.Rollout`, once built

    def head_dropout(self) -> bool:
        """Whether the run's LoRA puts an adapter with dropout on the output head
        (which a chunked head, one matrix, cannot apply)."""
        if self.lora is None or self.lora.dropout <= 0:
            return False
        model = self.policy(self.abstract_state().model)
        return isinstance(getattr(model, "lm_head", None), models.LoRALinear)

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)

    @property
    def family(self) -> models.Family:
        """The model family's registry entry (`eqtrain.models.family`)."""
        return models.family(self.model_type)

    def base_model(self, mesh: Any = None) -> Any:
        """The base model: `model.init_from`'s weights, or a random init (with a
        padded vocabulary, initialised at the real size and zero-padded, so the
        run starts where an unpadded one would). With `mesh`, `init_from`'s
        tensors are read straight into their shardings on it, one device block
        at a time (host memory: about one tensor, not the model)."""
        m = self.config.model
        if m.init_from is not None:
            shardings = None
            if mesh is not None and self.vocab_size is None:
                shardings = _model_shardings(mesh)
            model, _ = hf.load(m.init_from, dtype=m.param_dtype, shardings=shardings)
            options = models.runtime_options(m)
            model = model.with_options(**options, **models.moe_options(m, model.config))
        else:
            config = self.model_config
            if self.vocab_size is not None:
                config = dataclasses.replace(config, vocab_size=self.vocab_size)
            model = self.family.model(config, jr.key(self.config.seed))
        return models.resize_vocab(model, self.model_config.vocab_size)

    def exported(self, model: Any) -> Any:
        """What an export writes of a state's model (or its trainable filter): the
        policy (`policy`), with a padded vocabulary cut back to the real one."""
        model = self.policy(model)
        if self.vocab_size is None:
            return model
        return models.resize_vocab(model, self.vocab_size)

    def with_adapters(self, model: Any) -> Any:
        """`model` with the run's LoRA adapters (`model.adapter_from`'s values, or
        new ones: `lora_b` zero); unchanged without LoRA."""
        if self.lora is None:
            return model
        adapter = self.config.model.adapter_from
        if adapter is not None:
            return hf.load_adapter(model, adapter, model_type=self.model_type)
        key = jr.fold_in(jr.key(self.config.seed), ADAPTER_SEED)
        return lora_lib.apply(model, self.lora, key=key)

    def new_model(self, mesh: Any = None) -> Any:
        """The initial model: the base model with the run's adapters, if any
        (and with `task.reference = "copy"`, a frozen copy of it beside)."""
        return self._with_reference(self.with_adapters(self.base_model(mesh)))

    def _with_reference(self, model: Any) -> Any:
        if self.reference == "copy":
            return preference.with_reference(model)
        return model

    def trainable(self, model: Any) -> Any:
        """The trainable filter: everything, or with LoRA the adapters (and
        `lora.train_also`); a reference copy never trains."""
        if isinstance(model, preference.WithReference):
            return preference.reference_trainable(model, self.trainable(model.policy))
        if self.lora is None:
            return True
        return lora_lib.trainable(model, also=self.config.lora.train_also)

    @staticmethod
    def policy(model: Any) -> Any:
        """The trained model inside a state's model (what is exported): the
        policy of a `preference.WithReference`, else `model` itself."""
        if isinstance(model, preference.WithReference):
            return model.policy
        return model

    @property
    def tokens_per_row(self) -> int:
        """Tokens one training row feeds the model (a preference row is a pair)."""
        task = self.config.task
        if task.kind == "grpo":  # each prompt row samples a group of completions
            return self.config.data.seq_len * task.group_size
        pair = task.kind in PREFERENCE_TASKS
        return self.config.data.seq_len * (2 if pair else 1)

    def _state(self, model: Any, seed: int) -> TrainState:
        return TrainState.create(
            model,
            self.optimizer,
            key=seed,
            trainable=self.trainable(model),
            ema=self.config.loop.ema is not None,
        )

    def new_state(self, mesh: Any = None) -> TrainState:
        """The initial `TrainState` (allocates the model and optimizer state;
        with `mesh`, an HF base is read straight onto it, see `base_model`)."""
        return self._state(self.new_model(mesh), self.config.seed)

    def abstract_state(self) -> TrainState:
        """The state's structure, shapes and dtypes, without reading weights."""

        def init() -> TrainState:
            base = self.family.model(self.model_config, jr.key(0))
            return self._state(self._with_reference(self.with_adapters(base)), 0)

        return eqx.filter_eval_shape(init)

    def base_reference(self) -> dict[str, Any] | None:
        """What a LoRA run's checkpoints record of their frozen base (None without
        LoRA): `model.init_from`'s path and the sha256 of its safetensors, or for
        a random base its seed and the sha256 of its arrays."""
        if self.lora is None:
            return None
        init_from = self.config.model.init_from
        if init_from is not None:
            if not (Path(init_from) / "config.json").is_file():
                raise ConfigError(
                    f"this LoRA run's frozen base, model.init_from = {init_from!r}, "
                    "is gone (no config.json there): its checkpoints hold only the "
                    "adapters. Put the base back there, or pass its new place with "
                    "--set model.init_from=PATH (its content is checked)."
                )
            return self.init_from_hash()
        import hashlib

        digest = hashlib.sha256()
        for leaf in jax.tree.leaves(eqx.filter(self.base_model(), eqx.is_array)):
            digest.update(np.asarray(jax.device_get(leaf)).tobytes())
        return {"path": None, "seed": self.config.seed, "sha256": digest.hexdigest()}

    def init_from_hash(self) -> dict[str, Any]:
        """`hf.content_hash` of `model.init_from`, read once per job (the LoRA
        base reference and the precomputed reference's key both use it)."""
        if self._base_hash is None:
            self._base_hash = hf.content_hash(self.config.model.init_from)
        return self._base_hash

    def num_trainable(self) -> tuple[int, int]:
        """`(trainable, total)` parameter counts."""
        abstract = self.abstract_state()
        total = models.num_params(abstract.model)
        return models.num_params(abstract.params), total

    def flops_per_token(self) -> float:
        """The policy's training FLOPs per token (a reference forward, where the
        step runs one, is not counted: MFU counts the model being trained)."""
        seq_len = self.config.data.seq_len
        return self.family.flops_per_token(self.model_config, seq_len)


ADAPTER_SEED = 0x10A  # folded into the run's seed for the adapters' initial values


def build(config: Config, *, recorded: Path | None = None) -> Job:
    """The `Job` of `config`: reads the tokenizer and `model.init_from`'s
    config.json, checks that they agree, builds the optimizer, and checks the
    LoRA settings against the model (abstractly: nothing is allocated).

    `recorded`: a run's copy of `model.init_from`'s config and tokenizer files
    (`<run_dir>/init_from`, see `record_init_from`), read instead of the
    directory itself: an existing run's architecture is the one it was trained
    with, and the base directory may be gone (its weights are still needed to
    start a run, and by a LoRA run's frozen base)."""
    if recorded is not None and (
        config.model.init_from is None or not (recorded / "config.json").is_file()
    ):
        recorded = None
    source = config.model.init_from if recorded is None else str(recorded)
    tokenizer = make_tokenizer(config, source)
    config, model_config, model_type = _model_config(config, tokenizer, source)
    config = _optim_defaults(config)
    updates = config.loop.steps * (
        config.task.passes if config.task.kind == "grpo" else 1
    )
    opt_fields = dataclasses.asdict(config.optim.resolved(updates))
    opt_fields.pop("accumulate")
    optimizer = optim.build(**opt_fields, total_steps=updates)
    padded = _padded_vocab(config, model_config.vocab_size)
    real = None
    if padded != model_config.vocab_size:
        real = model_config.vocab_size
        model_config = dataclasses.replace(model_config, vocab_size=padded)
    job = Job(config, tokenizer, model_config, model_type, optimizer)
    job.vocab_size = real
    job.reference = reference_mode(config)
    if config.task.kind != "lm":
        job.template = _chat_template(config, source)
    if lora_on(config):
        job.lora = _lora_spec(config)
        try:
            job.abstract_state()  # targets, rank and train_also against the model
        except ConfigError as e:
            raise ConfigError(f"[lora]: {e}") from None
    chunk = loss_chunk(config, model_config.vocab_size, head_dropout=job.head_dropout())
    job.loss_fn = task_loss(config, job.reference, vocab_size=real, chunk=chunk)
    job.loss_chunk = chunk
    return job


def _optim_defaults(config: Config) -> Config:
    """`optim.weight_decay`'s default is AdamW's; `adam` takes no decoupled
    weight decay, so unless the key was set there it is 0 (and the run's
    config.toml says so)."""
    optim_ = config.optim
    if optim_.name != "adam" or "optim.weight_decay" in explicit(config):
        return config
    return dataclasses.replace(
        config, optim=dataclasses.replace(optim_, weight_decay=0.0)
    )


def _model_shardings(mesh: Any) -> Callable[[Any], Any]:
    """The shardings of a plain model's arrays on `mesh` (its partition rules),
    as `hf.load(shardings=)` takes them: a function of the abstract model."""

    def shardings(model: Any) -> Any:
        return sharding.state_shardings(model, mesh, sharding.rules_for(model, mesh))

    return shardings


def _padded_vocab(config: Config, vocab: int) -> int:
    """With tensor parallelism, `vocab` rounded up to a multiple of the tensor x
    FSDP size, so that the embedding and head split over both (the padded logits
    are masked out, and exports cut the rows off again); unchanged without
    tensor parallelism or when it already splits."""
    sizes = {"data": config.mesh.data, "fsdp": config.mesh.fsdp}
    sizes["tensor"] = config.mesh.tensor
    rest = [k for k, v in sizes.items() if v == -1]
    if rest:  # the devices the other axes leave
        known = math.prod(v for v in sizes.values() if v > 0)
        sizes[rest[0]] = max(1, jax.device_count() // known)
    if sizes["tensor"] <= 1:
        return vocab
    multiple = sizes["tensor"] * sizes["fsdp"]
    return -(-vocab // multiple) * multiple


def loss_chunk(config: Config, vocab: int, *, head_dropout: bool = False) -> int:
    """`model.loss_chunk` resolved for a model with `vocab` output ids: tokens per
    chunk of the chunked head + loss, or 0 for the plain loss. `auto` chunks from
    `LOSS_CHUNK_MIN_VOCAB` ids on (below it the logits are small, and the plain
    loss is faster) on runs without a sequence axis, unless `head_dropout` (a
    LoRA adapter with dropout on the head, which a chunked head cannot apply; an
    explicit chunk is an error)."""
    chunk = config.model.loss_chunk
    if chunk == "auto":
        # A sequence-split row would be gathered to be cut into token chunks.
        if head_dropout or vocab < LOSS_CHUNK_MIN_VOCAB or config.mesh.sequence > 1:
            return 0
        return AUTO_LOSS_CHUNK
    if chunk and head_dropout:
        raise ConfigError(
            f"model.loss_chunk = {chunk} computes the head as one matrix, which "
            f"cannot apply the LoRA dropout (lora.dropout = {config.lora.dropout}) "
            "of an adapter on `lm_head` (lora.targets). Set model.loss_chunk = 0, "
            "lora.dropout = 0, or leave lm_head out of lora.targets."
        )
    return int(chunk)


def task_loss(
    config: Config,
    reference: str | None,
    *,
    vocab_size: int | None = None,
    chunk: int = 0,
) -> Callable[..., Any]:
    """The loss of `task.kind`: next-token cross-entropy for lm and sft (whose
    rows mask out everything but completions), else the preference loss;
    `vocab_size`: a padded model's real vocabulary (its padded logits are
    masked); `chunk`: tokens per chunk of a chunked head + loss (0: the plain
    loss over full logits)."""
    t = config.task
    if t.kind == "grpo":
        return _grpo.loss(config, reference, vocab_size=vocab_size, chunk=chunk)
    if t.kind in ("lm", "sft"):
        if chunk:
            return chunked_causal_lm_loss_fn(chunk=chunk, vocab_size=vocab_size)
        if vocab_size is not None:
            return causal_lm_loss_fn(vocab_size=vocab_size)
        return causal_lm_loss
    try:
        return preference.preference_loss_fn(
            t.kind,
            reference=reference,
            beta=t.beta,
            label_smoothing=t.label_smoothing,
            orpo_lambda=t.orpo_lambda,
            gamma=t.simpo_gamma,
            vocab_size=vocab_size,
            chunk=chunk or None,
        )
    except ConfigError as e:
        raise ConfigError(f"[task]: {e}") from None


def _chat_template(config: Config, init_from: str | None) -> Any:
    """`data.chat_template` resolved: a `.jinja` file, the built-in template, or
    (`auto`) the tokenizer directory's template when it has one."""
    name = config.data.chat_template
    if name == "builtin":
        return data_lib.BuiltinChatTemplate()
    if name != "auto":
        path = Path(name)
        if not path.is_file() or path.suffix != ".jinja":
            raise ConfigError(
                f"`data.chat_template` names {name!r}, which is not a .jinja file. "
                "Pass a .jinja file, 'builtin' or 'auto'."
            )
        return _template_from(path, "data.chat_template")
    tokenizer = config.data.tokenizer
    if tokenizer == "auto":
        tokenizer = init_from or "byte"
    if tokenizer == "byte":
        return data_lib.BuiltinChatTemplate()
    return _template_from(Path(tokenizer), "data.tokenizer")


def chat_template_of(config: Config) -> Any:
    """The chat template `data.chat_template` names for `config` (also for a
    run that trains on plain text: what its conversations would be made of)."""
    return _chat_template(config, config.model.init_from)


def _template_from(path: Path, key: str) -> Any:
    try:
        return data_lib.chat_template(path)
    except data_lib.DataError as e:
        raise ConfigError(f"the chat template of `{key}` ({path}): {e}") from None


def _lora_spec(config: Config) -> lora_lib.LoRA:
    adapter = config.model.adapter_from
    if adapter is not None:
        try:
            spec = hf.adapter_spec(adapter)
        except (hf.HFFormatError, hf.HFFileNotFoundError) as e:
            raise ConfigError(f"`model.adapter_from` ({adapter}): {e}") from None
        if config.lora.rank not in (0, spec.rank):
            raise ConfigError(
                f"`lora.rank` is {config.lora.rank} but the adapter in "
                f"`model.adapter_from` ({adapter}) has rank {spec.rank}; unset "
                "lora.rank (the adapter decides it)."
            )
        return spec
    c = config.lora
    try:
        return lora_lib.LoRA(
            rank=c.rank,
            alpha=c.alpha,
            dropout=c.dropout,
            targets=c.targets,
            rslora=c.rslora,
        )
    except ConfigError as e:
        raise ConfigError(f"[lora]: {e}") from None


# -- tokenizer ------------------------------------------------------------------
def make_tokenizer(config: Config, init_from: str | None = None) -> Any:
    """The tokenizer `data.tokenizer` names (`auto`: the one in `init_from`, by
    default `model.init_from`)."""
    name = config.data.tokenizer
    if name == "auto":
        init_from = init_from or config.model.init_from
        name = hf.tokenizer_for(init_from) if init_from else "byte"
    if name == "byte":
        return data_lib.ByteTokenizer()
    path = Path(name)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(
            f"`data.tokenizer` names {name!r}, but {path} does not exist. Pass "
            "'byte', a tokenizer.json file, or a directory holding one."
        )
    return data_lib.HFTokenizer.from_file(path)


# -- model ------------------------------------------------------------------------
def _model_config(
    config: Config, tokenizer: Any, source: str | None
) -> tuple[Config, Any, str]:
    m = config.model
    if m.init_from is not None:
        model_config, hf_type = hf.load_config(source, dtype=m.param_dtype)
        # the [model] runtime options, as `base_model` applies them to the weights
        model_config = dataclasses.replace(
            model_config,
            **models.runtime_options(m),
            **models.moe_options(m, model_config),
        )
        model_type = hf.infer_model_type(model_config, hf_type)
        config = dataclasses.replace(
            config, model=model_section(model_config, model_type, base=m)
        )
        config = _fit_seq_len(config)
        _check_vocab(config, tokenizer, model_config.vocab_size, "model.init_from")
        return config, model_config, model_type
    vocab = m.vocab_size if m.vocab_size is not None else tokenizer.vocab_size
    _check_vocab(config, tokenizer, vocab, "model.vocab_size")
    seq = m.max_seq_len or config.data.seq_len
    given = {k.split(".", 1)[1] for k in explicit(config) if k.startswith("model.")}
    family = models.family(m.arch)
    try:
        model_config = family.from_section(
            m, vocab_size=vocab, max_seq_len=seq, given=given
        )
        # A family's own name lets the config pick the architecture: `llama` with
        # a sliding window is exported as Mistral, which has one.
        model_type = hf.infer_model_type(
            model_config, None if m.arch == family.name else m.arch
        )
    except ConfigError as e:
        if m.arch == family.name and "cannot express" in str(e):
            what = str(e).split(" has ", 1)[-1].split(", which")[0]
            raise ConfigError(
                f"no Hugging Face architecture expresses this [model] section (it "
                f"has {what}); set model.arch to the architecture you mean (the "
                "model types of docs/models.md, 'Decoder families')."
            ) from None
        raise ConfigError(f"the [model] section is inconsistent: {e}") from None
    return config, model_config, model_type


def _fit_seq_len(config: Config) -> Config:
    """Rows no longer than the loaded model's positions: the default `data.seq_len`
    shrinks to fit; an explicit one that does not fit is an error."""
    limit, seq = config.model.max_seq_len, config.data.seq_len
    if limit is None or seq <= limit:
        return config
    if "data.seq_len" in explicit(config):
        raise ConfigError(
            f"`data.seq_len` ({seq}) exceeds the positions of `model.init_from`'s "
            f"model ({limit}); use data.seq_len <= {limit}."
        )
    data = dataclasses.replace(config.data, seq_len=limit)
    return dataclasses.replace(config, data=data)


def model_section(model_config: Any, model_type: str, *, base: Any) -> Any:
    """The `[model]` section describing `model_config` (an HF model's), keeping
    `base`'s runtime options and `init_from`."""
    fields = models.family(model_type).to_section(model_config)
    return dataclasses.replace(base, arch=model_type, **fields)


def _check_vocab(config: Config, tokenizer: Any, vocab: int, source: str) -> None:
    if tokenizer.vocab_size > vocab:
        raise ConfigError(
            f"the tokenizer ({config.data.tokenizer!r}: {tokenizer.vocab_size} ids) "
            f"does not fit the model's vocabulary of {vocab} ({source}): token ids "
            "past the embedding table would be silently wrong. Use the model's own "
            "tokenizer (data.tokenizer) or a model with a large enough vocabulary."
        )


# -- data ---------------------------------------------------------------------------
def store(job: Job, source: str, split: str, key: str) -> data_lib.Store:
    """The tokenized store of the text source `source` (the config key `key`):
    opened at once when it was prepared before, else prepared now (in parallel,
    with a progress line). `stdlib` is the built-in corpus's `split`."""
    config = job.config
    if source == "stdlib":
        source = "stdlib" if split == "train" else "stdlib:eval"
    elif not Path(source).exists():
        raise ConfigError(
            f"`{key}` names {source!r}, which does not exist. Pass 'stdlib', a "
            "directory of text files or a .txt/.json/.jsonl/.parquet/.csv file "
            "(also .gz or .zst)."
        )
    workers = config.data.workers
    cache = config.data.cache
    try:
        return data_lib.prepare(
            source,
            job.tokenizer,
            cache_dir=None if cache == "auto" else cache,
            workers=None if workers == "auto" else workers,
            text_column=config.data.text_column,
            pattern=config.data.pattern,
        )
    except data_lib.DataError as e:
        raise ConfigError(f"`{key}` ({source}): {e}") from None


def check_sources(config: Config) -> None:
    """Every data source the run will read exists (`ConfigError` naming the key
    otherwise), said before any of them is read or tokenized."""
    lm = config.task.kind == "lm"
    keys = [(key, path) for _, path, _, key in text_sources(config)]
    source = eval_source(config)
    if source != "none" and (config.loop.eval_every or config.loop.eval_at_end):
        keys.append(("data.eval", source))
    wanted = (
        "'stdlib', a directory of text files or a .txt/.json/.jsonl/.parquet/.csv "
        "file (also .gz or .zst)"
        if lm
        else f"a {'/'.join(_RECORD_FILES)} file of records"
    )
    for key, path in keys:
        if path != "stdlib" and not Path(path).exists():
            raise ConfigError(
                f"`{key}` names {path!r}, which does not exist. Pass {wanted}."
            )


def text_sources(config: Config) -> list[tuple[str, str, float, str]]:
    """The training text sources: `(name, path, weight, key)` for each entry of
    `data.sources`, or the one `data.train`."""
    entries = parse_sources(config.data.sources)
    if not entries:
        return [("train", config.data.train, 1.0, "data.train")]
    out, seen = [], set()
    for i, (path, weight, name) in enumerate(entries):
        name = name or _source_name(path)
        while name in seen:
            name = f"{name}_{i}"
        seen.add(name)
        out.append((name, path, weight, f"data.sources[{i}]"))
    return out


def _source_name(path: str) -> str:
    """A metric-friendly name of a source: its file or directory name, without
    suffixes."""
    name = Path(path.rstrip("/")).name or path
    return name.split(".", 1)[0] or name


def num_rows(rows: Any) -> int:
    """Rows (or preference pairs) in `rows` (a dict of arrays or a row source)."""
    if hasattr(rows, "num_rows"):
        return int(rows.num_rows)
    return len(next(iter(rows.values())))


def first_rows(rows: Any, n: int) -> Rows:
    """The first `n` rows of `rows` as a dict of arrays."""
    if hasattr(rows, "take"):
        return rows.take(np.arange(n))
    return {k: v[:n] for k, v in rows.items()}


def train_rows(job: Job) -> Any:
    """The training rows of `data.train` (`tokens`, `targets`, `loss_mask`, ...;
    pairs for preference tasks): for task.kind = lm a row source over the
    tokenized stores (a `Mixture` with `data.sources`), else a dict of arrays.
    Fewer than one batch of them is an error saying how many there are."""
    config = job.config
    if config.task.kind == "lm":
        seq_len = config.data.seq_len
        sources = text_sources(config)
        try:
            parts = [
                store(job, path, "train", key).lm_rows(seq_len)
                for _, path, _, key in sources
            ]
        except data_lib.DataError as e:
            raise ConfigError(f"the training data: {e}") from None
        if len(parts) == 1 and not config.data.sources:
            rows = parts[0]
        else:
            rows = data_lib.Mixture(
                parts, [w for _, _, w, _ in sources], names=[n for n, *_ in sources]
            )
    elif config.task.kind == "grpo":
        rows = _grpo.rows(job, config.data.train, "data.train")
    else:
        rows = post_rows(job, config.data.train, "data.train")
    n = num_rows(rows)
    if n < config.data.batch_size:
        what = "pairs" if "chosen_tokens" in first_rows(rows, 1) else "rows"
        # the skip report explains a small count (e.g. a template's refusals)
        skipped = " ".join(n for n in job.notes if n.startswith("data.train "))
        raise ConfigError(
            f"the training data has {n} {what} of {config.data.seq_len} tokens, "
            f"fewer than one batch (`data.batch_size` = {config.data.batch_size}). "
            + (f"{skipped.rstrip('.')}. " if skipped else "")
            + "Lower data.batch_size or data.seq_len, or add data."
        )
    return rows


def post_rows(job: Job, source: str, key: str) -> Rows:
    """The SFT or preference rows of the file `source` (the config key `key`);
    skipped records are noted in `job.notes`."""
    config = job.config
    path = Path(source)
    if not path.is_file() or path.suffix.lower() not in _RECORD_FILES:
        what = "does not exist" if not path.exists() else "is not such a file"
        raise ConfigError(
            f"`{key}` names {source!r}, which {what}: task.kind = "
            f"{config.task.kind!r} reads records from a "
            f"{'/'.join(_RECORD_FILES)} file."
        )

    def build() -> tuple[Rows, dict[str, Any]]:
        rows, report = _post_rows(job, path, key, source)
        return rows, dataclasses.asdict(report)

    cache = config.data.cache
    template = job.template
    identity = {
        "kind": "post",
        "source": data_lib.fingerprint(path),
        "tokenizer": data_lib.tokenizer_identity(job.tokenizer),
        "template": [
            type(template).__name__,
            getattr(template, "source", None),
            getattr(template, "special_tokens", None),
        ],
        "eqtrain": _version(),  # the rows follow eqtrain's pipelines
        "settings": [
            config.task.kind,
            config.data.format,
            config.data.seq_len,
            config.data.max_prompt_len,
            config.data.pack,
        ],
    }
    try:
        rows, fields = data_lib.cached_rows(
            identity, build, cache_dir=None if cache == "auto" else cache
        )
    except data_lib.DataError as e:
        raise ConfigError(f"`{key}` ({source}): {e}") from None
    report = data_lib.SkipReport(**fields)
    if report.skipped:
        note = f"{key} ({path.name}): {report}"
        if report.skipped * 5 > report.total:  # e.g. a seq_len too short for the data
            top = max(report.reasons, key=report.reasons.__getitem__)
            check = (
                "the data against data.chat_template"
                if "chat template" in top
                else "data.seq_len and data.max_prompt_len"
            )
            note += (
                f". That is {report.skipped / report.total:.0%} of the data: check "
                f"{check}."
            )
        job.notes.append(note)
    return rows


def _version() -> str:
    import eqtrain

    return eqtrain.__version__


def _post_rows(
    job: Job, path: Path, key: str, source: str
) -> tuple[Rows, data_lib.SkipReport]:
    """The rows and skip report of the record file `path` (made in memory)."""
    config = job.config
    try:
        records = data_lib.from_files(path)
        fmt = config.data.format
        if fmt == "auto":  # the columns say
            fmt = data_lib.infer_format(records)
        else:
            _check_columns(records, fmt, key, source)
        kind = config.task.kind
        wanted = ("preference",) if kind in PREFERENCE_TASKS else _SFT_FORMATS
        if fmt not in wanted:
            raise ConfigError(
                f"`{key}` ({source}) holds {fmt!r} data (from its columns), but "
                f"task.kind = {kind!r} trains on {' or '.join(wanted)} data. Use "
                "another file, or set data.format / task.kind."
            )
        settings = dict(
            seq_len=config.data.seq_len,
            template=job.template,
            max_prompt_len=config.data.max_prompt_len,
        )
        if fmt == "preference":
            rows, report = data_lib.preference_rows(records, job.tokenizer, **settings)
        else:
            rows, report = data_lib.sft_rows(
                records, job.tokenizer, format=fmt, pack=config.data.pack, **settings
            )
    except data_lib.DataError as e:
        raise ConfigError(f"`{key}` ({source}): {e}") from None
    return rows, report


_RECORD_FILES = (".jsonl", ".json", ".parquet", ".csv")
_COLUMNS = {
    "chat": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("chosen", "rejected"),
}


def _check_columns(records: Any, fmt: str, key: str, source: str) -> None:
    """An explicit `data.format` whose columns the file lacks is a config error
    (not every row skipped as "missing")."""
    have = list(getattr(records, "column_names", []) or [])
    missing = [c for c in _COLUMNS.get(fmt, ()) if c not in have]
    if missing:
        raise ConfigError(
            f"data.format = {fmt!r} reads the column(s) {list(_COLUMNS[fmt])}, but "
            f"`{key}` ({source}) has {have}; it holds "
            f"{data_lib.infer_format(records)!r} data. Set data.format to match "
            "(or `auto`), or use another file."
        )


_SFT_FORMATS = ("chat", "prompt_completion")


def eval_rows(job: Job) -> Rows | None:
    """The evaluation rows of `data.eval` (at most `data.eval_rows`), or None."""
    config = job.config
    source = config.data.eval
    text = config.task.kind == "lm"
    if source == "auto":
        source = "stdlib" if config.data.train == "stdlib" and text else "none"
    if source == "none" or config.loop.eval_every == 0 and not config.loop.eval_at_end:
        return None
    if text:
        try:
            rows = store(job, source, "eval", "data.eval").lm_rows(config.data.seq_len)
        except data_lib.DataError as e:
            raise ConfigError(f"`data.eval` ({source}): {e}") from None
    else:
        rows = post_rows(job, source, "data.eval")
    n = min(config.data.eval_rows, num_rows(rows))
    n -= n % min(config.data.batch_size, n)  # whole batches: one compiled shape
    return first_rows(rows, n)


def eval_batch_size(rows: Rows, config: Config) -> int:
    """The eval batch: `data.batch_size`, or all rows when there are fewer."""
    return min(config.data.batch_size, num_rows(rows))


# -- a run's record of model.init_from ------------------------------------------------
RECORD = "init_from"
"""`<run_dir>/init_from/`: the config and tokenizer files of `model.init_from`
(no weights), so that the run's architecture and tokenizer never depend on that
directory staying where it was."""
RECORD_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def record_init_from(config: Config, run_dir: Path) -> dict[str, Any] | None:
    """Copy `model.init_from`'s config and tokenizer files into
    `<run_dir>/init_from/` (replacing an older copy whole, atomically) and
    return the manifest entry of the architecture (its config.json); None
    without `init_from`."""
    import json
    import os
    import shutil
    import tempfile

    init_from = config.model.init_from
    if init_from is None:
        return None
    source = Path(init_from)
    target = run_dir / RECORD
    tmp = Path(tempfile.mkdtemp(prefix=".init_from-", dir=run_dir))
    try:
        set_default_mode(tmp)  # mkdtemp's 0700 is for secrets
        for name in RECORD_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)
        old = run_dir / ".init_from.old"
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    with open(target / "config.json", encoding="utf-8") as f:
        return {"path": str(source.resolve()), "config": json.load(f)}


def recorded_init_from(run_dir: Path, manifest: dict[str, Any] | None) -> Path | None:
    """A run's record of `model.init_from` (`<run_dir>/init_from`), or, for a
    checkpoint without its run directory, one made from its manifest's
    architecture entry (config.json only) in a temporary directory; None."""
    import json
    import tempfile

    if (run_dir / RECORD / "config.json").is_file():
        return run_dir / RECORD
    entry = (manifest or {}).get(RECORD)
    if not entry or "config" not in entry:
        return None
    tmp = Path(tempfile.mkdtemp(prefix="eqtrain-init_from-"))
    (tmp / "config.json").write_text(json.dumps(entry["config"]), encoding="utf-8")
    return tmp
