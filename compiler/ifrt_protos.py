"""The IFRT proxy's messages, from the descriptors jaxlib's own client was built with.

jaxlib ships a client for a remote JAX backend (the IFRT proxy: ``jaxlib._ifrt_proxy``)
but no ``.proto`` files. Its shared library embeds every message definition it was
compiled with, as serialized ``FileDescriptorProto``s. ``extract`` cuts them out of the
installed ``libjax_common.so``; ``ifrt_proxy.binpb`` beside this module is the result (a
``FileDescriptorSet`` of the files the service and the compiler use, and everything
they import), and ``message`` builds classes from it with protobuf's own
``descriptor_pool`` and ``message_factory``. No protoc step, and the messages are
exactly those of the client that will connect.

Regenerate after a jaxlib upgrade (``tests/compiler/test_ifrt_protos.py`` fails until
it is done)::

    python -m jitserve.compiler.ifrt_protos            # rewrite ifrt_proxy.binpb
    python -m jitserve.compiler.ifrt_protos --check    # exit 1 if it is stale

Imports protobuf only (no jax): the API process parses requests with it.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import Message

__all__ = ["DESCRIPTOR_SET", "ROOTS", "extract", "installed_library", "message", "pool"]

DESCRIPTOR_SET = Path(__file__).with_name("ifrt_proxy.binpb")

# The files whose messages jitserve uses; their imports come along.
ROOTS = (
    "xla/python/ifrt_proxy/common/grpc_ifrt_service.proto",  # the service, IfrtRequest...
    "xla/python/ifrt/sharding_serdes.proto",  # SingleDeviceSharding, ConcreteEvenSharding...
    "xla/python/pjrt_ifrt/xla_sharding.proto",  # HloSharding
    "xla/python/pjrt_ifrt/xla_compiler.proto",  # XlaCompileOptions
    "xla/python/pjrt_ifrt/pjrt_layout_serdes.proto",
)

# A serialized FileDescriptorProto starts with its name: field 1, a length, "....proto".
_FILE_START = re.compile(rb"\x0a([\x01-\x7f])([A-Za-z0-9_/.\-]+?\.proto)")
_MAX_FIELD = 16  # FileDescriptorProto's highest field number, with room for new ones


@functools.cache
def pool() -> descriptor_pool.DescriptorPool:
    """A pool of ``DESCRIPTOR_SET``'s files (not protobuf's default pool: names stay apart)."""
    files = descriptor_pb2.FileDescriptorSet.FromString(DESCRIPTOR_SET.read_bytes())
    made = descriptor_pool.DescriptorPool()
    for file in files.file:
        made.Add(file)
    return made


@functools.cache
def message(full_name: str) -> Any:
    """The message class of ``full_name`` (``"xla.ifrt.proxy.IfrtRequest"``)."""
    cls: type[Message] = message_factory.GetMessageClass(pool().FindMessageTypeByName(full_name))
    return cls


def installed_library() -> Path:
    """The installed jaxlib's ``libjax_common.so``, where its client's descriptors are."""
    import importlib.util

    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("jaxlib is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "libjax_common.so"


def extract(library: Path, roots: tuple[str, ...] = ROOTS) -> bytes:
    """The ``FileDescriptorSet`` (serialized) of ``roots`` and their imports, cut out of
    ``library``; files in import order, so a pool can add them one by one."""
    found = _embedded_files(library.read_bytes())
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        if name not in found:
            raise LookupError(f"{library.name} embeds no descriptor of {name}")
        for dependency in found[name].dependency:
            visit(dependency)
        order.append(name)

    for root in roots:
        visit(root)
    out: bytes = descriptor_pb2.FileDescriptorSet(file=[found[n] for n in order]).SerializeToString()
    return out


def _embedded_files(data: bytes) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    """Every serialized ``FileDescriptorProto`` in ``data``, by file name.

    From each place that looks like the start of one (its name field), the fields are
    walked by their wire format until one cannot belong to it: a field number it does
    not have, a second name (the next file), or a wire type it never uses. The longest
    parse of each name wins.
    """
    found: dict[str, tuple[int, descriptor_pb2.FileDescriptorProto]] = {}
    for match in _FILE_START.finditer(data):
        if match.group(1)[0] != len(match.group(2)):
            continue
        end = _walk_fields(data, match.start())
        file = descriptor_pb2.FileDescriptorProto()
        try:
            file.ParseFromString(data[match.start():end])
        except Exception:  # noqa: BLE001 - not a descriptor after all
            continue
        if not (file.message_type or file.enum_type or file.service):
            continue
        size = end - match.start()
        if file.name not in found or found[file.name][0] < size:
            found[file.name] = (size, file)
    return {name: file for name, (_, file) in found.items()}


def _walk_fields(data: bytes, start: int) -> int:
    i, named = start, False
    try:
        while i < len(data):
            tag, j = _varint(data, i)
            field, wire_type = tag >> 3, tag & 7
            if not 1 <= field <= _MAX_FIELD or (field == 1 and named):
                break
            if wire_type == 2:
                length, j = _varint(data, j)
                j += length
            elif wire_type == 0:
                _, j = _varint(data, j)
            else:
                break
            if j > len(data):
                break
            named = named or field == 1
            i = j
    except IndexError:
        pass
    return i


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def main(argv: list[str]) -> int:
    fresh = extract(installed_library())
    if "--check" in argv:
        current = DESCRIPTOR_SET.read_bytes() if DESCRIPTOR_SET.exists() else b""
        if current != fresh:
            print(f"{DESCRIPTOR_SET} does not match the installed jaxlib: run "
                  "python -m jitserve.compiler.ifrt_protos", file=sys.stderr)
            return 1
        print(f"{DESCRIPTOR_SET.name} matches the installed jaxlib")
        return 0
    DESCRIPTOR_SET.write_bytes(fresh)
    print(f"wrote {DESCRIPTOR_SET} ({len(fresh):,} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
