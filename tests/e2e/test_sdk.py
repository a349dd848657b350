"""The SDK against a real ``jitserve serve`` process: the corpus through ``Client.jit``.

Every corpus function runs remotely and must match local ``jax.jit``; chaining
keeps arrays on the server; the async client does the same awaitably.
"""

from __future__ import annotations

import copy
import functools
import gc
import pickle
import re
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from corpus import CASES, Case, assert_outputs_match, expected

from jitserve.client import AsyncClient, Client, ProgramError, RemoteArray, Timeout

jax.config.update("jax_enable_x64", True)


@pytest.fixture(scope="module")
def client(server_url: str):  # noqa: ANN201 - a Client
    with Client(server_url, timeout=120) as c:
        yield c


def _metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics").text
    pattern = rf"^{re.escape(name)}{re.escape(labels)}\s+([0-9.e+-]+)$"
    return sum(float(m) for m in re.findall(pattern, text, flags=re.M))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_corpus_through_client_jit(client: Client, case: Case) -> None:
    out = client.jit(case.fn)(*case.args())
    leaves = jax.tree_util.tree_leaves(out)
    assert all(isinstance(leaf, RemoteArray) for leaf in leaves)
    want = expected(case)
    assert [leaf.shape for leaf in leaves] == [w.shape for w in want]  # known before fetching
    assert_outputs_match(case, [np.asarray(leaf) for leaf in leaves], want)


def test_pytree_structure_matches_jax_jit(client: Client) -> None:
    def fn(params, x):  # noqa: ANN001, ANN202
        return {"y": params["w"] @ x, "aux": (x.sum(), None)}

    params, x = {"w": np.eye(3)}, np.arange(3.0)
    remote, local = client.jit(fn)(params, x), jax.jit(fn)(params, x)
    assert jax.tree_util.tree_structure(remote) == jax.tree_util.tree_structure(local)
    np.testing.assert_allclose(np.asarray(remote["y"]), local["y"])


def test_static_argnums_recompile_per_value(client: Client) -> None:
    f = client.jit(lambda x, n: x * n, static_argnums=(1,))
    x = np.arange(4.0)
    np.testing.assert_array_equal(np.asarray(f(x, 2)), x * 2)
    np.testing.assert_array_equal(np.asarray(f(x, 3)), x * 3)


@pytest.mark.parametrize("hold", [0.0, Timeout().hold], ids=["no hold", "default hold"])
def test_chaining_uploads_no_bytes(server_url: str, hold: float) -> None:
    """A chained input stays on the server. Without a hold nothing comes back
    either; with one, each call's small outputs come back with its answer."""
    x = np.linspace(0, 1, 1 << 12)  # under the e2e server's small body limit
    with Client(server_url, timeout=Timeout(120, hold=hold)) as client:
        f = client.jit(lambda v: jnp.sin(v) + 1.0)
        y = f(x)
        y.block_until_ready()
        before_in = _metric(server_url, "jitserve_transfer_bytes_total", '{direction="in"}')
        before_out = _metric(server_url, "jitserve_transfer_bytes_total", '{direction="out"}')
        z = f(f(y))
        z.block_until_ready()
        assert _metric(server_url, "jitserve_transfer_bytes_total", '{direction="in"}') == before_in
        out = _metric(server_url, "jitserve_transfer_bytes_total", '{direction="out"}') - before_out
        assert out in ((0,) if hold == 0 else (0, x.nbytes, 2 * x.nbytes))  # a miss brings none
        np.testing.assert_allclose(np.asarray(z), np.sin(np.sin(np.sin(x) + 1) + 1) + 1,
                                   rtol=1e-12)


