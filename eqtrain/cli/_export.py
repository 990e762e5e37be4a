"""`eqtrain export`: a run's checkpoint in Hugging Face format, or a LoRA run's
adapter in PEFT's (`eqtrain.job.export_run`)."""

from typing import Annotated

import typer

from ._shared import RunPath, errors


OutDir = Annotated[str, typer.Argument(help="The Hugging Face directory to write.")]
Dtype = Annotated[
    str | None,
    typer.Option(help="float32 | bfloat16 | float16 (default: the parameters')."),
]
Ema = Annotated[bool, typer.Option(help="Export the EMA weights.")]
Merged = Annotated[
    bool,
    typer.Option(
        help="LoRA runs: write the full model with the adapters merged "
        "(default: the adapter in PEFT's format)."
    ),
]
Overwrite = Annotated[
    bool,
    typer.Option(
        help="Replace an earlier export at OUT_DIR (never one that also holds "
        "other files, e.g. your notes: move them out first)."
    ),
]


def export(
    path: RunPath,
    out_dir: OutDir,
    dtype: Dtype = None,
    ema: Ema = False,
    merged: Merged = False,
    overwrite: Overwrite = False,
) -> None:
    """Export a run's latest checkpoint (or the given step) in Hugging Face format
    (safetensors, config.json, tokenizer); a LoRA run's adapter in PEFT's format,
    or with --merged the full model."""
    from .. import job

    with errors():  # the refusals name --overwrite only where it would help
        out = job.export_run(
            path, out_dir, dtype=dtype, ema=ema, merged=merged, overwrite=overwrite
        )
    typer.echo(f"exported to {out}")
