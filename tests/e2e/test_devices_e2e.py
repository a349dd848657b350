"""Programs sharded across the devices of a runtime (issue 37).

One real server whose runtime has four simulated CPU devices
(``JITSERVE_CPU_DEVICES=4``). The client, with one device, exports for a mesh of
the server's (``jax.export`` over an ``AbstractMesh``), or sends the module as raw
StableHLO; the server lowers it on a mesh of its own devices, compiles for four,
and runs it. Results are compared with numpy on the same inputs: the sharding
changes where the work runs, not what it computes. Through the IFRT proxy
(``JAX_PLATFORMS=jitserve``), unmodified jax programs see the runtime's four devices
and are compared with the same programs on four local simulated devices.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from e2e.conftest import _free_port, _serve, metric_total, wait_ready
from jax import export
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jitserve import wire

pytestmark = pytest.mark.timeout(240)

MESH = AbstractMesh((2, 2), ("x", "y"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Four devices, one runtime; its HTTP url and its IFRT proxy target."""
    port = _free_port()
    for url in _serve(tmp_path_factory.mktemp("devices"), {"JITSERVE_CPU_DEVICES": "4",
                                                           "JITSERVE_IFRT_PORT": str(port)}):
        yield {"url": url, "target": f"127.0.0.1:{port}"}


@pytest.fixture(scope="module")
def url(server: dict[str, str]) -> str:
    return server["url"]


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
def groups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Four devices in two groups of two, one runtime each."""
    port = _free_port()
    for url in _serve(tmp_path_factory.mktemp("groups"), {
            "JITSERVE_CPU_DEVICES": "4", "JITSERVE_RUNTIME_DEVICES": "0-1;2-3",
            "JITSERVE_RUNTIMES": "1", "JITSERVE_IFRT_PORT": str(port)}):
        yield {"url": url, "target": f"127.0.0.1:{port}"}


@pytest.fixture(scope="module")
def groups_url(groups: dict[str, str]) -> str:
    return groups["url"]


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


def _in_use(url: str) -> list[float]:
    return [metric_total(url, f'jitserve_device_memory_bytes{{device="{d}",kind="in_use"}}')
            for d in range(4)]


def test_each_device_s_memory_is_a_gauge(url: str) -> None:
    """A kept array sharded over the four devices shows on each device's gauge (on
    the CPU: the runtime's live arrays there), a replicated one on each device whole,
    and both leave it when freed."""
    from jitserve.client import Client

    with Client(url, timeout=120) as c:
        mesh = c.mesh((2, 2), ("x", "y"))
        before = _in_use(url)
        rows = c.device_put(np.ones((256, 128), np.float32), NamedSharding(mesh, P(("x", "y"))))
        copies = c.device_put(np.ones((64, 128), np.float32), NamedSharding(mesh, P()))
        rows.block_until_ready()
        copies.block_until_ready()
        held = [after - b for after, b in zip(_in_use(url), before)]
        assert all(n >= 32 * 1024 + 32 * 1024 for n in held), held  # a quarter + a whole copy
        del rows, copies
        deadline = time.monotonic() + 60
        while any(after - b > 0 for after, b in zip(_in_use(url), before)):
            assert time.monotonic() < deadline, _in_use(url)
            time.sleep(0.2)


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


# -- through the IFRT proxy: unmodified jax programs on the group ---------------------------


def _jax_program(source: str, tmp_path: Path, *, target: str | None, devices: int = 4,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``source`` as its own program: through jitserve (``target``), or on ``devices``
    local simulated CPU devices (``target=None``), the baseline."""
    path = tmp_path / f"program_{abs(hash(source))}.py"
    path.write_text(textwrap.dedent(source))
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("JITSERVE_", "JAX_", "XLA_"))}
    if target is None:
        environ.update(JAX_PLATFORMS="cpu",
                       XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    else:
        environ.update(JAX_PLATFORMS="jitserve", JITSERVE_IFRT_TARGET=target)
    environ.update(env or {})
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          env=environ, timeout=180)


SHARDED = """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = jax.devices()
    out = {"devices": [d.id for d in devices]}
    mesh = Mesh(np.array(devices).reshape(2, 2), ("x", "y"))
    x = jax.device_put(np.arange(32.0, dtype=np.float32).reshape(8, 4),
                       NamedSharding(mesh, P("x", "y")))
    out["shards"] = sorted(s.device.id for s in x.addressable_shards)
    y = jax.jit(lambda a: jnp.sin(a) @ a.T, out_shardings=NamedSharding(mesh, P("x")))(x)
    out["matmul"], out["matmul_spec"] = np.asarray(y).tolist(), str(y.sharding.spec)
    psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh,
                                 in_specs=P("x", "y"), out_specs=P(None, "y")))
    out["psum"] = np.asarray(psum(x)).tolist()
    pmapped = jax.pmap(lambda a: a * jax.lax.psum(a, "i"), axis_name="i")
    out["pmap"] = np.asarray(pmapped(np.arange(4.0, dtype=np.float32).reshape(4, 1))).tolist()
    moved = jax.device_put(x, NamedSharding(mesh, P(None, "x")))
    out["reshard"] = [str(moved.sharding.spec), bool(np.array_equal(np.asarray(moved), np.asarray(x)))]
    out["grad"] = np.asarray(jax.jit(jax.grad(lambda a: (jnp.tanh(a) ** 2).sum()))(x)).tolist()
    last = jax.device_put(jnp.ones(3), devices[-1]) * 2
    out["last_device"] = [[d.id for d in last.devices()], np.asarray(last).tolist()]
    reversed_mesh = Mesh(np.array(devices[::-1]).reshape(4), ("x",))
    r = jax.jit(lambda a: a + 1, out_shardings=NamedSharding(reversed_mesh, P("x")))(
        np.arange(8.0, dtype=np.float32))
    out["reversed"] = [[s.device.id for s in r.addressable_shards], np.asarray(r).tolist()]
    print(json.dumps(out))
"""


