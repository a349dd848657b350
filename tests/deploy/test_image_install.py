"""The CPU image's install and start-up, replayed from docker/Dockerfile without Docker.

The builder stage's instructions run here as written: its ENV, WORKDIR and COPY (from this
source tree) into a scratch root under tmp, and its RUN commands with ``/bin/sh -c`` — so
the same ``python -m venv`` and ``pip install --constraint ... '.[server]'`` make a fresh
virtual environment. Then the runtime stage's ENV and its ENTRYPOINT/CMD start the server,
exactly as the image would, on a free loopback port, and the test checks /healthz, the
image's HEALTHCHECK command, and one remote call over REST (upload a jax.export program,
execute it with ?wait=).

What differs from a Docker build, and why:
- absolute paths (``/opt/jitserve``, ``/var/cache/jitserve``, ...) live under the scratch
  root; ``python`` is this interpreter's base Python (the image's is python:3.11-slim);
- ``PIP_NO_CACHE_DIR`` is dropped so that pip's cache is reused (CI time);
- the runtime stage's RUN (creating the jitserve user, as root) is not replayed: the
  server runs as the test's user;
- ``JITSERVE_HOST``/``JITSERVE_PORT`` are overridden to a free loopback port.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from deploy_dockerfile import Dockerfile, Stage, parse_copy, parse_env_raw, substitute
from deploy_helpers import REPO, promql_names
from jax import export

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

DOCKERFILE = REPO / "docker/Dockerfile"
# Dropped from the builder's ENV to reuse pip's cache between runs (see the module doc).
NOT_REPLAYED_ENV = {"PIP_NO_CACHE_DIR"}
# Host variables that must not leak into the replay (they would change what runs).
HOST_ENV_DROPPED = re.compile(r"^(PYTHON\w*|VIRTUAL_ENV|JITSERVE_\w+|REDIS_URL|JAX_\w+|XLA_\w+)$")
MP = "application/msgpack"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Image:
    root: Path  # stands for the container's "/"
    env: dict[str, str]  # the runtime stage's environment
    cwd: Path  # the runtime stage's WORKDIR
    argv: list[str]  # ENTRYPOINT + CMD
    healthcheck: list[str]

    def path(self, container_path: str) -> Path:
        return self.root / container_path.lstrip("/")


def _host_env(shim: Path) -> dict[str, str]:
    """This machine's environment, less what would leak in, with ``python`` on a shim."""
    outer_bin = str(Path(sys.executable).parent)
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep)
            if p and p != outer_bin and not (Path(p).parent / "pyvenv.cfg").exists()]
    env = {k: v for k, v in os.environ.items() if not HOST_ENV_DROPPED.match(k)}
    env["PATH"] = os.pathsep.join([str(shim), *path])
    return env


def _python_shim(tmp: Path) -> Path:
    shim = tmp / "shim"
    shim.mkdir()
    base = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    for name in ("python", "python3", f"python3.{sys.version_info.minor}"):
        (shim / name).symlink_to(base)
    return shim


def _apply_env(stage_ins: Any, env: dict[str, str], root: Path, skip: set[str]) -> None:
    """One ENV instruction: substitute, and move absolute paths under ``root``."""
    before = dict(env)
    for key, raw in parse_env_raw(stage_ins):
        if key in skip:
            continue
        value = substitute(raw, before)
        env[key] = str(root / value.lstrip("/")) if raw.startswith("/") else value


def _copy(src: Path, dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.pyo")
    if src.is_dir():
        shutil.copytree(src, dest, ignore=ignore, dirs_exist_ok=True)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)


