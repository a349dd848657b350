"""Programs from JAX's IFRT proxy client: their compile options, made safe.

An IFRT proxy client (``JAX_PLATFORMS=jitserve``) compiles by sending a StableHLO
portable artifact and an ``XlaCompileOptionsProto`` wrapping its whole
``xla.CompileOptionsProto``: the client's full ``DebugOptions`` (``xla_dump_to``,
``xla_gpu_per_fusion_autotune_cache_dir``, ``xla_gpu_cuda_data_dir``...), environment
overrides, FDO profiles and the like. None of that may reach this server's XLA.
``sanitize_options`` keeps what shapes the program's meaning (replicas, partitions,
the device assignment, layouts, sharding propagation) and a short list of numerics
flags, and takes everything else from this server's own options.
"""

from __future__ import annotations

from typing import Any

from jitserve.compiler.errors import InvalidProgram
from jitserve.compiler.ifrt_protos import message
from jitserve.compiler.options import (
    ALLOWED_DEBUG_OPTIONS,
    ALLOWED_OVERRIDES,
    BUILD_OVERRIDES,
)

__all__ = ["ALLOWED_BUILD_OPTIONS", "ALLOWED_DEBUG_OPTIONS", "program_bytes", "sanitize_options"]

# ExecutableBuildOptionsProto fields a client chooses: what the program means and how
# it is partitioned. Everything else (debug options, compilation environments, FDO
# profiles, device memory sizes, process counts, run_backend_only) is the server's.
ALLOWED_BUILD_OPTIONS = frozenset({
    "num_replicas", "num_partitions", "use_spmd_partitioning", "use_auto_spmd_partitioning",
    "use_shardy_partitioner", "device_assignment", "result_layout", "alias_passthrough_params",
    "allow_spmd_sharding_propagation_to_parameters", "allow_spmd_sharding_propagation_to_output",
    "auto_spmd_partitioning_mesh_shape", "auto_spmd_partitioning_mesh_ids", "deduplicate_hlo",
})
# CompileOptionsProto fields a client chooses.
_ALLOWED_TOP = frozenset({"argument_layouts", "parameter_is_tupled_arguments", "profile_version"})
_SERIALIZED_PROGRAM_TYPES = frozenset({"xla::ifrt::XlaProgram", "xla::ifrt::HloProgram"})
_SERIALIZED_OPTIONS_TYPES = frozenset({"xla::ifrt::XlaCompileOptions"})


def program_bytes(serialized: Any) -> bytes:
    """The module bytes of a compile request's ``program`` (an ``xla.ifrt.Serialized``)."""
    if serialized.type_name not in _SERIALIZED_PROGRAM_TYPES:
        raise InvalidProgram(f"program type {serialized.type_name!r} is not served "
                             f"(served: {', '.join(sorted(_SERIALIZED_PROGRAM_TYPES))})")
    data: bytes = serialized.data
    return data


def sanitize_options(serialized: Any, server_options: bytes) -> bytes:
    """A ``CompileOptionsProto`` (serialized) to compile a client's program with.

    ``serialized``: the request's ``compile_options`` (an ``xla.ifrt.Serialized`` of an
    ``XlaCompileOptionsProto``); ``server_options``: this server's own options
    (serialized ``CompileOptionsProto``), which the result starts from.
    """
    if serialized.type_name not in _SERIALIZED_OPTIONS_TYPES:
        raise InvalidProgram(f"compile options of type {serialized.type_name!r} are not served")
    try:
        theirs = message("xla.ifrt.XlaCompileOptionsProto").FromString(serialized.data).compile_options
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise InvalidProgram(f"compile options do not parse: {e}") from None
    ours = message("xla.CompileOptionsProto").FromString(server_options)
    _copy(theirs, ours, _ALLOWED_TOP)
    debug_fields = ours.executable_build_options.debug_options.DESCRIPTOR.fields_by_name
    # ``jax.jit(..., compiler_options={...})`` arrives as ``env_option_overrides``, which
    # XLA applies by name: those of ``compiler.options`` are kept, for XLA to check their
    # values; a name XLA knows but that is not there is refused, and one it does not know
    # is refused as XLA would ("No such compile option").
    for name in theirs.env_option_overrides:
        if name not in debug_fields and name not in BUILD_OVERRIDES:
            raise InvalidProgram(f"No such compile option: '{name}'")
        if name not in ALLOWED_OVERRIDES:
            raise InvalidProgram(f"compile option '{name}' is not allowed on this server "
                                 f"(allowed: {', '.join(sorted(ALLOWED_OVERRIDES))})")
        ours.env_option_overrides[name].CopyFrom(theirs.env_option_overrides[name])
    _copy(theirs.executable_build_options, ours.executable_build_options, ALLOWED_BUILD_OPTIONS)
    _copy(theirs.executable_build_options.debug_options,
          ours.executable_build_options.debug_options, ALLOWED_DEBUG_OPTIONS)
    build = ours.executable_build_options
    if build.num_replicas < 1 or build.num_partitions < 1:
        raise InvalidProgram(f"num_replicas ({build.num_replicas}) and num_partitions "
                             f"({build.num_partitions}) must be at least 1")
    out: bytes = ours.SerializeToString(deterministic=True)
    return out


def _copy(source: Any, target: Any, allowed: frozenset[str]) -> None:
    for field in allowed:
        if field not in source.DESCRIPTOR.fields_by_name:
            continue
        target.ClearField(field)
        value = getattr(source, field)
        descriptor = source.DESCRIPTOR.fields_by_name[field]
        if descriptor.is_repeated:
            getattr(target, field).extend(value)
        elif descriptor.message_type is not None:
            if source.HasField(field):
                getattr(target, field).CopyFrom(value)
        else:
            setattr(target, field, value)
