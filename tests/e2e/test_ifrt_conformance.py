"""JAX's own test files through jitserve, against local runs (``tests/ifrt_conformance``).

A fixed share of each file runs in CI (``SHARE``: the tests whose names hash to 0 modulo
it, the same ones every run); ``bench/conformance.py`` runs the whole files. The local
side comes from ``runner.BASELINE`` while the versions it was made with hold (a test
that then fails through jitserve is checked by a local run before it counts). A test that
passes locally and not through jitserve fails this test unless it is on
``tests/ifrt_conformance/expected_failures.txt`` with its reason. The server answers no
request INTERNAL over the run, and its ``/healthz`` stays 200. ``pjit_test.py`` and
``shard_map_test.py`` run on 8 devices: locally simulated, and through a server whose
runtime has 8 (``JITSERVE_CPU_DEVICES``), so jax through the proxy sees them all.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2e.conftest import _free_port, _serve, wait_ready
from ifrt_conformance.runner import (
    DEVICES,
    FILES,
    JAX_TESTS,
    baseline,
    compare,
    expected_failures,
    run_file,
)

# One test in SHARE[file] of each file: the whole seven files take about 55 minutes on two
# cores, through jitserve and locally; these shares keep CI's run to about three (the three
# slowest files at one in 24: lax_control_flow alone was 90 s at one in 12; through
# jitserve, pjit_test whole takes 90 s and shard_map_test 185 s).
SHARE = {"lax_numpy_test.py": 12, "api_test.py": 24, "lax_autodiff_test.py": 24,
         "lax_control_flow_test.py": 24, "random_test.py": 12, "pjit_test.py": 6,
         "shard_map_test.py": 8}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800),
              pytest.mark.skipif(not (JAX_TESTS / "tests").is_dir(),
                                 reason=f"JAX's test files are not at {JAX_TESTS}")]


def _server(tmp_path_factory: pytest.TempPathFactory, devices: int) -> Iterator[dict[str, str]]:
    port = _free_port()
    env = {"JITSERVE_IFRT_PORT": str(port), "JITSERVE_MAX_BODY_BYTES": str(256 << 20),
           "JITSERVE_CPU_DEVICES": str(devices)}
    for url in _serve(tmp_path_factory.mktemp("conformance"), env):
        wait_ready(url)
        yield {"url": url, "target": f"127.0.0.1:{port}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    yield from _server(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def server_of_8(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    yield from _server(tmp_path_factory, 8)


@pytest.mark.parametrize("name", FILES)
def test_jax_s_own_tests_pass_through_jitserve_as_locally(request: pytest.FixtureRequest,
                                                         name: str, tmp_path: Path) -> None:
    server = request.getfixturevalue({1: "server", 8: "server_of_8"}[DEVICES.get(name, 1)])
    # The local outcomes kept for these versions (runner.BASELINE), else a local run.
    share = SHARE[name]
    local = baseline(name, share)
    kept = local is not None
    if local is None:
        local = run_file(name, tmp_path / "local.xml", target=None, share=share)
    remote = run_file(name, tmp_path / "remote.xml", target=server["target"], share=share)
    result = compare(name, local, remote, expected_failures())
    if result.new and kept:  # what passed where the baseline was made may not pass here
        local = run_file(name, tmp_path / "local.xml", target=None, share=share)
        result = compare(name, local, remote, expected_failures())
    assert result.local_passed > 0, f"no test of {name} ran locally"
    assert not result.new, (
        f"{len(result.new)} tests of {name} pass locally but not through jitserve, and are not "
        f"on tests/ifrt_conformance/expected_failures.txt: {result.new}")
    assert httpx.get(f"{server['url']}/healthz", timeout=10).status_code == 200
    internal = [line for line in httpx.get(f"{server['url']}/metrics", timeout=10).text.splitlines()
                if line.startswith("jitserve_ifrt_requests_total{") and 'status="INTERNAL"' in line
                and not line.endswith(" 0.0")]
    assert not internal, internal


def test_the_kept_local_outcomes_hold_for_every_file() -> None:
    """Each file's local outcomes are kept (``runner.BASELINE``) for the versions CI
    installs: a stale entry does not fail the comparison, it runs the file locally as
    well, and that doubled the time of five files in CI unnoticed (after the
    fingerprint took in the devices). So a stale or missing entry fails here, naming the
    command that makes it again."""
    stale = [name for name in FILES if baseline(name, SHARE[name]) is None]
    assert not stale, (
        f"the kept local outcomes of {stale} do not hold for these versions; run, for each, "
        "python tests/ifrt_conformance/runner.py --baseline --share N --files F "
        "(N from SHARE in tests/e2e/test_ifrt_conformance.py)")
