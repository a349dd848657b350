"""The package layout and its import rules (docs/DESIGN.md, "Module map").

Each rule runs in a fresh interpreter, so that what one test imported cannot
hide what another module pulls in:

- ``jitserve.wire`` needs only numpy, msgpack and ml_dtypes;
- ``jitserve.client`` needs only those and httpx (jax comes with the first ``jit``);
- ``jitserve.compiler`` never imports httpx, the SDK, the service or Redis;
- the ``jitserve`` command answers ``--version`` with the base install alone.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]

# Refuses the named top-level modules (and their submodules), then runs a body.
_BLOCKING = textwrap.dedent("""
    import importlib.abc, json, sys
    BLOCKED = {blocked!r}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ImportError(f"blocked for this test: {{name}}")
            return None

    sys.meta_path.insert(0, Block())
""")


def _run(body: str, blocked: set[str] = frozenset()) -> list[str]:
    """Run ``body`` in a fresh interpreter; the modules it left in ``sys.modules``."""
    script = _BLOCKING.format(blocked=sorted(blocked)) + textwrap.dedent(body) + \
        "\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _top(modules: list[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


SERVER_SIDE = {"jax", "jaxlib", "fastapi", "uvicorn", "redis", "starlette", "pydantic",
               "pydantic_settings", "zstandard", "prometheus_client"}


def test_wire_needs_only_numpy_msgpack_ml_dtypes() -> None:
    loaded = _run("""
        import numpy as np
        from jitserve import wire
        a = wire.Aval((2, None), "bfloat16")
        assert wire.unpackb(wire.packb({"x": np.ones(2, np.float32)}))["x"].tolist() == [1, 1]
        assert wire.ErrorCode.NOT_FOUND.status == 404
    """, blocked=SERVER_SIDE | {"httpx", "jitserve.client", "jitserve.compiler", "jitserve.service"})
    assert not _top(loaded) & (SERVER_SIDE | {"httpx"})


def test_client_imports_without_server_packages_or_jax() -> None:
    loaded = _run("""
        import numpy as np
        from jitserve import wire
        from jitserve.client import AsyncClient, Client
        c = Client("http://127.0.0.1:1", api_key=None)
        f = c.jit(lambda x: x)            # jax is only needed on the first call
        c.close()
    """, blocked=SERVER_SIDE | {"jitserve.compiler", "jitserve.service"})
    assert not _top(loaded) & SERVER_SIDE
    assert "jitserve.compiler" not in loaded and "jitserve.service" not in loaded


def test_compiler_never_imports_httpx_the_sdk_or_the_service() -> None:
    loaded = _run("""
        import jitserve.compiler
        from jitserve.compiler import Compiler, CompilerConfig
    """, blocked={"httpx", "jitserve.client", "jitserve.service", "fastapi", "starlette"})
    assert "httpx" not in _top(loaded)
    assert not {m for m in loaded if m.startswith(("jitserve.client", "jitserve.service"))}
    assert "redis" not in _top(loaded), "the Redis code loads only when Redis is configured"


def test_cli_version_needs_only_the_base_install() -> None:
    loaded = _run("""
        import contextlib, io
        from jitserve.service import cli
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["--version"]) == 0
        assert out.getvalue().startswith("jitserve "), out.getvalue()
    """, blocked=SERVER_SIDE)
    assert not _top(loaded) & SERVER_SIDE


def test_cli_serve_names_the_missing_extra() -> None:
    _run("""
        import contextlib, io
        from jitserve.service import cli
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli.main(["serve"])
        assert code == 2, code
        assert "jitserve[server]" in err.getvalue(), err.getvalue()
    """, blocked={"fastapi", "uvicorn", "jax"})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_plain_install_is_one_namespace_and_a_working_client(tmp_path: Path) -> None:
    """``pip install .`` (no extras) puts only ``jitserve`` at the top of site-packages."""
    # Built from a copy: setuptools' build/ would otherwise keep stale modules in the tree.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path),
                    str(source)], check=True, capture_output=True, timeout=240)
    (wheel,) = tmp_path.glob("jitserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"jitserve", wheel.name.split("-")[0] + "-"
                                                 + wheel.name.split("-")[1] + ".dist-info"}
    assert {n.split("/")[1] for n in names if n.startswith("jitserve/")} == \
        {"client", "compiler", "service", "wire"}
    assert "jitserve/__init__.py" not in names  # one namespace, owned by nobody

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([venv / "bin" / "pip", "install", "-q", str(wheel)], check=True,
                   capture_output=True, timeout=240)
    python, cli = venv / "bin" / "python", venv / "bin" / "jitserve"
    loaded = subprocess.run([python, "-c", "import sys; from jitserve.client import Client; "
                             "Client('http://127.0.0.1:1').close(); print(' '.join(sys.modules))"],
                            check=True, capture_output=True, text=True, timeout=60).stdout.split()
    assert not _top(loaded) & SERVER_SIDE
    done = subprocess.run([cli, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("jitserve "), done
    done = subprocess.run([cli, "serve"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "jitserve[server]" in done.stderr, done


def test_pyproject_lists_every_package() -> None:
    """A package missing from pyproject works in a checkout and is absent from the wheel."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name: ROOT / path for name, path in config["package-dir"].items()}
    found = set()
    for name, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            if any(init.parent.is_relative_to(f) for n, f in folders.items()
                   if f != folder and f.is_relative_to(folder)):
                continue  # a folder mapped to a package of its own (client/wire)
            rel = init.parent.relative_to(folder).parts
            found.add(".".join((name, *rel)))
    assert set(config["packages"]) == found


def _packages() -> list[str]:
    names = ["jitserve.wire", "jitserve.client"]
    for pkg in ("jitserve.compiler", "jitserve.service"):
        names.append(pkg)
        mod = importlib.import_module(pkg)
        names += [m.name for m in pkgutil.iter_modules(mod.__path__, pkg + ".")
                  if m.ispkg]
    return names


@pytest.mark.parametrize("name", _packages())
def test_package_exports_are_sorted_and_complete(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", [])
    assert exported == sorted(exported)
    assert all(hasattr(module, n) for n in exported)
    # A package that loads its names lazily lists each once more in __all__.
    assert sorted(getattr(module, "_EXPORTS", exported)) == exported
