"""The API process never runs a program: no jax backend starts in it, whatever it serves.

Checked in a fresh interpreter (this test process has backends of its own, from
exporting the test programs): it serves an upload, an execute, a chained call and
a fetch through the app, then reports whether jax ever made a backend there.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_SCRIPT = r"""
import asyncio, sys
from pathlib import Path
import httpx, numpy as np
from jitserve import wire
from jitserve.service.app import create_app
from jitserve.service.settings import Settings

async def main(program: bytes, cache: str) -> None:
    app = create_app(Settings(env="test", cache_dir=cache, runtimes=1))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            pid = (await http.post("/v1/programs", content=program,
                                   headers={"content-type": wire.OCTET_STREAM})).json()["program_id"]
            x = np.arange(6, dtype=np.float32).reshape(2, 3)
            def body(args):
                return {"content": wire.packb({"args": args}),
                        "headers": {"content-type": wire.MSGPACK}}
            fid = (await http.post(f"/v1/programs/{pid}/execute", **body([x, x]))).json()["future_id"]
            ref = {"future": fid, "output": 0}
            fid2 = (await http.post(f"/v1/programs/{pid}/execute", **body([ref, x]))).json()["future_id"]
            r = await http.get(f"/v1/futures/{fid2}/result", params={"wait": 30000})
            out = wire.unpackb(r.content)["outputs"]
            assert np.array_equal(out[0], x * 3), out
    from jax._src import xla_bridge
    print("backends:", sorted(xla_bridge._backends))

asyncio.run(main(Path(sys.argv[1]).read_bytes(), sys.argv[2]))
"""


def test_serving_starts_no_backend_in_the_api_process(programs: dict[str, bytes],
                                                       tmp_path: Path) -> None:
    path = tmp_path / "add_mul"
    path.write_bytes(programs["add_mul"])
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(path), str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("backends: []"), done.stdout
