"""Unmodified JAX programs on a real ``jitserve serve``, through jaxlib's own IFRT proxy client.

Each program runs as a subprocess of this interpreter with ``JAX_PLATFORMS=jitserve``
(``client/ifrt_plugin.py``) against one server started for this module, with API keys,
two runtimes and a 3 s execution deadline; its baseline runs the same way on the local
CPU. These tests need only what ``jitserve[jit]`` installs beside the jax a user has:
``.ci/jax-range`` runs them again on the oldest jax of the ``jit`` extra against a
server on the pinned one, so jaxlib's oldest and newest clients both talk to it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from e2e.conftest import _free_port, _serve, metric_total, wait_ready

KEYS = ("ifrt-alice-key-0123456789", "ifrt-bob-key-0123456789")


def serve_ifrt(tmp_path_factory: pytest.TempPathFactory,
               extra: dict[str, str] | None = None) -> Iterator[dict[str, str]]:
    """A server with the IFRT proxy on (and the settings in ``extra``): its HTTP url and
    its IFRT target."""
    port = _free_port()
    env = {"JITSERVE_IFRT_PORT": str(port), "JITSERVE_API_KEYS": ",".join(KEYS),
           "JITSERVE_RUNTIMES": "2", "JITSERVE_EXECUTION_TIMEOUT_S": "3",
           "JITSERVE_IFRT_HOST_BUFFER_WAIT_S": "2", "JITSERVE_MAX_BODY_BYTES": str(64 << 20),
           "JITSERVE_MAX_EXECUTION_BYTES": str(512 << 20), "JITSERVE_LOG_LEVEL": "info",
           **(extra or {})}
    for url in _serve(tmp_path_factory.mktemp("ifrt"), env):
        wait_ready(url)
        yield {"url": url, "target": f"127.0.0.1:{port}"}


@pytest.fixture(scope="module")
def ifrt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    yield from serve_ifrt(tmp_path_factory)


def run_program(ifrt: dict[str, str], source: str, tmp_path: Path, *, key: str | None = KEYS[0],
                remote: bool = True, timeout: float = 180, stdin: Any = None,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``source`` as its own Python program: on the server (``JAX_PLATFORMS=jitserve``),
    or locally on the CPU (``remote=False``) as the baseline."""
    path = tmp_path / f"program_{abs(hash(source))}.py"
    path.write_text(textwrap.dedent(source))
    environ = program_env(ifrt, key) if remote else program_env(None)
    environ.update(env or {})
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=environ,
                          timeout=timeout, input=stdin)


