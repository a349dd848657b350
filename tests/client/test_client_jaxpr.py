"""``Client.jit(fn, format="jaxpr")`` against a fake server that decodes jaxpr documents.

The fake (``JaxprFakeServer``) is ``FakeServer`` plus the compiler's own jaxpr
decoder: a program uploaded with ``?format=jaxpr`` is decoded with
``compiler.jaxpr.decode_document`` and run with ``jax.jit`` of its flat
function, as the real compiler does. The real server is exercised in
``tests/e2e/test_jaxpr_e2e.py``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from client_fakes import FakeServer, executes, server_decoder

from jitserve import wire
from jitserve.client import (
    AsyncClient,
    AsyncRemoteArray,
    Client,
    HostCallbackError,
    RemoteArray,
    RemoteFunction,
)
from jitserve.client._jit import JIT_FORMATS
from jitserve.client.jaxpr import JaxprEncodeError

pytestmark = pytest.mark.timeout(120)

X = np.arange(6, dtype=np.float32).reshape(2, 3)


class JaxprFakeServer(FakeServer):
    """``FakeServer`` that also takes ``?format=jaxpr`` uploads and runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.formats: dict[str, str] = {}
        self.decode = server_decoder()

    def _post_programs(self, request: httpx.Request) -> httpx.Response:
        pid = hashlib.sha256(request.content).hexdigest()
        self.formats[pid] = request.url.params.get("format", "")
        return super()._post_programs(request)

    def program_doc(self, pid: str) -> dict[str, Any]:
        if self.formats.get(pid) != "jaxpr":
            return super().program_doc(pid)
        decoded = self.decode(self.programs[pid])
        avals = lambda xs: [a.to_json() for a in xs]  # noqa: E731
        # A jaxpr names no platform; the fake's execute route wants to see its own.
        return {"program_id": pid, "format": "jaxpr", "in_avals": avals(decoded.in_avals),
                "out_avals": avals(decoded.out_avals), "in_tree": None, "out_tree": None,
                "platforms": ["cpu"]}

    def _run(self, pid: str, args: list[np.ndarray]) -> dict[str, Any]:
        if self.formats.get(pid) != "jaxpr" or self.fail_with is not None:
            return super()._run(pid, args)
        decoded = self.decode(self.programs[pid])
        outs = [np.asarray(o) for o in jax.jit(decoded.as_function(), keep_unused=True)(*args)]
        avals = [{"shape": list(o.shape), "dtype": o.dtype.name} for o in outs]
        return {"status": "done", "error": None, "outputs": outs, "out_avals": avals}


