"""Programs sharded across the devices of a runtime (issue 37, first step).

One real server whose runtime has four simulated CPU devices
(``JITSERVE_CPU_DEVICES=4``). The client, with one device, exports for a mesh of
the server's (``jax.export`` over an ``AbstractMesh``), or sends the module as raw
StableHLO; the server lowers it on a mesh of its own devices, compiles for four,
and runs it. Results are compared with numpy on the same inputs: the sharding
changes where the work runs, not what it computes.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from e2e.conftest import _serve, metric_total, wait_ready
from jax import export
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jitserve import wire

pytestmark = pytest.mark.timeout(240)

MESH = AbstractMesh((2, 2), ("x", "y"))


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _serve(tmp_path_factory.mktemp("devices"), {"JITSERVE_CPU_DEVICES": "4"})


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client


def _export(fn: Callable[..., Any], shapes: list[tuple[int, ...]], in_specs: list[P],
            out_spec: P, mesh: AbstractMesh = MESH) -> bytes:
    jitted = jax.jit(fn, in_shardings=tuple(NamedSharding(mesh, s) for s in in_specs),
                     out_shardings=NamedSharding(mesh, out_spec))
    structs = [jax.ShapeDtypeStruct(s, np.float32) for s in shapes]
    return bytes(export.export(jitted)(*structs).serialize())


def _matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.sin(a) @ b + 1.0


def _psum_rows(a: jax.Array) -> jax.Array:
    """Sums the two halves of ``a``'s rows with a collective across axis ``x``."""
    return jax.shard_map(lambda x: jax.lax.psum(x, "x"), mesh=MESH, in_specs=P("x"),
                         out_specs=P())(a)


MATMUL = _export(_matmul, [(8, 8), (8, 8)], [P("x", "y"), P("y", None)], P("x", "y"))
PSUM = _export(_psum_rows, [(8, 4)], [P("x")], P())


def _upload(http: httpx.Client, program: bytes) -> dict[str, Any]:
    r = http.post("/v1/programs", content=program, headers={"content-type": wire.OCTET_STREAM})
    assert r.status_code in (200, 201), r.text
    return dict(r.json())


def _run(http: httpx.Client, program_id: str, *args: Any) -> str:
    r = http.post(f"/v1/programs/{program_id}/execute", content=wire.packb({"args": list(args)}),
                  headers={"content-type": wire.MSGPACK})
    assert r.status_code in (200, 202), r.text
    return str(r.json()["future_id"])


def _outputs(http: httpx.Client, future_id: str) -> list[np.ndarray]:
    r = http.get(f"/v1/futures/{future_id}/result", params={"wait": 60_000})
    assert r.status_code == 200, r.text
    return list(wire.unpackb(r.content)["outputs"])


def _inputs(*shapes: tuple[int, ...]) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def test_the_runtime_lists_its_four_devices(http: httpx.Client) -> None:
    doc = http.get("/v1/devices").json()
    assert [d["id"] for d in doc["devices"]] == [0, 1, 2, 3]
    assert [d["default"] for d in doc["devices"]] == [True, False, False, False]
    assert doc["backend"]["device_count"] == 4


def test_a_named_sharding_export_runs_on_four_devices(http: httpx.Client) -> None:
    program = _upload(http, MATMUL)
    assert program["nr_devices"] == 4
    assert program["sharding"] == {"mesh": {"x": 2, "y": 2}, "in": ["P('x', 'y')", "P('y', None)"],
                                   "out": ["P('x', 'y')"]}
    a, b = _inputs((8, 8), (8, 8))
    future_id = _run(http, program["program_id"], a, b)
    (out,) = _outputs(http, future_id)
    np.testing.assert_allclose(out, np.sin(a) @ b + 1.0, rtol=1e-5, atol=1e-5)
    # The executable's record says how it runs: four partitions, each input's layout.
    executable_id = http.get(f"/v1/futures/{future_id}").json()["executable_id"]
    record = http.get(f"/v1/executables/{executable_id}").json()
    assert record["sharding"]["device_count"] == 4 and record["sharding"]["partitions"] == 4
    assert record["sharding"]["in"][0] == "{devices=[2,2]<=[4]}"
    assert record["key_parts"]["device_count"] == "4"


