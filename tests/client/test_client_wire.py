"""The wire codec: every dtype round-trips, and malformed input is a WireError."""

from __future__ import annotations

import base64
import json
import math
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
import pytest

from jitserve import wire
from jitserve.wire import WireError
from jitserve.wire import _codec as wire_codec

pytestmark = pytest.mark.timeout(60)

ALL_DTYPES = sorted(wire.DTYPES)


def sample(name: str, shape: tuple[int, ...] = (2, 3)) -> np.ndarray:
    """An array of ``name`` with distinct, exactly representable values."""
    dtype = wire.DTYPES[name]
    n = math.prod(shape)
    if name == "bool":
        return (np.arange(n) % 2 == 0).reshape(shape)
    if name in ("int4", "uint4"):
        lo = -8 if name == "int4" else 0
        return (np.arange(n) % 8 + lo).astype(dtype).reshape(shape)
    if dtype.kind == "c":
        return (np.arange(n) + 1j * np.arange(n, 0, -1)).astype(dtype).reshape(shape)
    if name == "float8_e8m0fnu":  # powers of two only
        return (2.0 ** (np.arange(n) % 5)).astype(dtype).reshape(shape)
    return (np.arange(n) % 7).astype(dtype).reshape(shape)


def same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def test_dtype_table_matches_the_spec() -> None:
    expected = {"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                "uint64", "float16", "bfloat16", "float32", "float64", "complex64",
                "complex128", "int4", "uint4", "float8_e4m3fn", "float8_e5m2"}
    assert expected <= set(wire.DTYPES)
    for name, dtype in wire.DTYPES.items():
        assert wire.dtype_name(dtype) == name
        assert wire.dtype_from_name(name) == dtype


@pytest.mark.parametrize("name", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3), (5,), (2, 3), (1, 1, 1, 2)])
def test_msgpack_roundtrip(name: str, shape: tuple[int, ...]) -> None:
    a = sample(name, shape)
    out = wire.unpackb(wire.packb({"x": a}))["x"]
    same(out, a)


@pytest.mark.parametrize("name", ALL_DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (2, 3)])
def test_json_roundtrip_nested_lists(name: str, shape: tuple[int, ...]) -> None:
    a = sample(name, shape)
    text = wire.dumps_json({"x": a})
    json.loads(text)  # plain JSON
    same(wire.loads_json(text)["x"], a)


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_json_roundtrip_base64(name: str) -> None:
    a = sample(name)
    obj = {"dtype": name, "shape": [2, 3], "data": base64.b64encode(a.tobytes()).decode()}
    same(wire.from_json_array(obj), a)


@pytest.mark.parametrize("name", ALL_DTYPES)
def test_encode_array_fields(name: str) -> None:
    a = sample(name)
    enc = wire.encode_array(a)
    assert enc["dtype"] == name
    assert enc["shape"] == [2, 3]
    assert bytes(enc["data"]) == a.tobytes()
    assert wire.is_array(enc)


def test_encode_is_zero_copy_for_contiguous_little_endian() -> None:
    a = np.arange(4, dtype="<f4")
    data = wire.encode_array(a)["data"]
    assert np.shares_memory(np.frombuffer(data, np.uint8), a)


def test_decode_is_zero_copy() -> None:
    buf = np.arange(4, dtype="<f4").tobytes()
    out = wire.decode_array({"dtype": "float32", "shape": [2, 2], "data": buf})
    assert not out.flags.writeable  # a view of the immutable bytes
    assert np.shares_memory(out, np.frombuffer(buf, np.uint8))


def test_a_big_message_of_few_values_decodes_as_views_of_itself() -> None:
    a = np.arange(1 << 19, dtype=np.float32)  # 2 MiB: read by _views, not copied
    body = bytearray(wire.packb({"args": [a, {"future": "f", "output": 0}]}))
    out = wire.unpackb(body)
    assert np.shares_memory(out["args"][0], np.frombuffer(body, np.uint8))
    np.testing.assert_array_equal(out["args"][0], a)
    assert out["args"][1] == {"future": "f", "output": 0}


