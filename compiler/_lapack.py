"""Shape rules for the LAPACK custom calls a program may contain.

jaxlib's LAPACK kernels size their work from the operands and write results
without checking the declared result shapes. A hostile module that declares a
result smaller than the kernel writes would corrupt the server's memory. So each
allowed LAPACK target has a rule giving its exact result types from its operand
types and the attributes that change them (the rules mirror jax's lowerings in
jax/_src/lax/linalg.py; tests/compiler/test_lapack_rules.py checks them against
jax's own lowering for every dtype). compiler._cusolver reuses these rules for the
CUDA kernels that write the same results.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from jax._src.lib.mlir import ir

from jitserve.compiler.errors import UnsafeProgram

# ELEMENT, REAL, RULES, Rule, Typ, check_call, expect_operands and matrix are shared
# with compiler._cusolver, whose kernels write the same results for the same inputs.
__all__ = [
    "ELEMENT",
    "REAL",
    "RULES",
    "Rule",
    "Typ",
    "check_call",
    "check_lapack_call",
    "expect_operands",
    "is_lapack_target",
    "matrix",
]

_TARGET = re.compile(r"^lapack_([sdcz])([a-z]+)_ffi$")
ELEMENT = {"s": "f32", "d": "f64", "c": "complex<f32>", "z": "complex<f64>"}
REAL = {"s": "f32", "d": "f64", "c": "f32", "z": "f64"}
_COMPLEX = {"s": "complex<f32>", "d": "complex<f64>", "c": "complex<f32>", "z": "complex<f64>"}

Shape = tuple[int, ...]
Typ = tuple[Shape, str]
# A rule: (kind letter, operand types, backend-config attributes) -> the result types.
Rule = Callable[[str, list[Typ], dict[str, int]], list[Typ]]


def is_lapack_target(target: str) -> bool:
    return _TARGET.match(target) is not None


def check_lapack_call(op: ir.Operation, target: str) -> None:
    """Raise ``UnsafeProgram`` unless ``op``'s result types are exactly what the kernel writes."""
    m = _TARGET.match(target)
    if m is None or m.group(2) not in RULES:
        raise UnsafeProgram(f"custom_call target {target!r} has no shape rule")
    kind, family = m.groups()
    core_rank = 1 if family == "gtsv" else 2  # gtsv's first operand is a vector
    check_call(op, target, RULES[family], {ELEMENT[kind]: kind}, core_rank)


def check_call(op: ir.Operation, target: str, rule: Rule, kinds: dict[str, str], core_rank: int) -> None:
    """Compare ``op``'s results with ``rule``'s; shared with compiler._cusolver.

    ``kinds`` maps each element type the first operand may have to the kind
    letter the rule takes (LAPACK names it in the target, cuSOLVER does not);
    ``core_rank`` is the first operand's rank without batch dimensions.
    """
    operands = [_typ(v.type, target) for v in op.operands]
    kind = kinds.get(operands[0][1]) if operands else None
    if kind is None:
        raise UnsafeProgram(f"{target}: first operand must be of element type {' or '.join(kinds)}")
    attrs = _backend_config(op, target)
    try:
        expected = rule(kind, operands, attrs)
    except (IndexError, ValueError, KeyError) as e:
        raise UnsafeProgram(f"{target}: operands {_fmt(operands)} do not fit the kernel ({e})") from None
    _check_batch_attr(op, len(operands[0][0]) - core_rank, target)
    actual = [_typ(r.type, target) for r in op.results]
    # A rule returns a tuple of lists where the kernel writes several layouts alike.
    if actual not in (expected if isinstance(expected, tuple) else (expected,)):
        raise UnsafeProgram(
            f"{target}: results {_fmt(actual)} do not match what the kernel writes for "
            f"operands {_fmt(operands)}: {_fmt(expected)}")


def _typ(t: ir.Type, target: str) -> Typ:
    if not isinstance(t, ir.RankedTensorType) or not t.has_static_shape:
        raise UnsafeProgram(f"{target}: operands and results must be static tensors, got {t}")
    return tuple(t.shape), str(t.element_type)


def _fmt(types: list[Typ]) -> str:
    return ", ".join(f"{e}[{','.join(map(str, s))}]" for s, e in types)


def _backend_config(op: ir.Operation, target: str) -> dict[str, int]:
    """The integer and boolean (as ``bool``) attributes the kernel is given.

    jax writes them in ``mhlo.backend_config``. A dictionary ``backend_config``
    (API version 4) would reach the kernel instead of those, unchecked, so it is refused.
    """
    attributes = op.attributes
    if "backend_config" in attributes and isinstance(attributes["backend_config"], ir.DictAttr):
        raise UnsafeProgram(f"{target}: attributes must be in mhlo.backend_config, as jax writes "
                            "them, not in a backend_config dictionary")
    if "mhlo.backend_config" not in attributes:
        return {}
    config = attributes["mhlo.backend_config"]
    if not isinstance(config, ir.DictAttr):
        raise UnsafeProgram(f"{target}: mhlo.backend_config must be a dictionary, got {config}")
    out: dict[str, int] = {}
    for i in range(len(config)):
        named = config[i]
        if isinstance(named.attr, ir.BoolAttr):
            out[named.name] = ir.BoolAttr(named.attr).value
        elif isinstance(named.attr, ir.IntegerAttr):
            out[named.name] = ir.IntegerAttr(named.attr).value
    return out


