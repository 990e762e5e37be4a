"""From a `Config` to the pieces of a run: tokenizer, model config, data rows,
optimizer, loss and state builders. Everything that can be wrong with the config
or its files fails here, before any compilation."""

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.random as jr
import numpy as np

from .. import data as data_lib, hf, lora as lora_lib, models, optim
from .._errors import ConfigError
from .._state import TrainState
from ..config import Config, explicit, lora_on
from ..losses import causal_lm_loss


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
    """

    config: Config
    tokenizer: Any
    model_config: Any
    model_type: str
    optimizer: Any
    loss_fn: Callable[..., Any] = causal_lm_loss
    lora: lora_lib.LoRA | None = None

    @property
    def run_dir(self) -> Path:
        return Path(self.config.run_dir)

    @property
    def family(self) -> models.Family:
        """The model family's registry entry (`eqtrain.models.family`)."""
        return models.family(self.model_type)

    def base_model(self) -> Any:
        """The base model: `model.init_from`'s weights, or a random init."""
        m = self.config.model
        if m.init_from is not None:
            model, _ = hf.load(m.init_from, dtype=m.param_dtype)
            return model.with_options(remat=m.remat, scan_layers=m.scan_layers)
        return self.family.model(self.model_config, jr.key(self.config.seed))

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

    def new_model(self) -> Any:
        """The initial model: the base model with the run's adapters, if any."""
        return self.with_adapters(self.base_model())

    def trainable(self, model: Any) -> Any:
        """The trainable filter: everything, or with LoRA the adapters (and
        `lora.train_also`)."""
        if self.lora is None:
            return True
        return lora_lib.trainable(model, also=self.config.lora.train_also)

    def _state(self, model: Any, seed: int) -> TrainState:
        return TrainState.create(
            model,
            self.optimizer,
            key=seed,
            trainable=self.trainable(model),
            ema=self.config.loop.ema is not None,
        )

    def new_state(self) -> TrainState:
        """The initial `TrainState` (allocates the model and optimizer state)."""
        return self._state(self.new_model(), self.config.seed)

    def abstract_state(self) -> TrainState:
        """The state's structure, shapes and dtypes, without reading weights."""

        def init() -> TrainState:
            base = self.family.model(self.model_config, jr.key(0))
            return self._state(self.with_adapters(base), 0)

        return eqx.filter_eval_shape(init)

    def base_reference(self) -> dict[str, Any] | None:
        """What a LoRA run's checkpoints record of their frozen base (None without
        LoRA): `model.init_from`'s path and the sha256 of its safetensors, or for
        a random base its seed and the sha256 of its arrays."""
        if self.lora is None:
            return None
        init_from = self.config.model.init_from
        if init_from is not None:
            return hf.content_hash(init_from)
        import hashlib

        digest = hashlib.sha256()
        for leaf in jax.tree.leaves(eqx.filter(self.base_model(), eqx.is_array)):
            digest.update(np.asarray(jax.device_get(leaf)).tobytes())
        return {"path": None, "seed": self.config.seed, "sha256": digest.hexdigest()}

    def num_trainable(self) -> tuple[int, int]:
        """`(trainable, total)` parameter counts."""
        abstract = self.abstract_state()
        total = models.num_params(abstract.model)
        return models.num_params(abstract.params), total

    def flops_per_token(self) -> float:
        seq_len = self.config.data.seq_len
        return self.family.flops_per_token(self.model_config, seq_len)


ADAPTER_SEED = 0x10A  # folded into the run's seed for the adapters' initial values


def build(config: Config) -> Job:
    """The `Job` of `config`: reads the tokenizer and `model.init_from`'s
    config.json, checks that they agree, builds the optimizer, and checks the
    LoRA settings against the model (abstractly: nothing is allocated)."""
    tokenizer = make_tokenizer(config)
    config, model_config, model_type = _model_config(config, tokenizer)
    opt_fields = dataclasses.asdict(config.optim.resolved(config.loop.steps))
    opt_fields.pop("accumulate")
    optimizer = optim.build(**opt_fields, total_steps=config.loop.steps)
    job = Job(config, tokenizer, model_config, model_type, optimizer)
    if lora_on(config):
        job.lora = _lora_spec(config)
        try:
            job.abstract_state()  # targets, rank and train_also against the model
        except ConfigError as e:
            raise ConfigError(f"[lora]: {e}") from None
    return job


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
def make_tokenizer(config: Config) -> Any:
    """The tokenizer `data.tokenizer` names."""
    name = config.data.tokenizer
    if name == "auto":
        init_from = config.model.init_from
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
def _model_config(config: Config, tokenizer: Any) -> tuple[Config, Any, str]:
    m = config.model
    if m.init_from is not None:
        model_config, hf_type = hf.load_config(m.init_from, dtype=m.param_dtype)
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
def _documents(source: str, config: Config, split: str, key: str) -> list[str]:
    if source == "stdlib":
        return data_lib.stdlib_corpus(split)
    path = Path(source)
    if not path.exists():
        raise ConfigError(
            f"`{key}` names {source!r}, which does not exist. Pass 'stdlib', a "
            "directory of text files or a .txt/.json/.jsonl/.parquet/.csv file."
        )
    if path.is_dir():
        return data_lib.load_text_dir(path, pattern=config.data.pattern)
    if path.suffix.lower() == ".txt":
        return [data_lib.read_text(path)]
    table = data_lib.from_files(path)
    return data_lib.text_column(table, config.data.text_column, source=source)


def train_rows(job: Job) -> Rows:
    """The training rows (`tokens`, `targets`, `loss_mask`) of `data.train`;
    fewer than one batch of them is an error saying how many there are."""
    config = job.config
    docs = _documents(config.data.train, config, "train", "data.train")
    rows = data_lib.chunk_documents(docs, job.tokenizer, seq_len=config.data.seq_len)
    n = len(rows["tokens"])
    if n < config.data.batch_size:
        raise ConfigError(
            f"the training data has {n} rows of {config.data.seq_len} tokens, fewer "
            f"than one batch (`data.batch_size` = {config.data.batch_size}). Lower "
            "data.batch_size or data.seq_len, or add text."
        )
    return rows


def eval_rows(job: Job) -> Rows | None:
    """The evaluation rows of `data.eval` (at most `data.eval_rows`), or None."""
    config = job.config
    source = config.data.eval
    if source == "auto":
        source = "stdlib" if config.data.train == "stdlib" else "none"
    if source == "none" or config.loop.eval_every == 0 and not config.loop.eval_at_end:
        return None
    docs = _documents(source, config, "eval", "data.eval")
    rows = data_lib.chunk_documents(docs, job.tokenizer, seq_len=config.data.seq_len)
    n = min(config.data.eval_rows, len(rows["tokens"]))
    n -= n % min(config.data.batch_size, n)  # whole batches: one compiled shape
    return {k: v[:n] for k, v in rows.items()}


def eval_batch_size(rows: Rows, config: Config) -> int:
    """The eval batch: `data.batch_size`, or all rows when there are fewer."""
    return min(config.data.batch_size, len(rows["tokens"]))