@pytest.fixture
def server() -> JaxprFakeServer:
    """Overrides the conftest's ``server``: the ``client`` fixtures talk to this one."""
    return JaxprFakeServer()


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every jax.export.export call made while tracing (none for jaxprs)."""
    calls: list[Any] = []
    real = jax.export.export

    def counting(*args: Any, **kw: Any) -> Any:
        calls.append(kw.get("platforms"))
        return real(*args, **kw)

    monkeypatch.setattr(jax.export, "export", counting)
    return calls


def uploads(server: FakeServer) -> list[httpx.Request]:
    return [r for r in server.requests if r.method == "POST" and r.url.path == "/v1/programs"]


def assert_tree_matches(got: Any, want: Any) -> None:
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert (g.shape, g.dtype) == (w.shape, w.dtype)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


def test_pytrees_in_and_out(client: Client, server: JaxprFakeServer, exports: list[Any]) -> None:
    def fn(x: Any, pair: Any, *, scale: Any) -> Any:
        return {"sum": x + pair[0], "rest": (pair[1] * scale, None), "n": jnp.sum(x)}

    f = client.jit(fn, format="jaxpr")
    assert isinstance(f, RemoteFunction) and f.__name__ == "fn"
    out = f(X, (X, np.int32(3)), scale=np.int32(2))
    assert all(isinstance(v, RemoteArray) for v in jax.tree_util.tree_leaves(out))
    # Shapes and dtypes are known before anything is fetched.
    assert (out["sum"].shape, out["sum"].dtype, out["n"].shape) == ((2, 3), np.float32, ())
    assert_tree_matches(out, jax.jit(fn)(X, (X, np.int32(3)), scale=np.int32(2)))
    assert exports == []  # traced to a jaxpr, never exported
    assert set(server.formats.values()) == {"jaxpr"}


def test_requests_and_document(client: Client, server: JaxprFakeServer) -> None:
    f = client.jit(lambda x, y: (jnp.sin(x) @ y, x), format="jaxpr")
    f(X, X.T)
    ((pid, blob),) = server.programs.items()
    # No GET /v1/devices: a jaxpr is not made for a platform.
    assert server.paths() == [f"GET /v1/programs/{pid}", "POST /v1/programs",
                              f"POST /v1/programs/{pid}/execute"]
    (upload,) = uploads(server)
    assert upload.url.params["format"] == "jaxpr"
    assert pid == hashlib.sha256(blob).hexdigest()
    doc = msgpack.unpackb(blob)  # the smaller encoding
    assert (doc["format"], doc["version"]) == (wire.JAXPR_FORMAT_NAME, wire.JAXPR_FORMAT_VERSION)
    assert [v["aval"] for v in doc["jaxpr"]["invars"]] == [
        {"shape": [2, 3], "dtype": "float32"}, {"shape": [3, 2], "dtype": "float32"}]
    server.requests.clear()
    f(X + 1, X.T)
    assert client._ahead.flush(5)
    assert server.paths() == ["POST /v1/calls"]  # no trace, check or upload: run ahead
    assert f._cache_size() == 1


def test_default_format_is_still_jax_export(client: Client, server: JaxprFakeServer) -> None:
    client.jit(jnp.cos)(X)
    (upload,) = uploads(server)
    assert upload.url.params["format"] == "jax_export"


def test_same_function_in_both_formats(client: Client, server: JaxprFakeServer) -> None:
    def fn(a: Any, b: Any) -> Any:
        return {"y": jnp.tanh(a @ b), "s": (a * 2).sum(0)}

    a, b = X, np.ones((3, 4), np.float32)
    via_export, via_jaxpr = client.jit(fn)(a, b), client.jit(fn, format="jaxpr")(a, b)
    assert_tree_matches(via_jaxpr, via_export)
    assert sorted(server.formats.values()) == ["jax_export", "jaxpr"]


def test_static_arguments_and_new_signatures(client: Client, server: JaxprFakeServer) -> None:
    def power(x: Any, n: int, *, mode: str = "pow") -> Any:
        return x ** n if mode == "pow" else x * n

    f = client.jit(power, static_argnums=1, static_argnames="mode", format="jaxpr")
    np.testing.assert_allclose(np.asarray(f(X, 2)), X ** 2)
    np.testing.assert_allclose(np.asarray(f(X, n=3)), X ** 3)
    np.testing.assert_allclose(np.asarray(f(X, 2, mode="mul")), X * 2)
    np.testing.assert_allclose(np.asarray(f(X[:1], 2)), X[:1] ** 2)
    assert f._cache_size() == len(server.programs) == 4
    assert all(len(body["args"]) == 1 for body in executes(server))  # statics are not sent


def test_weak_typed_scalars_follow_jax_jit(client: Client, server: JaxprFakeServer) -> None:
    def fn(a: Any, b: Any, c: Any) -> Any:
        return a * b + 1, c

    f = client.jit(fn, format="jaxpr")
    out, want = f(X, 2.0, 3), jax.jit(fn)(X, 2.0, 3)
    assert_tree_matches(out, want)
    (blob,) = server.programs.values()
    invars = msgpack.unpackb(blob)["jaxpr"]["invars"]
    assert [v["aval"].get("weak_type", False) for v in invars] == [False, True, True]


def test_chaining_keeps_data_on_the_server(client: Client, server: JaxprFakeServer) -> None:
    f = client.jit(lambda a, b: a @ b, format="jaxpr")
    y = f(X, X.T)
    z = f(y, y)
    assert client._ahead.flush(5)
    assert not any(p.endswith("/result") for p in server.paths())
    assert executes(server)[1]["args"] == [{"future": y.future_id, "output": 0}] * 2
    np.testing.assert_allclose(np.asarray(z), (X @ X.T) @ (X @ X.T))


def test_reupload_as_jaxpr_when_the_server_lost_it(client: Client, server: JaxprFakeServer) -> None:
    f = client.jit(jnp.exp, format="jaxpr")
    f(X)
    server.programs.clear()  # a restart with a fresh store
    server.requests.clear()
    np.testing.assert_allclose(np.asarray(f(X)), np.exp(X), rtol=1e-6)
    (upload,) = uploads(server)
    assert upload.url.params["format"] == "jaxpr"


def test_control_flow_and_constants(client: Client) -> None:
    w = np.linspace(-1, 1, 3, dtype=np.float32)

    def fn(x: Any) -> Any:
        y = jax.lax.fori_loop(0, 3, lambda i, v: v * w + i, x)
        return jax.lax.cond(y.sum() > 0, jnp.sin, jnp.cos, y)

    assert_tree_matches(client.jit(fn, format="jaxpr")(X), jax.jit(fn)(X))


def test_unencodable_function_raises_before_any_request(client: Client,
                                                        server: JaxprFakeServer) -> None:
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Auto,))

    def sharded(x: Any) -> Any:
        return jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, PartitionSpec("d")))

    with pytest.raises(JaxprEncodeError, match="NamedSharding"):
        client.jit(sharded, format="jaxpr")(X)
    assert server.requests == []


def test_host_callbacks_are_refused_before_any_request(client: Client,
                                                       server: JaxprFakeServer) -> None:
    def noisy(x: Any) -> Any:
        jax.debug.print("x = {}", x)
        return x + 1

    with pytest.raises(HostCallbackError, match="print it on the client"):
        client.jit(noisy, format="jaxpr")(X)
    assert server.requests == []


@pytest.mark.parametrize("bad", ["stablehlo", "JAXPR", "", "pickle"])
def test_unknown_format_is_a_value_error(client: Client, server: JaxprFakeServer, bad: str) -> None:
    for jit in (lambda: client.jit(jnp.sin, format=bad),
                lambda: client.jit(format=bad),            # the decorator form, at once
                lambda: RemoteFunction(client, jnp.sin, format=bad)):
        with pytest.raises(ValueError) as info:
            jit()
        for name in JIT_FORMATS:
            assert repr(name) in str(info.value)
    assert server.requests == []


async def test_async_jit(aclient: AsyncClient, server: JaxprFakeServer) -> None:
    f = aclient.jit(lambda a, n: {"y": a * n}, static_argnums=1, format="jaxpr")
    out = await f(X, 3)
    y = out["y"]
    assert isinstance(y, AsyncRemoteArray) and y.shape == (2, 3)
    z = await f(y, 2)
    np.testing.assert_array_equal(await z["y"].result(timeout=5), X * 6)
    assert executes(server)[1]["args"] == [{"future": y.future_id, "output": 0}]
    assert {u.url.params["format"] for u in uploads(server)} == {"jaxpr"}

    @aclient.jit(format="jaxpr")
    def neg(a: Any) -> Any:
        return -a

    np.testing.assert_array_equal(await (await neg(X)), -X)
    with pytest.raises(ValueError, match="jax_export"):
        aclient.jit(jnp.sin, format="hlo")
