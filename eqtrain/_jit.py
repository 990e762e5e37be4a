"""`eqtrain.jit`: compile a step over the *array leaves* of the state with `jax.jit`.

The state is partitioned once into array leaves and static structure; the static part
is closed over, and only a flat list of arrays crosses the jit boundary (with donation
and, when given, shardings). This keeps JAX's asynchronous dispatch: unlike
`eqx.filter_jit`, nothing here waits for the result or re-walks the module tree.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import equinox as eqx
import jax
import jax.tree_util as jtu
from jax.sharding import Sharding

from ._errors import DonatedStateError, StructureError
from ._types import Batch


def _differences(expected: list[Any], got: list[Any], paths: list[str]) -> str:
    lines = []
    for path, a, b in zip(paths, expected, got, strict=False):
        if a is not b and not _same_static(a, b):
            lines.append(f"  {path}: {_short(a)} -> {_short(b)}")
        if len(lines) == 5:
            break
    return "\n".join(lines)


def _short(x: Any) -> str:
    if eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct):
        return f"array{tuple(x.shape)} {x.dtype}"
    text = repr(x)
    return text if len(text) < 60 else text[:57] + "..."


def _static_changed(was_array: bool, static: Any, new: Any) -> bool:
    """Whether a state leaf came out of the step unlike it went in: an array leaf
    no longer an array, or a static leaf an array or a different value."""
    if was_array:
        return not eqx.is_array(new)
    return eqx.is_array(new) or (static is not new and not _same_static(static, new))


def _static_differences(layout: Any, new_leaves: list[Any]) -> str:
    """The first differing leaves of the state's static part, by path."""
    skeleton = layout.rebuild([None] * layout.num_arrays)
    paths = [jtu.keystr(p) for p, _ in jtu.tree_flatten_with_path(skeleton)[0]]
    old = [
        s if not a else jax.ShapeDtypeStruct((), "float32")
        for a, s in zip(layout.is_array, layout.statics, strict=True)
    ]
    return _differences(old, new_leaves, paths)


