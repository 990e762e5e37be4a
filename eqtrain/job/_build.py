"""From a `Config` to the pieces of a run, as one frozen `Job`: tokenizer, model
config, optimizer, loss and state builders (`_resolve` resolves each piece).
Everything that can be wrong with the config or its files fails here, before
any compilation."""

import dataclasses
import functools
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.random as jr
import numpy as np

from .. import hf, lora as lora_lib, models, sharding
from .._errors import ConfigError
from .._state import TrainState
from ..config import PREFERENCE_TASKS, Config, lora_on, reference_mode
from ..losses import causal_lm_loss
from ..post_training import preference
from . import _grpo, _resolve


@dataclasses.dataclass(frozen=True)
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
        grpo: task.kind = "grpo": its prompts and rollout, learnt as the run
            reads its rows and builds its step (`_grpo.Online`), else None.
        abstract: the state's structure, shapes and dtypes (`abstract_state`),
            traced once by `build`: the phases after it read this field.
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
    grpo: _grpo.Online | None = None
    abstract: Any = None

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
        if self.config.model.init_from is not None:
            model = self._loaded_base(mesh)
        else:
            model = self._random_base()
        return models.resize_vocab(model, self.model_config.vocab_size)

    def _loaded_base(self, mesh: Any) -> Any:
        """`model.init_from`'s weights, with the `[model]` runtime options."""
        m = self.config.model
        shardings = None
        if mesh is not None and self.vocab_size is None:
            shardings = _model_shardings(mesh)
        model, _ = hf.load(m.init_from, dtype=m.param_dtype, shardings=shardings)
        options = models.runtime_options(m)
        return model.with_options(**options, **models.moe_options(m, model.config))

    def _random_base(self) -> Any:
        """A random init at the real vocabulary (padded afterwards)."""
        config = self.model_config
        if self.vocab_size is not None:
            config = dataclasses.replace(config, vocab_size=self.vocab_size)
        return self.family.model(config, jr.key(self.config.seed))

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
        """The state's structure, shapes and dtypes, without reading weights
        (`abstract`, when `build` has traced it)."""
        if self.abstract is not None:
            return self.abstract

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
        if init_from is None:
            return self._random_base_hash()
        if not (Path(init_from) / "config.json").is_file():
            raise ConfigError(
                f"this LoRA run's frozen base, model.init_from = {init_from!r}, "
                "is gone (no config.json there): its checkpoints hold only the "
                "adapters. Put the base back there, or pass its new place with "
                "--set model.init_from=PATH (its content is checked)."
            )
        return self.init_from_hash()

    def _random_base_hash(self) -> dict[str, Any]:
        """A random base's seed and the sha256 of its arrays."""
        digest = hashlib.sha256()
        for leaf in jax.tree.leaves(eqx.filter(self.base_model(), eqx.is_array)):
            digest.update(np.asarray(jax.device_get(leaf)).tobytes())
        return {"path": None, "seed": self.config.seed, "sha256": digest.hexdigest()}

    def init_from_hash(self) -> dict[str, Any]:
        """`hf.content_hash` of `model.init_from`, read once per job (the LoRA
        base reference and the precomputed reference's key both use it)."""
        return self._init_from_hash

    @functools.cached_property
    def _init_from_hash(self) -> dict[str, Any]:
        return hf.content_hash(self.config.model.init_from)

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
    (`<run_dir>/init_from`, see `_rundir.record_init_from`), read instead of the
    directory itself: an existing run's architecture is the one it was trained
    with, and the base directory may be gone (its weights are still needed to
    start a run, and by a LoRA run's frozen base)."""
    return _with_loss(_traced(_pieces(config, recorded)))


def _pieces(config: Config, recorded: Path | None) -> Job:
    """Everything of the job but its loss (the plain LM loss stands in)."""
    source = _resolve.architecture_source(config, recorded)
    tokenizer = _resolve.make_tokenizer(config, source)
    config, model_config, model_type = _resolve.architecture(config, tokenizer, source)
    config = _resolve.optim_defaults(config)
    vocab = model_config.vocab_size
    padded = _resolve.padded_vocab(config, vocab)
    kind = config.task.kind
    return Job(
        config,
        tokenizer,
        dataclasses.replace(model_config, vocab_size=padded),
        model_type,
        _resolve.optimizer(config),
        # in the order their errors are said: reference, template, LoRA
        reference=reference_mode(config),
        template=None if kind == "lm" else _resolve.chat_template(config, source),
        lora=_resolve.lora_spec(config) if lora_on(config) else None,
        vocab_size=None if padded == vocab else vocab,
        grpo=_grpo.Online() if kind == "grpo" else None,
    )


def _traced(job: Job) -> Job:
    """`job` with its abstract state traced (where its LoRA targets, rank and
    train_also are checked against the model)."""
    try:
        return dataclasses.replace(job, abstract=job.abstract_state())
    except ConfigError as e:
        if job.lora is None:
            raise
        raise ConfigError(f"[lora]: {e}") from None


def _with_loss(job: Job) -> Job:
    """`job` with the loss of its task, chunked as `model.loss_chunk` says."""
    config, real = job.config, job.vocab_size
    vocab = job.model_config.vocab_size
    chunk = _resolve.loss_chunk(config, vocab, head_dropout=job.head_dropout())
    loss_fn = _resolve.task_loss(config, job.reference, vocab_size=real, chunk=chunk)
    return dataclasses.replace(job, loss_fn=loss_fn, loss_chunk=chunk)


def _model_shardings(mesh: Any) -> Callable[[Any], Any]:
    """The shardings of a plain model's arrays on `mesh` (its partition rules),
    as `hf.load(shardings=)` takes them: a function of the abstract model."""

    def shardings(model: Any) -> Any:
        return sharding.state_shardings(model, mesh, sharding.rules_for(model, mesh))

    return shardings