def test_a_big_message_of_many_values_decodes_as_msgpack_does() -> None:
    # A batch of calls: a small array and 25 references each, 2 MiB in all. Too many
    # values for the Python reader to pay off: msgpack's decoder copies, and the
    # walk makes its arrays and leaves the rest as they are.
    calls = [{"args": [np.full((64, 784), i, np.float32),
                       *({"future": f"f{i}", "output": k, "none": None} for k in range(25))],
              "donate": [0, 1], "static_key": ""} for i in range(10)]
    body = bytearray(wire.packb({"calls": calls, "release": []}))
    assert len(body) >= wire.STREAM_BYTES
    out = wire.unpackb(body)
    for i, call in enumerate(out["calls"]):
        np.testing.assert_array_equal(call["args"][0], calls[i]["args"][0])
        assert not np.shares_memory(call["args"][0], np.frombuffer(body, np.uint8))
        assert call["args"][1:] == calls[i]["args"][1:]
        assert call["donate"] == [0, 1]


@pytest.mark.parametrize("name", ["int16", "int64", "float32", "float64", "complex128", "uint32"])
def test_big_endian_input_is_sent_little_endian(name: str) -> None:
    a = sample(name)
    big = a.astype(a.dtype.newbyteorder(">"))
    enc = wire.encode_array(big)
    assert enc["dtype"] == name
    assert bytes(enc["data"]) == a.astype(a.dtype.newbyteorder("<")).tobytes()
    same(wire.decode_array(enc), a)


@pytest.mark.parametrize("view", [
    lambda a: a[:, ::2],
    lambda a: a.T,
    lambda a: a[::-1],
    lambda a: np.broadcast_to(a[:1], (3, 4)),
])
def test_non_contiguous_input(view: Any) -> None:
    a = view(np.arange(12, dtype=np.int32).reshape(3, 4))
    out = wire.unpackb(wire.packb(a))
    np.testing.assert_array_equal(out, a)


@pytest.mark.parametrize("scalar, name", [
    (np.float32(1.5), "float32"), (np.int8(-3), "int8"), (np.bool_(True), "bool"),
    (np.complex64(1 - 2j), "complex64"), (ml_dtypes.bfloat16(2.5), "bfloat16"),
    (np.array(7, np.uint16), "uint16"),
])
def test_scalars_are_rank_0(scalar: Any, name: str) -> None:
    enc = wire.encode_array(scalar)
    assert enc["shape"] == [] and enc["dtype"] == name
    out = wire.unpackb(wire.packb([scalar]))[0]
    assert out.shape == () and out.dtype.name == name and out == scalar
    back = wire.loads_json(wire.dumps_json([scalar]))[0]
    assert back.shape == () and back == scalar


def test_json_nested_lists_format() -> None:
    doc = json.loads(wire.dumps_json({
        "c": np.array([1 + 2j, 3 - 4j], np.complex64),
        "b": np.array([True, False]),
        "h": np.array([[1.5]], ml_dtypes.bfloat16),
        "s": np.float32(2.0),
    }))
    assert doc["c"] == {"dtype": "complex64", "shape": [2], "data": [[1.0, 2.0], [3.0, -4.0]]}
    assert doc["b"]["data"] == [True, False]
    assert doc["h"]["data"] == [[1.5]]
    assert doc["s"] == {"dtype": "float32", "shape": [], "data": 2.0}


def test_json_accepts_ints_for_floats_and_reals_for_complex() -> None:
    out = wire.from_json_array({"dtype": "float32", "shape": [2], "data": [1, 2.5]})
    np.testing.assert_array_equal(out, np.array([1, 2.5], np.float32))
    out = wire.from_json_array({"dtype": "complex64", "shape": [2], "data": [1, [0, 1]]})
    np.testing.assert_array_equal(out, np.array([1, 1j], np.complex64))