def test_shard_map_with_a_collective(http: httpx.Client) -> None:
    program_id = _upload(http, PSUM)["program_id"]
    (a,) = _inputs((8, 4))
    future_id = _run(http, program_id, a)
    (out,) = _outputs(http, future_id)
    np.testing.assert_allclose(out, a[:4] + a[4:], rtol=1e-6)
    # Its output is replicated on the four devices: it holds four times its 64 bytes.
    executable_id = http.get(f"/v1/futures/{future_id}").json()["executable_id"]
    sharding = http.get(f"/v1/executables/{executable_id}").json()["sharding"]
    assert sharding["out"] == ["{replicated}"] and sharding["out_device_bytes"] == [4 * 64]


def test_raw_stablehlo_with_four_partitions(http: httpx.Client) -> None:
    text = export.deserialize(bytearray(MATMUL)).mlir_module().encode()
    program = _upload(http, text)
    assert program["format"] == "stablehlo" and program["nr_devices"] == 4
    a, b = _inputs((8, 8), (8, 8))
    (out,) = _outputs(http, _run(http, program["program_id"], a, b))
    np.testing.assert_allclose(out, np.sin(a) @ b + 1.0, rtol=1e-5, atol=1e-5)


def test_sharded_outputs_chain_relaid_and_gathered(http: httpx.Client) -> None:
    """An output kept on the runtime feeds a program that wants another layout (moved
    device to device) and a single-device program (gathered)."""
    matmul = _upload(http, MATMUL)["program_id"]
    psum = _upload(http, PSUM)["program_id"]
    single = _upload(http, bytes(export.export(jax.jit(lambda v: v * 2.0))(
        jax.ShapeDtypeStruct((8, 8), np.float32)).serialize()))["program_id"]
    a, b = _inputs((8, 8), (8, 8))
    relaid = metric_total(str(http.base_url).rstrip("/"), "jitserve_runtime_relaid_total")
    first = _run(http, matmul, a, b)
    y = np.sin(a) @ b + 1.0
    same = _run(http, matmul, {"future": first, "output": 0}, b)  # wants P("x", "y"): as is
    again = _run(http, matmul, a, {"future": first, "output": 0})  # P("x","y") -> P("y", None)
    doubled = _run(http, single, {"future": first, "output": 0})
    np.testing.assert_allclose(_outputs(http, same)[0], np.sin(y) @ b + 1.0, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_outputs(http, again)[0], np.sin(a) @ y + 1.0, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_outputs(http, doubled)[0], y * 2.0, rtol=1e-5, atol=1e-5)
    plain = _run(http, single, a)  # a single-device program on this runtime, from the host
    np.testing.assert_allclose(_outputs(http, plain)[0], a * 2.0)
    assert psum  # uploaded beside the others: programs of both kinds live on one runtime
    # Moved device to device once, gathered once; the call that wanted its layout took it as is.
    assert metric_total(str(http.base_url).rstrip("/"), "jitserve_runtime_relaid_total") == relaid + 2


def test_more_devices_than_the_server_has_is_refused_at_upload(http: httpx.Client) -> None:
    eight = _export(lambda a: a * 2.0, [(8, 8)], [P("x", "y")], P("x", "y"),
                    mesh=AbstractMesh((2, 4), ("x", "y")))
    r = http.post("/v1/programs", content=eight, headers={"content-type": wire.OCTET_STREAM})
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "too_many_devices"
    assert "8 devices" in error["message"] and "at most 4" in error["message"]


def test_a_restarted_runtime_reloads_a_sharded_executable(url: str, http: httpx.Client) -> None:
    program_id = _upload(http, PSUM)["program_id"]
    (a,) = _inputs((8, 4))
    _outputs(http, _run(http, program_id, a))
    (runtime,) = wait_ready(url)
    os.kill(runtime["pid"], signal.SIGKILL)
    wait_ready(url)
    compiled = http.post(f"/v1/programs/{program_id}/compile", json={}).json()
    assert compiled["tier"] == "disk", compiled  # loaded onto four devices, not compiled
    (out,) = _outputs(http, _run(http, program_id, a))
    np.testing.assert_allclose(out, a[:4] + a[4:], rtol=1e-6)


def test_many_collective_runs_at_once_all_finish(http: httpx.Client) -> None:
    """XLA:CPU deadlocks with some 32 collective runs in flight: a runtime launches
    sharded runs one at a time, so 50 submitted at once all finish."""
    program_id = _upload(http, PSUM)["program_id"]
    inputs = [np.full((8, 4), i, np.float32) for i in range(50)]
    futures = [_run(http, program_id, a) for a in inputs]
    for i, future_id in enumerate(futures):
        np.testing.assert_array_equal(_outputs(http, future_id)[0], np.full((4, 4), 2.0 * i))