def _same_static(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:
        return False


class _Layout:
    """How one state structure splits into array leaves and static leaves."""

    def __init__(self, treedef: Any, leaves: list[Any], *, abstract: bool = False):
        self.treedef = treedef
        self.is_array = [
            eqx.is_array(x) or (abstract and isinstance(x, jax.ShapeDtypeStruct))
            for x in leaves
        ]
        self.statics = [
            None if a else x for a, x in zip(self.is_array, leaves, strict=True)
        ]
        self.num_arrays = sum(self.is_array)

    def matches(self, treedef: Any, leaves: list[Any]) -> bool:
        if treedef != self.treedef:
            return False
        for a, s, x in zip(self.is_array, self.statics, leaves, strict=True):
            if a != eqx.is_array(x) or (
                not a and s is not x and not _same_static(s, x)
            ):
                return False
        return True

    def arrays(self, leaves: list[Any]) -> list[Any]:
        return [x for a, x in zip(self.is_array, leaves, strict=True) if a]

    def rebuild(self, arrays: Sequence[Any]) -> Any:
        it = iter(arrays)
        return self.treedef.unflatten(
            [
                next(it) if a else s
                for a, s in zip(self.is_array, self.statics, strict=True)
            ]
        )


@runtime_checkable
class CheckedOptions(Protocol):
    """XLA options for `eqtrain.jit`'s compilations that a compiled step must
    pass a check with before it first runs, else it is compiled again without
    them (`eqtrain.cpu.step_options()`: oneDNN's products on the CPU, whose
    fusions some jaxlibs abort or miscompute on). One object per `Jitted`:
    `note` says what the checks found."""

    note: str | None

    def options(self, dump: bool) -> dict[str, Any]:
        """The options for one compilation; `dump`: with what `check` reads
        (XLA's dump of the compilation), for a step that will run."""
        ...

    def check(self, jitted: Any, options: Mapping[str, Any], *args: Any) -> bool:
        """Compile `jitted` (a `jax.jit` built with `options`) for `args`, as
        a call with the same arguments then reuses; whether it may run."""
        ...


class Jitted:
    """A step compiled by `eqtrain.jit`. Call it like the step it wraps.

    `jitted(state, batch)` returns what the step returns. For the hot loop, `fit`
    uses `prepare(state)` once and then `call_flat(arrays, batch)`, which hands only
    flat lists of arrays back and forth.

    Attributes:
        num_traces: how many times the step has been traced (1 in a healthy loop;
            tests use it to prove there is no retrace).
        compile_note: what the check of `compiler_options` said (a
            `CheckedOptions`' `note`), else None.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        donate: bool = True,
        shardings: tuple[Any, Any] | None = None,
        compiler_options: Mapping[str, Any] | CheckedOptions | None = None,
    ):
        self.fn = fn
        self.donate = donate
        self.shardings = shardings
        self.num_traces = 0
        self._layout: _Layout | None = None
        self._jitted: Any = None
        self._mode: str | None = None  # "step": returns (state, aux); "fn": anything
        self._out_static: Any = None
        self._checker: CheckedOptions | None = None
        self._given: dict[str, Any] = {}  # plain XLA options, used as they are
        if isinstance(compiler_options, Mapping):
            self._given = dict(compiler_options)
        else:
            self._checker = compiler_options
        self._options: dict[str, Any] = {}  # XLA options of each compilation
        self._checked: set[Any] = set()  # (state, batch) signatures checked
        self._state_sig: Any = None

    @property
    def compile_note(self) -> str | None:
        return None if self._checker is None else self._checker.note

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", self.fn)
        return f"eqtrain.jit({name!r}, donate={self.donate})"

    # -- the hot path -------------------------------------------------------------
    def prepare(self, state: Any) -> tuple[list[Any], _Layout]:
        """Partition `state` once; returns its array leaves and its layout."""
        leaves, treedef = jtu.tree_flatten(state)
        if self._layout is None or not self._layout.matches(treedef, leaves):
            self._layout = _Layout(treedef, leaves)
            self._options = self._compiler_options(dump=True)
            self._jitted = self._build(self._layout)
            self._mode = None
            self._checked.clear()
        arrays = self._layout.arrays(leaves)
        if self._checking:  # a state of other shapes compiles anew: check it too
            self._state_sig = _signature(arrays)
        return arrays, self._layout

    def call_flat(self, arrays: list[Any], batch: Batch) -> Any:
        """Run on the array leaves of a prepared state.

        Returns `(new_arrays, aux)` for a step (a function returning a state of the
        same structure and something else), or the function's output otherwise.
        """
        if self._checking:
            self._check_compiled(arrays, batch)
        try:
            out = self._jitted(arrays, batch)
        except (RuntimeError, ValueError) as error:  # JAX raises either
            if "deleted" in str(error) and self._layout is not None:
                self._explain_deleted(arrays, error)
            raise
        if self._mode == "fn":
            return eqx.combine(out, self._out_static)
        return out

    def __call__(self, state: Any, batch: Batch) -> Any:
        arrays, layout = self.prepare(state)
        out = self.call_flat(arrays, batch)
        if self._mode == "step":
            new_arrays, aux = out
            return layout.rebuild(new_arrays), aux
        return out

    def lower(self, state: Any, batch: Any) -> Any:
        """`jax.jit(...).lower` of the step for `state` and `batch`, which may be
        abstract (`jax.ShapeDtypeStruct` leaves, e.g. `eqx.filter_eval_shape`'s
        state): `.compile().memory_analysis()` then tells the step's per-device
        memory without allocating it. Leaves this `Jitted`'s own compiled step
        (and `num_traces`) as they were."""
        leaves, treedef = jtu.tree_flatten(state)
        layout = _Layout(treedef, leaves, abstract=True)
        traces, mode, options = self.num_traces, self._mode, self._options
        self._options = self._compiler_options(dump=False)
        try:
            return self._build(layout).lower(layout.arrays(leaves), batch)
        finally:
            self.num_traces, self._mode = traces, mode
            self._options = options

    @property
    def _checking(self) -> bool:
        return self._checker is not None and self._options != self._given

    def _compiler_options(self, dump: bool) -> dict[str, Any]:
        if self._checker is None:
            return dict(self._given)
        return {**self._given, **self._checker.options(dump)}

    def _check_compiled(self, arrays: list[Any], batch: Batch) -> None:
        """Before a new input signature first runs with checked options,
        compile it and ask the check (`CheckedOptions.check`); a step it
        refuses is compiled again without them."""
        sig = (self._state_sig, _signature(batch))
        if sig in self._checked:
            return
        assert self._layout is not None and self._checker is not None
        if not self._checker.check(self._jitted, self._options, arrays, batch):
            self._options = dict(self._given)
            self._jitted = self._build(self._layout)
            return
        self._checked.add(sig)

    def _explain_deleted(self, arrays: list[Any], error: Exception) -> None:
        assert self._layout is not None
        check_live(self._layout.rebuild(arrays), f"{self!r}")

    @property
    def mode(self) -> str | None:
        """`"step"` once traced on a `(state, batch) -> (state, aux)` function."""
        return self._mode

    # -- building -----------------------------------------------------------------
    def _build(self, layout: _Layout) -> Any:
        def flat_fn(arrays: list[Any], batch: Batch) -> Any:
            self.num_traces += 1
            out = self.fn(layout.rebuild(arrays), batch)
            step_out = self._as_step(layout, out)
            if step_out is not None:
                return step_out
            if self.donate:
                raise StructureError(
                    f"{self!r}: with donate=True the function must return "
                    "`(state, metrics)` with `state` structured exactly like its "
                    "input; it returned something else. For evaluation-style "
                    "functions use `eqtrain.jit(fn, donate=False)`."
                )
            self._mode = "fn"
            dynamic, self._out_static = eqx.partition(out, eqx.is_array)
            return dynamic

        return jax.jit(flat_fn, **self._jit_options(layout))

    def _as_step(self, layout: _Layout, out: Any) -> tuple[list[Any], Any] | None:
        """`(new arrays, metrics)` when `out` is `(state, metrics)` with the state
        structured like the input (the function is a step), else None."""
        if not (isinstance(out, tuple) and len(out) == 2):
            return None
        new_leaves, new_def = jtu.tree_flatten(out[0])
        if new_def != layout.treedef:
            return None
        self._check_same_static(layout, new_leaves)
        self._mode = "step"
        return layout.arrays(new_leaves), out[1]

    def _jit_options(self, layout: _Layout) -> dict[str, Any]:
        """`jax.jit`'s donation, shardings and XLA options for this function."""
        kwargs: dict[str, Any] = {}
        if self._options:
            kwargs["compiler_options"] = dict(self._options)
        if self.donate:
            kwargs["donate_argnums"] = (0,)
        if self.shardings is not None:
            state_sh, batch_sh = self.shardings
            flat_sh = self._flat_shardings(layout, state_sh)
            kwargs["in_shardings"] = (flat_sh, batch_sh)
            if self.donate:  # a step: pin the state's output layout too
                kwargs["out_shardings"] = (flat_sh, None)
        return kwargs

    def _check_same_static(self, layout: _Layout, new_leaves: list[Any]) -> None:
        for a, s, x in zip(layout.is_array, layout.statics, new_leaves, strict=True):
            if _static_changed(a, s, x):
                raise StructureError(
                    f"{self!r}: the step changed the static part of the state "
                    "(non-array leaves must come out as they went in). First "
                    f"differences:\n{_static_differences(layout, new_leaves)}"
                )

    @staticmethod
    def _flat_shardings(layout: _Layout, state_sh: Any) -> Any:
        if state_sh is None or isinstance(state_sh, Sharding):
            return state_sh
        flat = jtu.tree_leaves(state_sh, is_leaf=lambda x: isinstance(x, Sharding))
        if len(flat) != layout.num_arrays:
            raise StructureError(
                f"state shardings have {len(flat)} leaves but the state has "
                f"{layout.num_arrays} arrays. Build them from the state, e.g. "
                "`jax.tree.map(lambda x: sharding_for(x), eqx.filter(state, "
                "eqx.is_array))`."
            )
        return flat


def _signature(tree: Any) -> Any:
    """What decides a compilation of `tree`'s leaves: structure, shapes, dtypes
    and shardings."""
    leaves, treedef = jtu.tree_flatten(tree)
    return treedef, tuple(
        (
            getattr(x, "shape", None),
            getattr(x, "dtype", type(x)),
            getattr(x, "sharding", None),
        )
        for x in leaves
    )


def check_live(state: Any, user: str) -> None:
    """Raise `DonatedStateError` naming the first array of `state` that was deleted
    (donated to an earlier step)."""
    for path, leaf in jtu.tree_flatten_with_path(state)[0]:
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise DonatedStateError(
                f"the state given to {user} has deleted arrays (first: "
                f"`{jtu.keystr(path)}`): an earlier step with donate=True consumed "
                "them. Use the state that step (or `fit`) returned; to keep an input "
                "state alive, copy it first or compile with "
                "`eqtrain.jit(step, donate=False)`."
            )


def jit(
    fn: Callable[..., Any],
    *,
    donate: bool = True,
    shardings: tuple[Any, Any] | None = None,
    compiler_options: Mapping[str, Any] | CheckedOptions | None = None,
) -> Jitted:
    """Compile a step for the training loop.

    The state (first argument) is partitioned into array leaves and static
    structure; the static part is closed over and `jax.jit` sees only a flat list of
    arrays, which it donates when `donate=True`. Dispatch stays asynchronous.

    Args:
        fn: `fn(state, batch)`. With `donate=True` it must return
            `(new_state, metrics)` with `new_state` structured like `state`
            (e.g. a step from `train_step`). With `donate=False` it may return
            any pytree (e.g. an `eval_step`).
        donate: donate the state's buffers to the step (halves peak memory). The
            arrays of the state you pass in are consumed: keep using the returned
            state.
        shardings: `(state_shardings, batch_shardings)`: `state_shardings` is one
            `Sharding` for every array or a pytree of them shaped like
            `eqx.filter(state, eqx.is_array)`; `batch_shardings` is a `Sharding`
            or a pytree prefix of the batch. `None` lets JAX follow the inputs.
        compiler_options: XLA options for each compilation of the step
            (`jax.jit(compiler_options=)`), or a `CheckedOptions` whose check a
            compiled step must pass before it first runs (e.g.
            `eqtrain.cpu.step_options()`, what `eqtrain fit` passes). `None`:
            XLA's defaults.

    Returns:
        A `Jitted` callable with the same call signature as `fn`.

    Example:
        >>> step = eqtrain.jit(eqtrain.train_step(loss_fn, optimizer))  # doctest: +SKIP
        >>> state, metrics = step(state, batch)  # doctest: +SKIP
    """
    return Jitted(
        fn, donate=donate, shardings=shardings, compiler_options=compiler_options
    )
