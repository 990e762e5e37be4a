"""eqtrain's CPU settings: a platform concern kept out of the core.

`tune_cpu()` sets glibc's allocator and the XLA flags measured fastest on this
processor (cached per processor and JAX version); `eqtrain fit` (the CLI) calls
it first thing, and a CPU training script calls it before its first JAX
computation. The core (`eqtrain.jit`, `fit`, the models, `generate`) never
imports this package: it takes its compile options from its caller, and these
functions give them (`step_options` for `eqtrain.jit(compiler_options=)`,
`generation_options` for `generate(compiler_options=)`, `layers_scanned` for
`model.scan_layers = "auto"`).

Example:
    >>> import eqtrain.cpu
    >>> applied = eqtrain.cpu.tune_cpu()  # doctest: +SKIP
"""

from ._tune import (
    OPT_OUT as OPT_OUT,
    CPUPerformanceWarning as CPUPerformanceWarning,
    allocator_tuned as allocator_tuned,
    cpu_settings as cpu_settings,
    generation_options as generation_options,
    layers_scanned as layers_scanned,
    setting_code as setting_code,
    shared_setting as shared_setting,
    step_options as step_options,
    tune_cpu as tune_cpu,
)
