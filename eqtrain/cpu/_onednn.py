"""oneDNN's products for `eqtrain.jit`'s steps on the CPU, and the check that
keeps them from taking the process down.

With `xla_cpu_use_onednn` and the `dot` fusion type, XLA:CPU gives each matrix
product to oneDNN, fused with the elementwise operations around it
(`__onednn_fusion`), which can train faster than Eigen's products
(docs/performance.md, "oneDNN's products"). But jaxlib 0.10 grows a
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

The same jaxlib also computes some fusions wrongly, silently. XLA gives a
fusion's result the memory of an elementwise input that dies there, and
oneDNN, not told, reads that input after writing over it: `(x @ y) * sin(z)`
and `(x @ y) * 0.125` over long products come out far off, `(x @ y) * sin(z) +
w` with any length (`tests/test_onednn.py`). Only an input that oneDNN adds
(`x @ y + sin(z)`, its "sum" operation, made to accumulate into the result)
computed right in every case tested. So the
check also reads the compilation's buffer assignment (XLA's dump of it,
`compile_checked`) and refuses a step in which a oneDNN fusion shares memory
with an input that anything but an addition reads (`shared_buffer`).
"""

import atexit
import glob
import os
import re
import shutil
import tempfile
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
    them (`_tuning.Choice.compiler_options`), else none."""
    return dict(_active)


MAX_FUSED = 3
"""Elementwise operations a oneDNN fusion may hold after its product (a
product with four additions ran in jaxlib 0.10, five aborted; later XLA fuses
at most four operations in all)."""

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(?:\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\(([^)]*)\)"
)
_OPERAND = re.compile(r"%([\w.\-]+)")
_ONEDNN_CALL = re.compile(r"calls=%?([\w.\-]+).*\"kind\":\"__onednn_fusion\"")

Instruction = tuple[str, str, list[str]]
"""`(name, opcode, operand names)` of one HLO instruction (a parameter's:
`[its number]`)."""


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
            operands = (
                [args.strip()] if opcode == "parameter" else _OPERAND.findall(args)
            )
            current.append((name, opcode, operands))
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
    aborted jaxlib 0.10 with as few as three operations.)"""
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


_VALUE = re.compile(r"^ value: <(\d+) [^>]*> \(size=(\d+),offset=(\d+)\)")
_ALLOCATION = re.compile(r"^allocation (\d+):")
_USED = re.compile(r"^<(\d+) ([^\s{]+)")
_USE = re.compile(r"^  ([\w.\-]+), operand (\d+)")


def shared_buffer(hlo: str, assignment: str) -> str | None:
    """The first oneDNN fusion of `hlo` whose result shares memory with one of
    its inputs, other than an input only added to the product, by the
    compilation's buffer assignment (`assignment`: XLA's
    `*buffer-assignment*.txt` dumps, concatenated), described; None if none
    does. Such a fusion computes wrong results in jaxlib 0.10 (see above)."""
    calls = dict(_fusion_calls(hlo))  # fusion -> its fused computation
    fused = set(calls)
    if not fused:
        return None
    where: dict[str, tuple[int, int, int]] = {}  # value id -> allocation, start, end
    defined: dict[str, list[str]] = {}  # fusion -> the ids of its results
    inputs: dict[str, list[tuple[str, int]]] = {}  # fusion -> (value id, operand)
    allocation, value = None, None
    for line in assignment.splitlines():
        m = _ALLOCATION.match(line)
        if m:
            allocation = int(m.group(1))
            continue
        m = _VALUE.match(line)
        if m and allocation is not None:
            size, offset = int(m.group(2)), int(m.group(3))
            where[m.group(1)] = (allocation, offset, offset + size)
            continue
        m = _USED.match(line)
        if m:
            value = m.group(1)
            if m.group(2) in fused:
                defined.setdefault(m.group(2), []).append(value)
            continue
        m = _USE.match(line)
        if m and value is not None and m.group(1) in fused:
            inputs.setdefault(m.group(1), []).append((value, int(m.group(2))))
    bodies = _computations(hlo)
    for name in sorted(fused):
        for out in defined.get(name, []):
            if out not in where:
                continue
            a, start, end = where[out]
            for value, operand in inputs.get(name, []):
                b, s0, s1 = where.get(value, (None, 0, 0))
                if b != a or s1 <= start or end <= s0:
                    continue
                users = _parameter_users(bodies.get(calls.get(name, ""), []), operand)
                if users != {"add"}:
                    why = ", ".join(sorted(users)) or "the product"
                    return (
                        f"{name}: its result shares memory with its input "
                        f"{operand}, which {why} reads"
                    )
    return None


