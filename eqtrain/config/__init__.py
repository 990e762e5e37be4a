"""Typed run configuration for `eqtrain fit`: frozen dataclasses per TOML section
(`model`, `data`, `optim`, `loop`, `checkpoint`, `mesh`, `distributed`, `log`,
`lora`, `export`, plus `run_dir` and `seed`), read from TOML files and `--set
key=value` overrides.

    config = eqtrain.config.load("run.toml", ["optim.lr=1e-4", "loop.steps=10_000"])
    print(eqtrain.config.to_toml(config))
"""

from ._config import SECTIONS as SECTIONS, Config as Config, explicit as explicit
from ._data import DataConfig as DataConfig
from ._fields import Field as Field, schema as schema
from ._model import ModelConfig as ModelConfig
from ._parse import (
    apply_overrides as apply_overrides,
    from_dict as from_dict,
    load as load,
    read_toml as read_toml,
)
from ._resolve import (
    best_mode as best_mode,
    data_format as data_format,
    eval_metrics as eval_metrics,
    eval_source as eval_source,
    export_targets as export_targets,
    lora_on as lora_on,
    reference_mode as reference_mode,
    reward_names as reward_names,
    reward_weights as reward_weights,
    steps_export_dir as steps_export_dir,
)
from ._run import (
    DistributedConfig as DistributedConfig,
    ExportConfig as ExportConfig,
    LogConfig as LogConfig,
    MeshConfig as MeshConfig,
)
from ._schema import (
    AUTO_LOSS_CHUNK as AUTO_LOSS_CHUNK,
    LOSS_CHUNK_MIN_VOCAB as LOSS_CHUNK_MIN_VOCAB,
    PREFERENCE_TASKS as PREFERENCE_TASKS,
)
from ._sources import format_sources as format_sources, parse_sources as parse_sources
from ._task import LoRAConfig as LoRAConfig, TaskConfig as TaskConfig
from ._toml import to_dict as to_dict, to_toml as to_toml, toml_value as toml_value
from ._training import (
    CheckpointConfig as CheckpointConfig,
    LoopConfig as LoopConfig,
    OptimConfig as OptimConfig,
)
from ._units import (
    parse_duration as parse_duration,
    parse_resources as parse_resources,
    parse_size as parse_size,
)
from ._validate import ARCH_KEYS as ARCH_KEYS, validate as validate


def __getattr__(name: str) -> object:
    """`rewards_of`, moved to the job (it imports the reward functions, which
    a config no longer does): kept for one release, with a warning."""
    if name == "rewards_of":
        import importlib
        import warnings

        warnings.warn(
            "`eqtrain.config.rewards_of` moved: the job imports task.rewards' "
            "functions (`eqtrain.config.reward_names` checks the names).",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module("eqtrain.job._grpo").rewards_of
    raise AttributeError(f"module 'eqtrain.config' has no attribute {name!r}")
