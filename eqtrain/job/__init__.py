"""The whole job `eqtrain fit` runs, as Python: `run(config)` assembles data,
model, optimizer, mesh, resume, hooks, checkpoints, evaluation and export from a
`Config` and calls `eqtrain.fit`. The CLI's other commands are here too.

    config = eqtrain.config.load("run.toml", ["loop.steps=1000"])
    result = eqtrain.job.run(config)
"""

from ._build import Job as Job, build as build
from ._data import prepare_data as prepare_data, tokens_per_source as tokens_per_source
from ._dry import budget_report as budget_report, report as report
from ._generate import (
    Completion as Completion,
    Generator as Generator,
    Options as Options,
    chat_stop_ids as chat_stop_ids,
    complete as complete,
    open_model as open_model,
    prompt_tokens as prompt_tokens,
    stream_text as stream_text,
    template_kwargs_option as template_kwargs_option,
    with_template_kwargs as with_template_kwargs,
)
from ._import import import_hf as import_hf
from ._inspect import (
    evaluate_run as evaluate_run,
    export_run as export_run,
    run_info as run_info,
)
from ._open import open_run as open_run, restore_run as restore_run
from ._preflight import (
    check_outputs as check_outputs,
    export_targets as export_targets,
    is_write_error as is_write_error,
    last_checkpoint_note as last_checkpoint_note,
    write_error_message as write_error_message,
)
from ._prepare import Prepared as Prepared, prepare as prepare
from ._run import RunResult as RunResult, run as run
