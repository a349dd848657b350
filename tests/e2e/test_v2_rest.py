"""The Open Inference Protocol over REST: tritonclient.http (and .aio) against a real server.

Health and metadata, inference with JSON and binary tensors for every v2 datatype
(compared with ``jax.jit`` here), requested outputs, symbolic dimensions, model
versions, compressed bodies, bad requests (each a 4xx ``{"error": "..."}`` that
names the problem), auth, and that v2 inferences count in the metrics and leave
no future behind.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
from e2e.conftest import metric_total
from e2e.v2_programs import (
    DATATYPES,
    SHAPE,
    affine,
    expected,
    pair,
    program,
    sample,
    upload,
    v2_server,
)
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with v2_server(tmp_path_factory.mktemp("v2-rest")) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(server.removeprefix("http://"))
    yield c
    c.close()


def _input(name: str, array: np.ndarray, datatype: str, binary: bool) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def _post(url: str, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, headers=headers, timeout=60)


def test_server_live_ready_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "jitserve" and "binary_tensor_data" in meta["extensions"]


@pytest.mark.parametrize("datatype", DATATYPES)
def test_model_metadata_comes_from_the_signature(client: triton.InferenceServerClient,
                                                 datatype: str) -> None:
    name = f"affine_{datatype.lower()}"
    assert client.is_model_ready(name) and client.is_model_ready(name, "1")
    meta = client.get_model_metadata(name)
    tensor = {"datatype": datatype, "shape": list(SHAPE)}
    assert meta == {"name": name, "versions": ["1"], "platform": "jitserve_jax_export",
                    "inputs": [{"name": "input_0", **tensor}],
                    "outputs": [{"name": "output_0", **tensor}]}


# tritonclient sends BF16 only in binary (test_bf16_json_input sends JSON by hand).
_ENCODINGS = [pytest.param(datatype, binary_in, binary_out,
                           id=f"{datatype}-{'binary' if binary_in else 'json'}_in-"
                              f"{'binary' if binary_out else 'json'}_out")
              for datatype in DATATYPES for binary_in in (False, True)
              for binary_out in (False, True) if binary_in or datatype != "BF16"]


@pytest.mark.parametrize(("datatype", "binary_in", "binary_out"), _ENCODINGS)
def test_infer_every_datatype(client: triton.InferenceServerClient, datatype: str,
                              binary_in: bool, binary_out: bool) -> None:
    x = sample(datatype)
    result = client.infer(f"affine_{datatype.lower()}", [_input("input_0", x, datatype, binary_in)],
                          outputs=[triton.InferRequestedOutput("output_0", binary_data=binary_out)],
                          request_id="req-7")
    response = result.get_response()
    assert response["model_name"] == f"affine_{datatype.lower()}"
    assert response["model_version"] == "1" and response["id"] == "req-7"
    assert ("data" in response["outputs"][0]) is not binary_out
    y = result.as_numpy("output_0")
    assert y.dtype == x.dtype and y.shape == SHAPE
    np.testing.assert_array_equal(y, expected(affine, x))


def test_bf16_json_input(server: str) -> None:
    x = sample("BF16")
    body = {"inputs": [{"name": "input_0", "datatype": "BF16", "shape": list(SHAPE),
                        "data": x.astype(np.float32).reshape(-1).tolist()}]}
    r = _post(server, "/v2/models/affine_bf16/infer", body)
    assert r.status_code == 200, r.text
    (out,) = r.json()["outputs"]
    assert out["datatype"] == "BF16" and out["shape"] == list(SHAPE)
    np.testing.assert_array_equal(np.array(out["data"], np.float32).reshape(SHAPE),
                                  expected(affine, x).astype(np.float32))


def test_non_finite_floats_round_trip_in_json(server: str) -> None:
    x = np.array([np.nan, np.inf, -np.inf, 1.0, -0.0, 3.5], np.float64)
    body = {"inputs": [{"name": "input_0", "datatype": "FP64", "shape": list(SHAPE),
                        "data": x.tolist()}]}  # json.dumps writes NaN, Infinity, -Infinity
    r = _post(server, "/v2/models/affine_fp64/infer", body)
    assert r.status_code == 200, r.text
    got = np.array(json.loads(r.content)["outputs"][0]["data"], np.float64)
    np.testing.assert_array_equal(got, expected(affine, x.reshape(SHAPE)).reshape(-1))


def test_named_inputs_and_requested_outputs(client: triton.InferenceServerClient) -> None:
    meta = client.get_model_metadata("pair")
    assert [t["name"] for t in meta["inputs"]] == ["x", "y"]
    assert [t["name"] for t in meta["outputs"]] == ["prod", "sum"]
    x, y = sample("FP32"), sample("FP32")[::-1].copy()
    want = expected(pair, {"x": x, "y": y})
    inputs = [_input("y", y, "FP32", True), _input("x", x, "FP32", False)]  # any order
    everything = client.infer("pair", inputs)  # no outputs named: all, in binary
    for name in ("sum", "prod"):
        np.testing.assert_array_equal(everything.as_numpy(name), want[name])
    only = client.infer("pair", inputs, outputs=[triton.InferRequestedOutput("sum", False)])
    assert [o["name"] for o in only.get_response()["outputs"]] == ["sum"]
    np.testing.assert_array_equal(only.as_numpy("sum"), want["sum"])


def test_symbolic_dimensions_are_minus_one(client: triton.InferenceServerClient) -> None:
    meta = client.get_model_metadata("batched")
    assert meta["inputs"][0]["shape"] == [-1, 3] and meta["outputs"][0]["shape"] == [-1, 3]
    for batch in (1, 4):
        x = np.arange(batch * 3, dtype=np.float32).reshape(batch, 3)
        y = client.infer("batched", [_input("input_0", x, "FP32", True)]).as_numpy("output_0")
        np.testing.assert_array_equal(y, expected(affine, x))


def test_versions_are_uploads_under_one_name(server: str,
                                             client: triton.InferenceServerClient) -> None:
    assert upload(server, program("affine_FP32"), "versioned")["version"] == 1
    assert upload(server, program("affine_FP64", (4,)), "versioned")["version"] == 2
    again = upload(server, program("affine_FP32"), "versioned")  # the same bytes: no new version
    assert again["version"] == 1 and again["name"] == "versioned"
    assert client.get_model_metadata("versioned")["versions"] == ["1", "2"]
    assert client.get_model_metadata("versioned")["inputs"][0]["datatype"] == "FP64"  # latest
    assert client.get_model_metadata("versioned", "1")["inputs"][0]["datatype"] == "FP32"
    x = sample("FP32")
    result = client.infer("versioned", [_input("input_0", x, "FP32", True)], model_version="1")
    assert result.get_response()["model_version"] == "1"
    np.testing.assert_array_equal(result.as_numpy("output_0"), expected(affine, x))
    second = upload(server, program("affine_FP64", (4,)), "versioned")["program_id"]
    assert httpx.delete(f"{server}/v1/programs/{second}", timeout=60).status_code == 200
    assert client.get_model_metadata("versioned")["versions"] == ["1"]  # deleted: hidden
    with pytest.raises(InferenceServerException, match="has no version 2"):
        client.get_model_metadata("versioned", "2")


def test_compressed_request_bodies(client: triton.InferenceServerClient) -> None:
    x = sample("INT32")
    for algorithm in ("gzip", "deflate"):
        result = client.infer("affine_int32", [_input("input_0", x, "INT32", True)],
                              request_compression_algorithm=algorithm)
        np.testing.assert_array_equal(result.as_numpy("output_0"), expected(affine, x))


def test_compressed_bodies_are_bounded_when_inflated(server: str) -> None:
    """A small gzip body that inflates past JITSERVE_MAX_BODY_BYTES (256 KiB here) is a 413."""
    bomb = gzip.compress(json.dumps({"inputs": [_X32], "pad": "0" * (1 << 20)}).encode())
    assert len(bomb) < 16 << 10
    r = _post(server, "/v2/models/affine_fp32/infer", bomb, {"content-encoding": "gzip"})
    assert r.status_code == 413 and "decompressed body is over the limit" in r.json()["error"]
    r = _post(server, "/v2/models/affine_fp32/infer", b"not gzip", {"content-encoding": "gzip"})
    assert r.status_code == 400 and "not valid gzip data" in r.json()["error"]
    r = _post(server, "/v2/models/affine_fp32/infer", b"{}", {"content-encoding": "br"})
    assert r.status_code == 415 and "Content-Encoding 'br'" in r.json()["error"]


async def test_aio_client(server: str) -> None:
    async with triton_aio.InferenceServerClient(server.removeprefix("http://")) as c:
        assert await c.is_server_live() and await c.is_server_ready()
        assert await c.is_model_ready("affine_int64")
        meta = await c.get_model_metadata("affine_int64")
        assert meta["inputs"][0]["datatype"] == "INT64"
        for datatype in ("INT64", "BF16", "BOOL"):
            x = sample(datatype)
            tensor = triton_aio.InferInput("input_0", list(SHAPE), datatype)
            tensor.set_data_from_numpy(x)
            result = await c.infer(f"affine_{datatype.lower()}", [tensor])
            np.testing.assert_array_equal(result.as_numpy("output_0"), expected(affine, x))
        with pytest.raises(InferenceServerException, match="unknown model 'missing'"):
            await c.get_model_metadata("missing")


_X32 = {"name": "input_0", "datatype": "FP32", "shape": [2, 3], "data": [1, 2, 3, 4, 5, 6]}


def _binary(header: dict[str, Any], tail: bytes) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(header).encode()
    return head + tail, {"Inference-Header-Content-Length": str(len(head))}


def _bad_requests() -> list[Any]:
    x32 = np.zeros(6, np.float32).tobytes()
    binary = {"name": "input_0", "datatype": "FP32", "shape": [2, 3],
              "parameters": {"binary_data_size": 24}}
    cases: list[tuple[str, str, Any, dict[str, str] | None, int, str]] = [
        ("unknown model", "/v2/models/nope/infer", {"inputs": [_X32]}, None, 404,
         "unknown model 'nope'"),
        ("unknown version", "/v2/models/affine_fp32/versions/9/infer", {"inputs": [_X32]},
         None, 404, "has no version 9; its versions are [1]"),
        ("bad version", "/v2/models/affine_fp32/versions/latest/infer", {"inputs": [_X32]},
         None, 400, "must be a number"),
        ("wrong shape", "/v2/models/affine_fp32/infer",
         {"inputs": [{**_X32, "shape": [3, 2]}]}, None, 400,
         "input 'input_0' has shape [3, 2], but the model takes [2, 3]"),
        ("wrong rank", "/v2/models/batched/infer",
         {"inputs": [{**_X32, "shape": [6]}]}, None, 400, "the model takes [-1, 3]"),
        ("wrong datatype", "/v2/models/affine_fp32/infer",
         {"inputs": [{**_X32, "datatype": "FP64"}]}, None, 400,
         "has datatype 'FP64', but the model takes FP32"),
        ("unknown datatype", "/v2/models/affine_fp32/infer",
         {"inputs": [{**_X32, "datatype": "BYTES"}]}, None, 400,
         "has datatype 'BYTES', but the model takes FP32"),
        ("element count", "/v2/models/affine_fp32/infer",
         {"inputs": [{**_X32, "data": [1, 2, 3]}]}, None, 400,
         "data has 3 elements, shape [2, 3] needs 6"),
        ("strings as numbers", "/v2/models/affine_fp32/infer",
         {"inputs": [{**_X32, "data": ["1"] * 6}]}, None, 400, "FP32 data must be numbers"),
        ("int out of range", "/v2/models/affine_int8/infer",
         {"inputs": [{**_X32, "datatype": "INT8", "data": [1, 2, 3, 4, 5, 300]}]}, None, 400,
         "300 is out of the range of INT8"),
        ("missing input", "/v2/models/pair/infer", {"inputs": [{**_X32, "name": "x"}]}, None,
         400, "input 'y' is missing; model 'pair' takes ['x', 'y']"),
        ("unknown input", "/v2/models/affine_fp32/infer", {"inputs": [{**_X32, "name": "z"}]},
         None, 400, "has no input 'z'; its inputs are ['input_0']"),
        ("input twice", "/v2/models/affine_fp32/infer", {"inputs": [_X32, _X32]}, None, 400,
         "is given twice"),
        ("unknown output", "/v2/models/affine_fp32/infer",
         {"inputs": [_X32], "outputs": [{"name": "nope"}]}, None, 400,
         "has no output 'nope'; its outputs are ['output_0']"),
        ("no inputs", "/v2/models/affine_fp32/infer", {"id": "1"}, None, 400, "needs 'inputs'"),
        ("bad JSON", "/v2/models/affine_fp32/infer", b'{"inputs": [', None, 400,
         "not valid JSON"),
        ("byte count", "/v2/models/affine_fp32/infer", *_binary({"inputs": [binary]}, x32[:20]),
         400, "binary_data_size 24 runs past the end of the body"),
        ("extra bytes", "/v2/models/affine_fp32/infer",
         *_binary({"inputs": [binary]}, x32 + b"\0\0"), 400,
         "2 bytes that no input's binary_data_size accounts for"),
        ("size vs shape", "/v2/models/affine_fp32/infer",
         *_binary({"inputs": [{**binary, "parameters": {"binary_data_size": 20}}]}, x32[:20]),
         400, "20 bytes of data, but a FP32 tensor of shape [2, 3] is 24 bytes"),
        ("BOOL byte", "/v2/models/affine_bool/infer",
         *_binary({"inputs": [{**binary, "datatype": "BOOL",
                               "parameters": {"binary_data_size": 6}}]}, b"\0\1\2\0\0\0"),
         400, "a BOOL element is one byte, 0 or 1"),
        ("header length", "/v2/models/affine_fp32/infer", b"{}",
         {"Inference-Header-Content-Length": "99"}, 400, "Inference-Header-Content-Length"),
        ("unknown route", "/v2/models/affine_fp32/explain", {}, None, 404, "no v2 route"),
    ]
    return [pytest.param(*case[1:], id=case[0]) for case in cases]


@pytest.mark.parametrize(("path", "body", "headers", "status", "message"), _bad_requests())
def test_bad_requests_are_4xx_naming_the_problem(server: str, path: str, body: Any,
                                                 headers: dict[str, str] | None, status: int,
                                                 message: str) -> None:
    r = _post(server, path, body, headers)
    assert r.status_code == status, r.text
    assert list(r.json()) == ["error"] and message in r.json()["error"], r.text


def test_tritonclient_sees_the_refusals(client: triton.InferenceServerClient) -> None:
    x = np.zeros((3, 2), np.float32)
    with pytest.raises(InferenceServerException, match=r"shape \[3, 2\]") as e:
        client.infer("affine_fp32", [_input("input_0", x, "FP32", True)])
    assert e.value.status() == "400"
    with pytest.raises(InferenceServerException, match="unknown model") as e:
        client.get_model_metadata("nope")
    assert e.value.status() == "404"
    assert not client.is_model_ready("nope")


def test_bad_model_names_are_refused_at_upload(server: str) -> None:
    for name in ("", "-lead", "has space", "a" * 129, "slash/name"):
        r = httpx.post(f"{server}/v1/programs", params={"name": name},
                       content=program("affine_FP32"), timeout=60)
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["code"] == "bad_request"


def test_inferences_share_the_metrics_and_leave_no_future(server: str,
                                                          client: triton.InferenceServerClient
                                                          ) -> None:
    executions = metric_total(server, "jitserve_executions_total")
    x = sample("UINT16")
    for _ in range(3):
        client.infer("affine_uint16", [_input("input_0", x, "UINT16", True)])
    assert metric_total(server, "jitserve_executions_total") >= executions + 3
    metrics = httpx.get(f"{server}/metrics", timeout=10).text
    assert 'jitserve_requests_total{route="/v2/models/{name}/infer",status="200"}' in metrics
    assert metric_total(server, "jitserve_futures") == 0
    assert metric_total(server, "jitserve_device_bytes_in_use") == 0


def test_auth_names_are_per_key(auth_server_url: str, auth_keys: tuple[str, ...]) -> None:
    alice, bob = auth_keys
    upload(auth_server_url, program("affine_INT32"), "secret_model", key=alice)
    x = sample("INT32")
    host = auth_server_url.removeprefix("http://")
    with triton.InferenceServerClient(host) as c:
        assert c.is_server_live() and c.is_server_ready()  # health stays open
        result = c.infer("secret_model", [_input("input_0", x, "INT32", True)],
                         headers={"Authorization": f"Bearer {alice}"})
        np.testing.assert_array_equal(result.as_numpy("output_0"), expected(affine, x))
        with pytest.raises(InferenceServerException, match="Authorization: Bearer") as e:
            c.infer("secret_model", [_input("input_0", x, "INT32", True)])
        assert e.value.status() == "401"
        with pytest.raises(InferenceServerException, match="unknown model") as e:
            c.get_model_metadata("secret_model", headers={"Authorization": f"Bearer {bob}"})
        assert e.value.status() == "404"