def _check_batch_attr(op: ir.Operation, batch_rank: int, target: str) -> None:
    if "mhlo.frontend_attributes" not in op.attributes:
        return
    front = ir.DictAttr(op.attributes["mhlo.frontend_attributes"])
    if "num_batch_dims" in front:
        declared = ir.StringAttr(front["num_batch_dims"]).value
        if declared != str(batch_rank):
            raise UnsafeProgram(f"{target}: num_batch_dims={declared} does not fit its operands")


def matrix(t: Typ, square: bool = False) -> tuple[Shape, int, int]:
    shape = t[0]
    if len(shape) < 2:
        raise ValueError("expected a matrix operand")
    batch, m, n = shape[:-2], shape[-2], shape[-1]
    if square and m != n:
        raise ValueError("expected a square matrix")
    return batch, m, n


def expect_operands(operands: list[Typ], count: int = 1) -> None:
    if len(operands) != count:
        raise ValueError(f"expected {count} operand(s), got {len(operands)}")


def _potrf(k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    expect_operands(ops)
    b, _, _ = matrix(ops[0], square=True)
    return [ops[0], (b, "i32")]


def _getrf(k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    expect_operands(ops)
    b, m, n = matrix(ops[0])
    return [ops[0], ((*b, min(m, n)), "i32"), (b, "i32")]


def _geqrf(k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    expect_operands(ops)
    b, m, n = matrix(ops[0])
    return [ops[0], ((*b, min(m, n)), ELEMENT[k])]


def _orgqr(k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    expect_operands(ops, 2)
    b, m, n = matrix(ops[0])
    tau_shape, tau_el = ops[1]
    if tau_el != ELEMENT[k] or tau_shape[:-1] != b or not (tau_shape[-1] <= n <= m):
        raise ValueError("tau must be [..., k] with k <= n <= m")
    return [ops[0]]


def _syevd(k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    expect_operands(ops)
    b, n, _ = matrix(ops[0], square=True)
    return [ops[0], ((*b, n), REAL[k]), (b, "i32")]


def _geev(k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    expect_operands(ops)
    b, n, _ = matrix(ops[0], square=True)
    vectors = [((*b, n, n), _COMPLEX[k])] * 2
    values = [((*b, n), ELEMENT[k])] * (2 if k in "sd" else 1)
    return [*values, *vectors, (b, "i32")]


def _gesdd(k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    expect_operands(ops)
    b, m, n = matrix(ops[0])
    mode, r = attrs.get("mode"), min(m, n)
    if mode not in (ord("A"), ord("S"), ord("N")):
        raise ValueError(f"unsupported mode {mode}")
    e = ELEMENT[k]

    def results(u: tuple[int, int], vt: tuple[int, int]) -> list[Typ]:
        return [ops[0], ((*b, r), REAL[k]), ((*b, *u), e), ((*b, *vt), e), (b, "i32")]

    full, reduced = results((m, m), (n, n)), results((m, r), (r, n))
    if mode == ord("N"):  # no U or V^T is written: jax declares either layout
        return full, reduced  # type: ignore[return-value]
    return reduced if mode == ord("S") else full


def _trsm(k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    expect_operands(ops, 2)
    b, side_n, _ = matrix(ops[0], square=True)
    bb, m, n = matrix(ops[1])
    side = attrs.get("side")
    if bb != b or ops[1][1] != ELEMENT[k] or side not in (ord("L"), ord("R")):
        raise ValueError("b must share a's batch and dtype; side must be L or R")
    if side_n != (m if side == ord("L") else n):
        raise ValueError("a's size must match b on the solved side")
    return [ops[1]]


def _gtsv(k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    expect_operands(ops, 4)
    b, m, _ = matrix(ops[3])
    if any(t != ((*b, m), ELEMENT[k]) for t in ops[:3]):
        raise ValueError("dl, d, du must be [..., m] with b [..., m, n]")
    return [*ops, (b, "i32")]


def _gees(k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    expect_operands(ops)
    b, n, _ = matrix(ops[0], square=True)
    values = [((*b, n), ELEMENT[k])] * (2 if k in "sd" else 1)
    return [ops[0], ops[0], *values, (b, "i32"), (b, "i32")]


def _gehrd(k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    expect_operands(ops)
    b, n, _ = matrix(ops[0], square=True)
    low, high = attrs.get("low"), attrs.get("high")
    if low is None or high is None or not 1 <= low <= high <= max(n, 1):
        raise ValueError(f"need 1 <= low <= high <= n, got low={low} high={high}")
    return [ops[0], ((*b, max(n - 1, 0)), ELEMENT[k]), (b, "i32")]


def _sytrd(k: str, ops: list[Typ], attrs: dict[str, int]) -> list[Typ]:
    expect_operands(ops)
    b, n, _ = matrix(ops[0], square=True)
    off = max(n - 1, 0)
    return [ops[0], ((*b, n), REAL[k]), ((*b, off), REAL[k]), ((*b, off), ELEMENT[k]), (b, "i32")]


RULES: dict[str, Rule] = {
    "potrf": _potrf, "getrf": _getrf, "geqrf": _geqrf, "orgqr": _orgqr, "ungqr": _orgqr,
    "syevd": _syevd, "heevd": _syevd, "geev": _geev, "gesdd": _gesdd, "trsm": _trsm,
    "gtsv": _gtsv, "gees": _gees, "gehrd": _gehrd, "sytrd": _sytrd, "hetrd": _sytrd,
}
