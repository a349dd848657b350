"""The package layout and its import rules (docs/DESIGN.md, "Module map").

Each rule runs in a fresh interpreter, so that what one test imported cannot
hide what another module pulls in:

- ``jitserve.wire`` needs only numpy, msgpack and ml_dtypes;
- ``jitserve.client`` needs only those and httpx (jax comes with the first ``jit``);
- ``jitserve.compiler`` never imports httpx, the SDK, the service or Redis;
- the ``jitserve`` command answers ``--version`` with the base install alone.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import pkgutil
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
import zipfile
from collections.abc import Callable
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


# -- the service's packages and their import rules ------------------------------------

# Each part of the service, and the parts it may import (docs/DESIGN.md, "Import
# rules"). The top-level modules under everything else are the "base".
BASE = frozenset({"settings", "errors", "metrics", "logs", "memory", "owners", "console"})
MAY_IMPORT = {
    "base": {"base"},
    "runtimes": {"base", "runtimes"},
    "cluster": {"base", "cluster"},
    "calls": {"base", "calls", "runtimes"},
    "api": {"base", "api", "calls", "cluster", "runtimes"},
    "v2": {"base", "v2", "api", "calls", "runtimes"},
    "ifrt": {"base", "ifrt", "api", "calls", "runtimes"},
    "app": {"base", "app", "api", "calls", "cluster", "runtimes", "v2", "ifrt"},
    "cli": {"base", "cli", "app", "api", "calls", "cluster", "runtimes", "v2", "ifrt"},
    "__main__": {"cli"},
    "root": {"base", "app"},  # jitserve.service: Settings and create_app, lazily
}


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement of a jitserve module, resolved to the module it loads."""

    source: str  # the importing module
    target: str  # the imported module (a package's __init__ when a name is not a module)
    lazy: bool  # inside a function: loads when called
    typing_only: bool  # under ``if TYPE_CHECKING``

    @property
    def at_import(self) -> bool:
        return not self.lazy and not self.typing_only