def _fusion_calls(hlo: str) -> Iterator[tuple[str, str]]:
    """`(instruction, fused computation)` of each oneDNN fusion of `hlo`."""
    for line in hlo.splitlines():
        call = _ONEDNN_CALL.search(line)
        m = _INSTRUCTION.match(line)
        if call and m:
            yield m.group(1), call.group(1)


def _parameter_users(body: list[Instruction], number: int) -> set[str]:
    """The opcodes in a fused computation `body` that read its parameter
    `number`."""
    param = next(
        (n for n, o, a in body if o == "parameter" and a == [str(number)]), None
    )
    return {o for _, o, args in body if param is not None and param in args}


def compile_checked(jitted: Any, dump: str, *args: Any) -> tuple[str, str | None]:
    """Compile `jitted` (a `jax.jit` whose options dump to the folder `dump`,
    `dump_options`) for `args`, as a call with the same arguments then reuses:
    its HLO text, and why its oneDNN fusions cannot run (`unsafe_fusion`,
    `shared_buffer`) or None. The dump is removed."""
    shutil.rmtree(dump, ignore_errors=True)
    try:
        hlo = compiled_text(jitted, *args)
        if not uses_onednn(hlo):
            return hlo, None
        bad = unsafe_fusion(hlo)
        if bad is not None:
            return hlo, bad
        files = sorted(glob.glob(os.path.join(dump, "*buffer-assignment*.txt")))
        if not files:
            return hlo, "XLA wrote no buffer assignment to check it against"
        text = "\n".join(open(f, encoding="utf-8").read() for f in files)
        return hlo, shared_buffer(hlo, text)
    finally:
        shutil.rmtree(dump, ignore_errors=True)


def dump_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """`options` plus a fresh folder for XLA to dump each compilation into
    (`compile_checked` reads and removes it), and that folder's path."""
    dump = tempfile.mkdtemp(prefix="eqtrain-onednn-")
    atexit.register(shutil.rmtree, dump, True)  # a compilation outside the check
    return {**options, "xla_dump_to": dump}, dump


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


class StepOptions:
    """oneDNN's products as `eqtrain.jit`'s checked options
    (`eqtrain.CheckedOptions`): each compilation dumps to a fresh folder, and
    a step whose oneDNN fusions `compile_checked` refuses is compiled again
    without them (Eigen's products) before it runs. `note`: `"onednn"` once
    a compiled step runs them, or why it does not (`"eigen: ..."`); `"eigen"`
    where XLA gave no product to oneDNN; None before the first check."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        self._base = dict(options)
        self.note: str | None = None

    def options(self, dump: bool) -> dict[str, Any]:
        import jax

        if not self._base or jax.default_backend() != "cpu":
            return {}
        return dump_options(self._base)[0] if dump else dict(self._base)

    def check(self, jitted: Any, options: Mapping[str, Any], *args: Any) -> bool:
        hlo, bad = compile_checked(jitted, options["xla_dump_to"], *args)
        if bad is not None:
            self.note = f"eigen: a oneDNN fusion jaxlib cannot run ({bad})"
            return False
        if uses_onednn(hlo):
            self.note = "onednn"
        elif self.note is None:
            self.note = "eigen"
        return True
