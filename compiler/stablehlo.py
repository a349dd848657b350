"""StableHLO modules: parse, read the signature of ``@main``, specialize to static shapes.

Every program format ends here: a module plus the concrete input avals becomes a
module whose ``@main`` has static shapes, ready for XLA. Specializing wraps the
program's ``@main`` in a new ``@main`` with the concrete types, converting each
argument to the type the original expects (the way jax calls an exported module),
then runs jax's shape refinement, which also checks jax's shape assertions.
Wrapping also drops the program's own argument attributes, such as buffer
donation: a program must never consume the arrays it is given, since they may be
other futures' outputs. Donation is the caller's to ask for, per call
(``specialize(..., donate)``), and the server's to honour only with buffers
nobody else holds. Only the shardings of ``@main``'s arguments and results are
kept (``sdy.sharding``, ``mhlo.sharding``): a sharded program's layout on its
devices (``device_count``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import cast

from jax._src.interpreters import mlir
from jax._src.lib import _jax
from jax._src.lib.mlir import ir
from jaxlib.mlir.dialects import func as func_d
from jaxlib.mlir.dialects import stablehlo as hlo

from jitserve.compiler.errors import (
    CompilerError,
    InvalidProgram,
    SignatureMismatch,
    message_of,
)
from jitserve.compiler.records import Limits
from jitserve.compiler.safety import check_text_nesting
from jitserve.wire import DTYPES, Aval

__all__ = [
    "MLIR_BYTECODE_MAGIC",
    "TOKEN_AVAL",
    "device_count",
    "main_result_types",
    "main_signature",
    "module_name",
    "new_context",
    "parse_module",
    "partitions",
    "specialize",
    "to_bytecode",
]

MLIR_BYTECODE_MAGIC = b"ML\xefR"
_ORIGINAL_MAIN = "_jitserve_program_main"
# More devices than any host has: a module that says so is refused, not believed.
_MAX_DEVICES = 1 << 16
# The attributes of @main's arguments and results that specializing keeps.
_SHARDING_ATTRS = ("sdy.sharding", "mhlo.sharding")


def new_context() -> ir.Context:
    """A fresh MLIR context with jax's dialects. Contexts are not shared across threads."""
    return mlir.make_ir_context()


def parse_module(data: bytes, ctx: ir.Context, limits: Limits) -> ir.Module:
    """Parse MLIR text, MLIR bytecode or a VHLO portable artifact. Untrusted input."""
    limits.check_program_bytes(data)
    try:
        if data.startswith(MLIR_BYTECODE_MAGIC):
            if b"StableHLO_v" in data[:64]:
                module: ir.Module = _jax.mlir.deserialize_portable_artifact(data, ctx)
                return module
            return ir.Module.parse(data, context=ctx)
        text = data.decode("utf-8")
        check_text_nesting(text, limits)
        return ir.Module.parse(text, context=ctx)
    except UnicodeDecodeError:
        raise InvalidProgram("program is neither MLIR bytecode nor UTF-8 MLIR text") from None
    except CompilerError:
        raise
    except Exception as e:  # the MLIR bindings raise several types; all mean "not MLIR"
        raise InvalidProgram(f"cannot parse the program as StableHLO: {message_of(e)}") from None


def main_signature(module: ir.Module, *, tokens: bool = False
                   ) -> tuple[tuple[Aval, ...], tuple[Aval, ...]]:
    """The input and output avals of ``@main``; dynamic dimensions are ``None``.

    ``tokens``: a ``!stablehlo.token`` (which jax's own programs pass and return: ordered
    effects, ``jax.lax.create_token``) is ``TOKEN_AVAL``, an array of no bytes, rather than
    refused.
    """
    ftype = _function_type(_main(module))
    return (tuple(_aval(t, "input", tokens) for t in ftype.inputs),
            tuple(_aval(t, "output", tokens) for t in ftype.results))