def program_env(ifrt: dict[str, str] | None, key: str | None = None) -> dict[str, str]:
    """The environment of a program on the server at ``ifrt`` (with ``key``), or of one on
    the local CPU (``None``): this one's, without its jitserve, jax and XLA settings."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("JITSERVE_", "JAX_", "XLA_"))}
    if ifrt is None:
        environ["JAX_PLATFORMS"] = "cpu"
        return environ
    environ.update(JAX_PLATFORMS="jitserve", JITSERVE_IFRT_TARGET=ifrt["target"])
    if key is not None:
        environ["JITSERVE_API_KEY"] = key
    return environ


NUMERICS = """
    import json
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_enable_x64", True)

    out = {"platform": jax.devices()[0].platform, "named": str(jax.devices("cpu")[0].platform)}
    x = jnp.arange(12.0).reshape(3, 4)
    out["jit"] = np.asarray(jax.jit(lambda a: (a * 2).sum(axis=0))(x)).tolist()
    out["grad"] = np.asarray(jax.grad(lambda a: (jnp.sin(a) ** 2).sum())(x)).tolist()
    out["inv"] = np.asarray(jnp.linalg.inv(jnp.eye(3) * 2.0 + 0.5)).tolist()
    out["eig"] = np.asarray(jnp.linalg.eigh(jnp.eye(3) * 3.0)[0]).tolist()
    out["random"] = np.asarray(jax.random.normal(jax.random.key(0), (4,))).tolist()
    out["scan"] = np.asarray(jax.lax.scan(lambda c, v: (c + v, c * v), 0.0, jnp.arange(5.0))[1]).tolist()
    out["f64"] = str(jnp.asarray(np.float64(1) / 3).dtype)
    out["c128"] = str(jnp.asarray(np.complex128(1 + 2j)) * 2)
    out["int"] = np.asarray(jnp.arange(10, dtype=jnp.int8) * 3).tolist()
    out["bool"] = np.asarray(jnp.arange(4) > 1).tolist()
    out["bf16"] = np.asarray(jnp.ones(3, jnp.bfloat16) / 3).astype(np.float32).tolist()
    out["broadcast"] = np.asarray(jnp.asarray(np.broadcast_to(np.arange(3.0), (2, 3)))).tolist()
    out["reversed"] = np.asarray(jnp.asarray(np.arange(5.0)[::-1])).tolist()
    big = np.random.default_rng(0).random((512, 1024))  # 4 MiB each way: shared memory
    back = np.asarray(jax.device_put(big) * 2)
    out["big"] = bool(np.array_equal(back, big * 2))
    # The server's copy of an upload is its own: the shared memory it came through goes
    # to the next uploads (each waited for: one at a time, each segment used in turn),
    # and they do not change it. Read as computed there, not from the client's copy.
    kept = jax.device_put(big).block_until_ready()
    others = [jax.device_put(big * k).block_until_ready() for k in range(3, 9)]
    out["kept"] = bool(np.array_equal(np.asarray(kept + 0), big)
                       and np.array_equal(np.asarray(others[-1] + 0), big * 8))
    donated = jax.jit(lambda a: a + 1, donate_argnums=0)(jnp.ones(4))
    out["donated"] = np.asarray(donated).tolist()
    out["memory_stats"] = jax.devices()[0].memory_stats()  # None, as a local CPU's
    print(json.dumps(out))
