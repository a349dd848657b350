"""The jaxpr document format: round trips, hand-written documents, and hostile input.

- Every corpus function (``jaxpr_cases.py``) survives encode -> decode -> jax.jit
  with results identical to ``jax.jit`` of the function itself, in JSON and msgpack.
- A document written by hand, with no JAX on the writer's side, decodes and runs.
- Each kind of bad document raises the right ``CompilerError`` subclass, with a
  message naming the equation (and the path through nested jaxprs).
- A hypothesis fuzz test mutates valid documents: the decoder answers every one
  with a program or a ``CompilerError``, never another exception.
"""

from __future__ import annotations

import copy
import functools
import json
import pathlib
import re
import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from jaxpr_cases import all_cases, case_args

from jitserve import wire
from jitserve.client.jaxpr import JaxprEncodeError, encode_document, encode_function, jaxpr_to_document
from jitserve.compiler.errors import CompilerError, InvalidProgram, LimitExceeded, UnsafeProgram
from jitserve.compiler.jaxpr import (
    DecodedJaxpr,
    JaxprLimits,
    decode_document,
    refused_primitives,
    supported_primitives,
)
from jitserve.wire import Aval

jax.config.update("jax_enable_x64", True)

pytestmark = pytest.mark.timeout(300)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _doc(fn: Any, *args: Any) -> dict[str, Any]:
    """The document of ``fn`` traced on ``args``, as a plain tree (JSON spelling)."""
    return jaxpr_to_document(jax.make_jaxpr(fn)(*args))


def _run(decoded: DecodedJaxpr, *args: Any) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.jit(decoded.as_function(), keep_unused=True)(*args)]


# -- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("case", all_cases(), ids=lambda c: c.name)
@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_corpus_round_trip_matches_local_jit(case: Any, fmt: str) -> None:
    args = case_args(case)
    decoded = decode_document(encode_function(case.fn, *args, format=fmt))
    got = _run(decoded, *jax.tree.leaves(args))
    want = [np.asarray(x) for x in jax.tree.leaves(jax.jit(case.fn)(*args))]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert (g.dtype, g.shape) == (w.dtype, w.shape), f"output {i}"
        if case.rtol:
            np.testing.assert_allclose(g, w, rtol=case.rtol, atol=case.rtol, err_msg=f"output {i}")
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"output {i}")
    assert decoded.in_avals == tuple(Aval.of(np.asarray(x)) for x in jax.tree.leaves(args))
    assert [a.dtype for a in decoded.out_avals] == [w.dtype.name for w in want]


def test_decoded_lowering_is_the_same_program() -> None:
    def f(x, w):
        return jnp.tanh(x @ w).sum(0), jax.nn.relu(x)

    x, w = np.ones((4, 3), np.float32), np.ones((3, 2), np.float32)
    decoded = decode_document(encode_function(f, x, w))
    ours = jax.jit(decoded.as_function(), keep_unused=True).lower(x, w).as_text()
    theirs = jax.jit(f).lower(x, w).as_text()
    ops = lambda text: sorted(re.findall(r"stablehlo\.\w+", text))  # noqa: E731
    assert ops(ours) == ops(theirs)


def test_custom_jvp_and_vjp_calls_are_inlined() -> None:
    @jax.custom_vjp
    def double(y):
        return y * 2

    double.defvjp(lambda y: (y * 2, None), lambda _, g: (g,))
    decoded = decode_document(encode_function(lambda x: double(jax.nn.relu(x)), np.ones(3, np.float32)))
    names = {e.primitive.name for e in decoded.closed_jaxpr.eqns}
    assert not names & {"custom_jvp_call", "custom_vjp_call"}, names


def test_json_and_msgpack_carry_the_same_document() -> None:
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    doc_json = json.loads(encode_function(lambda v: v * np.float32(3) + x, x))
    doc_msgpack = msgpack.unpackb(encode_function(lambda v: v * np.float32(3) + x, x, format="msgpack"))
    const = doc_msgpack["jaxpr"]["consts"][0]["value"]
    assert isinstance(const["data"], bytes)
    assert doc_json["jaxpr"]["eqns"] == doc_msgpack["jaxpr"]["eqns"]
    assert doc_json["version"] == wire.JAXPR_FORMAT_VERSION


