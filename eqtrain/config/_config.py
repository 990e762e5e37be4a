"""`Config`: the whole run's configuration, the top-level keys and one section
per TOML table (`SECTIONS`, in TOML order)."""

import dataclasses

from ._data import DataConfig
from ._model import ModelConfig
from ._run import DistributedConfig, ExportConfig, LogConfig, MeshConfig
from ._schema import setting
from ._task import LoRAConfig, TaskConfig
from ._training import CheckpointConfig, LoopConfig, OptimConfig


@dataclasses.dataclass(frozen=True)
class Config:
    run_dir: str = setting(
        "runs/default",
        "Where the run writes: config.toml, metrics.jsonl, checkpoints/, hf/, tb/.",
        kind="path",
    )
    seed: int = setting(
        0, "Seed of the initial weights, the step keys and the data order."
    )
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    loop: LoopConfig = dataclasses.field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(
        default_factory=DistributedConfig
    )
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    export: ExportConfig = dataclasses.field(default_factory=ExportConfig)
    # The dotted keys a file or `--set` gave (see `explicit`): not a config key,
    # and two configs with the same values are equal however they were written.
    _explicit: frozenset[str] = dataclasses.field(
        default=frozenset(), compare=False, repr=False
    )


SECTIONS: dict[str, type] = {
    f.name: f.type  # type: ignore[misc]
    for f in dataclasses.fields(Config)
    if dataclasses.is_dataclass(f.type)
}


def explicit(config: Config) -> frozenset[str]:
    """The dotted keys a file or an override set (as opposed to defaults); kept
    by `dataclasses.replace` and ignored by `==`."""
    return config._explicit
