"""Program formats in, one ``Program`` type out; and each format's way to a module.

A ``Program`` is what a client uploaded, decoded and validated once. Compiling it
for concrete inputs goes through ``lower``: each format yields a StableHLO module
whose ``@main`` takes the flat input leaves, and from there every format shares the
same path (``compiler.compile``).

Program bytes are untrusted: decoding never unpickles or evaluates anything. A
``jax_export`` artifact is a flatbuffer read by jax's own deserializer; its module
is a VHLO artifact parsed by MLIR; a ``jaxpr`` document is plain data decoded
against a primitive allowlist.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax import tree_util
from jax._src.lib.mlir import ir

from jitserve.compiler import stablehlo
from jitserve.compiler.errors import (
    CompilerError,
    InvalidProgram,
    LimitExceeded,
    PlatformMismatch,
    SignatureMismatch,
    TooManyDevices,
    UnsafeProgram,
    message_of,
)
from jitserve.compiler.jaxpr import DecodedJaxpr, decode_document
from jitserve.compiler.records import Limits, Program
from jitserve.compiler.safety import check_module
from jitserve.compiler.trees import treedef_to_json
from jitserve.wire import DTYPES, Aval, ProgramFormat, WireError

__all__ = ["decode_program", "lower"]


def decode_program(data: bytes, format: str | None, *, platform: str, limits: Limits,
                   devices: int = 1) -> Program:
    """Decode and validate ``data``; ``format`` is detected when ``None``.

    Raises a ``CompilerError`` naming the problem: unreadable bytes, a disallowed
    op or custom call, a size over ``limits``, an export for other platforms, or a
    sharded program for more than ``devices`` devices (``TooManyDevices``).
    """
    limits.check_program_bytes(data)
    fmt = _format(format) if format else _detect(data)
    decoder = {ProgramFormat.JAX_EXPORT: _decode_export, ProgramFormat.STABLEHLO: _decode_stablehlo,
               ProgramFormat.JAXPR: _decode_jaxpr}[fmt]
    try:
        program = decoder(bytes(data), platform, limits)
    except InvalidProgram as e:
        if format or fmt is not ProgramFormat.JAX_EXPORT:
            raise
        raise InvalidProgram(  # detection fell through: say what was tried
            "unrecognized program: not StableHLO (MLIR text or bytecode), not a JSON jaxpr "
            "document, and not a jax_export artifact (Exported.serialize() bytes); pass "
            "format= to name it") from e
    if program.nr_devices > devices:
        raise TooManyDevices(
            f"program needs {program.nr_devices} devices; this server runs programs on at "
            f"most {devices} (its largest device group: JITSERVE_RUNTIME_DEVICES, and "
            "JITSERVE_CPU_DEVICES on CPU)")
    return program


def lower(program: Program, in_avals: Sequence[Aval], ctx: ir.Context, limits: Limits,
          devices: Sequence[Any] = ()) -> ir.Module:
    """The program as a module in ``ctx`` whose ``@main`` takes the flat ``in_avals``.

    ``devices``: the ``program.nr_devices`` devices a sharded program runs on.
    """
    if program.format is ProgramFormat.STABLEHLO:
        return stablehlo.parse_module(program.payload, ctx, limits)
    jit: Callable[..., Any] = functools.partial(jax.jit, keep_unused=True)
    context: Any = contextlib.nullcontext()
    if program.format is ProgramFormat.JAX_EXPORT:
        exp = _deserialize_export(program.payload)
        fn = _export_as_flat_function(exp)
        if program.nr_devices > 1:  # under a mesh of ours shaped as the export's
            mesh = _mesh_of(exp, devices[:program.nr_devices])
            context = jax.set_mesh(mesh)
            jit = functools.partial(jit, in_shardings=tuple(exp.in_shardings_jax(mesh)),
                                    out_shardings=list(exp.out_shardings_jax(mesh)))
    else:
        fn = _jaxpr_document(program.payload, limits).as_function()
    structs = [jax.ShapeDtypeStruct(a.shape, DTYPES[a.dtype], weak_type=p.weak_type)
               for a, p in zip(in_avals, program.in_avals)]
    try:
        with context:
            module = jit(fn).lower(*structs).compiler_ir("stablehlo")
    except CompilerError:
        raise
    except Exception as e:  # jax says why the inputs do not fit (symbolic dims, dtypes)
        raise SignatureMismatch(f"the inputs do not fit the program: {message_of(e)}") from None
    assert module is not None  # None only for a dialect jax does not know
    return stablehlo.parse_module(stablehlo.to_bytecode(module), ctx, limits)


def _export_sharding(exp: Any) -> dict[str, Any]:
    """A sharded export's mesh and shardings, as text for records (``Program.sharding``)."""
    if getattr(exp, "_has_named_shardings", False):
        named = [*exp._in_named_shardings, *exp._out_named_shardings]
        mesh = next((s.mesh for s in named if s is not None), None)

        def text(shardings: Sequence[Any]) -> list[str | None]:
            return [None if s is None else str(s.spec) for s in shardings]

        return {"mesh": None if mesh is None else dict(zip(mesh.axis_names, mesh.axis_sizes)),
                "in": text(exp._in_named_shardings), "out": text(exp._out_named_shardings)}
    return {"mesh": None,
            "in": [None if h is None else str(h) for h in exp.in_shardings_hlo],
            "out": [None if h is None else str(h) for h in exp.out_shardings_hlo]}


