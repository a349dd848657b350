"""Run JAX's own test files locally and through a jitserve server; compare them test by test.

The files are ``../shared/jax-tests/tests/`` (unmodified copies of the pinned jax
release's). Each runs twice with ``JAX_NUM_GENERATED_CASES=1`` and x64 on: on the local
CPU, and with ``JAX_PLATFORMS=jitserve`` against ``target``. A test that passes locally
must pass through jitserve, or be on ``expected_failures.txt`` with its reason (a limit
of jaxlib's client, docs/ifrt.md). ``share`` N runs the tests whose names hash to 0
modulo N (``share.py``), the same ones in both runs.

Used by ``tests/e2e/test_ifrt_conformance.py`` (a share, in CI) and
``bench/conformance.py`` (whole files).

The files of ``DEVICES`` need several devices: they run locally on that many simulated
CPU devices, and through a server whose runtimes have as many (``JITSERVE_CPU_DEVICES``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["DEVICES", "FILES", "JAX_TESTS", "Comparison", "baseline", "compare",
           "expected_failures", "run_file", "write_baseline"]

HERE = Path(__file__).resolve().parent
JAX_TESTS = Path(os.environ.get("JITSERVE_JAX_TESTS", HERE.parents[2] / "shared" / "jax-tests"))
FILES = ("lax_numpy_test.py", "api_test.py", "lax_autodiff_test.py", "lax_control_flow_test.py",
         "random_test.py", "pjit_test.py", "shard_map_test.py")
# The devices a file runs on, where that is more than one.
DEVICES = {"pjit_test.py": 8, "shard_map_test.py": 8}


def expected_failures() -> dict[str, str]:
    """``expected_failures.txt``: test id -> the reason it cannot pass through the proxy."""
    out = {}
    for line in (HERE / "expected_failures.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            test, _, reason = line.partition("  # ")
            out[test.strip()] = reason.strip()
    return out


def run_file(name: str, junit: Path, *, target: str | None, share: int = 1,
             key: str | None = None, timeout: float = 3000) -> dict[str, str]:
    """Run one test file; each test id (``file::Class::test``) -> passed, failed or skipped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "JITSERVE_", "XLA_"))}
    env.update(JAX_NUM_GENERATED_CASES="1", JAX_ENABLE_X64="1",
               JITSERVE_CONFORMANCE_SHARE=str(share), PYTHONPATH=str(HERE.parent))
    if name in DEVICES:  # locally; through jitserve, jax.devices() is the session's group
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES[name]}"
    if target is None:
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.update(JAX_PLATFORMS="jitserve", JITSERVE_IFRT_TARGET=target)
        if key:
            env["JITSERVE_API_KEY"] = key
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:asyncio",
         "-p", "no:randomly", "-p", "ifrt_conformance.share", "-o", "addopts=",
         "--rootdir", str(JAX_TESTS), f"--junitxml={junit}", str(JAX_TESTS / "tests" / name)],
        env=env, cwd=junit.parent, capture_output=True, text=True, timeout=timeout)
    return _outcomes(junit, name)


# The local runs' outcomes, kept so that CI runs each file only through jitserve:
# valid while the test file, jax, jaxlib, numpy, Python and the share are what they
# were (``_fingerprint``); else the file runs locally again. Regenerate, for each file at
# its share in tests/e2e/test_ifrt_conformance.py's ``SHARE``, with
# ``python tests/ifrt_conformance/runner.py --baseline --share N --files F...``.
BASELINE = HERE / "local_baseline.json"


def _fingerprint(name: str, share: int) -> str:
    import hashlib
    import importlib.metadata as md

    h = hashlib.sha256((JAX_TESTS / "tests" / name).read_bytes())
    for dist in ("jax", "jaxlib", "numpy"):
        h.update(f"{dist}={md.version(dist)};".encode())
    h.update(f"python={sys.version_info[:2]};share={share};devices={DEVICES.get(name, 1)}".encode())
    return h.hexdigest()


def baseline(name: str, share: int) -> dict[str, str] | None:
    """The kept local outcomes of ``name`` at ``share``, if they still hold here; else ``None``."""
    import json

    if not BASELINE.exists():
        return None
    entry = json.loads(BASELINE.read_text()).get(f"{name}@{share}")
    if entry is None or entry["fingerprint"] != _fingerprint(name, share):
        return None
    return dict(entry["outcomes"])


def write_baseline(names: tuple[str, ...], share: int, tmp: Path) -> None:
    """Run ``names`` locally at ``share`` and keep their outcomes in ``BASELINE``."""
    import json

    kept = json.loads(BASELINE.read_text()) if BASELINE.exists() else {}
    for name in names:
        outcomes = run_file(name, tmp / f"{name}.xml", target=None, share=share)
        kept[f"{name}@{share}"] = {"fingerprint": _fingerprint(name, share),
                                   "outcomes": dict(sorted(outcomes.items()))}
        print(f"{name}: {sum(o == 'passed' for o in outcomes.values())} of {len(outcomes)} pass")
    BASELINE.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")


def _outcomes(junit: Path, name: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = f"{name}::{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if case.find("skipped") is not None:
            outcome = "skipped"
        elif case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        else:
            outcome = "passed"
        # A test that errors in teardown after passing is reported twice: failed wins.
        if out.get(test) != "failed":
            out[test] = outcome
    return out


@dataclasses.dataclass
class Comparison:
    """One file's two runs, compared."""

    file: str
    local_passed: int
    remote_passed: int  # of those that passed locally
    expected: list[str]  # passed locally, not remotely, and on the list
    new: list[str]  # passed locally, not remotely, and not on the list: a regression
    stale: list[str]  # on the list, yet passed remotely

    @property
    def share_passing(self) -> float:
        return self.remote_passed / self.local_passed if self.local_passed else 1.0

    def to_json(self) -> dict[str, object]:
        return {**dataclasses.asdict(self), "share_passing": round(self.share_passing, 4)}


def compare(name: str, local: dict[str, str], remote: dict[str, str],
            expected: dict[str, str]) -> Comparison:
    passed = [t for t, o in local.items() if o == "passed"]
    missing = [t for t in passed if remote.get(t) != "passed"]
    return Comparison(
        file=name, local_passed=len(passed), remote_passed=len(passed) - len(missing),
        expected=sorted(t for t in missing if _listed(t, expected)),
        new=sorted(t for t in missing if not _listed(t, expected)),
        stale=sorted(t for t in passed if remote.get(t) == "passed" and _listed(t, expected)))


def _listed(test: str, expected: dict[str, str]) -> bool:
    """Whether ``test`` is on the list: by its id, or by a pattern (an id ending in ``*``)."""
    return test in expected or any(
        p.endswith("*") and re.fullmatch(re.escape(p[:-1]) + ".*", test) for p in expected)


if __name__ == "__main__":
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description="keep the local runs' outcomes (BASELINE)")
    parser.add_argument("--baseline", action="store_true", required=True)
    parser.add_argument("--share", type=int, default=12)
    parser.add_argument("--files", nargs="*", default=list(FILES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        write_baseline(tuple(args.files), args.share, Path(d))