def test_the_version_window_is_sane() -> None:
    assert wire.JAXPR_MIN_SUPPORTED_VERSION <= wire.JAXPR_FORMAT_VERSION


def test_every_public_primitive_is_allowed_or_refused() -> None:
    from jitserve.compiler.jaxpr._prims import public_primitives

    allowed, refused = supported_primitives(), refused_primitives()
    assert not set(allowed) & set(refused)
    assert set(public_primitives()) <= set(allowed) | set(refused)
    for name in ("psum", "after_all", "rng_uniform", "get", "sharding_constraint"):
        assert name in refused


def test_the_wire_vocabulary_is_the_allowlist() -> None:
    # The SDK checks a document's primitives against wire.JAXPR_PRIMITIVES before it
    # sends it (on whatever jax the user has); the server reads exactly the allowlist.
    assert wire.JAXPR_PRIMITIVES == set(supported_primitives())


# -- hand-written documents ---------------------------------------------------------------

# The example of docs/jaxpr-format.md: y = sum(relu(x * w + b)) over axis 1, and
# x unchanged, for x: f32[2, 3]. Written by hand; no JAX involved.
HAND_WRITTEN = r"""
{
  "format": "jitserve.jaxpr",
  "version": 1,
  "jaxpr": {
    "consts": [
      {"var": "w", "value": {"dtype": "float32", "shape": [3], "data": [1.0, -2.0, 0.5]}}
    ],
    "invars": [{"var": "x", "aval": {"shape": [2, 3], "dtype": "float32"}}],
    "eqns": [
      {"primitive": "broadcast_in_dim", "invars": ["w"], "outvars": ["wb"],
       "params": {"shape": [2, 3], "broadcast_dimensions": [1]}},
      {"primitive": "mul", "invars": ["x", "wb"], "outvars": ["xw"]},
      {"primitive": "add", "invars": ["xw", {"literal": 0.25, "dtype": "float32"}],
       "outvars": [{"var": "z", "aval": {"shape": [2, 3], "dtype": "float32"}}]},
      {"primitive": "max", "invars": ["z", {"literal": 0.0, "dtype": "float32"}], "outvars": ["r"]},
      {"primitive": "reduce_sum", "invars": ["r"], "outvars": ["y"], "params": {"axes": [1]}}
    ],
    "outvars": ["y", "x"]
  }
}
"""


def _hand_written_expected(x: np.ndarray) -> np.ndarray:
    return np.maximum(x * np.array([1.0, -2.0, 0.5], np.float32) + np.float32(0.25), 0).sum(1)


@pytest.mark.parametrize("as_bytes", [True, False])
def test_hand_written_json_document(as_bytes: bool) -> None:
    data = HAND_WRITTEN.encode() if as_bytes else json.loads(HAND_WRITTEN)
    decoded = decode_document(data)
    assert decoded.in_avals == (Aval((2, 3), "float32"),)
    assert decoded.out_avals == (Aval((2,), "float32"), Aval((2, 3), "float32"))
    x = np.arange(6, dtype=np.float32).reshape(2, 3) - 2
    y, same = _run(decoded, x)
    np.testing.assert_allclose(y, _hand_written_expected(x), rtol=1e-6)
    np.testing.assert_array_equal(same, x)


def test_docs_show_the_hand_written_example() -> None:
    text = (ROOT / "docs" / "jaxpr-format.md").read_text()
    block = re.search(r"<!-- example-start -->\s*```json\n(.*?)```", text, re.S)
    assert block, "docs/jaxpr-format.md lost its example block"
    assert json.loads(block.group(1)) == json.loads(HAND_WRITTEN)