def _replay_builder(stage: Stage, root: Path, env: dict[str, str]) -> dict[str, str]:
    env = dict(env)
    cwd = root
    for ins in stage.instructions:
        if ins.keyword == "ENV":
            _apply_env(ins, env, root, NOT_REPLAYED_ENV)
        elif ins.keyword == "WORKDIR":
            cwd = root / substitute(ins.value, env).lstrip("/")
            cwd.mkdir(parents=True, exist_ok=True)
        elif ins.keyword == "COPY":
            c = parse_copy(ins)
            assert c.from_stage is None, f"line {ins.lineno}: COPY --from in the builder"
            dest = cwd / c.dest if not c.dest.startswith("/") else root / c.dest.lstrip("/")
            for src in c.sources:
                into_dir = c.dest.endswith("/") or len(c.sources) > 1
                target = dest / Path(src).name if into_dir and (REPO / src).is_file() else dest
                _copy(REPO / src, target)
        elif ins.keyword == "RUN":
            result = subprocess.run(["/bin/sh", "-c", ins.value], cwd=cwd, env=env,
                                    capture_output=True, text=True, timeout=1200, check=False)
            if result.returncode != 0:
                pytest.fail(f"docker/Dockerfile:{ins.lineno} RUN failed ({result.returncode}):\n"
                            f"{ins.value}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
        elif ins.keyword in ("ARG", "LABEL"):
            continue
        else:
            pytest.fail(f"docker/Dockerfile:{ins.lineno}: the replay does not handle "
                        f"{ins.keyword} in the builder; teach tests/deploy/test_image_install.py")
    return env


def _runtime(stage: Stage, builder: Stage, root: Path, env: dict[str, str]) -> Image:
    env = dict(env)
    cwd = root
    for ins in stage.instructions:
        if ins.keyword == "ENV":
            _apply_env(ins, env, root, set())
        elif ins.keyword == "WORKDIR":
            cwd = root / substitute(ins.value, env).lstrip("/")
            cwd.mkdir(parents=True, exist_ok=True)
        elif ins.keyword == "COPY":
            c = parse_copy(ins)
            # A venv is not relocatable: the image keeps it at the builder's path, and so
            # does this replay (the scratch root is shared by both stages).
            assert c.from_stage == builder.name and c.sources == [c.dest], ins.value
        elif ins.keyword == "VOLUME":
            for v in ins.exec_form() or ins.value.split():
                (root / v.lstrip("/")).mkdir(parents=True, exist_ok=True)
    _, healthcheck = stage.healthcheck()
    return Image(root, env, cwd, stage.entrypoint_and_cmd(), healthcheck)


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    tmp = tmp_path_factory.mktemp("image")
    df = Dockerfile(DOCKERFILE)
    builder, runtime = df.stages[0], df.final
    root = tmp / "root"
    root.mkdir()
    host = _host_env(_python_shim(tmp))
    _replay_builder(builder, root, host)
    # The runtime stage starts again from the base image's environment, not the builder's.
    yield _runtime(runtime, builder, root, host)
    shutil.rmtree(root, ignore_errors=True)  # the venv is ~600 MB; pytest keeps old tmp dirs


@pytest.fixture(scope="module")
def api_key() -> str:
    return secrets.token_hex(16)


@pytest.fixture(scope="module")
def server(image: Image, api_key: str) -> Iterator[str]:
    port = _free_port()
    env = {**image.env, "JITSERVE_HOST": "127.0.0.1", "JITSERVE_PORT": str(port),
           "JITSERVE_API_KEYS": api_key, "JITSERVE_LOG_LEVEL": "warning"}
    assert Path(env["JITSERVE_CACHE_DIR"]).is_relative_to(image.root)
    url = f"http://127.0.0.1:{port}"
    log = image.root / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(image.argv, cwd=image.cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{image.argv} exited with {proc.returncode}:\n"
                            f"{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"not healthy in 120 s:\n{log.read_text()[-4000:]}")
            time.sleep(0.2)
        image.env = env  # the health check command reads JITSERVE_PORT
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_installed_the_entrypoint_into_the_fresh_venv(image: Image) -> None:
    venv = Path(image.env["VIRTUAL_ENV"])
    assert venv.is_relative_to(image.root) and (venv / "pyvenv.cfg").is_file()
    assert shutil.which(image.argv[0], path=image.env["PATH"]) == str(venv / "bin" / image.argv[0])
    version = subprocess.run([str(venv / "bin/python"), "-c", "import jax; print(jax.__version__)"],
                             capture_output=True, text=True, check=True, timeout=120)
    assert version.stdout.strip() == jax.__version__


def test_health_and_the_image_healthcheck(server: str, image: Image) -> None:
    assert httpx.get(f"{server}/healthz", timeout=10).json() == {"status": "ok"}
    assert httpx.get(f"{server}/readyz", timeout=10).status_code == 200
    ok = subprocess.run(image.healthcheck, env=image.env, capture_output=True, timeout=30,
                        check=False)
    assert ok.returncode == 0, ok.stderr
    # A control: the same command fails when nothing listens on the port.
    down = {**image.env, "JITSERVE_PORT": str(_free_port())}
    failed = subprocess.run(image.healthcheck, env=down, capture_output=True, timeout=30,
                            check=False)
    assert failed.returncode != 0


def test_one_remote_call(server: str, api_key: str) -> None:
    exported = export.export(jax.jit(lambda x: jnp.sin(x) * 2))(
        jax.ShapeDtypeStruct((3,), np.float32))
    x = np.array([0.0, 0.5, 1.0], dtype=np.float32)
    auth = {"authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=server, timeout=60, headers=auth) as http:
        assert httpx.get(f"{server}/v1/devices", timeout=10).status_code == 401  # keys from env

        r = http.post("/v1/programs", params={"format": "jax_export"},
                      content=bytes(exported.serialize()),
                      headers={"content-type": "application/octet-stream"})
        assert r.status_code in (200, 201), r.text
        program_id = r.json()["program_id"]

        body = msgpack.packb({"args": [{"dtype": "float32", "shape": [3], "data": x.tobytes()}]},
                             use_bin_type=True)
        r = http.post(f"/v1/programs/{program_id}/execute", params={"wait": 5000},
                      content=body, headers={"content-type": MP, "accept": MP})
        assert r.status_code in (200, 202), r.text
        answer = msgpack.unpackb(r.content, raw=False)
        if r.status_code == 202:  # not done within the wait: long-poll the result
            r = http.get(f"/v1/futures/{answer['future_id']}/result", params={"wait": 30000},
                         headers={"accept": MP})
            assert r.status_code == 200, r.text
            answer = msgpack.unpackb(r.content, raw=False)
        (out,) = answer["outputs"]
        assert out["dtype"] == "float32" and out["shape"] == [3]
        y = np.frombuffer(out["data"], dtype="<f4").reshape(out["shape"])
        np.testing.assert_allclose(y, np.sin(x) * 2, rtol=1e-6)

        metrics = http.get("/metrics").text
        assert re.search(r'^jitserve_requests_total\{.*route="/v1/programs/\{program_id\}/execute"',
                         metrics, re.MULTILINE), metrics[:2000]


def test_metrics_cover_the_dashboard(server: str) -> None:
    """Every metric family the Grafana dashboard reads is exported by the server."""
    dashboard = json.loads((REPO / "deploy/grafana/jitserve.json").read_text())
    used: set[str] = set()
    for panel in dashboard["panels"]:
        for t in panel.get("targets", []):
            used |= promql_names(t["expr"])[0]
    families = {re.sub(r"_(bucket|sum|count)$", "", re.sub(r"_total$", "", m)) for m in used}
    text = httpx.get(f"{server}/metrics", timeout=10).text
    exported = {re.sub(r"_total$", "", name)
                for name in re.findall(r"^# TYPE (\w+) ", text, re.MULTILINE)}
    assert families - exported == set(), "the dashboard reads metrics the server lacks"
