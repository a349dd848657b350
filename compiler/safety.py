"""What an untrusted program may contain, checked before XLA sees it.

Programs arrive from the network. Before a byte reaches XLA the compiler checks
sizes (program bytes, op count, region nesting, the bytes of every tensor type)
and allowlists (ops by dialect, ``custom_call`` targets). Host callbacks
(``jax.pure_callback``, ``io_callback``, ``jax.debug.print``), infeed/outfeed and
kernels written in other languages (Pallas, Triton) are refused by name.
"""

from __future__ import annotations

from collections.abc import Iterator

from jax._src.export import _export as jax_export_internals
from jax._src.lib.mlir import ir

from jitserve.compiler._cusolver import check_cusolver_call, is_cusolver_target
from jitserve.compiler._lapack import check_lapack_call, is_lapack_target
from jitserve.compiler.errors import LimitExceeded, UnsafeProgram
from jitserve.compiler.records import Limits

__all__ = ["ALLOWED_CUSTOM_CALLS", "check_module", "check_text_nesting"]

# Targets that carry arbitrary code, or that only make sense off this host.
_REFUSED_TARGETS = frozenset({
    "tf.call_tf_function",  # calls back into TensorFlow
    "tpu_custom_call",  # Pallas/Mosaic TPU kernels: arbitrary device code
    "mosaic_gpu_v2",  # Pallas Mosaic GPU kernels: arbitrary device code
})

# Targets that write no buffer sized by their attributes: safe whatever their types.
_SHAPE_FREE_TARGETS = frozenset({
    "shape_assertion", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape",
    "annotate_device_placement", "AllocateBuffer",
})

# Shape-polymorphic placeholders jax guarantees stable: a symbolic k or shape is an
# operand, and shape refinement rewrites each into a plain op (chlo.top_k,
# ApproxTopK, stablehlo.rng_bit_generator) before XLA sees the module. No kernel
# runs them, so one left in a static module is refused.
_REFINED_TARGETS = frozenset({
    "stablehlo.dynamic_top_k", "stablehlo.dynamic_approx_top_k",
    "stablehlo.dynamic_rng_bit_generator",
}) & jax_export_internals._CUSTOM_CALL_TARGETS_GUARANTEED_STABLE

# Targets XLA itself lowers to plain ops, after checking that their result types
# agree with their attributes (tests/compiler/test_stable_targets.py resizes them).
_CHECKED_BY_XLA = frozenset({"ApproxTopK"})

# What jax 0.8 and 0.9 (clients of the SDK's supported range) write for chlo ops that
# their StableHLO had no op for. Shape refinement rewrites each into its chlo op, whose
# verifier checks the result types against the operands (and k, for top_k), so a
# resized one is refused (tests/compiler/test_stable_targets.py).
_OLDER_JAX_TARGETS = frozenset({
    "mhlo.topk", "mhlo.erf", "mhlo.acos", "mhlo.acosh", "mhlo.asin", "mhlo.asinh",
    "mhlo.atanh", "mhlo.cosh", "mhlo.sinh",
})

# What a program may call: the targets jax.export guarantees stable, less those
# that run foreign code, and of the rest only those whose result types the server
# can check (compiler._lapack, compiler._cusolver) or that write nothing sized by
# attributes. Kernels trust their declared result shapes, so a target without a
# rule (today: the ROCm and TPU solver kernels, cu_threefry2x32_ffi) is refused
# rather than trusted. Callbacks (xla_ffi_python_cpu_callback and friends) are not
# in jax's list, so they stay out.
ALLOWED_CUSTOM_CALLS: frozenset[str] = frozenset(
    t for t in jax_export_internals._CUSTOM_CALL_TARGETS_GUARANTEED_STABLE - _REFUSED_TARGETS
    if is_lapack_target(t) or is_cusolver_target(t)
    or t in _SHAPE_FREE_TARGETS | _REFINED_TARGETS | _CHECKED_BY_XLA
) | _OLDER_JAX_TARGETS

