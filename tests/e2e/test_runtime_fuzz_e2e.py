"""Fuzzing the runtimes through one real server: a hostile program costs a runtime, never the API.

Programs are decoded, compiled and run in supervised runtime processes
(docs/runtimes.md), so a program that crashes or hangs XLA takes down one
runtime, which is restarted, and the API process answers on. This module sends
such programs to one ``jitserve serve`` and checks for every one of them that:

- the upload answers a 2xx, or a 4xx JSON error: never a 5xx or a dropped
  connection, and within a bound;
- an accepted program's execute answers a 4xx JSON refusal, or a future that
  ends (done, failed or cancelled) within the run deadline plus a restart; a
  failed one says why with a run code (execution_timeout, runtime_crashed,
  out_of_memory, future_failed);
- ``/healthz`` answers 200 afterwards: the API process is still there.

At the end ``/readyz`` is 200 again, a normal program still runs right, and at
least one case restarted a runtime, so the fuzz did reach crashes and hangs.

What is fuzzed, and why:

1. StableHLO that jax wrote, mutated:
   a. sort comparators that are not strict weak orders (LE, NE, always true, a
      FLOAT compare on raw NaNs) on floats with ties and NaNs: XLA's unstable
      sort is ``std::sort``, which reads out of bounds with such a comparator
      (SIGSEGV) or never ends;
   b. while loops whose condition never turns false (constant true, a flipped
      compare, a step of 0 or one that jumps over the bound);
   c. LAPACK custom calls, whose result shapes the allowlist checks
      (compiler/safety.py, compiler/_lapack.py): results dropped or added,
      operands reshaped or retyped, kernel attributes set to junk, other
      targets, allowed or not;
   d. regions nested deeply, as MLIR text, MLIR bytecode and a VHLO artifact:
      bytecode has no text depth guard, so its depth is checked after parsing,
      which must still answer in bounded time. MLIR spends quadratic time on
      deep nesting (reading bytecode, freeing the module): 20,000 levels (700 KB
      of bytecode) outlast the decode deadline, so the runtime is stopped.
2. ``jax.export`` artifacts with bytes flipped, cut off or inserted, uploaded
   as ``jax_export``.

Hypothesis runs derandomized (as the fuzz of test_jaxpr_e2e.py does) with small
budgets: each crash or hang costs a runtime restart (2 to 3 s here), and the
module must stay under a minute and a half on a 2-core machine (it takes about
one). Each execute asks for a 1 s deadline, so a hang costs a second more.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from e2e.conftest import _serve, metric_total, wait_ready
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax import export, lax
from lapack_cases import FAMILIES

from jitserve import wire

pytestmark = pytest.mark.timeout(300)

ENV = {
    "JITSERVE_RUNTIMES": "1",
    "JITSERVE_EXECUTION_TIMEOUT_S": "3",
    "JITSERVE_COMPILE_TIMEOUT_S": "10",
    "JITSERVE_DECODE_TIMEOUT_S": "10",  # a runaway decode is stopped after it
    "JITSERVE_MAX_BODY_BYTES": str(8 << 20),  # room for the deep bytecode
}
RUN_DEADLINE_S = 1.0  # what each execute asks for
ANSWER_BOUND_S = 30.0  # an upload or an execute: the compile timeout plus a restart
FUTURE_BOUND_S = 30.0  # a future: the deadline plus a restart, loosely
FINAL = ("done", "failed", "cancelled")
RUN_CODES = ("execution_timeout", "runtime_crashed", "out_of_memory", "future_failed")
# A call is accepted before its compile: a refusal of the program then fails the future.
COMPILE_CODES = tuple(sorted(wire.PROGRAM_ERRORS))
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

F32 = jax.ShapeDtypeStruct((), np.float32)


# -- the server and the contract -------------------------------------------------------------


class Server:
    """One jitserve process; ``check`` sends it a program and asserts the contract.

    ``outcomes`` counts what the cases did ("422 unsafe_program", "failed
    runtime_crashed", "done", ...), for the last test and for failure messages.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=2 * ANSWER_BOUND_S)
        self.outcomes: collections.Counter[str] = collections.Counter()

    def check(self, program: bytes, fmt: str, args: list[np.ndarray] | None = None) -> str:
        """Upload ``program``, run it if accepted (on ``args``, else on inputs made for
        its signature), wait for the end; returns what happened."""
        outcome = self._check(program, fmt, args)
        self.outcomes[outcome] += 1
        r = self.http.get("/healthz")
        assert r.status_code == 200, f"after {outcome!r}: /healthz {r.status_code} {r.text[:300]}"
        return outcome

    def _check(self, program: bytes, fmt: str, args: list[np.ndarray] | None) -> str:
        r = self._post("/v1/programs", program, wire.OCTET_STREAM, format=fmt)
        if r.status_code >= 400:
            return _refusal(r)
        assert r.status_code in (200, 201), r.text[:500]
        info = r.json()
        args = args if args is not None else _args_for(info["in_avals"], program)
        if args is None:
            return "accepted, inputs too big to send"
        r = self._post(f"/v1/programs/{info['program_id']}/execute",
                       wire.packb({"args": args, "timeout_s": RUN_DEADLINE_S}), wire.MSGPACK)
        if r.status_code >= 400:
            return _refusal(r)
        assert r.status_code == 202, r.text[:500]
        view = self._final(r.json()["future_id"])
        if view["status"] == "failed":
            assert view["error"]["code"] in RUN_CODES + COMPILE_CODES, view["error"]
            return f"failed {view['error']['code']}"
        if view["status"] == "done":
            r = self.http.get(f"/v1/futures/{view['future_id']}/result", params={"wait": 10_000})
            assert r.status_code == 200, r.text[:500]
            assert len(wire.unpackb(r.content)["outputs"]) == len(view["out_avals"])
        return view["status"]

    def _post(self, path: str, body: bytes, content_type: str, **params: str) -> httpx.Response:
        started = time.monotonic()
        try:
            r = self.http.post(path, content=body, params=params,
                               headers={"content-type": content_type})
        except httpx.TransportError as e:
            pytest.fail(f"POST {path}: no answer ({e!r}); did the API process die?")
        took = time.monotonic() - started
        assert r.status_code < 500, f"POST {path}: {r.status_code} {r.text[:500]}"
        assert took < ANSWER_BOUND_S, f"POST {path} took {took:.1f} s ({r.status_code})"
        return r

    def _final(self, fid: str) -> dict[str, Any]:
        deadline = time.monotonic() + FUTURE_BOUND_S
        while time.monotonic() < deadline:
            view = self.http.get(f"/v1/futures/{fid}", params={"wait": 1000}).json()
            if view["status"] in FINAL:
                return view
        pytest.fail(f"future {fid} still {view['status']} after {FUTURE_BOUND_S} s")


def _refusal(r: httpx.Response) -> str:
    """``"<status> <code>"`` of a 4xx, after checking it is a JSON error."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    error = r.json()["error"]
    assert isinstance(error["code"], str) and isinstance(error["message"], str), error
    return f"{r.status_code} {error['code']}"


# Ties, both zeros and NaNs: what trips a comparator that is not a strict weak order.
PALETTE = np.array([1.0, -1.0, 0.0, -0.0, 2.0, np.nan], np.float32)


def _values(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).choice(PALETTE, n)


def _args_for(in_avals: list[dict[str, Any]], program: bytes) -> list[np.ndarray] | None:
    """Inputs of the signature, from the palette (NaNs for float kinds only); ``None``
    when one would be over a million elements or has a dtype the wire lacks."""
    seed = int.from_bytes(hashlib.sha256(program).digest()[:4], "little")
    args = []
    for aval in in_avals:
        shape = [3 if d is None else d for d in aval["shape"]]
        if aval["dtype"] not in wire.DTYPES or math.prod(shape) > 1 << 20:
            return None
        dtype = wire.dtype_from_name(aval["dtype"])
        values = _values(math.prod(shape), seed).reshape(shape)
        if dtype.kind not in "fc":
            values = np.nan_to_num(np.abs(values))  # 0, 1, 2: fits every integer dtype
        args.append(values.astype(dtype))
    return args


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with contextlib.contextmanager(_serve)(tmp_path_factory.mktemp("runtime-fuzz"), ENV) as url:
        fuzzed = Server(url)
        with fuzzed.http:
            yield fuzzed


def _lowered(fn: Callable[..., Any], *specs: Any) -> str:
    return jax.jit(fn).lower(*specs).as_text()


def _sub(pattern: str, replacement: str, text: str) -> str:
    """``re.sub`` that must hit exactly once: the mutated program is the one meant."""
    out, n = re.subn(pattern, replacement, text)
    assert n == 1, f"{pattern!r} matched {n} times"
    return out


def _return_constant(text: str, ret: str, value: str) -> str:
    """Make ``stablehlo.return <ret> : tensor<i1>`` return a constant instead."""
    return _sub(rf"stablehlo\.return {ret} : tensor<i1>",
                f"%k = stablehlo.constant dense<{value}> : tensor<i1>\n"
                "      stablehlo.return %k : tensor<i1>", text)


# -- 1a. sort comparators --------------------------------------------------------------------


@functools.cache
def _sort_text(n: int) -> str:
    return _lowered(lambda x: lax.sort(x, is_stable=True), jax.ShapeDtypeStruct((n,), np.float32))


def _sort(n: int, stable: bool, direction: str, operands: str, kind: str,
          constant: str | None) -> bytes:
    """jax's float sort, its final compare changed (``operands``: ``%4, %8`` are jax's
    canonicalized keys, ``%arg1, %arg2`` the raw ones, NaNs and all)."""
    text = _sort_text(n).replace("is_stable = true", f"is_stable = {str(stable).lower()}")
    text = _sub(r"compare  ?LT, %4, %8, TOTALORDER", f"compare {direction}, {operands}, {kind}", text)
    if constant is not None:
        text = _return_constant(text, "%9", constant)
    return text.encode()


@settings(FUZZ, max_examples=10)
@given(n=st.sampled_from([40, 1000]), stable=st.booleans(),
       direction=st.sampled_from(["LT", "LE", "GT", "GE", "EQ", "NE"]),
       operands=st.sampled_from(["%4, %8", "%8, %4", "%arg1, %arg2"]),
       kind=st.sampled_from(["TOTALORDER", "FLOAT"]),
       constant=st.sampled_from([None, None, "true", "false"]), seed=st.integers(0, 3))
@example(n=1000, stable=False, direction="NE", operands="%4, %8", kind="FLOAT", constant=None, seed=0)
@example(n=1000, stable=False, direction="LT", operands="%4, %8", kind="FLOAT", constant="true", seed=0)
@example(n=1000, stable=True, direction="LT", operands="%4, %8", kind="FLOAT", constant="true", seed=0)
@example(n=1000, stable=False, direction="LE", operands="%arg1, %arg2", kind="FLOAT", constant=None,
         seed=1)
def test_sort_with_a_comparator_that_is_no_order(server: Server, n: int, stable: bool,
                                                 direction: str, operands: str, kind: str,
                                                 constant: str | None, seed: int) -> None:
    server.check(_sort(n, stable, direction, operands, kind, constant), "stablehlo",
                 [_values(n, seed)])


# -- 1b. while loops ---------------------------------------------------------------------------


@functools.cache
def _while_text() -> str:
    """Ten doublings: ``(i, x)`` until ``i < 10`` fails, with an int64 counter."""
    return _lowered(lambda x: lax.while_loop(lambda c: c[0] < 10, lambda c: (c[0] + 1, c[1] * 2.0),
                                             (0, x))[1], jax.ShapeDtypeStruct((4,), np.float32))


def _while(direction: str, bound: int, step: int, constant: str | None) -> bytes:
    text = _sub(r"compare  ?LT, %iterArg,", f"compare {direction}, %iterArg,", _while_text())
    text = _sub(r"dense<10> : tensor<i64>", f"dense<{bound}> : tensor<i64>", text)
    text = _sub(r"dense<1> : tensor<i64>", f"dense<{step}> : tensor<i64>", text)
    if constant is not None:
        text = _return_constant(text, "%1", constant)
    return text.encode()


@settings(FUZZ, max_examples=5)
@given(direction=st.sampled_from(["LT", "LE", "GT", "GE", "EQ", "NE"]),
       bound=st.sampled_from([10, 0, -1, 1 << 40]), step=st.sampled_from([1, 0, -1, 3]),
       constant=st.sampled_from([None, None, None, "true"]))
@example(direction="LT", bound=10, step=1, constant="true")  # never false
@example(direction="GE", bound=10, step=1, constant=None)  # false at once
@example(direction="NE", bound=10, step=3, constant=None)  # jumps over the bound
def test_while_loops_that_may_never_end(server: Server, direction: str, bound: int, step: int,
                                        constant: str | None) -> None:
    server.check(_while(direction, bound, step, constant), "stablehlo",
                 [np.arange(4, dtype=np.float32)])


# -- 1c. LAPACK custom calls -----------------------------------------------------------------

_CALL = re.compile(r"= stablehlo\.custom_call @(\w+)\((.*?)\) \{(.*)\} : \((.*?)\) -> \(?(.*?)\)?$")
_TENSOR = re.compile(r"tensor<((?:\d+x)*)(.+)>")
# What a LAPACK call may be turned into: a target without a shape rule, allowed ones
# whose kernels are not LAPACK, and refused ones.
OTHER_TARGETS = ["lapack_sfrobnicate_ffi", "lapack_sgetrf", "cusolver_getrf_ffi",
                 "Sharding", "AllocateBuffer", "annotate_device_placement", "SPMDFullToShardShape",
                 "ApproxTopK", "xla_ffi_python_cpu_callback", "tpu_custom_call"]
ELEMENTS = ["f32", "f64", "i32", "i8", "complex<f32>", "complex<f64>"]
DIMS = [0, 1, 2, 3, 7, 64]


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and quotes."""
    parts, depth, start, quoted = [], 0, 0, False
    for i, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted
        elif quoted:
            continue
        elif ch in "<[{(":
            depth += 1
        elif ch in ">]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return [p for p in [*parts, text[start:].strip()] if p]


