"""Sharded executables across compilers of different device counts (issue 37).

Each compiler runs in a process of its own with simulated CPU devices
(``--xla_force_host_platform_device_count``), sharing one cache directory: a
4-device executable compiles, runs and reloads in a fresh compiler; a 2-device
process refuses the program at decode and treats the entry as a miss, without
loading it (loading onto a device list of another size is an XLA CHECK failure
that kills the process) and without deleting it; single-device entries are
shared by processes of any device count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from jax import export
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.timeout(300)

MESH = AbstractMesh((2, 2), ("x", "y"))

_SCRIPT = r'''
import json, sys
from pathlib import Path
import jax, numpy as np
from jitserve.compiler import Compiler, CompilerConfig, CompilerError

mode, cache, programs = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
a = np.arange(32, dtype=np.float32).reshape(8, 4)
out = {"devices": len(jax.devices())}

def run(compiler, lookup):
    exe = lookup.executable
    shardings = exe.in_shardings if exe.device_count > 1 else [compiler.device]
    (y,) = exe.run([jax.device_put(a, s) for s in shardings])
    return np.asarray(y).tolist()

for name, path in programs.items():
    first = Compiler(CompilerConfig(cache_dir=cache))
    try:
        program = first.decode(Path(path).read_bytes())
    except CompilerError as e:
        out[name] = {"refused": e.code.value, "message": str(e)}
        continue
    entry = {"id": first.executable_id(program), "nr_devices": program.nr_devices}
    if mode == "compile":
        lookup = first.lookup(program)
        entry.update(tier=lookup.tier, value=run(first, lookup))
        fresh = Compiler(CompilerConfig(cache_dir=cache))
        again = fresh.lookup(fresh.decode(Path(path).read_bytes()))
        entry.update(fresh_tier=again.tier, fresh_value=run(fresh, again))
    else:
        found = first.lookup(program)
        entry.update(tier=found.tier, value=run(first, found))
    out[name] = entry
for name, executable_id in json.loads(sys.argv[4]).items():
    out["load_" + name] = Compiler(CompilerConfig(cache_dir=cache)).load(executable_id) is not None
print(json.dumps(out))
'''


def _in_process(devices: int, mode: str, cache: Path, programs: dict[str, str],
                load: dict[str, str] | None = None) -> dict[str, Any]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, mode, str(cache), json.dumps(programs),
                           json.dumps(load or {})], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _psum_rows(x: jax.Array) -> jax.Array:
    return jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=MESH, in_specs=P("x"),
                         out_specs=P())(x)


def test_entries_by_device_count(tmp_path: Path) -> None:
    spec = jax.ShapeDtypeStruct((8, 4), np.float32)
    sharded = export.export(jax.jit(_psum_rows, in_shardings=NamedSharding(MESH, P("x")),
                                    out_shardings=NamedSharding(MESH, P())))(spec)
    single = export.export(jax.jit(lambda x: x * 2.0))(spec)
    programs = {}
    for name, exp in (("sharded", sharded), ("single", single)):
        path = tmp_path / f"{name}.bin"
        path.write_bytes(exp.serialize())
        programs[name] = str(path)
    cache = tmp_path / "cache"
    a = np.arange(32, dtype=np.float32).reshape(8, 4)

    four = _in_process(4, "compile", cache, programs)
    assert four["devices"] == 4
    assert four["sharded"]["nr_devices"] == 4 and four["sharded"]["tier"] == "compiled"
    np.testing.assert_array_equal(four["sharded"]["value"], a[:4] + a[4:])
    assert four["sharded"]["fresh_tier"] == "disk"  # reloaded onto four devices
    np.testing.assert_array_equal(four["sharded"]["fresh_value"], a[:4] + a[4:])
    np.testing.assert_array_equal(four["single"]["value"], a * 2.0)

    entries = sorted(p.name for p in (cache / "executables").rglob("*") if p.is_file())
    two = _in_process(2, "load", cache, {"single": programs["single"],
                                         "sharded": programs["sharded"]},
                      load={"sharded": four["sharded"]["id"], "single": four["single"]["id"]})
    assert two["sharded"]["refused"] == "too_many_devices"
    assert "4 devices" in two["sharded"]["message"] and "at most 2" in two["sharded"]["message"]
    assert two["load_sharded"] is False  # a miss: never loaded onto two devices
    assert two["load_single"] is True
    # One device: the same key at any device count, so the entry compiled by the
    # 4-device process serves.
    assert two["single"]["id"] == four["single"]["id"] and two["single"]["tier"] == "disk"
    np.testing.assert_array_equal(two["single"]["value"], a * 2.0)
    # The 4-device entry was not dropped by the process it is not for.
    assert sorted(p.name for p in (cache / "executables").rglob("*") if p.is_file()) == entries


_IFRT_SCRIPT = r'''
import json, sys
from pathlib import Path
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jitserve.compiler import Compiler, CompilerConfig, CompilerError
from jitserve.compiler._worker import compile_options

cache = Path(sys.argv[1])
devices = jax.devices()
mesh = Mesh(np.array(devices[:2]), ("x",))
spec = jax.ShapeDtypeStruct((8,), np.float32)
module = jax.jit(lambda a: jnp.sin(a) * 2.0,
                 in_shardings=NamedSharding(mesh, P("x")),
                 out_shardings=NamedSharding(mesh, P("x"))).lower(spec).as_text().encode()
a = np.arange(8, dtype=np.float32)
out = {}

def lookup(compiler, ids, partitions=2):
    options = compile_options(partitions, device_ids=tuple(ids)).SerializeAsString()
    try:
        found = compiler.lookup_module(module, options)
    except CompilerError as e:
        return {"refused": e.code.value, "message": str(e)}
    exe = found.executable
    (y,) = exe.run([jax.device_put(a, s) for s in exe.in_shardings])
    return {"tier": str(found.tier), "id": found.executable_id,
            "devices": [d.id for d in exe.devices],
            "out_devices": sorted(d.id for d in y.devices()), "value": np.asarray(y).tolist()}

first = Compiler(CompilerConfig(cache_dir=cache))
out["on_2_3"] = lookup(first, [2, 3])
out["on_0_1"] = lookup(first, [0, 1])
out["on_3_9"] = lookup(first, [3, 9])
out["on_8"] = lookup(first, range(8), partitions=8)
out["fresh_on_1_0"] = lookup(Compiler(CompilerConfig(cache_dir=cache)), [1, 0])
print(json.dumps(out))
'''


def test_ifrt_programs_run_on_the_devices_their_assignment_names(tmp_path: Path) -> None:
    """An IFRT proxy client's module compiled for two devices runs on the two its
    device assignment names; the key does not depend on which two, so other devices
    (and another process, in another order) are hits; devices the process has not,
    or more than it has, are refused."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    done = subprocess.run([sys.executable, "-c", _IFRT_SCRIPT, str(tmp_path / "cache")], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    expected = (np.sin(np.arange(8, dtype=np.float32)) * 2.0).tolist()
    for name, tier, devices in (("on_2_3", "compiled", [2, 3]), ("on_0_1", "memory", [0, 1]),
                                ("fresh_on_1_0", "disk", [1, 0])):
        got = out[name]
        assert (got["tier"], got["devices"], got["out_devices"]) == (tier, devices, sorted(devices))
        np.testing.assert_allclose(got["value"], expected, rtol=1e-6)
        assert got["id"] == out["on_2_3"]["id"]
    assert out["on_3_9"]["refused"] == "invalid_program"
    assert "names devices [3, 9]" in out["on_3_9"]["message"]
    assert out["on_8"]["refused"] == "too_many_devices" and "8 devices" in out["on_8"]["message"]
