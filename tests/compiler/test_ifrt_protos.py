"""The IFRT proxy's messages (``compiler.ifrt_protos``) and a client's compile options (``compiler.ifrt``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jitserve.compiler.errors import InvalidProgram
from jitserve.compiler.ifrt import ALLOWED_DEBUG_OPTIONS, program_bytes, sanitize_options
from jitserve.compiler.ifrt_protos import DESCRIPTOR_SET, extract, installed_library, message, pool


def test_the_checked_in_descriptors_are_the_installed_jaxlib_s() -> None:
    """Regenerate with ``python -m jitserve.compiler.ifrt_protos`` after a jaxlib upgrade."""
    assert extract(installed_library()) == DESCRIPTOR_SET.read_bytes()
    check = subprocess.run([sys.executable, "-m", "jitserve.compiler.ifrt_protos", "--check"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr


def test_the_service_and_its_messages_are_there() -> None:
    service = pool().FindServiceByName("xla.ifrt.proxy.GrpcIfrtService")
    assert {m.name for m in service.methods} >= {
        "GetVersion", "IfrtSession", "HostBufferStore", "HostBufferLookup", "HostBufferDelete"}
    request = message("xla.ifrt.proxy.IfrtRequest")()
    request.compile_request.program.type_name = "xla::ifrt::XlaProgram"
    assert request.WhichOneof("request") == "compile_request"
    parsed = message("xla.ifrt.proxy.IfrtRequest").FromString(request.SerializeToString())
    assert parsed.compile_request.program.type_name == "xla::ifrt::XlaProgram"


def _server_options() -> bytes:
    from jitserve.compiler._worker import compile_options

    data: bytes = compile_options().SerializeAsString()
    return data


def _client_options(**build: object) -> object:
    options = message("xla.CompileOptionsProto")()
    debug = options.executable_build_options.debug_options
    debug.xla_dump_to = "/tmp/steal"
    debug.xla_gpu_per_fusion_autotune_cache_dir = "/etc"
    debug.xla_cpu_enable_fast_math = True
    options.executable_build_options.fdo_profile = b"profile"
    options.executable_build_options.run_backend_only = True
    options.executable_build_options.num_partitions = 1
    options.executable_build_options.num_replicas = 1
    for name, value in build.items():
        setattr(options.executable_build_options, name, value)
    serialized = message("xla.ifrt.Serialized")(type_name="xla::ifrt::XlaCompileOptions")
    serialized.data = message("xla.ifrt.XlaCompileOptionsProto")(compile_options=options).SerializeToString()
    return serialized


def test_a_client_s_options_keep_only_what_the_program_means() -> None:
    sanitized = message("xla.CompileOptionsProto").FromString(
        sanitize_options(_client_options(use_shardy_partitioner=True), _server_options()))
    build = sanitized.executable_build_options
    assert build.debug_options.xla_dump_to == ""  # the server's, not the client's
    assert build.debug_options.xla_gpu_per_fusion_autotune_cache_dir == ""
    assert "xla_cpu_enable_fast_math" in ALLOWED_DEBUG_OPTIONS
    assert build.debug_options.xla_cpu_enable_fast_math is True  # a numerics choice: kept
    assert not sanitized.env_option_overrides
    assert build.fdo_profile == b"" and build.run_backend_only is False
    assert build.use_shardy_partitioner is True and build.num_partitions == 1


def test_options_and_programs_of_other_kinds_are_refused() -> None:
    wrong = message("xla.ifrt.Serialized")(type_name="xla::ifrt::SomethingElse", data=b"")
    with pytest.raises(InvalidProgram, match="not served"):
        sanitize_options(wrong, _server_options())
    with pytest.raises(InvalidProgram, match="not served"):
        program_bytes(wrong)
    garbage = message("xla.ifrt.Serialized")(type_name="xla::ifrt::XlaCompileOptions", data=b"\xff\xff")
    with pytest.raises(InvalidProgram, match="do not parse"):
        sanitize_options(garbage, _server_options())
    with pytest.raises(InvalidProgram, match="at least 1"):
        sanitize_options(_client_options(num_partitions=0), _server_options())


def _with_override(name: str, value: bool) -> object:
    options = message("xla.CompileOptionsProto")()
    options.executable_build_options.num_partitions = options.executable_build_options.num_replicas = 1
    options.env_option_overrides[name].bool_field = value
    serialized = message("xla.ifrt.Serialized")(type_name="xla::ifrt::XlaCompileOptions")
    serialized.data = message("xla.ifrt.XlaCompileOptionsProto")(compile_options=options).SerializeToString()
    return serialized


def test_compiler_options_of_jax_jit_are_kept_checked_or_refused() -> None:
    """``jax.jit(f, compiler_options=...)`` arrives as overrides: allowed ones go on to XLA
    (which checks their values), unknown names are refused as XLA would, and known ones
    off the allowlist are refused by name."""
    kept = message("xla.CompileOptionsProto").FromString(
        sanitize_options(_with_override("xla_embed_ir_in_executable", True), _server_options()))
    assert kept.env_option_overrides["xla_embed_ir_in_executable"].bool_field is True
    with pytest.raises(InvalidProgram, match="No such compile option: 'invalid_key'"):
        sanitize_options(_with_override("invalid_key", True), _server_options())
    with pytest.raises(InvalidProgram, match="'xla_dump_to' is not allowed"):
        sanitize_options(_with_override("xla_dump_to", True), _server_options())