def _psum_on_one_side(a: jax.Array) -> jax.Array:
    """A collective only the first half of axis ``x`` reaches: the other waits forever."""
    def body(x: jax.Array) -> jax.Array:
        first = jax.lax.axis_index("x") == 0
        return jax.lax.cond(first, lambda v: jax.lax.psum(v, "x"), lambda v: v, x)

    return jax.shard_map(body, mesh=MESH, in_specs=P("x"), out_specs=P("x"), check_vma=False)(a)


def test_a_collective_that_never_completes_meets_its_deadline(url: str,
                                                              http: httpx.Client) -> None:
    program_id = _upload(http, _export(_psum_on_one_side, [(8, 4)], [P("x")], P("x")))["program_id"]
    (a,) = _inputs((8, 4))
    r = http.post(f"/v1/programs/{program_id}/execute", headers={"content-type": wire.MSGPACK},
                  content=wire.packb({"args": [a], "timeout_s": 2}))
    assert r.status_code in (200, 202), r.text
    future = http.get(f"/v1/futures/{r.json()['future_id']}", params={"wait": 60_000}).json()
    while future["status"] not in ("done", "failed"):
        future = http.get(f"/v1/futures/{future['future_id']}", params={"wait": 60_000}).json()
    assert future["status"] == "failed" and future["error"]["code"] == "execution_timeout", future
    wait_ready(url)  # the runtime came back
    (b,) = _inputs((8, 4))
    (out,) = _outputs(http, _run(http, _upload(http, PSUM)["program_id"], b))
    np.testing.assert_allclose(out, b[:4] + b[4:], rtol=1e-6)


# -- the SDK: Client.mesh, and jax.jit's shardings on Client.jit -------------------------


def test_client_jit_with_shardings_over_the_servers_mesh(url: str) -> None:
    from jitserve.client import Client

    with Client(url, timeout=120) as c:
        mesh = c.mesh((2, 2), ("x", "y"))
        rows, cols = NamedSharding(mesh, P("x", "y")), NamedSharding(mesh, P("y", None))

        def step(params: dict[str, jax.Array], x: jax.Array) -> dict[str, jax.Array]:
            y = jax.lax.with_sharding_constraint(jnp.sin(x) @ params["w"], rows)
            total = jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"),
                                  out_specs=P())(y)
            return {"y": y + params["b"], "total": total}

        f = c.jit(step, in_shardings=({"w": cols, "b": None}, rows), out_shardings=rows)
        w, x = _inputs((8, 8), (8, 8))
        b = np.float32(0.5)
        out = f({"w": w, "b": b}, x)
        assert out["y"].sharding == rows and out["total"].sharding == rows  # as out_shardings
        y = np.sin(x) @ w
        np.testing.assert_allclose(np.asarray(out["y"]), y + b, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(out["total"]), y[:4] + y[4:], rtol=1e-4, atol=1e-4)
        # Chained: the remote output goes back in as an argument of another layout.
        again = f({"w": w, "b": b}, out["y"])
        np.testing.assert_allclose(np.asarray(again["y"]), np.sin(y + b) @ w + b,
                                   rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="needs 8 devices; the server runs programs on at most 4"):
            c.mesh((2, 4), ("x", "y"))


def test_a_mesh_inside_without_boundary_shardings_raises_with_the_fix(url: str) -> None:
    from jitserve.client import Client

    with Client(url, timeout=120) as c:
        mesh = c.mesh((4,), ("x",))
        f = c.jit(lambda x: jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P("x"))))
        with pytest.raises(ValueError, match="in_shardings= or out_shardings= over that mesh"):
            f(np.ones(8, np.float32))


# -- device groups: JITSERVE_RUNTIME_DEVICES ----------------------------------------------