_ALLOWED_DIALECTS = frozenset({"builtin", "func", "stablehlo", "chlo", "sdy"})
# Ops that move data between the device and the host, outside the call's arguments.
_REFUSED_OPS = frozenset({
    "stablehlo.infeed", "stablehlo.outfeed", "stablehlo.send", "stablehlo.recv",
})


def check_text_nesting(text: str, limits: Limits) -> None:
    """Refuse MLIR text nested deeper than the limit, before the parser recurses into it.

    MLIR's parser recurses on every kind of bracket (regions, types, attributes,
    locations), so all of them count; the count over-approximates region depth,
    which only makes the check stricter.
    """
    depth = max_depth = 0
    for ch in text:
        if ch in "([{<":
            depth += 1
            max_depth = max(max_depth, depth)
        elif ch in ")]}>":
            depth -= 1
    if max_depth > 8 * limits.max_nesting:
        raise LimitExceeded(
            f"program text nests {max_depth} brackets deep, over the limit "
            f"({8 * limits.max_nesting}, for {limits.max_nesting} regions)")


def check_module(module: ir.Module, limits: Limits, *, static: bool = False) -> None:
    """Walk every op of ``module``; raise if anything is not allowed.

    Dynamic dimensions are skipped by the tensor-size check; the specialized
    (``static``) module is checked again before it is compiled, and must have no
    shape-polymorphic placeholder left.
    """
    ops = 0
    for op, depth in _walk(module.operation, 0):
        ops += 1
        if ops > limits.max_ops:
            raise LimitExceeded(f"program has more than {limits.max_ops} ops")
        if depth > limits.max_nesting:
            raise LimitExceeded(f"program nests regions deeper than {limits.max_nesting}")
        _check_op(op, limits, static)


def _walk(op: ir.Operation, depth: int) -> Iterator[tuple[ir.Operation, int]]:
    # Iterative: a hostile module must not exhaust Python's recursion limit.
    stack = [(op, depth)]
    while stack:
        op, depth = stack.pop()
        yield op, depth
        for region in op.regions:
            for block in region.blocks:
                stack.extend((child.operation, depth + 1) for child in block.operations)


def _check_op(op: ir.Operation, limits: Limits, static: bool) -> None:
    name = op.name
    if name.split(".", 1)[0] not in _ALLOWED_DIALECTS or name in _REFUSED_OPS:
        raise UnsafeProgram(f"op {name!r} is not allowed in a jitserve program")
    if name == "stablehlo.custom_call":
        target = ir.StringAttr(op.attributes["call_target_name"]).value
        if target not in ALLOWED_CUSTOM_CALLS:
            raise UnsafeProgram(
                f"custom_call target {target!r} is not allowed (host callbacks, foreign "
                "kernels and unknown targets are refused; allowed are the LAPACK and CUDA "
                "linalg targets jax.export guarantees stable, with checked shapes)"
            )
        if is_lapack_target(target):
            check_lapack_call(op, target)
        elif is_cusolver_target(target):
            check_cusolver_call(op, target)
        if static and target in _REFINED_TARGETS:
            raise UnsafeProgram(f"custom_call target {target!r} is left after shape refinement; "
                                "only its refined form can be compiled")
    for result in op.results:
        _check_type(result.type, name, limits)
    if name == "func.func":
        ftype = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
        for t in [*ftype.inputs, *ftype.results]:
            _check_type(t, name, limits)


def _check_type(t: ir.Type, where: str, limits: Limits) -> None:
    if not isinstance(t, ir.RankedTensorType) or not t.has_static_shape:
        return
    nbytes = 1
    for d in t.shape:
        nbytes *= d
    nbytes = nbytes * element_bits(t.element_type) // 8
    if nbytes > limits.max_tensor_bytes:
        raise LimitExceeded(
            f"{where} has a tensor of type {t} ({nbytes:,} bytes), over the limit of "
            f"{limits.max_tensor_bytes:,} bytes per tensor"
        )


def element_bits(t: ir.Type) -> int:
    """Storage bits of one element; sub-byte types count as a byte, as numpy stores them."""
    if isinstance(t, ir.ComplexType):
        return 2 * element_bits(t.element_type)
    width = getattr(t, "width", None)
    return max(int(width), 8) if width is not None else 64
