"""The Open Inference Protocol over gRPC: tritonclient.grpc (and .aio) against a real server.

The server listens on ``JITSERVE_GRPC_PORT``: health, server and model metadata,
inference with ``raw_input_contents`` for every v2 datatype (compared with
``jax.jit`` here) and with typed contents, requested outputs, and bad requests,
each a NOT_FOUND or INVALID_ARGUMENT status whose message names the problem, and
bearer-token auth on the model RPCs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.grpc.aio as triton_aio
from e2e.conftest import _free_port
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
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc
from tritonclient.utils import InferenceServerException

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``host:port`` of the gRPC service of a real server with every model uploaded."""
    with v2_server(tmp_path_factory.mktemp("v2-grpc")) as (_, port):
        yield f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def client(target: str) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(target)
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(target: str) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    """The protocol's own stub, for requests tritonclient never sends."""
    with grpc.insecure_channel(target) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def _input(name: str, array: np.ndarray, datatype: str) -> triton.InferInput:
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def test_server_live_ready_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta.name == "jitserve" and "binary_tensor_data" in meta.extensions


@pytest.mark.parametrize("datatype", DATATYPES)
def test_metadata_and_infer_every_datatype(client: triton.InferenceServerClient,
                                           datatype: str) -> None:
    name = f"affine_{datatype.lower()}"
    assert client.is_model_ready(name) and client.is_model_ready(name, "1")
    meta = client.get_model_metadata(name, as_json=True)
    tensor = {"datatype": datatype, "shape": [str(d) for d in SHAPE]}  # int64s as JSON strings
    assert meta["inputs"] == [{"name": "input_0", **tensor}]
    assert meta["outputs"] == [{"name": "output_0", **tensor}]
    assert meta["versions"] == ["1"] and meta["platform"] == "jitserve_jax_export"
    x = sample(datatype)
    result = client.infer(name, [_input("input_0", x, datatype)], request_id="r1")
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == (name, "1", "r1")
    y = result.as_numpy("output_0")
    assert y.dtype == x.dtype and y.shape == SHAPE
    np.testing.assert_array_equal(y, expected(affine, x))


def test_named_inputs_requested_outputs_and_symbolic_dims(
        client: triton.InferenceServerClient) -> None:
    x, y = sample("FP32"), sample("FP32")[::-1].copy()
    want = expected(pair, {"x": x, "y": y})
    result = client.infer("pair", [_input("y", y, "FP32"), _input("x", x, "FP32")],
                          outputs=[triton.InferRequestedOutput("sum")])
    assert [o.name for o in result.get_response().outputs] == ["sum"]
    np.testing.assert_array_equal(result.as_numpy("sum"), want["sum"])
    meta = client.get_model_metadata("batched")
    assert list(meta.inputs[0].shape) == [-1, 3]
    b = np.arange(12, dtype=np.float32).reshape(4, 3)
    got = client.infer("batched", [_input("input_0", b, "FP32")]).as_numpy("output_0")
    np.testing.assert_array_equal(got, expected(affine, b))


@pytest.mark.parametrize(("datatype", "field"), [("INT8", "int_contents"),
                                                 ("UINT64", "uint64_contents"),
                                                 ("BOOL", "bool_contents"),
                                                 ("FP64", "fp64_contents")])
def test_typed_contents(stub: pb_grpc.GRPCInferenceServiceStub, datatype: str,
                        field: str) -> None:
    x = sample(datatype)
    tensor = pb.ModelInferRequest().InferInputTensor(name="input_0", datatype=datatype,
                                                     shape=list(SHAPE))
    getattr(tensor.contents, field).extend(x.reshape(-1).tolist())
    reply = stub.ModelInfer(pb.ModelInferRequest(model_name=f"affine_{datatype.lower()}",
                                                 inputs=[tensor]))
    y = np.frombuffer(reply.raw_output_contents[0], x.dtype).reshape(SHAPE)
    np.testing.assert_array_equal(y, expected(affine, x))


async def test_aio_client(target: str) -> None:
    async with triton_aio.InferenceServerClient(target) as c:
        assert await c.is_server_live() and await c.is_server_ready()
        assert await c.is_model_ready("affine_bf16")
        assert (await c.get_model_metadata("affine_bf16")).inputs[0].datatype == "BF16"
        for datatype in DATATYPES:
            x = sample(datatype)
            tensor = triton_aio.InferInput("input_0", list(SHAPE), datatype)
            tensor.set_data_from_numpy(x)
            result = await c.infer(f"affine_{datatype.lower()}", [tensor])
            np.testing.assert_array_equal(result.as_numpy("output_0"), expected(affine, x))
        with pytest.raises(InferenceServerException, match="unknown model 'missing'") as e:
            await c.get_model_metadata("missing")
        assert e.value.status() == "StatusCode.NOT_FOUND"


