"""Errors a researcher meets writing a loss or composing `eqtrain.step`'s pieces
(issue 58, point 5): the loss contract is checked at trace time with a message
that shows the expected return, and every piece's error names the function the
user called, with the argument as they wrote it."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
import optax
import pytest

import eqtrain
from eqtrain import ConfigError, StructureError, TrainState, sharding, step as S


OPT = optax.sgd(0.1)
BATCH = {"x": jnp.ones((8, 4)), "y": jnp.ones((8,))}


def _model():
    return eqx.nn.Linear(4, "scalar", key=jr.key(0))


def _errors(model, batch):
    return jax.vmap(model)(batch["x"]) - batch["y"]


def bare_scalar(model, batch, key):
    return jnp.mean(_errors(model, batch) ** 2)


def per_example(model, batch, key):
    return _errors(model, batch) ** 2, {}


def metrics_not_a_dict(model, batch, key):
    return jnp.mean(_errors(model, batch) ** 2), 0.0


def good(model, batch, key):
    return jnp.mean(_errors(model, batch) ** 2), {}


def _state(**kwargs):
    return TrainState.create(_model(), OPT, key=0, **kwargs)


# -- the loss contract ------------------------------------------------------------
@pytest.mark.parametrize(
    ("run", "caller"),
    [
        (lambda loss: eqtrain.train_step(loss, OPT)(_state(), BATCH), "train_step"),
        (lambda loss: eqtrain.eval_step(loss)(_state(), BATCH), "eval_step"),
        (
            lambda loss: S.gradient_step(S.value_and_grad(loss), OPT)(_state(), BATCH),
            "value_and_grad",
        ),
    ],
    ids=["train_step", "eval_step", "value_and_grad"],
)
def test_a_bare_scalar_loss_names_the_contract(run, caller):
    with pytest.raises(StructureError) as raised:
        run(bare_scalar)
    message = str(raised.value)
    assert message.startswith(f"{caller}: ")
    assert "`bare_scalar` returned an array of shape ()" in message
    assert "def loss_fn(model, batch, key) -> (loss, metrics_dict)" in message
    assert "return loss, {}" in message
    assert "0-d array" not in message


def test_a_per_example_loss_is_refused_with_its_shape():
    with pytest.raises(StructureError, match=r"shape \(8,\).*\.mean\(\)"):
        eqtrain.train_step(per_example, OPT)(_state(), BATCH)


def test_metrics_that_are_not_a_dict_are_refused():
    with pytest.raises(StructureError, match="metrics.*a dict.*float"):
        eqtrain.train_step(metrics_not_a_dict, OPT)(_state(), BATCH)


def _stateful_state():
    class Counted(eqx.Module):
        linear: eqx.nn.Linear

        def __call__(self, x, state):
            return self.linear(x), state

    model, model_state = eqx.nn.make_with_state(Counted)(_model())
    return TrainState.create(model, OPT, key=0, model_state=model_state)


def test_a_stateful_model_shows_the_three_item_return():
    def two_items(model, batch, key, *, model_state):
        return good(model.linear, batch, key)

    with pytest.raises(StructureError) as raised:
        eqtrain.train_step(two_items, OPT)(_stateful_state(), BATCH)
    message = str(raised.value)
    assert "returned a tuple of 2 items" in message
    assert "def loss_fn(model, batch, key, *, model_state)" in message
    assert "return loss, {}, new_model_state" in message


def test_a_stateful_model_needs_a_loss_that_takes_its_state():
    with pytest.raises(StructureError) as raised:
        eqtrain.train_step(good, OPT)(_stateful_state(), BATCH)
    message = str(raised.value)
    assert message.startswith("train_step: the state has a `model_state`")
    assert "`good` takes no `model_state` keyword" in message


def test_a_good_loss_still_trains_under_accumulation_and_jit():
    step = eqtrain.jit(eqtrain.train_step(good, OPT, accumulate=2))
    _, metrics = step(_state(), BATCH)
    assert jnp.isfinite(metrics["loss"])


# -- errors name the piece the user called ----------------------------------------
def _message(build):
    with pytest.raises(ConfigError) as raised:
        build()
    return str(raised.value)


def test_microbatched_names_itself_not_the_recipe_keyword():
    message = _message(lambda: S.microbatched(S.value_and_grad(good), 0))
    assert message.startswith("microbatched: ") and "accumulate" not in message
    step = S.gradient_step(S.microbatched(S.value_and_grad(good), 3), OPT)
    message = _message(lambda: step(_state(), BATCH))
    assert message.startswith("microbatched(grad_fn, 3): ")
    assert "accumulate" not in message


def test_with_ema_names_itself():
    plain = S.gradient_step(S.value_and_grad(good), OPT)
    message = _message(lambda: S.with_ema(plain, 1.5))
    assert message.startswith("with_ema: `decay`") and "`ema`" not in message
    message = _message(lambda: S.with_ema(plain, 0.9)(_state(), BATCH))
    assert message.startswith("with_ema(step, 0.9) needs a state")
    assert "train_step" not in message


def test_precision_names_the_function_given_it():
    bad = "int8"
    assert _message(lambda: S.value_and_grad(good, precision=bad)).startswith(
        "value_and_grad: `precision`"
    )
    assert _message(lambda: eqtrain.eval_step(good, precision=bad)).startswith(
        "eval_step: `precision`"
    )
    assert _message(lambda: eqtrain.train_step(good, OPT, precision=bad)).startswith(
        "train_step: `precision`"
    )


def test_the_recipes_name_themselves_and_their_keywords():
    assert _message(lambda: eqtrain.train_step(good, OPT, accumulate=0)).startswith(
        "train_step: `accumulate`"
    )
    message = _message(
        lambda: eqtrain.train_step(good, OPT, accumulate=3)(_state(), BATCH)
    )
    assert message.startswith("train_step(..., accumulate=3): ")
    assert _message(lambda: eqtrain.train_step(good, OPT, ema=1.5)).startswith(
        "train_step: `ema`"
    )
    message = _message(lambda: eqtrain.train_step(good, OPT, ema=0.9)(_state(), BATCH))
    assert message.startswith("train_step(..., ema=0.9) needs a state")
    assert "TrainState.create(..., ema=True)" in message


@pytest.mark.parametrize(
    ("keywords", "named"),
    [
        ({"accumulate": 0}, "`accumulate`"),
        ({"precision": "int8"}, "`precision`"),
        ({"nonfinite": "skp"}, "`nonfinite`"),
        ({"ema": 2.0}, "`ema`"),
    ],
)
def test_data_parallel_step_names_itself(keywords, named):
    mesh = sharding.make_mesh({"data": -1})
    message = _message(lambda: sharding.data_parallel_step(good, OPT, mesh, **keywords))
    assert message.startswith(f"data_parallel_step: {named}")


def test_data_parallel_step_names_its_loss_contract():
    mesh = sharding.make_mesh({"data": -1})
    step = sharding.data_parallel_step(bare_scalar, OPT, mesh)
    with pytest.raises(StructureError, match=r"^data_parallel_step: `bare_scalar`"):
        step(_state(), BATCH)