def test_json_non_finite_floats() -> None:
    a = np.array([np.nan, np.inf, -np.inf], np.float32)
    out = wire.loads_json(wire.dumps_json(a))
    np.testing.assert_array_equal(out, a)


def test_future_refs_and_plain_values_pass_through() -> None:
    msg = {"args": [{"future": "f1", "output": 0}], "static_key": "k", "n": None,
           "blob": b"\x00\x01", "ok": True, "x": 1.5}
    assert wire.unpackb(wire.packb(msg)) == msg
    assert wire.is_future_ref(msg["args"][0])
    msg.pop("blob")
    assert wire.loads_json(wire.dumps_json(msg)) == msg


@pytest.mark.parametrize("obj, expected", [
    ({"future": "f", "output": 1}, True),
    ({"future": "f", "output": True}, False),
    ({"future": 1, "output": 1}, False),
    ({"future": "f", "output": 1, "x": 0}, False),
    ({"future": "f"}, False),
    ([], False),
])
def test_is_future_ref(obj: Any, expected: bool) -> None:
    assert wire.is_future_ref(obj) is expected


def test_tuples_pack_as_lists() -> None:
    assert wire.unpackb(wire.packb({"t": (1, 2)})) == {"t": [1, 2]}


def test_max_bytes_bounds_each_array_and_the_total() -> None:
    a = np.zeros(100, np.uint8)
    blob = wire.packb([a, a])
    with pytest.raises(WireError, match="over the limit"):
        wire.unpackb(blob, max_bytes=150)
    with pytest.raises(WireError, match="over the limit"):
        wire.unpackb(wire.packb(a), max_bytes=50)
    with pytest.raises(WireError, match="over the limit"):
        wire.loads_json(wire.dumps_json([np.zeros(10, np.complex128)] * 2), max_bytes=200)
    assert len(wire.unpackb(blob, max_bytes=len(blob))) == 2


def test_an_error_past_decoded_arrays_names_its_path() -> None:
    # The walk decodes arrays in place; the error's second walk counts them again.
    a = np.zeros(100, np.uint8)
    bad = {"dtype": "float32", "shape": [3], "data": b"xx"}
    with pytest.raises(WireError, match=r"^\$\.x\.args\[1\]: array data is 2 bytes"):
        wire.unpackb(wire.packb({"x": {"args": [a, bad]}}))
    decoder = wire_codec._Decoder(150, wire_codec._msgpack_array)
    with pytest.raises(WireError, match=r"^\$\.x\.args\[1\]: .* over the limit of 50"):
        decoder.walk(msgpack.unpackb(wire.packb({"x": {"args": [a, a]}})))


F32_8 = np.arange(2, dtype=np.float32).tobytes()


def arr(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"dtype": "float32", "shape": [2], "data": F32_8}
    base.update(kw)
    return {k: v for k, v in base.items() if v is not ...}


MALFORMED_ARRAYS = [
    (arr(dtype="float33"), "unsupported dtype 'float33'"),
    (arr(dtype="object"), "unsupported dtype"),
    (arr(dtype=5), "dtype must be a string"),
    (arr(shape=[3]), "8 bytes, but shape \\[3\\] of float32 needs 12"),
    (arr(shape=[-2]), "negative dimension -2"),
    (arr(shape=[2.0]), "shape entries must be ints"),
    (arr(shape=[True, 2]), "shape entries must be ints"),
    (arr(shape="2"), "shape must be a list"),
    (arr(shape=[1] * 65), "rank 65 exceeds"),
    (arr(shape=[2**62, 2**62, 2**62]), "needs"),
    (arr(shape=[2**40, 2**40, 0]), "needs 0"),
    (arr(data="AAAA"), "data must be bytes"),
    (arr(data=[1.0, 2.0]), "data must be bytes"),
    (arr(data=...), "missing \\['data'\\]"),
    (arr(extra=1), "unexpected \\['extra'\\]"),
    ({"dtype": "bool", "shape": [2], "data": b"\x00\x02"}, "bytes 0 and 1"),
    ({"dtype": "int4", "shape": [1], "data": b"\xff"}, "low 4 bits"),
    ({"dtype": "uint4", "shape": [1], "data": b"\x10"}, "low 4 bits"),
    ([1, 2], "an array is a map"),
]


