"""A language model's vocabulary rows: `resize_vocab` pads the token embedding and
the output head with zero rows (or cuts them), e.g. to split the vocabulary evenly
over a tensor-parallel mesh (`eqtrain.losses.vocab_mask` masks the padded logits)."""

import copy
import dataclasses
from typing import Any

import equinox as eqx
import jax.numpy as jnp

from .._errors import ConfigError


# The attributes of the Llama family and GPT-2 that hold `[vocab, hidden]` weights.
VOCAB_LAYERS = ("embed_tokens", "wte", "lm_head")


def resize_vocab(model: Any, vocab_size: int) -> Any:
    """`model` with `vocab_size` rows in its token embedding and output head
    (zero rows added, or the last rows cut) and `config.vocab_size` set; the
    other arrays are shared. Works on a model's trainable-filter tree too
    (non-array leaves are kept).

    Padded rows are never looked up (no token id reaches them) and, once their
    logits are masked (the losses' `vocab_size=`), never
    predicted: cutting them off again gives back the original model exactly.
    """
    old = model.config.vocab_size
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ConfigError(f"`vocab_size` must be an int >= 1; got {vocab_size!r}.")
    if vocab_size == old:
        return model
    for name in VOCAB_LAYERS:
        layer = getattr(model, name, None)
        weight = getattr(layer, "weight", None)
        if not eqx.is_array(weight):
            continue
        if vocab_size < old:
            new = weight[:vocab_size]
        else:
            pad = jnp.zeros((vocab_size - old, *weight.shape[1:]), weight.dtype)
            new = jnp.concatenate([weight, pad])
        model = eqx.tree_at(lambda m, n=name: getattr(m, n).weight, model, new)
    out = copy.copy(model)
    config = dataclasses.replace(model.config, vocab_size=vocab_size)
    object.__setattr__(out, "config", config)  # a static field
    return out