def _mesh_of(exp: Any, devices: Sequence[Any]) -> Any:
    """A ``Mesh`` of ``devices`` like the one ``exp`` was exported for: its named
    shardings' axis names, sizes and types, else one axis over all of them."""
    named = [s for s in (*exp._in_named_shardings, *exp._out_named_shardings)
             if s is not None] if getattr(exp, "_has_named_shardings", False) else []
    if named:
        abstract = named[0].mesh
        return jax.sharding.Mesh(np.array(devices).reshape(abstract.axis_sizes),
                                 abstract.axis_names, axis_types=abstract.axis_types)
    return jax.sharding.Mesh(np.array(devices), ("devices",))


def _format(name: str) -> ProgramFormat:
    try:
        return ProgramFormat(name)
    except ValueError:
        raise InvalidProgram(
            f"unknown program format {name!r}; expected one of {[f.value for f in ProgramFormat]}"
        ) from None


def _detect(data: bytes) -> ProgramFormat:
    if data.startswith(stablehlo.MLIR_BYTECODE_MAGIC):
        return ProgramFormat.STABLEHLO
    head = data[:4096].lstrip()
    # A JSON jaxpr document; a msgpack one must be named (format=jaxpr), since its
    # first byte could equally be a flatbuffer's root offset.
    if head.startswith(b"{") and b"\x00" not in data[:16]:
        return ProgramFormat.JAXPR
    if b"func.func" in data[:1 << 20] or head.startswith((b"module", b"#loc", b"//")):
        return ProgramFormat.STABLEHLO
    return ProgramFormat.JAX_EXPORT


def _program(data: bytes, fmt: ProgramFormat, **fields: Any) -> Program:
    return Program(hashlib.sha256(data).hexdigest(), fmt, data, **fields)


def _decode_stablehlo(data: bytes, platform: str, limits: Limits) -> Program:
    with stablehlo.new_context() as ctx:
        module = stablehlo.parse_module(data, ctx, limits)
        check_module(module, limits)
        in_avals, out_avals = stablehlo.main_signature(module)
        nr_devices = stablehlo.device_count(module)
    _check_inputs(in_avals, limits)
    static_out = out_avals if all(a.is_static for a in out_avals) else None
    return _program(data, ProgramFormat.STABLEHLO, in_avals=in_avals, out_avals=static_out,
                    nr_devices=nr_devices)


def _decode_export(data: bytes, platform: str, limits: Limits) -> Program:
    exp = _deserialize_export(data)
    if platform not in exp.platforms:
        raise PlatformMismatch(
            f"program was exported for platforms {list(exp.platforms)}; this server runs "
            f"{platform!r} (export with platforms=[{platform!r}, ...])")
    if exp.ordered_effects or exp.unordered_effects:
        raise UnsafeProgram(
            f"program has effects {[*exp.ordered_effects, *exp.unordered_effects]}; "
            "jitserve runs pure programs only (no callbacks, no debug printing)")
    with stablehlo.new_context() as ctx:
        check_module(stablehlo.parse_module(exp.mlir_module_serialized, ctx, limits), limits)
    in_avals = tuple(_export_aval(a) for a in exp.in_avals)
    _check_inputs(in_avals, limits)
    return _program(
        data, ProgramFormat.JAX_EXPORT, in_avals=in_avals,
        out_avals=tuple(_export_aval(a) for a in exp.out_avals),
        in_tree=treedef_to_json(exp.in_tree), out_tree=treedef_to_json(exp.out_tree),
        platforms=tuple(exp.platforms), name=str(exp.fun_name)[:200],
        nr_devices=max(1, int(exp.nr_devices)),
        sharding=_export_sharding(exp) if exp.nr_devices > 1 else None)


def _decode_jaxpr(data: bytes, platform: str, limits: Limits) -> Program:
    decoded = _jaxpr_document(data, limits)
    _check_inputs(decoded.in_avals, limits)
    return _program(data, ProgramFormat.JAXPR, in_avals=tuple(decoded.in_avals),
                    out_avals=tuple(decoded.out_avals))


def _jaxpr_document(data: bytes, limits: Limits) -> DecodedJaxpr:
    return decode_document(data, limits=limits.jaxpr)


def _deserialize_export(data: bytes) -> Any:
    try:
        return jax.export.deserialize(bytearray(data))
    except Exception as e:  # a flatbuffer reader on hostile bytes fails in many ways
        # The reader's own words describe its internals (struct sizes, offsets), not the
        # caller's mistake; they stay in the chained exception, out of the answer.
        raise InvalidProgram(
            "not a valid jax_export artifact (the bytes of jax.export's "
            "Exported.serialize())") from e


def _export_as_flat_function(exp: Any) -> Callable[..., list[Any]]:
    def flat(*leaves: Any) -> list[Any]:
        args, kwargs = tree_util.tree_unflatten(exp.in_tree, leaves)
        return tree_util.tree_leaves(exp.call(*args, **kwargs))

    return flat


def _export_aval(aval: Any) -> Aval:
    shape = tuple(d if isinstance(d, int) else str(d) for d in aval.shape)
    try:
        return Aval(shape, str(aval.dtype), bool(getattr(aval, "weak_type", False)))
    except WireError as e:
        raise InvalidProgram(f"export input or output {aval}: {e}") from None


def _check_inputs(in_avals: Sequence[Aval], limits: Limits) -> None:
    if len(in_avals) > limits.max_inputs:
        raise LimitExceeded(f"program takes {len(in_avals)} inputs, over {limits.max_inputs}")