def _raw(name: str, datatype: str, shape: list[int], data: bytes,
         model: str = "affine_fp32", version: str = "") -> pb.ModelInferRequest:
    tensor = pb.ModelInferRequest().InferInputTensor(name=name, datatype=datatype, shape=shape)
    return pb.ModelInferRequest(model_name=model, model_version=version, inputs=[tensor],
                                raw_input_contents=[data])


_ZEROS = bytes(24)
_BAD = [
    pytest.param(_raw("input_0", "FP32", [2, 3], _ZEROS, model="nope"), "NOT_FOUND",
                 "unknown model 'nope'", id="unknown model"),
    pytest.param(_raw("input_0", "FP32", [2, 3], _ZEROS, version="4"), "NOT_FOUND",
                 "has no version 4", id="unknown version"),
    pytest.param(_raw("input_0", "FP32", [3, 2], _ZEROS), "INVALID_ARGUMENT",
                 "has shape [3, 2], but the model takes [2, 3]", id="wrong shape"),
    pytest.param(_raw("input_0", "INT32", [2, 3], _ZEROS), "INVALID_ARGUMENT",
                 "has datatype 'INT32', but the model takes FP32", id="wrong datatype"),
    pytest.param(_raw("input_0", "FP32", [2, 3], _ZEROS[:20]), "INVALID_ARGUMENT",
                 "20 bytes of data, but a FP32 tensor of shape [2, 3] is 24 bytes",
                 id="wrong byte count"),
    pytest.param(_raw("input_0", "FP32", [-2, 3], _ZEROS), "INVALID_ARGUMENT",
                 "shape must be a list of sizes >= 0", id="negative dimension"),
    pytest.param(_raw("x", "FP32", [2, 3], _ZEROS, model="pair"), "INVALID_ARGUMENT",
                 "input 'y' is missing", id="missing input"),
    pytest.param(pb.ModelInferRequest(model_name="affine_fp32", inputs=[
        pb.ModelInferRequest().InferInputTensor(name="input_0", datatype="FP32", shape=[2, 3])],
        raw_input_contents=[_ZEROS, _ZEROS]), "INVALID_ARGUMENT",
        "raw_input_contents has 2 entries for 1 inputs", id="raw count"),
    pytest.param(pb.ModelInferRequest(model_name="affine_fp32", inputs=[
        pb.ModelInferRequest().InferInputTensor(name="input_0", datatype="FP32", shape=[2, 3])]),
        "INVALID_ARGUMENT", "input 'input_0' has no data", id="no data"),
]


@pytest.mark.parametrize(("request_", "status", "message"), _BAD)
def test_bad_requests_name_the_problem(stub: pb_grpc.GRPCInferenceServiceStub,
                                       request_: pb.ModelInferRequest, status: str,
                                       message: str) -> None:
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(request_)
    assert e.value.code() == getattr(grpc.StatusCode, status)
    assert message in e.value.details()


def test_tritonclient_sees_the_status(client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match=r"shape \[3, 2\]") as e:
        client.infer("affine_fp32", [_input("input_0", np.zeros((3, 2), np.float32), "FP32")])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.is_model_ready("nope")


def test_auth_on_the_model_rpcs(start_server: Callable[..., str],
                                auth_keys: tuple[str, ...]) -> None:
    """With API keys, model RPCs need ``authorization: Bearer`` metadata; health stays open."""
    alice, bob = auth_keys
    port = _free_port()
    url = start_server({"JITSERVE_API_KEYS": ",".join(auth_keys),
                        "JITSERVE_GRPC_PORT": str(port)}, "auth")
    upload(url, program("affine_INT32"), "mine", key=alice)
    x = sample("INT32")
    with triton.InferenceServerClient(f"127.0.0.1:{port}") as c:
        assert c.is_server_live() and c.is_server_ready()
        result = c.infer("mine", [_input("input_0", x, "INT32")],
                         headers={"authorization": f"Bearer {alice}"})
        np.testing.assert_array_equal(result.as_numpy("output_0"), expected(affine, x))
        with pytest.raises(InferenceServerException, match="Authorization: Bearer") as e:
            c.get_model_metadata("mine")
        assert e.value.status() == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(InferenceServerException, match="unknown model 'mine'") as e:
            c.infer("mine", [_input("input_0", x, "INT32")],
                    headers={"authorization": f"Bearer {bob}"})  # names are per key
        assert e.value.status() == "StatusCode.NOT_FOUND"