@pytest.mark.parametrize("obj, message", MALFORMED_ARRAYS)
def test_decode_array_rejects(obj: Any, message: str) -> None:
    with pytest.raises(WireError, match=message):
        wire.decode_array(obj)


# Inside a message, a map is an array when it has "dtype" and "data" keys.
IN_MESSAGE = [m for m in MALFORMED_ARRAYS if isinstance(m[0], dict) and "data" in m[0]]


@pytest.mark.parametrize("obj, message", IN_MESSAGE)
def test_unpackb_rejects_malformed_arrays_with_a_path(obj: Any, message: str) -> None:
    with pytest.raises(WireError, match=r"\$\.args\[0\]: .*" + message):
        wire.unpackb(msgpack.packb({"args": [obj]}, use_bin_type=True))


def test_decode_array_max_bytes() -> None:
    with pytest.raises(WireError, match="over the limit of 4"):
        wire.decode_array(arr(), max_bytes=4)


MALFORMED_MSGPACK = [
    (b"", "malformed msgpack"),
    (b"\xc1", "malformed msgpack"),  # never-used type byte
    (b"\x92\x01", "malformed msgpack"),  # truncated array
    (b"\x01\x02", "malformed msgpack"),  # extra data
    (b"\xdd\xff\xff\xff\xff", "malformed msgpack"),  # claims 4G items
    (b"\xc6\xff\xff\xff\xff", "malformed msgpack"),  # claims a 4 GiB bin
    (b"\x91" * 100_000 + b"\xc0", "malformed msgpack"),  # too deep for msgpack
    (b"\x91" * 200 + b"\xc0", "deeper than 128"),
    (b"\xa2\xff\xfe", "malformed msgpack"),  # bad UTF-8
    (msgpack.packb({1: 2}), "malformed msgpack"),  # non-string map key
    (msgpack.packb(msgpack.ExtType(5, b"x")), "extension types"),
    (msgpack.packb(msgpack.Timestamp(1, 0)), "unsupported value of type Timestamp"),
    ("not bytes", "must be bytes"),
    (None, "must be bytes"),
]


@pytest.mark.parametrize("data, message", MALFORMED_MSGPACK)
def test_unpackb_rejects(data: Any, message: str) -> None:
    with pytest.raises(WireError, match=message):
        wire.unpackb(data)


def test_unpackb_message_size_limit() -> None:
    with pytest.raises(WireError, match="message is 6 bytes, over the limit of 5"):
        wire.unpackb(msgpack.packb("hello"), max_bytes=5)


def j(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"dtype": "float32", "shape": [2], "data": [1.0, 2.0]}
    base.update(kw)
    return base


@pytest.mark.parametrize("obj, message", [
    (j(data=[1.0]), "axis 0 expects a list of 2, got a list of 1"),
    (j(shape=[2, 2], data=[[1.0, 2.0], [3.0]]), "axis 1 expects a list of 2"),  # ragged
    (j(shape=[2, 1], data=[1.0, 2.0]), "axis 1 expects a list of 1, got float"),
    (j(shape=[], data=[1.0]), "must hold numbers"),
    (j(data=1.0), "axis 0 expects a list of 2, got float"),
    (j(data=["a", "b"]), "must hold numbers"),
    (j(data=[True, False]), "must hold numbers"),
    (j(data=[1e400, 1.0]), None),  # json gives inf: allowed
    (j(dtype="int8", data=[1, 300]), "must lie in \\[-128, 127\\]"),
    (j(dtype="int4", data=[1, 8]), "must lie in \\[-8, 7\\]"),
    (j(dtype="uint32", data=[1, -1]), "must lie in"),
    (j(dtype="int32", data=[1, 2.5]), "must hold integers"),
    (j(dtype="bool", data=[1, 2]), "true/false"),
    (j(dtype="complex64", data=[[1, 2, 3], 1]), "\\[re, im\\] pairs"),
    (j(dtype="float16", data=[10**400, 1]), "too large"),
    (j(data="!!notbase64"), "not valid base64"),
    (j(data=base64.b64encode(b"123").decode()), "3 bytes, but shape"),
    (j(shape=[2**40, 2**40], data=[]), "over the limit"),
    (j(dtype="bfloat17"), "unsupported dtype"),
])
def test_from_json_array_rejects(obj: Any, message: str | None) -> None:
    if message is None:
        wire.from_json_array(obj)
        return
    with pytest.raises(WireError, match=message):
        wire.from_json_array(obj, max_bytes=1 << 30)