@pytest.fixture(scope="module")
def groups_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Four devices in two groups of two, one runtime each."""
    yield from _serve(tmp_path_factory.mktemp("groups"), {
        "JITSERVE_CPU_DEVICES": "4", "JITSERVE_RUNTIME_DEVICES": "0-1;2-3",
        "JITSERVE_RUNTIMES": "1"})


def test_groups_of_two_run_two_device_programs_and_refuse_four(groups_url: str) -> None:
    from jitserve.client import Client

    with httpx.Client(base_url=groups_url, timeout=120) as http:
        doc = http.get("/v1/devices").json()
        assert [(g["devices"], g["runtimes"]) for g in doc["groups"]] == [([0, 1], [0]),
                                                                         ([2, 3], [1])]
        assert doc["max_program_devices"] == 2
        # Each group's devices as its own runtime reports them: two each.
        assert [(d["id"], d["group"], d["platform"]) for d in doc["devices"]] == [
            (0, 0, "cpu"), (1, 0, "cpu"), (2, 1, "cpu"), (3, 1, "cpu")]
        r = http.post("/v1/programs", content=MATMUL, headers={"content-type": wire.OCTET_STREAM})
        assert r.status_code == 422 and r.json()["error"]["code"] == "too_many_devices", r.text
        assert "at most 2" in r.json()["error"]["message"]
        pair = AbstractMesh((2,), ("x",))
        program_id = _upload(http, _export(lambda a: jnp.cos(a) * 3.0, [(8, 4)], [P("x")], P("x"),
                                           mesh=pair))["program_id"]
        (a,) = _inputs((8, 4))
        for _ in range(4):  # wherever each call goes, a group of two runs it
            np.testing.assert_allclose(_outputs(http, _run(http, program_id, a))[0],
                                       np.cos(a) * 3.0, rtol=1e-6)
    with Client(groups_url, timeout=120) as c:
        with pytest.raises(ValueError, match="needs 4 devices; the server runs programs on at most 2"):
            c.mesh((2, 2), ("x", "y"))
        mesh = c.mesh((2,), ("x",))
        f = c.jit(lambda x: jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh,
                                          in_specs=P("x"), out_specs=P())(x),
                  in_shardings=NamedSharding(mesh, P("x")))
        np.testing.assert_allclose(np.asarray(f(a)), a[:4] + a[4:], rtol=1e-6)
        g = c.jit(lambda x: x + 1.0)  # single-device programs run on either group
        np.testing.assert_allclose(np.asarray(g(a)), a + 1.0)


def test_a_big_sharded_output_is_fetched_whole(http: httpx.Client) -> None:
    """Over the inline size, a sharded output is assembled in the segment shard by shard
    (replicas once): rows split over x, replicated over y."""
    program_id = _upload(http, _export(lambda a: a * 2.0 + 1.0, [(512, 1024)], [P("x")],
                                       P("x")))["program_id"]
    a = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)
    r = http.post(f"/v1/programs/{program_id}/execute", headers={"content-type": wire.MSGPACK},
                  content=wire.packb({"args": [{"future": _put(http, a), "output": 0}]}))
    assert r.status_code in (200, 202), r.text
    (out,) = _outputs(http, r.json()["future_id"])
    np.testing.assert_array_equal(out, a * 2.0 + 1.0)


def _put(http: httpx.Client, array: np.ndarray) -> str:
    """Keep ``array`` on the server (``POST /v1/arrays``): bodies here are small."""
    chunks = np.array_split(array, 16)
    futures = []
    for chunk in chunks:
        r = http.post("/v1/arrays", content=wire.packb({"arrays": [chunk]}),
                      headers={"content-type": wire.MSGPACK})
        assert r.status_code in (200, 201), r.text
        futures.append(r.json()["future_id"])
    concat = _upload(http, _concat_program([c.shape for c in chunks]))["program_id"]
    return _run(http, concat, *({"future": f, "output": 0} for f in futures))


def _concat_program(shapes: list[tuple[int, ...]]) -> bytes:
    structs = [jax.ShapeDtypeStruct(s, np.float32) for s in shapes]
    return bytes(export.export(jax.jit(lambda *xs: jnp.concatenate(xs)))(*structs).serialize())


_MODULE = """module @m attributes {mhlo.num_partitions = %s : i32, mhlo.num_replicas = %s : i32} {
  %s
  func.func public @main(%%arg0: tensor<8xf32>%s) -> tensor<8xf32> {
    %%0 = stablehlo.add %%arg0, %%arg0 : tensor<8xf32>
    return %%0 : tensor<8xf32>
  }
}"""


@pytest.mark.parametrize(("partitions", "replicas", "mesh", "arg", "code", "words"), [
    ("0", "1", "", "", "invalid_program", "mhlo.num_partitions is 0; expected 1 to 65536"),
    ("100000", "1", "", "", "invalid_program", "mhlo.num_partitions is 100000"),
    ("1", "-2", "", "", "invalid_program", "mhlo.num_replicas is -2"),
    ("4", "1", 'sdy.mesh @mesh = <["x"=2]>', ' {sdy.sharding = #sdy.sharding<@mesh, [{"x"}]>}',
     "compile_failed", "Invalid sharding"),
    ("4", "1", "", ' {mhlo.sharding = "{devices=[8]<=[8]}"}', "compile_failed",
     "Invalid sharding"),
], ids=["no-partitions", "too-many-partitions", "negative-replicas", "mesh-of-2-for-4",
        "sharding-over-8"])
def test_a_module_that_lies_about_its_devices_is_refused(
        http: httpx.Client, partitions: str, replicas: str, mesh: str, arg: str, code: str,
        words: str) -> None:
    text = (_MODULE % (partitions, replicas, mesh, arg)).encode()
    r = http.post("/v1/programs", content=text, headers={"content-type": wire.OCTET_STREAM})
    if r.status_code in (200, 201):  # decoded; XLA refuses it at compile
        r = http.post(f"/v1/programs/{r.json()['program_id']}/execute",
                      content=wire.packb({"args": [np.zeros(8, np.float32)]}),
                      headers={"content-type": wire.MSGPACK})
    assert r.status_code in (400, 422), r.text
    assert r.json()["error"]["code"] == code and words in r.json()["error"]["message"], r.text
    assert http.get("/healthz").status_code == 200


def test_replicas_each_run_the_whole_program(http: httpx.Client) -> None:
    """``mhlo.num_replicas = 4``: each input goes to every replica, replica 0's outputs
    are the answer, and each copy counts."""
    program_id = _upload(http, (_MODULE % ("1", "4", "", "")).encode())["program_id"]
    a = np.arange(8, dtype=np.float32)
    future_id = _run(http, program_id, a)
    np.testing.assert_array_equal(_outputs(http, future_id)[0], a + a)
    executable_id = http.get(f"/v1/futures/{future_id}").json()["executable_id"]
    sharding = http.get(f"/v1/executables/{executable_id}").json()["sharding"]
    assert (sharding["replicas"], sharding["partitions"]) == (4, 1)
    assert sharding["out"] == ["{replicated}"] and sharding["out_device_bytes"] == [4 * 32]


def test_device_put_with_a_sharding_lays_arrays_out_on_the_server(url: str) -> None:
    from jitserve.client import Client

    with Client(url, timeout=120) as c:
        mesh = c.mesh((2, 2), ("x", "y"))
        rows = NamedSharding(mesh, P("x", "y"))
        w, x = _inputs((8, 8), (8, 8))
        params = c.device_put({"w": w, "b": np.float32(0.5)},
                              {"w": NamedSharding(mesh, P("y", None)), "b": None})
        placed = c.device_put(x, rows)
        assert placed.sharding == rows and params["b"].sharding is None
        f = c.jit(lambda p, v: jnp.sin(v) @ p["w"] + p["b"], in_shardings=(
            {"w": NamedSharding(mesh, P("y", None)), "b": None}, rows), out_shardings=rows)
        np.testing.assert_allclose(np.asarray(f(params, placed)), np.sin(x) @ w + 0.5,
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(placed), x)  # the same bytes, laid out


def _device_runs(url: str) -> list[float]:
    return [metric_total(url, f'jitserve_device_runs_total{{device="{d}"}}') for d in range(4)]


def test_single_device_programs_use_every_device_of_the_group(url: str,
                                                              http: httpx.Client) -> None:
    """Calls of a single-device program take turns over the runtime's four devices; a
    call on a kept output runs where that output is, moving nothing."""
    program_id = _upload(http, bytes(export.export(jax.jit(lambda v: v * 3.0 - 1.0))(
        jax.ShapeDtypeStruct((16,), np.float32)).serialize()))["program_id"]
    before = _device_runs(url)
    relaid = metric_total(url, "jitserve_runtime_relaid_total")
    a = np.arange(16, dtype=np.float32)
    for _ in range(8):
        np.testing.assert_array_equal(_outputs(http, _run(http, program_id, a))[0], a * 3 - 1)
    runs = [n - b for n, b in zip(_device_runs(url), before)]
    assert sum(runs) == 8 and all(n >= 1 for n in runs), runs
    chained = _run(http, program_id, a)
    for _ in range(3):
        chained = _run(http, program_id, {"future": chained, "output": 0})
    expected = a
    for _ in range(4):
        expected = expected * 3 - 1
    np.testing.assert_array_equal(_outputs(http, chained)[0], expected)
    assert metric_total(url, "jitserve_runtime_relaid_total") == relaid