def _modules() -> dict[str, Path]:
    """Every module of the four packages: import name -> file (the generated gRPC ones too)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found: dict[str, Path] = {}
    for package, folder in config["package-dir"].items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            if any(path.is_relative_to(ROOT / f) for p, f in config["package-dir"].items()
                   if p != package and (ROOT / f).is_relative_to(ROOT / folder)):
                continue  # client/wire is a package of its own
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            found[".".join((package, *parts))] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[Import]:
    """The jitserve imports of one module, with where they sit."""
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def resolve(node: ast.ImportFrom) -> list[str]:
        base = node.module or ""
        if node.level:
            anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
            base = ".".join([*anchor, *([base] if base else [])])
        if not base.startswith("jitserve."):
            return []
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
        return subs + ([base] if len(subs) < len(node.names) else [])

    def visit(node: ast.AST, lazy: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True, typing_only)
            elif isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
                visit(child, lazy, True)
            elif isinstance(child, ast.ImportFrom):
                found.extend(Import(name, t, lazy, typing_only) for t in resolve(child))
            elif isinstance(child, ast.Import):
                found.extend(Import(name, a.name, lazy, typing_only) for a in child.names
                             if a.name.startswith("jitserve."))
            else:
                visit(child, lazy, typing_only)

    visit(ast.parse(path.read_text()), False, False)
    return found


IMPORTS = [i for name, path in MODULES.items() for i in _imports(name, path)]


def _part(module: str) -> str | None:
    """The part of the service ``module`` belongs to (``base`` for the bottom modules);
    ``None`` outside the service."""
    if module == "jitserve.service":
        return "root"
    if not module.startswith("jitserve.service."):
        return None
    head = module.split(".")[2]
    return "base" if head in BASE else head


def test_the_import_scanner_sees_every_package() -> None:
    """A guard on the rules below: the scanner finds the arrows a reader sees."""
    edges = {(i.source, i.target) for i in IMPORTS}
    assert ("jitserve.service.api.deps", "jitserve.service.calls.calls") in edges
    assert ("jitserve.service.app", "jitserve.service.api.deps") in edges
    assert ("jitserve.compiler.compile", "jitserve.wire") in edges
    assert len(MODULES) > 100


@pytest.mark.parametrize("part", sorted(MAY_IMPORT))
def test_each_service_part_imports_only_what_it_may(part: str) -> None:
    """``api/`` may import ``calls/`` and ``cluster/``, never the reverse; ``calls/`` knows
    neither HTTP nor the replicas; the runtimes and the replicas know only the base."""
    wrong = sorted(f"{i.source} -> {i.target}" for i in IMPORTS
                   if _part(i.source) == part and _part(i.target) not in (None, *MAY_IMPORT[part]))
    assert not wrong, f"{part} may import only {sorted(MAY_IMPORT[part])}: {wrong}"


def test_only_the_runtimes_import_the_child_and_no_service_module_imports_redis_code() -> None:
    child = sorted(f"{i.source}" for i in IMPORTS if i.target.startswith(
        ("jitserve.service.runtimes.child", "jitserve.service.runtimes.landlock"))
        and not i.source.startswith("jitserve.service.runtimes"))
    assert not child, f"the runtime process's code, imported outside runtimes/: {child}"
    redis = sorted(f"{i.source}" for i in IMPORTS if i.target.startswith("jitserve.compiler.redis")
                   and i.source.startswith("jitserve.service"))
    assert not redis, f"service modules that import the compiler's Redis code: {redis}"


def test_no_import_cycle_at_import_time() -> None:
    """No module imports one that imports it back, directly or not, as they load."""
    assert not _cycles(lambda i: i.at_import)


def test_no_service_module_needs_itself_even_for_its_types() -> None:
    """In the service not even type hints go round in a circle: a reader (or a tool)
    following the arrows of a package always reaches its bottom."""
    assert not _cycles(lambda i: not i.lazy and i.source.startswith("jitserve.service"))


def _cycles(counts: Callable[[Import], bool]) -> list[list[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for i in IMPORTS:
        if counts(i) and i.target in graph and i.target != i.source:
            graph[i.source].add(i.target)
    return [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of ``graph`` (iterative, so deep chains do not recurse)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        comp.append(top)
                        if top == node:
                            break
                    out.append(comp)
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return out


@pytest.mark.parametrize("part", ["runtimes", "cluster", "calls", "api", "v2"])
def test_each_service_part_loads_without_what_it_may_not_import(part: str) -> None:
    """In a fresh interpreter, every module of ``part`` imports with the parts it may not
    import refused: the rule holds for what loads along the way, not only for its own
    lines."""
    modules = sorted(m for m in MODULES if _part(m) == part)
    reach, grown = set(MAY_IMPORT[part]), True
    while grown:  # what the parts it may import may import in turn
        more = set().union(*(MAY_IMPORT[p] for p in reach)) - reach
        reach |= more
        grown = bool(more)
    blocked = {f"jitserve.service.{p}" for p in set(MAY_IMPORT) - {"base", "root"} - reach}
    blocked |= {"jitserve.service.app", *REDIS_CODE}
    if part != "runtimes":
        blocked |= RUNTIME_PROCESS
    _run(f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)\n",
         blocked=blocked)


# What only a runtime process loads, and the compiler's Redis code (its settings are a
# plain dataclass that the service's settings hand out).
RUNTIME_PROCESS = {"jitserve.service.runtimes.child", "jitserve.service.runtimes.landlock"}
REDIS_CODE = {f"jitserve.compiler.redis.{m}"
              for m in ("connection", "blobs", "executables", "lock", "catalog", "tiers")}


def test_the_api_process_never_loads_the_runtime_child_redis_code_or_jax() -> None:
    loaded = _run("""
        from jitserve.service.app import create_app
        from jitserve.service.settings import Settings
        create_app(Settings(env="test"))
    """)
    assert not (RUNTIME_PROCESS | REDIS_CODE) & set(loaded)
    # It never touches a program's content (compiler.records; tests/e2e/test_rest.py
    # checks the running process's mapped files).
    assert not {m for m in loaded if m.split(".")[0] in ("jax", "jaxlib")}


# -- the module map ------------------------------------------------------------------

_MAP_ROW = re.compile(r"^\|\s*`(jitserve(?:\.\w+)*)`\s*\|[^|]*\|(.*)\|\s*$")


def _module_map() -> dict[str, list[str]]:
    """docs/DESIGN.md's module map: package -> the modules it names (bold: **name**)."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    section = text.split("### Module map", 1)[1].split("\n### ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        if (match := _MAP_ROW.match(line)) is not None:
            rows.setdefault(match.group(1), []).extend(re.findall(r"\*\*(\w+)\*\*", match.group(2)))
    return rows


def test_the_module_map_names_every_module_once() -> None:
    named = [f"{package}.{m}" if m != "__init__" else package
             for package, mods in _module_map().items() for m in mods]
    twice = sorted({m for m in named if named.count(m) > 1})
    assert not twice, f"named more than once in docs/DESIGN.md's module map: {twice}"
    packages = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    wanted = {m for m in MODULES if m not in packages and not m.endswith(("_pb2", "_pb2_grpc"))}
    missing = sorted(wanted - set(named))
    assert not missing, f"modules missing from docs/DESIGN.md's module map: {missing}"
    unknown = sorted(set(named) - set(MODULES))
    assert not unknown, f"docs/DESIGN.md's module map names modules that do not exist: {unknown}"