def test_a_call_and_its_value_take_one_request(server_url: str) -> None:
    """``np.asarray(f(x))`` of a function with small outputs: the execute's answer
    holds the outputs (``Timeout.hold``, long here so that a loaded machine never
    misses it), so no result request follows, and the call is one round trip."""
    route = '{route="/v1/futures/{future_id}/result",status="200"}'
    with Client(server_url, timeout=Timeout(120, hold=10.0)) as client:
        f = client.jit(lambda v: (jnp.cos(v) * 2.0, v.sum()))
        x = np.linspace(-1, 1, 256)
        results = _metric(server_url, "jitserve_requests_total", route)
        got = [f(x * k) for k in range(1, 9)]  # the first compiles within the hold
        values = [(np.asarray(a), float(b)) for a, b in got]
        assert _metric(server_url, "jitserve_requests_total", route) == results
        for k, (a, b) in enumerate(values, start=1):
            np.testing.assert_allclose(a, np.cos(x * k) * 2.0, rtol=1e-12)
            assert b == pytest.approx(float((x * k).sum()), abs=1e-12)
        y = f(got[-1][0])[0]  # a held answer's arrays chain by reference
        np.testing.assert_allclose(np.asarray(y), np.cos(np.cos(x * 8) * 2.0) * 2.0, rtol=1e-12)


def test_recall_reuses_the_program(client: Client) -> None:
    traces = []

    def fn(v):  # noqa: ANN001, ANN202
        traces.append(1)
        return v * 2

    f = client.jit(fn)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(np.ones(5))), np.full(5, 2.0))
    assert len(traces) == 1


async def test_async_client_jit_and_chain(server_url: str) -> None:
    async with AsyncClient(server_url, timeout=120) as ac:
        f = ac.jit(lambda v: v @ v.T)
        x = np.random.default_rng(0).standard_normal((8, 4))
        y = await f(x)
        z = await f(y)
        np.testing.assert_allclose(await z.result(), (x @ x.T) @ (x @ x.T).T, rtol=1e-12)


def test_big_answer_from_a_small_call(client: Client) -> None:
    # 4 MiB back for 4 KiB sent: the answer is read into one buffer of its length.
    x = np.arange(512.0)
    got = np.asarray(client.jit(lambda v: jnp.broadcast_to(v, (1024, 512)) * 2)(x))
    np.testing.assert_array_equal(got, np.broadcast_to(x * 2, (1024, 512)))


async def test_big_answer_async(server_url: str) -> None:
    async with AsyncClient(server_url, timeout=120) as ac:
        x = np.arange(512.0)
        got = await (await ac.jit(lambda v: jnp.broadcast_to(v, (1024, 512)) + 1)(x)).result()
    np.testing.assert_array_equal(got, np.broadcast_to(x + 1, (1024, 512)))


def test_copies_outlive_their_originals_and_pickles_are_values(client: Client) -> None:
    """``copy.copy`` and ``copy.deepcopy`` make new arrays on the server, as copying a
    ``jax.Array`` makes a new one: a kept copy (``best = copy.deepcopy(params)``)
    outlives the original's collection, deletion and donation. A second handle on the
    same output would have freed it with the first."""
    f = client.jit(lambda v: v * 2)
    x = np.arange(6.0).reshape(2, 3)
    y = f(x)
    twin = copy.copy(y)
    assert isinstance(twin, RemoteArray) and twin.future_id != y.future_id
    del twin
    gc.collect()
    np.testing.assert_array_equal(np.asarray(y), x * 2)  # alive: the copy freed its own
    params = {"w": f(x), "b": f(x[0]), "key": client.jit(lambda k: k)(jax.random.key(3))}
    best = copy.deepcopy(params)
    step = client.jit(lambda p: {**p, "w": p["w"] + 1, "b": p["b"] + 1}, donate_argnums=0)
    params = step(params)
    np.testing.assert_array_equal(np.asarray(best["w"]), x * 2)  # kept through the donation
    np.testing.assert_array_equal(np.asarray(params["w"]), x * 2 + 1)
    pickled = pickle.loads(pickle.dumps(best))  # values, as a jax.Array pickles as its value
    assert type(pickled["w"]) is np.ndarray and pickled["w"].tolist() == (x * 2).tolist()
    assert jax.random.key_data(pickled["key"]).tolist() == jax.random.key_data(
        jax.random.key(3)).tolist()


