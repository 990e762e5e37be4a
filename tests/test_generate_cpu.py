"""Generation compiles with XLA's own products on the CPU, whatever `tune_cpu`
chose for training (`eqtrain.cpu._tune.generation_options`).

Each case runs in a fresh process: XLA reads `XLA_FLAGS` once, when JAX starts.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest


SCRIPT = textwrap.dedent(
    """
    import json, os, re, sys
    import eqtrain
    if os.environ.get("TUNE") == "1":
        eqtrain.cpu.tune_cpu()
    import jax.numpy as jnp, jax.random as jr
    from eqtrain.cpu._tune import generation_options
    from eqtrain.generate import GREEDY, _generate, _settings, left_pad
    from eqtrain.models import Llama, LlamaConfig

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    )
    model = Llama(config, jr.key(0))
    tokens, lengths = left_pad([[5, 17, 33], [23, 4]], pad_id=0)
    args = (model, jnp.asarray(tokens), jnp.asarray(lengths), jr.key(0))
    hlo = _generate.lower(
        *args, _settings(4, GREEDY, (), 0, None, None), options=generation_options()
    )
    text = hlo.lowered.compile().as_text()
    entry = text[text.index("\\nENTRY"):]
    kinds = sorted(re.findall(r'"kind":"(__\\w+)"', text))
    print(json.dumps({
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "options": generation_options(),
        "library_fusions": kinds,
        "dots": len(re.findall(r" dot\\(", text)),
        "entry_ops": sorted(
            re.findall(r"= \\S+ ([a-z][\\w-]*)\\(", entry)
        ),
    }))
    """
)


def _compiled(**env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    environ.update(JAX_PLATFORMS="cpu", EQTRAIN_CPU_TUNING="fixed", **env)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def untuned() -> dict:
    return _compiled(TUNE="0")


def test_generation_under_eigen_flags_compiles_as_without_them(untuned):
    # `tune_cpu` (fixed: Eigen's products) puts the flag into XLA_FLAGS for
    # training; the generation compiled in that process is the untuned one's
    tuned = _compiled(TUNE="1")
    assert "--xla_cpu_experimental_ynn_fusion_type=" in tuned["xla_flags"]
    assert tuned["options"] and not untuned["options"]
    assert "__ynn_fusion" in untuned["library_fusions"]
    assert tuned["library_fusions"] == untuned["library_fusions"]
    assert tuned["entry_ops"] == untuned["entry_ops"]
    assert tuned["dots"] == untuned["dots"] > 0
    # (XLA moves a few bitcasts into the fusions under the flag: the same
    # products, measured at the same speed in benchmarks/generate.py)


def test_flags_the_user_set_stand(untuned):
    # the user's own XLA_FLAGS choose the products: tune_cpu chooses nothing, and
    # generation compiles under them (Eigen's: no YNNPACK fusion)
    yours = _compiled(TUNE="1", XLA_FLAGS="--xla_cpu_experimental_ynn_fusion_type=")
    assert yours["options"] == {}
    assert "__ynn_fusion" not in yours["library_fusions"]