@dataclasses.dataclass(frozen=True)
class Call:
    """One custom call, as ``@main``'s only op: its operands are ``@main``'s inputs, and
    all its results are returned."""

    target: str
    attrs: tuple[str, ...]  # "name = value"
    operands: tuple[str, ...]  # types
    results: tuple[str, ...]

    @classmethod
    def parse(cls, line: str) -> Call:
        target, _, attrs, operands, results = _CALL.search(line).groups()
        attrs = re.sub(r", sdy\.sharding_rule = .*$", "", attrs)  # sizes in it go stale
        return cls(target, tuple(_split_top(attrs)), tuple(operands.split(", ")),
                   tuple(results.split(", ")))

    def program(self) -> bytes:
        ins, outs = ", ".join(self.operands), ", ".join(self.results)
        arguments = ", ".join(f"%a{i}: {t}" for i, t in enumerate(self.operands))
        values = ", ".join(f"%a{i}" for i in range(len(self.operands)))
        n = len(self.results)
        lhs, returned = ("%0", "%0") if n == 1 else (f"%0:{n}", ", ".join(f"%0#{i}" for i in range(n)))
        return (f"func.func public @main({arguments}) -> ({outs}) {{\n"
                f"  {lhs} = stablehlo.custom_call @{self.target}({values}) "
                f"{{{', '.join(self.attrs)}}} : ({ins}) -> ({outs})\n"
                f"  return {returned} : {outs}\n}}\n").encode()

    def reshaped(self, **types: tuple[str, ...]) -> Call:
        """With other operand or result types, and without the attributes MLIR's
        verifier checks against them (layouts, aliases), so that the allowlist answers."""
        kept = tuple(a for a in self.attrs
                     if not a.startswith(("operand_layouts", "result_layouts", "output_operand_aliases")))
        return dataclasses.replace(self, attrs=kept, **types)


