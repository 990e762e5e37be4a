"""oneDNN's products for `eqtrain.jit`'s steps on the CPU, and the check that
keeps them from taking the process down.

With `xla_cpu_use_onednn` and the `dot` fusion type, XLA:CPU gives each matrix
product to oneDNN, fused with the elementwise operations around it
(`__onednn_fusion`); on processor B that trained the Llama step of
`benchmarks/models.py` 10-15% faster than Eigen's products
(docs/performance.md, "oneDNN's products"). But this jaxlib (0.10.2) grows a
fusion as far as its operations allow, and oneDNN fails to compile one with a
product and five or more of them (e.g. `x @ y + a + b + c + d + e`, or the
causal blocks' key gradients summed over eight blocks), or one whose
operations branch (`x @ y + z * 2 + w`): XLA then aborts the
whole process (`partition compile failed`, SIGILL) on its first run. Later
XLA caps a fusion at four operations.

So `eqtrain.jit` never sets the flags process-wide: it compiles a step with
them as that compilation's options, reads the compiled HLO, and keeps it only
if every oneDNN fusion is a product followed by a short chain of operations
(`_unsafe` says exactly what; the tests run each shape it admits); otherwise
it compiles the step again without them (Eigen's products), before anything
runs.
"""

import re
import warnings
from collections.abc import Iterator, Mapping
from typing import Any


_active: dict[str, Any] = {}
"""The XLA options `eqtrain.jit` compiles with in this process (`activate`)."""


def activate(options: Mapping[str, Any]) -> None:
    """Compile `eqtrain.jit`'s steps with `options` from now on (`tune_cpu`
    passes its choice's, `{}` for none)."""
    _active.clear()
    _active.update(options)


def compiler_options() -> dict[str, Any]:
    """The options `activate` set: oneDNN's products where `tune_cpu` chose
    them (`_cpu_tuning.Choice.compiler_options`), else none."""
    return dict(_active)


MAX_FUSED = 3
"""Elementwise operations a oneDNN fusion may hold after its product (a
product with four additions ran in this jaxlib, five aborted; later XLA fuses
at most four operations in all)."""

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\(([^)]*)\)"
)
_OPERAND = re.compile(r"%([\w.\-]+)")
_ONEDNN_CALL = re.compile(r"calls=%?([\w.\-]+).*\"kind\":\"__onednn_fusion\"")

Instruction = tuple[str, str, list[str]]
"""`(name, opcode, operand names)` of one HLO instruction."""


def _computations(hlo: str) -> dict[str, list[Instruction]]:
    """Each computation's instructions in order, by name, from HLO text."""
    out: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    for line in hlo.splitlines():
        if current is None:
            m = _COMPUTATION.match(line)
            if m and "=" not in line.split("{")[0]:
                current = out.setdefault(m.group(1), [])
            continue
        if line.strip() == "}":
            current = None
            continue
        op = _INSTRUCTION.match(line)
        if op:
            name, opcode, args = op.groups()
            current.append((name, opcode, _OPERAND.findall(args)))
    return out


def fusions(hlo: str) -> Iterator[tuple[str, list[Instruction]]]:
    """`(name, instructions)` of each oneDNN fusion in `hlo`."""
    comps = _computations(hlo)
    seen = set()
    for name in _ONEDNN_CALL.findall(hlo):
        if name not in seen:
            seen.add(name)
            yield name, comps.get(name, [])


def _unsafe(body: list[Instruction]) -> str | None:
    """Why a oneDNN fusion's body is outside what runs, or None: it must be
    one product of two parameters followed by a chain of at most `MAX_FUSED`
    operations, each taking the previous one's result and otherwise only
    parameters. (An operation on a side branch, e.g. `x @ y + z * 2 + w`,
    aborted this jaxlib with as few as three operations.)"""
    params = {name for name, opcode, _ in body if opcode == "parameter"}
    ops = [(n, o, a) for n, o, a in body if o != "parameter"]
    if not ops or ops[0][1] != "dot" or not set(ops[0][2]) <= params:
        return "not a product of two of its inputs first"
    if len(ops) - 1 > MAX_FUSED:
        return f"{len(ops) - 1} operations after the product (at most {MAX_FUSED})"
    previous = ops[0][0]
    for name, opcode, args in ops[1:]:
        others = [a for a in args if a != previous]
        if opcode == "dot" or len(others) != len(args) - 1 or not set(others) <= params:
            return f"{opcode} is not a link of one chain after the product"
        previous = name
    return None


def unsafe_fusion(hlo: str) -> str | None:
    """The first oneDNN fusion of `hlo` outside what is known to run
    (`_unsafe`), described; None if all are (or there are none)."""
    for name, body in fusions(hlo):
        why = _unsafe(body)
        if why is not None:
            ops = ", ".join(o for _, o, _ in body if o != "parameter")
            return f"{name}: {ops}: {why}"
    return None


def uses_onednn(hlo: str) -> bool:
    """Whether any product of `hlo` runs in oneDNN."""
    return '"kind":"__onednn_fusion"' in hlo


def compiled_text(jitted: Any, *args: Any) -> str:
    """The HLO text of `jitted` (a `jax.jit`) compiled for `args`, which a
    call with the same arguments then reuses. JAX's persistent compilation
    cache cannot hold a oneDNN fusion; its warning is silenced here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*thunk kind: onednn", UserWarning)
        return jitted.lower(*args).compile().as_text()