"""


def test_an_unmodified_program_gives_local_jax_s_answers(ifrt: dict[str, str], tmp_path: Path) -> None:
    # With jax's persistent compilation cache on, as training scripts often have it: it
    # leaves the backend alone (jaxlib's client cannot serialize executables), where it
    # warned of a failed write at every compile.
    cache = tmp_path / "jax-cache"
    remote = run_program(ifrt, NUMERICS, tmp_path, env={
        "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})
    assert remote.returncode == 0, remote.stderr[-3000:]
    local = run_program(ifrt, NUMERICS, tmp_path, remote=False)
    assert local.returncode == 0, local.stderr[-3000:]
    got, want = json.loads(remote.stdout), json.loads(local.stdout)
    assert got["platform"] == "cpu" and got["named"] == "cpu"
    for name in want:
        if isinstance(want[name], list):
            np.testing.assert_allclose(np.asarray(got[name], float), np.asarray(want[name], float),
                                       rtol=1e-6, err_msg=name)
        else:
            assert got[name] == want[name], name
    # Nothing from the proxy client: no warnings, no stack trace at exit.
    assert remote.stderr == "", remote.stderr[-3000:]
    assert not cache.exists() or not any(cache.iterdir())


def test_this_jaxlib_s_client_opens_a_session_in_a_protocol_the_server_serves(
        ifrt: dict[str, str], tmp_path: Path) -> None:
    """The session of this interpreter's jaxlib (jaxlib 0.8.0's client asks protocol 19
    at most, 0.10.2's 25), as the console shows it while the program holds it open."""
    path = tmp_path / "holds.py"
    path.write_text("import sys, jax, jaxlib\nprint(jaxlib.__version__, jax.devices()[0].platform, "
                    "flush=True)\nsys.stdin.readline()\n")
    env = program_env(ifrt, KEYS[1])
    proc = subprocess.Popen([sys.executable, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        version, platform = proc.stdout.readline().split()
        import jaxlib

        assert version == jaxlib.__version__ and platform == "cpu"
        r = httpx.get(f"{ifrt['url']}/v1/console/sessions", timeout=30,
                      headers={"authorization": f"Bearer {KEYS[1]}"})
        assert r.status_code == 200, r.text
        sessions = r.json()["sessions"]
        assert sessions and all(16 <= s["protocol"] <= 25 for s in sessions), sessions
        out, err = proc.communicate("\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0 and err == "", err[-2000:]


DOCS = Path(__file__).resolve().parents[2] / "docs" / "ifrt.md"


def _walkthrough() -> str:
    """The python block under docs/ifrt.md's "Train a model, unmodified"."""
    text = DOCS.read_text()
    section = text[text.index("## Train a model, unmodified"):]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)  # type: ignore[union-attr]


def test_the_docs_training_walkthrough_runs_unmodified_with_local_losses(
        ifrt: dict[str, str], tmp_path: Path) -> None:
    """The flax CNN with optax, as docs/ifrt.md writes it: the same losses as local jax.jit,
    the server's compiles in its metrics, and a second run served from the cache."""
    code = _walkthrough()
    compiled_before = _tier_count(ifrt["url"], "compiled")
    remote = run_program(ifrt, code, tmp_path, env={"STEPS": "4"})
    assert remote.returncode == 0 and remote.stderr == "", remote.stderr[-3000:]
    local = run_program(ifrt, code, tmp_path, remote=False, env={"STEPS": "4"})
    assert local.returncode == 0, local.stderr[-3000:]

    def losses(out: str) -> list[float]:
        return [float(v) for v in re.findall(r"loss (\d+\.\d+)", out)]

    assert len(losses(remote.stdout)) == 4
    np.testing.assert_allclose(losses(remote.stdout), losses(local.stdout), rtol=1e-5)
    compiled = _tier_count(ifrt["url"], "compiled")
    assert compiled > compiled_before  # the server compiled the training step
    again = run_program(ifrt, code, tmp_path, env={"STEPS": "4"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert losses(again.stdout) == losses(remote.stdout)
    assert _tier_count(ifrt["url"], "compiled") == compiled  # all from the cache


def test_a_program_exits_with_its_own_status_and_says_nothing_from_the_proxy(
        ifrt: dict[str, str], tmp_path: Path) -> None:
    ended = run_program(ifrt, """
        import jax, jax.numpy as jnp
        y = jax.jit(lambda x: x + 1)(jnp.ones(3))
        y.block_until_ready()
        raise SystemExit(7)
    """, tmp_path)
    assert ended.returncode == 7 and ended.stderr == "", ended.stderr[-3000:]
    failed = run_program(ifrt, """
        import jax.numpy as jnp
        x = jnp.ones(3) * 2
        raise ValueError("the program's own error")
    """, tmp_path)
    assert failed.returncode == 1
    assert failed.stderr.rstrip().endswith("ValueError: the program's own error"), failed.stderr
    assert "IFRT" not in failed.stderr and "Stack trace" not in failed.stderr


READS = """
    import json, resource
    import jax, numpy as np
    host = np.random.default_rng(0).random(12 << 20, dtype=np.float32)  # 48 MiB
    x = jax.device_put(host)
    faults = []
    for k in range(5):
        y = x + k
        y.block_until_ready()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        back = np.asarray(y)  # the read before stays held until this one is made
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        assert back[7] == host[7] + k
    print(json.dumps(faults))
"""


def test_big_reads_reuse_the_memory_the_reads_before_freed(ifrt: dict[str, str],
                                                           tmp_path: Path) -> None:
    # jaxlib's client copies a read twice into blocks of its size, on a thread of its
    # own; glibc gives such blocks fresh pages each time unless the backend keeps freed
    # memory for reuse (client/ifrt_plugin.py). Counted in page faults, not time: from
    # the third read on, reads reuse what the reads before freed. Which of jaxlib's
    # threads copies a read varies with the machine's load, and a read on a thread
    # whose arena holds nothing freed faults afresh (one of three reads did, in CI
    # beside other tests): so the best of reads three to five.
    # Off when told, and when local XLA shares the process (its threads keep their arenas).
    ways = {"default": {}, "off": {"JITSERVE_IFRT_RETAIN_FREED_BYTES": "0"},
            "beside cpu": {"JAX_PLATFORMS": "jitserve,cpu"}}
    reads = {}
    for way, env in ways.items():
        done = run_program(ifrt, READS, tmp_path, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        reads[way] = json.loads(done.stdout)
    first, reused = reads["default"][0], min(reads["default"][2:])
    assert reused * 4 < first, reads
    assert min(reads["off"][2:]) > reused * 4 and min(reads["beside cpu"][2:]) > reused * 4, reads


def test_a_bad_retain_setting_is_refused_naming_it(ifrt: dict[str, str], tmp_path: Path) -> None:
    done = run_program(ifrt, "import jax; jax.devices()", tmp_path,
                       env={"JITSERVE_IFRT_RETAIN_FREED_BYTES": "lots"})
    assert done.returncode == 1
    assert "JITSERVE_IFRT_RETAIN_FREED_BYTES='lots' is not a number of bytes" in done.stderr


def test_a_second_run_is_served_from_the_cache(ifrt: dict[str, str], tmp_path: Path) -> None:
    program = """
        import jax, jax.numpy as jnp
        f = jax.jit(lambda x, y: jnp.tanh(x @ y) * 17.25)
        print(float(f(jnp.ones((8, 8)), jnp.ones((8, 8))).sum()))
    """
    before = metric_total(ifrt["url"], "jitserve_ifrt_compiles_total")
    first = run_program(ifrt, program, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    compiled = _tier_count(ifrt["url"], "compiled")
    assert metric_total(ifrt["url"], "jitserve_ifrt_compiles_total") > before
    second = run_program(ifrt, program, tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout == first.stdout
    assert _tier_count(ifrt["url"], "compiled") == compiled  # every compile was a hit


def test_compiles_are_listed_with_why_they_recompiled(ifrt: dict[str, str],
                                                      tmp_path: Path) -> None:
    # jax lowers a new module for each signature; the console lists each compile under
    # the function's name, and the second says what changed, as /v1's do.
    program = """
        import jax, jax.numpy as jnp
        def scaled_sum(a):
            return (a * 3.5).sum()
        g = jax.jit(scaled_sum)
        print(float(g(jnp.ones(8))), float(g(jnp.ones(16))))
    """
    ran = run_program(ifrt, program, tmp_path)
    assert ran.returncode == 0 and ran.stdout.split() == ["28.0", "56.0"], ran.stderr[-3000:]

    def compiles(key: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{ifrt['url']}/v1/console/compiles", params={"seconds": 600},
                      headers={"authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200, r.text
        return [c for c in r.json()["recent"] if c["name"] == "jit_scaled_sum"]

    mine = {c["signature"]: c for c in compiles(KEYS[0])}
    assert set(mine) == {"float32[8]", "float32[16]"}, mine
    first, second = mine["float32[8]"], mine["float32[16]"]
    assert first["tier"] == second["tier"] == "compiled" and first["seconds"] > 0
    assert first["recompiled_because"] is None
    assert second["recompiled_because"] == ["shape: arg 0 float32[8] -> float32[16]"], second
    assert compiles(KEYS[1]) == []  # another key's compiles are not its business


def _tier_count(url: str, tier: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f'jitserve_ifrt_compiles_total{{tier="{tier}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_session_without_a_valid_key_is_refused(ifrt: dict[str, str], tmp_path: Path) -> None:
    # jaxlib's client retries a refused connection until its timeout: a short one here.
    for key, says in ((None, "needs an API key"), ("not-a-key", "the API key is not valid")):
        refused = run_program(ifrt, "import jax\nprint(jax.devices())\n", tmp_path, key=key,
                              env={"JITSERVE_IFRT_CONNECT_TIMEOUT_S": "2"})
        assert refused.returncode != 0
        assert "UNAUTHENTICATED" in refused.stderr and says in refused.stderr, refused.stderr[-2000:]


def test_a_program_past_its_deadline_raises_naming_it_and_others_go_on(
        ifrt: dict[str, str], tmp_path: Path) -> None:
    looping = run_program(ifrt, """
        import jax, jax.numpy as jnp
        f = jax.jit(lambda x: jax.lax.while_loop(lambda c: c.sum() >= 0, lambda c: c + 1.0, x))
        try:
            f(jnp.ones(3)).block_until_ready()
        except Exception as e:
            print("RAISED", e)
    """, tmp_path, key=KEYS[1])
    assert "RAISED" in looping.stdout, (looping.stdout, looping.stderr[-2000:])
    assert "DEADLINE_EXCEEDED" in looping.stdout and "JITSERVE_EXECUTION_TIMEOUT_S" in looping.stdout
    assert httpx.get(f"{ifrt['url']}/healthz", timeout=10).status_code == 200
    wait_ready(ifrt["url"])
    fine = run_program(ifrt, "import jax.numpy as jnp\nprint(float((jnp.ones(3) * 2).sum()))\n",
                       tmp_path)
    assert fine.returncode == 0 and fine.stdout.strip() == "6.0", fine.stderr[-2000:]


def test_a_runtime_killed_under_a_session_fails_its_program_and_a_new_session_works(
        ifrt: dict[str, str], tmp_path: Path) -> None:
    path = tmp_path / "waits.py"
    path.write_text(textwrap.dedent("""
        import sys, jax, jax.numpy as jnp, numpy as np
        x = jnp.arange(4.0) * 2
        x.block_until_ready()
        print("READY", flush=True)
        sys.stdin.readline()
        try:
            print(np.asarray(x + 1))
        except Exception as e:
            print("RAISED", e, flush=True)
    """))
    env = program_env(ifrt, KEYS[0])
    proc = subprocess.Popen([sys.executable, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        for runtime in wait_ready(ifrt["url"]):  # every runtime: the session's is one of them
            os.kill(runtime["pid"], signal.SIGKILL)
        out, err = proc.communicate("go\n", timeout=120)
    finally:
        proc.kill()
    assert "RAISED" in out, (out, err[-2000:])
    assert "runtime" in out and "lost" in out
    assert httpx.get(f"{ifrt['url']}/healthz", timeout=10).status_code == 200
    wait_ready(ifrt["url"])
    fine = run_program(ifrt, "import jax.numpy as jnp\nprint(float(jnp.arange(3.0).sum()))\n", tmp_path)
    assert fine.returncode == 0 and fine.stdout.strip() == "3.0", fine.stderr[-2000:]


def test_refused_programs_raise_jitserve_s_refusal_and_the_session_goes_on(
        ifrt: dict[str, str], tmp_path: Path) -> None:
    refused = run_program(ifrt, """
        import jax, jax.numpy as jnp
        call = jax.ffi.ffi_call("jitserve_test_not_allowed", jax.ShapeDtypeStruct((3,), jnp.float32))
        try:
            jax.jit(call)(jnp.ones(3)).block_until_ready()
        except Exception as e:
            print("RAISED", e)
        try:  # a module with a 64 GiB tensor: over the per-tensor limit, never compiled
            jax.jit(lambda x: jnp.zeros((1 << 20, 1 << 14), jnp.float32).sum() + x)(1.0)
        except Exception as e:
            print("TOO BIG", e)
        try:  # a loop carrying 1 GiB: past the per-run device memory, refused, never run
            carry = lambda x: jax.lax.fori_loop(0, 3, lambda i, c: c * 1.5, jnp.full((1 << 28,), x))
            print(float(jax.jit(lambda x: carry(x)[0])(1.0)))
        except Exception as e:
            print("RUN TOO BIG", e)
        print(float(jnp.ones(2).sum()))
    """, tmp_path)
    assert "RAISED" in refused.stdout, (refused.stdout, refused.stderr[-2000:])
    assert "jitserve refused the program" in refused.stdout
    assert "jitserve_test_not_allowed" in refused.stdout
    assert "TOO BIG" in refused.stdout and "over the limit" in refused.stdout
    assert "RUN TOO BIG" in refused.stdout, refused.stdout
    run = refused.stdout.split("RUN TOO BIG", 1)[1]
    assert "bytes of device memory" in run
    assert f"over the limit of {512 << 20:,} bytes (JITSERVE_MAX_EXECUTION_BYTES)" in run
    assert refused.stdout.strip().endswith("2.0")  # the session goes on