@functools.cache
def _lapack_calls() -> tuple[Call, ...]:
    """The LAPACK calls jax writes for each family (float32), one per target."""
    calls: dict[str, Call] = {}
    for fn, shapes in FAMILIES.values():
        text = _lowered(fn, *[jax.ShapeDtypeStruct(s, np.float32) for s in shapes])
        for line in text.splitlines():
            if "stablehlo.custom_call" in line:
                call = Call.parse(line)
                calls.setdefault(call.target, call)
    return tuple(calls.values())


def _tensor(shape: list[int], element: str) -> str:
    return f"tensor<{''.join(f'{d}x' for d in shape)}{element}>"


def _drop_result(call: Call, draw: Any) -> Call:
    i = draw(st.integers(0, len(call.results) - 1))
    return call.reshaped(results=call.results[:i] + call.results[i + 1:] or call.results[:1])


def _add_result(call: Call, draw: Any) -> Call:
    extra = _tensor(draw(st.lists(st.sampled_from(DIMS), max_size=3)), draw(st.sampled_from(ELEMENTS)))
    return call.reshaped(results=(*call.results, extra))


def _retype(call: Call, draw: Any) -> Call:
    """One operand or result with a dimension or its element type changed."""
    which = draw(st.sampled_from(["operands", "results"]))
    types = list(getattr(call, which))
    i = draw(st.integers(0, len(types) - 1))
    dims, element = _TENSOR.fullmatch(types[i]).groups()
    shape = [int(d) for d in dims.split("x") if d]
    if shape and draw(st.booleans()):
        shape[draw(st.integers(0, len(shape) - 1))] = draw(st.sampled_from(DIMS))
    else:
        element = draw(st.sampled_from(ELEMENTS))
    types[i] = _tensor(shape, element)
    return call.reshaped(**{which: tuple(types)})