def partitions(module: ir.Module) -> tuple[int, int]:
    """``module``'s ``mhlo.num_partitions`` and ``mhlo.num_replicas`` (1 where it does not say)."""
    attrs = module.operation.attributes
    out = []
    for name in ("mhlo.num_partitions", "mhlo.num_replicas"):
        value = 1
        if name in attrs:
            try:
                value = ir.IntegerAttr(attrs[name]).value
            except (ValueError, TypeError):
                raise InvalidProgram(f"module attribute {name} is not an integer") from None
            if not 1 <= value <= _MAX_DEVICES:
                raise InvalidProgram(f"module attribute {name} is {value}; expected 1 to "
                                     f"{_MAX_DEVICES}")
        out.append(value)
    return out[0], out[1]


def device_count(module: ir.Module) -> int:
    """The devices one run of ``module`` takes: partitions x replicas."""
    p, r = partitions(module)
    return p * r


def main_result_types(module: ir.Module) -> list[ir.Type]:
    """The MLIR types of ``@main``'s results."""
    return list(_function_type(_main(module)).results)


# What a token stands for in a signature (``main_signature(tokens=True)``): no bytes.
TOKEN_AVAL = Aval((0,), "bool")


def specialize(module: ir.Module, in_avals: Sequence[Aval],
               donate: Sequence[int] = ()) -> ir.Module:
    """A module whose ``@main`` takes exactly ``in_avals`` (static) and has static shapes.

    ``donate``: inputs XLA may consume, marked as jax marks ``donate_argnums``: an
    input aliases the first unclaimed output of its type (``tf.aliasing_output``),
    else it is a buffer donor that XLA may reuse for anything.
    """
    main = _main(module)
    ftype = _function_type(main)
    if len(in_avals) != len(ftype.inputs):
        raise SignatureMismatch(f"program takes {len(ftype.inputs)} inputs, got {len(in_avals)}")
    with module.context, ir.Location.unknown():
        new_types = [_ir_type(a) for a in in_avals]
        for i, (want, got) in enumerate(zip(ftype.inputs, new_types)):
            if not _compatible(want, got):
                raise SignatureMismatch(f"input {i}: program expects {want}, got {got}")
        shardings = (_kept_attrs(main, "arg_attrs", len(new_types)),
                     _kept_attrs(main, "res_attrs", len(ftype.results)))
        symtab = ir.SymbolTable(module.operation)
        symtab.set_symbol_name(main, _ORIGINAL_MAIN)
        main.attributes["sym_visibility"] = ir.StringAttr.get("private")
        _add_wrapper(module, ftype, new_types, donate, shardings)
    # Always refine: it resolves dynamic shapes anywhere in the module (jax leaves
    # them inside polymorphic exports), checks shape assertions, and verifies that
    # what XLA gets is fully static.
    return _refine(module)


def to_bytecode(module: ir.Module) -> bytes:
    return mlir.module_to_bytecode(module)


def _kept_attrs(main: ir.Operation, name: str, n: int) -> list[dict[str, ir.Attribute]]:
    """The sharding attributes of ``main``'s ``n`` arguments or results (``name``)."""
    out: list[dict[str, ir.Attribute]] = [{} for _ in range(n)]
    if name not in main.attributes:
        return out
    for i, entry in enumerate(ir.ArrayAttr(main.attributes[name])):
        if i < n:
            attrs = ir.DictAttr(entry)
            out[i] = {k: attrs[k] for k in _SHARDING_ATTRS if k in attrs}
    return out