def test_jax_random_at_and_dlpack_take_remote_arrays(client: Client,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """What a training script does outside its jitted step, on what the step returned: a
    remote key split or drawn from by ``jax.random`` (which took a typed remote key for
    key data: "invalid PRNG key data"), ``y.at[i].set(v)``, ``from_dlpack``. Each works
    on the fetched value, as ``jnp`` does, and matches jax."""
    key = client.jit(lambda k: k)(jax.random.key(7))
    keys = client.jit(lambda k: jax.random.split(k, 3))(jax.random.key(7))
    local = jax.random.key(7)

    def data(k):  # noqa: ANN001, ANN202
        return np.asarray(jax.random.key_data(k))

    np.testing.assert_array_equal(data(jax.random.split(key)), data(jax.random.split(local)))
    np.testing.assert_array_equal(data(jax.random.fold_in(key, 5)),
                                  data(jax.random.fold_in(local, 5)))
    np.testing.assert_array_equal(jax.random.normal(key, (4,)), jax.random.normal(local, (4,)))
    np.testing.assert_array_equal(data(keys), data(jax.random.split(local, 3)))
    with pytest.raises(ValueError, match="accepts a single key"):  # jax's own check
        jax.random.normal(keys, (2,))
    raw = client.jit(lambda k: k)(jax.random.PRNGKey(7))  # raw uint32 data, as before
    np.testing.assert_array_equal(jax.random.uniform(raw, (3,)),
                                  jax.random.uniform(jax.random.PRNGKey(7), (3,)))
    np.testing.assert_array_equal(data(jax.random.wrap_key_data(raw)), data(local))

    y = client.jit(lambda v: v * 2)(np.arange(4.0))
    loss = client.jit(lambda v: (v ** 2).mean())(y)
    # print(loss) and f"loss {loss}" show the value, as for a jax array
    assert str(loss) == f"{loss}" == str(jnp.mean(jnp.arange(4.0) ** 2 * 4)) == "14.0"
    updated = y.at[1].add(10.0)
    assert isinstance(updated, jax.Array) and updated.tolist() == [0, 12, 4, 6]
    assert y.tolist() == [0, 2, 4, 6]  # an update makes a new array
    assert y.__dlpack_device__() == (1, 0)
    capfd.readouterr()
    for took in (np.from_dlpack(y), jnp.from_dlpack(y)):
        np.testing.assert_array_equal(took, np.arange(4.0) * 2)
    assert "not aligned" not in capfd.readouterr().err  # jax takes the copy as it is
    mine = np.from_dlpack(y)
    mine[0] = 99.0  # the consumer's own copy: the array's value is unchanged
    assert y.tolist() == [0, 2, 4, 6]
    with pytest.raises(TypeError, match="PRNGKey dtype"):  # as a local key array
        np.from_dlpack(key)


def test_a_jitted_function_binds_as_a_method(client: Client) -> None:
    """``@functools.partial(c.jit, static_argnums=0)`` on a method, as with ``jax.jit``:
    the instance comes first (it took the argument's place: "missing 1 required
    positional argument"), one trace per instance."""
    class Scaler:
        def __init__(self, k: float) -> None:
            self.k = k

        @functools.partial(client.jit, static_argnums=0)
        def apply(self, x):  # noqa: ANN001, ANN202
            return x * self.k

    two, three = Scaler(2.0), Scaler(3.0)
    assert two.apply(np.ones(2)).tolist() == [2, 2]
    assert three.apply(np.ones(2)).tolist() == [3, 3]
    assert Scaler.apply(two, np.ones(2)).tolist() == [2, 2]  # through the class, as a function
    assert Scaler.apply._cache_size() == 2


def test_lower_and_compile_ahead_of_time_as_jax_does(client: Client, server_url: str) -> None:
    """``f.lower(x).compile()``, as with ``jax.jit``: the program's text and output shapes
    without the server compiling; then the server's compile of the executable the
    calls run (donations included: the first donating step compiles nothing more),
    its XLA cost and memory analyses, and a compiled function that takes only its own
    signature."""
    salt = float(time.time_ns() % 1_000_003)  # a program no earlier run compiled

    def step(w, b):  # noqa: ANN001, ANN202
        return w + salt, jnp.tanh(w @ b).sum()

    f = client.jit(step, donate_argnums=0)
    w, b = np.ones((64, 32), np.float32), np.full((32, 16), 0.5, np.float32)
    compiles = _metric(server_url, "jitserve_compile_seconds_count")
    lowered = f.lower(w, b)
    assert "func.func public @main" in lowered.as_text() and "tensor<64x32xf32>" in lowered.as_text()
    assert lowered.out_info == jax.eval_shape(step, w, b) == f.eval_shape(w, b)
    assert _metric(server_url, "jitserve_compile_seconds_count") == compiles  # traced only

    traced = f.trace(w, b)  # here, as jax.jit(f).trace
    assert "tanh" in {e.primitive.name for e in traced.jaxpr.jaxpr.eqns}
    assert traced.out_info == lowered.out_info and traced.fun_name == "step"
    assert traced.lower().as_text() == lowered.as_text()

    compiled = lowered.compile()
    assert compiled.tier == "compiled" and compiled.executable_id
    assert _metric(server_url, "jitserve_compile_seconds_count") == compiles + 1
    local = jax.jit(step).lower(w, b)
    assert (compiled.in_tree, compiled.out_tree) == (lowered.in_tree, lowered.out_tree) == (
        local.in_tree, local.out_tree)
    # XLA's optimized HLO of the executable, as jax's Compiled.as_text() prints it.
    hlo = compiled.as_text()
    assert hlo.startswith("HloModule") and "is_scheduled=true" in hlo and "f32[64,16]" in hlo
    r = httpx.get(f"{server_url}/v1/executables/{'0' * 64}/text")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert f.lower(w, b).compile().tier == "memory"  # the server's cache, as a call finds it
    cost = compiled.cost_analysis()
    assert cost is not None and cost["flops"] >= 2 * 64 * 32 * 16 and cost["bytes accessed"] > 0
    memory = compiled.memory_analysis()
    assert memory is not None and memory.argument_size_in_bytes == w.nbytes + b.nbytes
    new_w, total = compiled(w, b)
    want_w, want_total = jax.jit(step)(w, b)
    np.testing.assert_array_equal(np.asarray(new_w), want_w)
    np.testing.assert_allclose(float(total), float(want_total), rtol=1e-6)
    with pytest.raises(TypeError, match=r"compiled for other arguments.*leaf 0 of shape \(2, 32\)"):
        compiled(np.ones((2, 32), np.float32), b)

    # A remote w is donated: compiled ahead with its donation, the step compiles nothing.
    remote = client.device_put(w)
    compiles = _metric(server_url, "jitserve_compile_seconds_count")
    donating = f.lower(remote, b).compile()
    assert donating.executable_id != compiled.executable_id  # donating is compiled in
    assert _metric(server_url, "jitserve_compile_seconds_count") == compiles + 1
    new_w, _ = donating(remote, b)
    np.testing.assert_array_equal(np.asarray(new_w), want_w)
    assert remote.is_deleted()
    assert _metric(server_url, "jitserve_compile_seconds_count") == compiles + 1

    # The server lost the program since it was uploaded (a restart, a delete): compile()
    # uploads it again, as a call does.
    lowered = f.lower(w, b)
    assert httpx.delete(f"{server_url}/v1/programs/{lowered.program_id}").status_code == 200
    assert lowered.compile().tier == "memory"

    text = client.jit(lambda v: v * 2, format="jaxpr").lower(np.arange(3.0)).as_text()
    assert '"primitive": "mul"' in text  # the jaxpr document the server gets


def test_jax_jit_s_other_keywords(client: Client, server_url: str) -> None:
    """``keep_unused``, ``inline`` and ``compiler_options`` are ``jax.jit``'s: the options
    reach the server's XLA (fast math turns ``inf - inf`` from nan into 0, as it does
    locally), key their own executable and name themselves as a recompile reason; an
    option the server does not allow is refused naming it; ``device`` and ``backend``
    say where the function runs instead."""
    salt = float(time.time_ns() % 1_000_003)  # programs no earlier run compiled
    inf = np.array([np.inf, 1.0, -np.inf], np.float32)

    def diff(x):  # noqa: ANN001, ANN202
        return x - x + (salt - salt)

    fast = {"xla_cpu_enable_fast_math": True, "xla_cpu_fast_math_honor_nans": False,
            "xla_cpu_fast_math_honor_infs": False}
    want_plain, want_fast = jax.jit(diff)(inf), jax.jit(diff, compiler_options=fast)(inf)
    assert np.isnan(want_plain[0]) and want_fast[0] == 0  # what the options do locally
    plain = client.jit(diff)
    np.testing.assert_array_equal(np.asarray(plain(inf)), want_plain)
    compiles = _metric(server_url, "jitserve_compile_seconds_count")
    fast_f = client.jit(diff, compiler_options=fast)
    np.testing.assert_array_equal(np.asarray(fast_f(inf)), want_fast)
    np.testing.assert_array_equal(np.asarray(fast_f(inf)), want_fast)  # its own, kept
    assert _metric(server_url, "jitserve_compile_seconds_count") == compiles + 1
    compiled = fast_f.lower(inf).compile()
    assert compiled.tier == "memory"
    assert compiled.executable_id != plain.lower(inf).compile().executable_id
    record = httpx.get(f"{server_url}/v1/executables/{compiled.executable_id}").json()
    assert any(r.startswith("flags: compiler_options") for r in record["recompiled_because"])
    np.testing.assert_array_equal(np.asarray(compiled(inf)), want_fast)
    # Lowered.compile's options go over the function's, and its calls run with them.
    honest = plain.lower(inf).compile(compiler_options={"xla_cpu_enable_fast_math": False})
    assert honest.executable_id != compiled.executable_id
    assert np.isnan(np.asarray(honest(inf))[0])

    with pytest.raises(ProgramError, match="compile option 'xla_dump_to' is not allowed"):
        client.jit(diff, compiler_options={"xla_dump_to": "/tmp/x"})(inf).result()
    with pytest.raises(TypeError, match="compiler_options"):
        client.jit(diff, compiler_options={"xla_cpu_ftz": [1]})
    with pytest.raises(TypeError, match="runs on the jitserve server's devices"):
        client.jit(diff, backend="cpu")

    def first(x, unused):  # noqa: ANN001, ANN202
        return x * 2

    kept = client.jit(first, keep_unused=True, inline=True)
    assert kept.lower(inf, inf).as_text().count("tensor<3xf32>") > client.jit(first).lower(
        inf, inf).as_text().count("tensor<3xf32>")
    np.testing.assert_array_equal(np.asarray(kept(inf, inf)), inf * 2)


async def test_async_lower_and_compile(server_url: str) -> None:
    async with AsyncClient(server_url, timeout=120) as ac:
        f = ac.jit(lambda v: v * 3 + 1)
        lowered = await f.lower(np.arange(4.0))
        assert lowered.out_info == jax.ShapeDtypeStruct((4,), np.float64)
        assert await f.eval_shape(np.arange(4.0)) == lowered.out_info
        compiled = await lowered.compile()
        assert (await compiled.as_text()).startswith("HloModule")
        assert f.trace(np.arange(4.0)).out_info == lowered.out_info
        assert (await f.trace(np.arange(4.0)).lower()).program_id == lowered.program_id
        y = await compiled(np.arange(4.0))
        assert (await y.result()).tolist() == [1, 4, 7, 10]
        with pytest.raises(TypeError, match="compiled for other arguments"):
            await compiled(np.arange(5.0))


async def test_async_copies_are_values(server_url: str) -> None:
    async with AsyncClient(server_url, timeout=120) as ac:
        y = await ac.jit(lambda v: v + 1)(np.arange(3.0))
        with pytest.raises(TypeError, match="not fetched yet"):
            copy.copy(y)
        assert str(y) == f"{y}" == repr(y)  # printing cannot wait for it
        await y.result()
        assert str(y) == f"{y}" == str(np.arange(3.0) + 1) != repr(y)
        kept = copy.deepcopy(y)
        assert type(kept) is np.ndarray and kept.flags.writeable and kept.tolist() == [1, 2, 3]
