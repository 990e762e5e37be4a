"""Built-in hooks: a JSONL metrics writer, a progress bar, a console logger, and
writers for TensorBoard and Weights & Biases; `SamplesWriter`, which generates
from the model at its steps; `EarlyStopping`, whose state every checkpoint keeps;
`peak_flops` for MFU.

Each is a plain callable `hook(info)`; schedule it with `eqtrain.every(n, hook)` or
pass it as is (every step). All but `SamplesWriter` read only metrics (no
`uses_state`), so they run a little late (the loop reads metrics in batches) and
never make the loop wait for the device.
"""

from ._console import ConsoleLogger as ConsoleLogger, format_line as format_line
from ._devices import (
    peak_flops as peak_flops,
    total_peak_flops as total_peak_flops,
)
from ._early_stopping import EarlyStopping as EarlyStopping
from ._jsonl import JsonlWriter as JsonlWriter
from ._progress import ProgressBar as ProgressBar
from ._samples import SamplesWriter as SamplesWriter
from ._tensorboard import TensorBoardWriter as TensorBoardWriter
from ._wandb import WandbLogger as WandbLogger