@pytest.mark.parametrize("data, message", [
    (b"{", "malformed JSON"),
    (b"\xff\xfe\x00", "malformed JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "malformed JSON|deeper than"),
    (b"[" * 200 + b"]" * 200, "deeper than 128"),
    (b'{"a": {"dtype": "float32", "shape": [1], "data": [[1]]}}', r"\$\.a: "),
    (b"1" * 5000, "malformed JSON"),  # int digit limit
    (42, "must be bytes"),
])
def test_loads_json_rejects(data: Any, message: str) -> None:
    with pytest.raises(WireError, match=message):
        wire.loads_json(data)


@pytest.mark.parametrize("obj", [object(), {"s": {1, 2}}, np.array(["a"]), np.array([None])])
def test_encoders_reject_unsupported_values(obj: Any) -> None:
    with pytest.raises(WireError):
        wire.packb(obj)
    with pytest.raises(WireError):
        wire.dumps_json(obj)


@pytest.mark.parametrize("bad", ["float33", None, 3, np.dtype("datetime64[s]"), object])
def test_dtype_helpers_reject(bad: Any) -> None:
    with pytest.raises(WireError):
        wire.dtype_from_name(bad) if not isinstance(bad, np.dtype) else wire.dtype_name(bad)
    with pytest.raises(WireError):
        wire.dtype_name(bad)


def test_wire_error_is_value_error() -> None:
    assert issubclass(WireError, ValueError)


@pytest.mark.parametrize("decode, encode", [
    (wire.unpackb, wire.packb),
    (wire.loads_json, wire.dumps_json),
])
def test_fuzzed_messages_decode_or_raise_wire_error(decode: Any, encode: Any) -> None:
    rng = np.random.default_rng(0)
    good = bytearray(encode({"args": [sample("float32"), sample("complex64", (2,)),
                                      {"future": "f", "output": 0}], "static_key": "k"}))
    for _ in range(3000):
        blob = bytearray(good)
        for i in rng.integers(0, len(blob), size=rng.integers(1, 4)):
            blob[i] = int(rng.integers(0, 256))
        cut = int(rng.integers(1, len(blob) + 1))
        try:
            decode(bytes(blob[:cut]), max_bytes=1 << 20)
        except WireError:
            pass


@pytest.mark.parametrize(("nbytes", "carried"), [
    ([], ()),
    ([4, 8, 4], (0, 1, 2)),  # small in all: every one comes back
    ([wire.INLINE_OUTPUTS_BYTES - 4, 4], (0, 1)),
    ([1 << 20, 4], (1,)),  # a model and its loss: the loss
    ([4, 1 << 20, wire.SMALL_OUTPUT_BYTES, wire.SMALL_OUTPUT_BYTES + 1], (0, 2)),
    ([wire.SMALL_OUTPUT_BYTES] * 70 + [1 << 20], tuple(range(64))),  # 64 KiB in all at most
])
def test_carried_outputs(nbytes: list[int], carried: tuple[int, ...]) -> None:
    """Which outputs a runtime sends back with a run's answer (``wire.carried_outputs``)."""
    assert wire.carried_outputs(nbytes) == carried