def _junk_attribute(call: Call, draw: Any) -> Call:
    """A kernel attribute (uplo, mode, side, low, ...) set to any value, or an api_version."""
    attrs = list(call.attrs)
    i = next(i for i, a in enumerate(attrs) if a.startswith("mhlo.backend_config"))
    config = _split_top(attrs[i].split("=", 1)[1].strip()[1:-1])
    if not config or draw(st.booleans()):
        return dataclasses.replace(call, attrs=(*attrs, f"api_version = {draw(st.integers(0, 4))} : i32"))
    j = draw(st.integers(0, len(config) - 1))
    name, _, typ = re.fullmatch(r"(\w+) = (-?\d+) : (\w+)", config[j]).groups()
    value = draw(st.integers(0, 255) if typ == "ui8" else st.sampled_from([-1, 0, 1, 2, 5, 1 << 30]))
    config[j] = f"{name} = {value} : {typ}"
    attrs[i] = f"mhlo.backend_config = {{{', '.join(config)}}}"
    return dataclasses.replace(call, attrs=tuple(attrs))


def _retarget(call: Call, draw: Any) -> Call:
    """Another LAPACK target, of this kind or another (s, d, c, z), or one of ``OTHER_TARGETS``."""
    lapack = [c.target for c in _lapack_calls()]
    target = draw(st.sampled_from([*lapack, *(re.sub(r"^lapack_s", f"lapack_{k}", t)
                                               for t in lapack for k in "dcz"), *OTHER_TARGETS]))
    return dataclasses.replace(call, target=target)


