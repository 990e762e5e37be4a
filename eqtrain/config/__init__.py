"""Typed run configuration for `eqtrain fit`: frozen dataclasses per TOML section
(`model`, `data`, `optim`, `loop`, `checkpoint`, `mesh`, `distributed`, `log`,
`lora`, `export`, plus `run_dir` and `seed`), read from TOML files and `--set
key=value` overrides.

    config = eqtrain.config.load("run.toml", ["optim.lr=1e-4", "loop.steps=10_000"])
    print(eqtrain.config.to_toml(config))
"""

from ._parse import (
    Field as Field,
    apply_overrides as apply_overrides,
    explicit as explicit,
    format_sources as format_sources,
    from_dict as from_dict,
    load as load,
    parse_duration as parse_duration,
    parse_sources as parse_sources,
    read_toml as read_toml,
    schema as schema,
)
from ._schema import (
    AUTO_LOSS_CHUNK as AUTO_LOSS_CHUNK,
    LOSS_CHUNK_MIN_VOCAB as LOSS_CHUNK_MIN_VOCAB,
    PREFERENCE_TASKS as PREFERENCE_TASKS,
    SECTIONS as SECTIONS,
    CheckpointConfig as CheckpointConfig,
    Config as Config,
    DataConfig as DataConfig,
    DistributedConfig as DistributedConfig,
    ExportConfig as ExportConfig,
    LogConfig as LogConfig,
    LoopConfig as LoopConfig,
    LoRAConfig as LoRAConfig,
    MeshConfig as MeshConfig,
    ModelConfig as ModelConfig,
    OptimConfig as OptimConfig,
    TaskConfig as TaskConfig,
)
from ._toml import to_dict as to_dict, to_toml as to_toml, toml_value as toml_value
from ._units import parse_resources as parse_resources, parse_size as parse_size
from ._validate import (
    ARCH_KEYS as ARCH_KEYS,
    data_format as data_format,
    eval_metrics as eval_metrics,
    eval_source as eval_source,
    lora_on as lora_on,
    reference_mode as reference_mode,
    rewards_of as rewards_of,
    validate as validate,
)