def test_hand_written_msgpack_without_jax() -> None:
    # The writer's process never imports jax: encode_document is plain data.
    script = f"""
import sys, json, numpy as np
from jitserve.client.jaxpr import encode_document
doc = json.loads({HAND_WRITTEN!r})
doc["jaxpr"]["consts"][0]["value"] = np.array([1.0, -2.0, 0.5], np.float32)
sys.stdout.buffer.write(encode_document(doc, format="msgpack"))
assert "jax" not in sys.modules, "client.jaxpr imported jax"
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, check=True)
    decoded = decode_document(out.stdout)
    x = np.ones((2, 3), np.float32)
    np.testing.assert_allclose(_run(decoded, x)[0], _hand_written_expected(x), rtol=1e-6)


def test_omitted_params_take_their_defaults() -> None:
    doc = json.loads(HAND_WRITTEN)
    doc["jaxpr"]["eqns"].append({"primitive": "sort", "invars": ["y"], "outvars": ["s"],
                                 "params": {"dimension": 0}})
    doc["jaxpr"]["outvars"] = ["s"]
    decoded = decode_document(doc)
    sort = decoded.closed_jaxpr.eqns[-1]
    assert sort.params == {"dimension": 0, "is_stable": True, "num_keys": 1}


# -- bad documents ----------------------------------------------------------------------------


def _base() -> dict[str, Any]:
    return json.loads(HAND_WRITTEN)


def _eqns(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return doc["jaxpr"]["eqns"]


def _while_doc() -> dict[str, Any]:
    return _doc(lambda x: lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2.0),
                                         (0, x)), np.ones(3, np.float32))


def _mutate(doc: dict[str, Any], fn: Any) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    fn(doc)
    return doc


def _find_while_body(doc: dict[str, Any]) -> dict[str, Any]:
    (eqn,) = [e for e in _eqns(doc) if e["primitive"] == "while"]
    return eqn["params"]["body_jaxpr"]


BAD_DOCUMENTS: dict[str, tuple[Any, type[CompilerError], list[str]]] = {
    "unknown primitive": (
        lambda d: _eqns(d)[1].update(primitive="frobnicate"),
        InvalidProgram, ["eqn 1", "unknown primitive 'frobnicate'"]),
    "python-looking primitive": (
        lambda d: _eqns(d)[0].update(primitive="os.system"),
        InvalidProgram, ["eqn 0", "unknown primitive"]),
    "refused collective": (
        lambda d: _eqns(d)[3].update(primitive="psum", params={"axes": ["i"]}),
        UnsafeProgram, ["eqn 3", "'psum' is not allowed", "collective"]),
    "refused effect": (
        lambda d: _eqns(d)[0].update(primitive="create_token", params={}),
        UnsafeProgram, ["eqn 0", "effect"]),
    "param of the wrong type": (
        lambda d: _eqns(d)[4]["params"].update(axes="1"),
        InvalidProgram, ["eqn 4 (reduce_sum)", "param 'axes'", "expected a list"]),
    "param item of the wrong type": (
        lambda d: _eqns(d)[0]["params"].update(shape=[2, 3.5]),
        InvalidProgram, ["eqn 0 (broadcast_in_dim)", "param 'shape'", "item 1"]),
    "unknown param": (
        lambda d: _eqns(d)[1].update(params={"evil": "__import__('os')"}),
        InvalidProgram, ["eqn 1 (mul)", "unknown param", "evil"]),
    "missing param": (
        lambda d: _eqns(d)[4].update(params={}),
        InvalidProgram, ["eqn 4 (reduce_sum)", "missing param 'axes'"]),
    "non-default sharding": (
        lambda d: _eqns(d)[0]["params"].update(sharding={"mesh": "x"}),
        InvalidProgram, ["eqn 0", "param 'sharding'", "only null"]),
    "shape mismatch": (
        lambda d: _eqns(d)[1].update(invars=["x", "w"]),
        InvalidProgram, ["eqn 1 (mul)", "ill-typed"]),
    "dtype mismatch": (
        lambda d: _eqns(d)[2]["invars"][1].update(literal=1, dtype="int32"),
        InvalidProgram, ["eqn 2 (add)", "ill-typed"]),
    "literal of the wrong kind": (
        lambda d: _eqns(d)[2]["invars"][1].update(dtype="int32"),
        InvalidProgram, ["eqn 2 (add) input 1", "int32 value must be an integer, got 0.25"]),
    "declared aval mismatch": (
        lambda d: _eqns(d)[2]["outvars"][0]["aval"].update(shape=[3, 2]),
        InvalidProgram, ["eqn 2 (add) output 0", "declared float32[3,2]", "computes float32[2,3]"]),
    "undefined variable": (
        lambda d: _eqns(d)[3].update(invars=["nope", "z"]),
        InvalidProgram, ["eqn 3 (max) input 0", "undefined variable 'nope'"]),
    "use before definition": (
        lambda d: _eqns(d).reverse(),
        InvalidProgram, ["eqn 0 (reduce_sum)", "undefined variable 'r'"]),
    "variable defined twice": (
        lambda d: _eqns(d)[3].update(outvars=["xw"]),
        InvalidProgram, ["eqn 3 (max) output 0", "'xw' is defined twice"]),
    "input redefined": (
        lambda d: _eqns(d)[1].update(outvars=["x"]),
        InvalidProgram, ["eqn 1 (mul)", "'x' is defined twice"]),
    "wrong number of outputs": (
        lambda d: _eqns(d)[1].update(outvars=["p", "q"]),
        InvalidProgram, ["eqn 1 (mul)", "binds 2 outputs", "has 1"]),
    "future version": (
        lambda d: d.update(version=wire.JAXPR_FORMAT_VERSION + 1),
        InvalidProgram, ["version 2", "newer"]),
    "retired version": (
        lambda d: d.update(version=0),
        InvalidProgram, ["version 0", "no longer read"]),
    "wrong format name": (
        lambda d: d.update(format="pickle"),
        InvalidProgram, ["format is 'pickle'"]),
    "unknown top-level field": (
        lambda d: d.update(extra=1),
        InvalidProgram, ["unknown field", "extra"]),
    "literal out of range": (
        lambda d: _eqns(d)[2]["invars"][1].update(literal=300, dtype="int8"),
        InvalidProgram, ["eqn 2 (add) input 1", "out of range for int8"]),
    "bad const data": (
        lambda d: d["jaxpr"]["consts"][0]["value"].update(data=[1.0, 2.0]),
        InvalidProgram, ["const 0", "shape"]),
    "key-typed program input": (
        lambda d: d["jaxpr"]["invars"][0]["aval"].update(dtype="key<threefry2x32>", shape=[]),
        InvalidProgram, ["eqn 1 (mul)"]),
}


@pytest.mark.parametrize("name", BAD_DOCUMENTS)
def test_bad_document_is_refused_with_its_location(name: str) -> None:
    mutate, error, fragments = BAD_DOCUMENTS[name]
    with pytest.raises(error) as info:
        decode_document(_mutate(_base(), mutate))
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_error_in_a_nested_jaxpr_names_the_path() -> None:
    doc = _while_doc()
    body = _find_while_body(doc)
    body["eqns"][1]["invars"][1] = {"literal": 2, "dtype": "int32"}  # f32 * i32
    with pytest.raises(InvalidProgram, match=r"eqn 0 > while body > eqn 1 \(mul\): ill-typed"):
        decode_document(doc)


def test_while_with_a_mistyped_carry_is_refused() -> None:
    doc = _while_doc()
    body = _find_while_body(doc)
    body["outvars"] = list(reversed(body["outvars"]))
    with pytest.raises(InvalidProgram, match=r"eqn 0 \(while\): ill-typed: body jaxpr outputs"):
        decode_document(doc)


def test_top_level_key_input_is_refused() -> None:
    doc = {"format": "jitserve.jaxpr", "version": 1, "jaxpr": {
        "invars": [{"var": "k", "aval": {"shape": [], "dtype": "key<threefry2x32>"}}],
        "eqns": [{"primitive": "random_bits", "invars": ["k"], "outvars": ["b"],
                  "params": {"bit_width": 32, "shape": [2]}}],
        "outvars": ["b"]}}
    with pytest.raises(InvalidProgram, match="input 0 is key<fry>"):
        decode_document(doc)


def _nested_jits(depth: int) -> dict[str, Any]:
    jaxpr: dict[str, Any] = {"invars": [{"var": "a", "aval": {"shape": [], "dtype": "float32"}}],
                             "eqns": [], "outvars": ["a"]}
    for _ in range(depth):
        jaxpr = {"invars": [{"var": "a", "aval": {"shape": [], "dtype": "float32"}}],
                 "eqns": [{"primitive": "jit", "params": {"jaxpr": jaxpr},
                           "invars": ["a"], "outvars": ["b"]}],
                 "outvars": ["b"]}
    return {"format": "jitserve.jaxpr", "version": 1, "jaxpr": jaxpr}


def _chain(n: int) -> dict[str, Any]:
    eqns = [{"primitive": "neg", "invars": [f"v{i}"], "outvars": [f"v{i + 1}"]} for i in range(n)]
    return {"format": "jitserve.jaxpr", "version": 1, "jaxpr": {
        "invars": [{"var": "v0", "aval": {"shape": [4], "dtype": "float32"}}],
        "eqns": eqns, "outvars": [f"v{n}"]}}


def test_nesting_within_the_limit_decodes() -> None:
    decoded = decode_document(_nested_jits(5))
    assert _run(decoded, np.float32(2)) == [np.float32(2)]


@pytest.mark.parametrize("doc, limits, fragments", [
    (_nested_jits(40), JaxprLimits(), ["eqn 0 > jit body > eqn 0", "nest deeper than 32"]),
    (_chain(50), JaxprLimits(max_eqns=20), ["eqn 20", "more than 20 equations"]),
    (_chain(50), JaxprLimits(max_vars=10), ["more than 10 variables"]),
    ({"format": "jitserve.jaxpr", "version": 1, "jaxpr": {
        "consts": [{"var": "c", "value": {"dtype": "float32", "shape": [1 << 21], "data": ""}}],
        "invars": [], "eqns": [], "outvars": ["c"]}},
     JaxprLimits(), ["const 0", "2097152 elements", "limit is 1048576"]),
    ({"format": "jitserve.jaxpr", "version": 1, "jaxpr": {
        "invars": [], "outvars": ["big"], "eqns": [
            {"primitive": "broadcast_in_dim", "invars": [{"literal": 1, "dtype": "int8"}],
             "outvars": ["big"], "params": {"shape": [1 << 20, 1 << 20], "broadcast_dimensions": []}}]}},
     JaxprLimits(), ["eqn 0 (broadcast_in_dim) output 0", "1099511627776 elements"]),
    ({"format": "jitserve.jaxpr", "version": 1, "jaxpr": {
        "invars": [{"var": "x", "aval": {"shape": [1] * 40, "dtype": "float32"}}],
        "eqns": [], "outvars": ["x"]}},
     JaxprLimits(), ["invar 0", "rank 40"]),
])
def test_size_and_depth_bombs_are_refused(doc: dict, limits: JaxprLimits, fragments: list[str]) -> None:
    with pytest.raises(LimitExceeded) as info:
        decode_document(doc, limits=limits)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_scan_unroll_is_limited() -> None:
    doc = _doc(lambda x: lax.scan(lambda c, v: (c + v, None), 0.0, x, unroll=2)[0],
               np.ones(8, np.float32))
    (scan,) = [e for e in _eqns(doc) if e["primitive"] == "scan"]
    scan["params"]["unroll"] = 1 << 30
    with pytest.raises(InvalidProgram, match=r"\(scan\): param 'unroll': unroll 1073741824 exceeds"):
        decode_document(doc)


def test_document_size_is_limited() -> None:
    data = encode_document(_base())
    with pytest.raises(LimitExceeded, match="bytes; the limit is 100"):
        decode_document(data, limits=JaxprLimits(max_document_bytes=100))


@pytest.mark.parametrize("data", [
    b"", b"{", b"\xc1", b"{" + b'"a":[' * 100_000, b"\x91" * 100_000, b"null", b"[1, 2]",
    b'{"format": NaN}', "{\"format\": \"\u00e9\xff".encode("latin-1"),
])
def test_garbage_bytes_are_invalid(data: bytes) -> None:
    with pytest.raises(CompilerError):
        decode_document(data)


def test_decoder_source_never_evaluates_or_unpickles() -> None:
    sources = sorted((ROOT / "compiler" / "jaxpr").glob("*.py"))
    assert len(sources) >= 5, sources
    forbidden = re.compile(r"\b(pickle|cloudpickle|dill|marshal|eval|exec|compile|__import__|"
                           r"importlib|import_module|getattr\(\s*(builtins|__builtins__))\b\s*[.(]")
    for path in sources:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            assert not forbidden.search(line), f"{path.name}:{lineno}: {line.strip()}"


# -- the encoder's refusals ---------------------------------------------------------------------


def test_encoder_refuses_effects() -> None:
    def f(x):
        jax.debug.print("x = {}", x)
        return x + 1

    with pytest.raises(JaxprEncodeError, match=r"eqn 0 \(debug_print\): has effects"):
        encode_function(f, np.ones(2, np.float32))


def test_encoder_refuses_key_inputs() -> None:
    with pytest.raises(JaxprEncodeError, match="input 0 is a PRNG key"):
        encode_function(lambda k: jax.random.normal(k, (2,)), jax.random.key(0))


def test_encoder_refuses_unknown_param_values() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    with pytest.raises(JaxprEncodeError, match="sharding"):
        encode_function(lambda x: jax.jit(lambda v: v * 2, out_shardings=spec)(x), np.ones(2))


def test_import_client_jaxpr_does_not_import_jax() -> None:
    script = "import sys, client.jaxpr; assert 'jax' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True)


# -- fuzz ------------------------------------------------------------------------------------------


@functools.cache
def _fuzz_seeds() -> tuple[dict[str, Any], ...]:
    f32 = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    idx = np.array([1, 0], np.int32)
    return (
        _base(),
        _while_doc(),
        _doc(lambda x, i: (x.at[i].add(1.0), x[i], jnp.sort(x, 1)), f32, idx),
        _doc(lambda x: lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x) @ x.T, f32),
        _doc(lambda x: lax.scan(lambda c, v: (c * v, jax.nn.relu(c)), x[0], x)[1], f32),
    )


_NAMES = ["a", "b", "x", "w", "z", "_", "add", "while", "float32", "int32", "key<threefry2x32>"]
_LEAVES = st.one_of(
    st.none(), st.booleans(), st.sampled_from(_NAMES), st.text(max_size=8),
    st.integers(min_value=-(1 << 70), max_value=1 << 70), st.sampled_from([0, 1, -1, 2, 3, 1 << 40]),
    st.floats(allow_nan=True, allow_infinity=True), st.binary(max_size=16),
)
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.sampled_from(["var", "aval", "shape", "dtype", "literal",
                                                             "primitive", "params", "invars"]),
                                            inner, max_size=3)),
    max_leaves=8,
)


def _slots(tree: Any, path: tuple = ()) -> list[tuple]:
    """Every (container path, key) in ``tree``: the places a mutation can hit."""
    out = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        out.append((*path, key))
        out.extend(_slots(value, (*path, key)))
    return out


def _parent(tree: Any, path: tuple) -> Any:
    for key in path[:-1]:
        tree = tree[key]
    return tree


def _apply_mutation(doc: dict[str, Any], data: Any) -> None:
    path = data.draw(st.sampled_from(_slots(doc)))
    parent, key = _parent(doc, path), path[-1]
    action = data.draw(st.sampled_from(["replace", "delete", "duplicate", "swap"]))
    if action == "replace":
        parent[key] = data.draw(_VALUES)
    elif action == "delete":
        del parent[key]
    elif action == "duplicate" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(parent[key]))
    elif action == "swap" and isinstance(parent, list) and len(parent) > 1:
        other = data.draw(st.integers(0, len(parent) - 1))
        parent[key], parent[other] = parent[other], parent[key]


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_fuzz_mutated_documents_decode_or_raise_compiler_errors(data: Any) -> None:
    doc = copy.deepcopy(data.draw(st.sampled_from(_fuzz_seeds())))
    for _ in range(data.draw(st.integers(1, 3))):
        _apply_mutation(doc, data)
    as_msgpack = data.draw(st.booleans())
    try:
        payload = msgpack.packb(doc, use_bin_type=True) if as_msgpack else doc
    except (TypeError, ValueError, OverflowError):  # ints beyond 64 bits have no msgpack form
        payload = doc
    try:
        decode_document(payload)
    except CompilerError:
        pass


@settings(max_examples=50, deadline=None, derandomize=True)
@given(data=st.data())
def test_fuzz_corrupted_bytes_decode_or_raise_compiler_errors(data: Any) -> None:
    seed = data.draw(st.sampled_from(_fuzz_seeds()))
    blob = bytearray(msgpack.packb(seed, use_bin_type=True) if data.draw(st.booleans())
                     else json.dumps(seed).encode())
    for _ in range(data.draw(st.integers(1, 4))):
        blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode_document(bytes(blob))
    except CompilerError:
        pass