MUTATIONS = [_drop_result, _add_result, _retype, _junk_attribute, _retarget]


@settings(FUZZ, max_examples=25)
@given(data=st.data())
def test_lapack_calls_mutated(server: Server, data: Any) -> None:
    call = data.draw(st.sampled_from(_lapack_calls()))
    for mutate in data.draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3)):
        call = mutate(call, data.draw)
    server.check(call.program(), "stablehlo")


def _getrf() -> Call:
    return next(c for c in _lapack_calls() if c.target == "lapack_sgetrf_ffi")


# Calls the allowlist must refuse. A kernel writes what its operands size, whatever
# the declared results: run, the first three would write past their buffers.
REFUSED_CALLS = {
    "pivots_and_info_dropped": lambda: _getrf().reshaped(results=_getrf().results[:1]),
    "pivots_shrunk": lambda: _getrf().reshaped(
        results=(_getrf().results[0], "tensor<2x1xi32>", _getrf().results[2])),
    "operand_grown": lambda: _getrf().reshaped(operands=("tensor<2x64x64xf32>",)),
    "target_without_a_rule": lambda: dataclasses.replace(_getrf(), target="lapack_sfrobnicate_ffi"),
    "callback_target": lambda: dataclasses.replace(_getrf(), target="xla_ffi_python_cpu_callback"),
}