def test_an_unmodified_sharded_program_runs_across_the_group_through_the_proxy(
        server: dict[str, str], tmp_path: Path) -> None:
    """``jax.devices()`` through the proxy is the runtime's four devices; NamedSharding,
    shard_map with a collective, pmap, resharding, a single device and a reversed device
    order all give what they give on four local devices."""
    remote = _jax_program(SHARDED, tmp_path, target=server["target"])
    assert remote.returncode == 0, remote.stderr[-3000:]
    local = _jax_program(SHARDED, tmp_path, target=None)
    assert local.returncode == 0, local.stderr[-3000:]
    got, want = json.loads(remote.stdout), json.loads(local.stdout)
    assert got["devices"] == want["devices"] == [0, 1, 2, 3]
    assert got["shards"] == [0, 1, 2, 3]
    for field in ("matmul", "psum", "pmap", "grad"):
        np.testing.assert_allclose(np.array(got[field]), np.array(want[field]), rtol=1e-6)
    for field in ("matmul_spec", "reshard", "last_device", "reversed"):
        assert got[field] == want[field], field


GROUP = """
    import json
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"),
                                  out_specs=P()))
    x = jax.device_put(np.arange(8.0, dtype=np.float32), NamedSharding(mesh, P("x")))
    print(json.dumps({"devices": len(jax.devices()), "psum": np.asarray(total(x)).tolist()}))
"""


def test_a_session_lives_on_one_group_and_asks_for_no_more_than_a_group_has(
        groups: dict[str, str], tmp_path: Path) -> None:
    for asked in ({}, {"JITSERVE_IFRT_DEVICES": "2"}):
        done = _jax_program(GROUP, tmp_path, target=groups["target"], env=asked)
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout) == {"devices": 2, "psum": [4.0, 6.0, 8.0, 10.0]}
    refused = _jax_program(GROUP, tmp_path, target=groups["target"],
                           env={"JITSERVE_IFRT_DEVICES": "4"})
    assert refused.returncode != 0
    assert "JITSERVE_IFRT_DEVICES='4': this server's groups have at most 2 devices" in refused.stderr


def test_bad_shardings_and_remaps_on_the_wire_are_error_statuses(server: dict[str, str]) -> None:
    """Shardings naming a device twice or one the group has not, shards of unknown
    place, and a remap plan past its arrays: each an error status naming the problem."""
    import grpc
    from e2e.test_ifrt_e2e import Session, _status

    from jitserve.compiler.ifrt_protos import message

    f32 = message("xla.ifrt.DTypeProto").Kind.Value("KIND_F32")

    def hlo(devices: list[int]) -> dict[str, Any]:
        proto = message("xla.ifrt.HloShardingProto")()
        proto.devices.device_ids.extend(devices)
        proto.xla_op_sharding.type = proto.xla_op_sharding.REPLICATED
        return {"serialized_sharding": {"type_name": "xla::ifrt::HloSharding",
                                        "data": proto.SerializeToString()}}

    def concrete(devices: list[int]) -> dict[str, Any]:
        proto = message("xla.ifrt.ConcreteShardingProto")()
        proto.devices.device_ids.extend(devices)
        return {"serialized_sharding": {"type_name": "xla::ifrt::ConcreteSharding",
                                        "data": proto.SerializeToString()}}

    session = Session(server["target"], key=None)
    try:
        values = np.arange(4, dtype=np.float32)

        def make(sharding: dict[str, Any], handle: int) -> tuple[int, str]:
            session.store(handle + 100, values.tobytes())  # each request takes its own
            return _status(session.request(make_array_from_host_buffer_request={
                "dtype": {"kind": f32}, "shape": {"dims": [4]}, "host_buffer_handle": handle + 100,
                "array_handle": handle, "sharding": sharding}))

        code, text = make(hlo([0, 0, 1, 2]), 20)
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "each at most once" in text
        code, text = make(hlo([0, 9]), 21)
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "unknown device 9" in text
        code, text = make(concrete([0, 1]), 22)
        assert code == grpc.StatusCode.UNIMPLEMENTED.value[0] and "which part" in text
        assert make(hlo([0, 1, 2, 3]), 23) == (0, "")  # replicated on all four: fine
        plan = {"input_specs": [{"dtype": {"kind": f32}, "shape": {"dims": [4]},
                                 "sharding": hlo([0, 1, 2, 3])}],
                "output_specs": [{"dtype": {"kind": f32}, "shape": {"dims": [4]},
                                  "sharding": hlo([0, 1])}],
                "mappings": [{"in_array": 0, "out_array": 0, "from_start": [2], "from_end": [9],
                              "from_step": [1], "to_start": [0], "to_end": [7], "to_step": [1]}]}
        code, text = _status(session.request(remap_arrays_request={
            "plan": plan, "array_handles": [23], "result_handles": [24]}))
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "intervals" in text
        plan["mappings"][0].update(from_end=[4], to_end=[2])  # shards 2 and 3 onto 0 and 1
        code, text = _status(session.request(remap_arrays_request={
            "plan": plan, "array_handles": [23], "result_handles": [24]}))
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "devices" in text
        plan["mappings"][0].update(from_start=[0], from_end=[2])  # shards 0 and 1: fits
        assert _status(session.request(remap_arrays_request={
            "plan": plan, "array_handles": [23], "result_handles": [24]})) == (0, "")
        read = session.request(copy_to_host_buffer_request={"array_handle": 24,
                                                            "host_buffer_handle": 25})
        assert _status(read) == (0, "")
    finally:
        session.close()