def _add_wrapper(module: ir.Module, ftype: ir.FunctionType, new_types: Sequence[ir.Type],
                 donate: Sequence[int],
                 shardings: tuple[list[dict[str, ir.Attribute]], list[dict[str, ir.Attribute]]]
                 ) -> None:
    arg_shardings, result_shardings = shardings
    with ir.InsertionPoint(module.body):
        wrapper = func_d.FuncOp("main", ir.FunctionType.get(new_types, list(ftype.results)))
        wrapper.attributes["sym_visibility"] = ir.StringAttr.get("public")
        donation = _donation_attrs(new_types, list(ftype.results), donate)
        if donate or any(arg_shardings):
            wrapper.arg_attrs = ir.ArrayAttr.get(
                [ir.DictAttr.get({**a, **d}) for a, d in zip(arg_shardings, donation)])
        if any(result_shardings):
            wrapper.attributes["res_attrs"] = ir.ArrayAttr.get(
                [ir.DictAttr.get(r) for r in result_shardings])
        # mypy sees the generated FuncOp; jaxlib's func.py redefines it with this method
        block = wrapper.add_entry_block()  # type: ignore[attr-defined]
        with ir.InsertionPoint(block):
            args = [a if a.type == t else hlo.convert(t, a)
                    for t, a in zip(ftype.inputs, block.arguments)]
            call = func_d.CallOp(list(ftype.results), ir.FlatSymbolRefAttr.get(_ORIGINAL_MAIN), args)
            func_d.ReturnOp(call.results)


def _donation_attrs(inputs: Sequence[ir.Type], results: list[ir.Type],
                    donate: Sequence[int]) -> list[dict[str, ir.Attribute]]:
    unclaimed = list(range(len(results)))
    attrs = []
    for i, t in enumerate(inputs):
        entry: dict[str, ir.Attribute] = {}
        if i in donate:
            match = next((j for j in unclaimed if results[j] == t), None)
            if match is None:
                entry["jax.buffer_donor"] = ir.BoolAttr.get(True)
            else:
                unclaimed.remove(match)
                entry["tf.aliasing_output"] = ir.IntegerAttr.get(
                    ir.IntegerType.get_signless(32), match)
        attrs.append(entry)
    return attrs


def _refine(module: ir.Module) -> ir.Module:
    try:  # returns a module in a context of its own
        return mlir.refine_polymorphic_shapes(module)
    except Exception as e:
        cause = e.__cause__ or e
        raise SignatureMismatch(f"the inputs do not fit the program's shapes: {message_of(cause)}") from None


def module_name(module: ir.Module) -> str:
    """The module's ``sym_name`` (jax names it ``jit_<function>``); "" when it has none."""
    attributes = module.operation.attributes
    if "sym_name" not in attributes:
        return ""
    return ir.StringAttr(attributes["sym_name"]).value[:256]


def _main(module: ir.Module) -> ir.Operation:
    for view in module.body.operations:
        op = view.operation
        if op.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
            return op
    raise InvalidProgram("the module has no func.func @main")


def _function_type(main: ir.Operation) -> ir.FunctionType:
    return ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)


@functools.cache
def _dtype_by_ir_name() -> dict[str, str]:
    with new_context():
        return {str(mlir.dtype_to_ir_type(dt)): name for name, dt in DTYPES.items()}


def _aval(t: ir.Type, where: str, tokens: bool = False) -> Aval:
    if tokens and str(t) == "!stablehlo.token":
        return TOKEN_AVAL
    if not isinstance(t, ir.RankedTensorType):
        raise InvalidProgram(f"@main {where} of type {t} is not a ranked tensor")
    dtype = _dtype_by_ir_name().get(str(t.element_type))
    if dtype is None:
        raise InvalidProgram(f"@main {where} has unsupported element type {t.element_type}")
    shape = tuple(None if t.is_dynamic_dim(i) else d for i, d in enumerate(t.shape))
    return Aval(shape, dtype)


def _ir_type(aval: Aval) -> ir.RankedTensorType:
    shape = cast("list[int]", list(aval.shape))  # static: specialize's avals are concrete
    return ir.RankedTensorType.get(shape, mlir.dtype_to_ir_type(DTYPES[aval.dtype]))


def _compatible(want: ir.Type, got: ir.RankedTensorType) -> bool:
    if not isinstance(want, ir.RankedTensorType) or want.element_type != got.element_type:
        return False
    if want.rank != got.rank:
        return False
    return all(want.is_dynamic_dim(i) or w == g for i, (w, g) in enumerate(zip(want.shape, got.shape)))