@pytest.mark.parametrize("name", REFUSED_CALLS)
def test_lapack_calls_the_allowlist_refuses(server: Server, name: str) -> None:
    outcome = server.check(REFUSED_CALLS[name]().program(), "stablehlo")
    assert outcome.startswith("4"), f"not refused: {outcome}"


# -- 1d. deep nesting --------------------------------------------------------------------------


def _nested(kind: str, depth: int) -> str:
    """``@main(%i: i32, %x: f32) -> %x`` under ``depth`` nested regions: ``case`` ops,
    ``while`` ops (whose conditions are false), or modules around a private function."""
    if kind == "module":
        inner = "func.func private @f(%y: tensor<f32>) -> tensor<f32> { return %y : tensor<f32> }"
        return ("module {\n" * depth + inner + "\n}" * depth + "\n"
                "func.func public @main(%i: tensor<i32>, %x: tensor<f32>) -> tensor<f32> {\n"
                "  return %x : tensor<f32>\n}\n")
    value = "%x"
    opened, closed = [], []
    for k in range(depth):
        # After level k closes: the return of the region around it (level k-1's, or @main's).
        ret = f"{'stablehlo.return' if k else 'return'} %r{k} : tensor<f32>"
        if kind == "case":
            opened.append(f'%r{k} = "stablehlo.case"(%i) ({{')
            closed.append(f"}}) : (tensor<i32>) -> tensor<f32>\n{ret}")
        else:
            opened.append(f"%r{k} = stablehlo.while(%a{k} = {value}) : tensor<f32>\n cond {{\n"
                          f"  %c{k} = stablehlo.constant dense<false> : tensor<i1>\n"
                          f"  stablehlo.return %c{k} : tensor<i1>\n }} do {{")
            closed.append(f"}}\n{ret}")
            value = f"%a{k}"
    body = "\n".join([*opened, f"stablehlo.return {value} : tensor<f32>", *reversed(closed)])
    return ("func.func public @main(%i: tensor<i32>, %x: tensor<f32>) -> tensor<f32> {\n"
            f"{body}\n}}\n")


# Encodes MLIR text as bytecode or as a VHLO artifact (what jax.export embeds) in a
# child process: MLIR's text parser and the VHLO conversion recurse once per level
# (so on a thread with a big stack), and MLIR frees deep nesting in quadratic time
# (so the child exits without freeing anything). Reads [[text, encoding], ...] as
# msgpack on stdin, writes the list of programs as msgpack on stdout.
_ENCODE_SCRIPT = """
import os, sys, threading
import msgpack
from jax._src.interpreters import mlir
from jax._src.lib import _jax
from jax._src.lib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

def encode():
    out, modules = [], []  # kept: os._exit below ends the process without freeing them
    for text, encoding in msgpack.unpackb(sys.stdin.buffer.read()):
        modules.append(ir.Module.parse(text, context=mlir.make_ir_context()))
        data = mlir.module_to_bytecode(modules[-1])
        if encoding == "vhlo":  # for jax's usual target version
            version = hlo.get_version_from_compatibility_requirement(
                hlo.StablehloCompatibilityRequirement.WEEK_4)
            data = _jax.mlir.serialize_portable_artifact(data, version)
        out.append(bytes(data))
    sys.stdout.buffer.write(msgpack.packb(out))
    sys.stdout.flush()
    os._exit(0)

threading.stack_size(512 << 20)
threading.Thread(target=encode).start()
"""

MAX_NESTING = 64  # the server's default Limits.max_nesting
NESTINGS = [  # (kind, depth, encoding)
    ("case", 40, "text"), ("while", 40, "text"), ("module", 40, "text"),
    ("case", 65, "text"), ("while", 100, "text"), ("case", 300, "text"),
    ("case", 40, "bytecode"), ("case", 2000, "bytecode"), ("while", 2000, "bytecode"),
    ("module", 2000, "bytecode"), ("while", 40, "vhlo"), ("case", 1000, "vhlo"),
    # Decoding this takes longer than the decode deadline (JITSERVE_DECODE_TIMEOUT_S):
    # the server stops the runtime and answers 400 invalid_program.
    ("case", 20_000, "bytecode"),
]


@functools.cache
def _nested_programs() -> dict[tuple[str, int, str], bytes]:
    """Every program of ``NESTINGS``, encoded."""
    encoded = [n for n in NESTINGS if n[2] != "text"]
    done = subprocess.run(
        [sys.executable, "-c", _ENCODE_SCRIPT], capture_output=True, timeout=120,
        input=msgpack.packb([[_nested(kind, depth), encoding] for kind, depth, encoding in encoded]))
    assert done.returncode == 0 and done.stdout, done.stderr.decode()[-3000:]
    programs = dict(zip(encoded, msgpack.unpackb(done.stdout)))
    return {n: programs[n] if n in programs else _nested(n[0], n[1]).encode() for n in NESTINGS}


@pytest.mark.parametrize(("kind", "depth", "encoding"), NESTINGS,
                         ids=[f"{k}-{d}-{e}" for k, d, e in NESTINGS])
def test_deep_nesting(server: Server, kind: str, depth: int, encoding: str) -> None:
    program = _nested_programs()[kind, depth, encoding]
    outcome = server.check(program, "stablehlo", [np.int32(0), np.float32(1.5)])
    if depth > MAX_NESTING:
        assert outcome.startswith("4"), f"nested {depth} deep, yet {outcome}"
    else:
        assert outcome == "done", outcome


# -- 2. damaged exports ------------------------------------------------------------------------


def _export(fn: Callable[..., Any], *specs: Any) -> bytes:
    return bytes(export.export(jax.jit(fn))(*specs).serialize())


@functools.cache
def _exports() -> tuple[bytes, ...]:
    vec, mat = jax.ShapeDtypeStruct((8,), np.float32), jax.ShapeDtypeStruct((4, 4), np.float32)
    return (_export(lambda x: x * 2, F32),  # the first doubles a scalar
            _export(jnp.sort, vec),
            _export(lambda x: lax.fori_loop(0, 5, lambda i, v: v * 2.0 + i, x), vec),
            _export(lax.linalg.lu, mat),
            _export(lambda a, b: (a @ b, jnp.cumsum(a, 0)), mat, mat))


_EDITS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 16), st.integers(1, 255)),
    st.tuples(st.just("cut"), st.integers(0, 1 << 16), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=8)),
)


def _damaged(data: bytes, edits: list[tuple[str, int, Any]]) -> bytes:
    out = bytearray(data)
    for what, where, value in edits:
        at = where % max(len(out), 1)
        if what == "flip" and out:
            out[at] ^= value
        elif what == "cut":
            del out[at:]
        elif what == "insert":
            out[at:at] = value
    return bytes(out)


@settings(FUZZ, max_examples=25)
@given(which=st.integers(0, 4), edits=st.lists(_EDITS, min_size=1, max_size=4))
def test_damaged_exports(server: Server, which: int, edits: list[tuple[str, int, Any]]) -> None:
    server.check(_damaged(_exports()[which], edits), "jax_export")


# -- after all that ----------------------------------------------------------------------------


def test_the_server_is_ready_and_right_after_all_that(server: Server,
                                                     request: pytest.FixtureRequest) -> None:
    """Runs last: the runtime is back after every crash, and the fuzz above caused some."""
    runtimes = wait_ready(server.url, within_s=60)
    r = server.http.post("/v1/programs", content=_exports()[0],
                         headers={"content-type": wire.OCTET_STREAM})
    assert r.status_code in (200, 201), r.text[:500]
    r = server.http.post(f"/v1/programs/{r.json()['program_id']}/execute", params={"wait": 10_000},
                         content=wire.packb({"args": [np.float32(21)]}),
                         headers={"content-type": wire.MSGPACK})
    assert r.status_code == 200, r.text[:500]
    assert float(wire.unpackb(r.content)["outputs"][0]) == 42
    restarts = sum(runtime["restarts"] for runtime in runtimes)
    assert metric_total(server.url, "jitserve_runtime_restarts_total") == restarts
    print(f"runtime restarts: {restarts}; outcomes: {dict(server.outcomes)}")
    ran = {item.originalname for item in request.session.items}
    if ran >= {test_sort_with_a_comparator_that_is_no_order.__name__,
               test_while_loops_that_may_never_end.__name__}:  # not left out by -k
        assert restarts >= 1, f"no case restarted a runtime: {dict(server.outcomes)}"
