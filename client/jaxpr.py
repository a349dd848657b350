"""Write jitserve jaxpr documents: a JAX program as plain, versioned data.

A jaxpr document (``docs/jaxpr-format.md``) is what a client sends as
``format="jaxpr"``: the equations of a traced JAX program, each naming a
primitive, its params, and its input and output variables, plus the array
constants it closes over. The server decodes it against an allowlist and
compiles it like any other program; nothing in it is ever unpickled or run as
Python.

Examples::

    from jitserve.client.jaxpr import encode_function
    body = encode_function(lambda x, y: jnp.sin(x) @ y, x, y)            # JSON bytes
    body = encode_function(f, x, format="msgpack")                      # smaller

    encode_jaxpr(jax.make_jaxpr(f)(x))                                  # from a ClosedJaxpr
    encode_document({"format": "jitserve.jaxpr", "version": 1, ...})    # hand-written, no JAX

JAX is imported only by the functions that trace or walk a jaxpr, so that
``import client.jaxpr`` (and ``encode_document``) work without it.
"""

from __future__ import annotations

import base64
import enum
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import msgpack
import numpy as np

from jitserve import wire

__all__ = [
    "JaxprEncodeError",
    "encode_document",
    "encode_function",
    "encode_jaxpr",
    "jaxpr_to_document",
    "trace_flat",
]

_FORMATS = ("json", "msgpack")


class JaxprEncodeError(ValueError):
    """A jaxpr holds something the format cannot carry; the message says where and what."""


# -- entry points ---------------------------------------------------------------------


def encode_function(fn: Callable[..., Any], *example_args: Any, format: str = "json",
                    **example_kwargs: Any) -> bytes:
    """Trace ``fn`` on example arguments and encode the resulting jaxpr.

    The document's inputs are the leaves of ``(example_args, example_kwargs)``
    in ``jax.tree.flatten`` order, and its outputs the leaves of ``fn``'s result.
    Arguments may be arrays or ``jax.ShapeDtypeStruct``s.

    Example::

        doc = encode_function(lambda x: jnp.tanh(x) * 2, np.ones(3, np.float32))
    """
    closed, _, _ = trace_flat(fn, *example_args, **example_kwargs)
    return encode_jaxpr(closed, format=format)


def trace_flat(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    """``(closed_jaxpr, in_tree, out_tree)`` of ``fn`` on flattened arguments."""
    import jax

    leaves, in_tree = jax.tree.flatten((args, kwargs))
    out_trees: list[Any] = []

    def flat_fn(*flat: Any) -> list[Any]:
        a, k = jax.tree.unflatten(in_tree, flat)
        out_leaves, out_tree = jax.tree.flatten(fn(*a, **k))
        out_trees.append(out_tree)
        return out_leaves

    closed = jax.make_jaxpr(flat_fn)(*leaves)
    return closed, in_tree, out_trees[-1]


def encode_jaxpr(closed_jaxpr: Any, *, format: str = "json") -> bytes:
    """Encode a ``ClosedJaxpr`` (from ``jax.make_jaxpr``) as JSON or msgpack bytes."""
    _check_format(format)
    return _dump(jaxpr_to_document(closed_jaxpr, binary=format == "msgpack"), format)


def jaxpr_to_document(closed_jaxpr: Any, *, binary: bool = False) -> dict[str, Any]:
    """The document of a ``ClosedJaxpr`` as a plain tree (dicts, lists, numbers, strings).

    ``binary`` puts array data as raw bytes (for msgpack) instead of base64 text.
    """
    import jax

    for i, var in enumerate(closed_jaxpr.jaxpr.invars):
        _check_top_dtype(var.aval, f"input {i}")
    for i, atom in enumerate(closed_jaxpr.jaxpr.outvars):
        _check_top_dtype(atom.aval, f"output {i}")
    body = _Encoder(binary=binary).jaxpr(closed_jaxpr.jaxpr, closed_jaxpr.consts, "")
    return {"format": wire.JAXPR_FORMAT_NAME, "version": wire.JAXPR_FORMAT_VERSION,
            "producer": f"jax {jax.__version__}", "jaxpr": body}


def encode_document(document: Mapping[str, Any], *, format: str = "json") -> bytes:
    """Serialize a document tree written by hand; needs no JAX.

    Arrays may be given as numpy arrays anywhere an array map is expected
    (``consts[i]["value"]``); they are written as ``{"dtype", "shape", "data"}``.
    """
    _check_format(format)
    return _dump(_arrays_to_wire(document, binary=format == "msgpack"), format)


# -- the encoder ----------------------------------------------------------------------------


class _Encoder:
    """Walks a jaxpr; each nested jaxpr gets its own variable names."""

    def __init__(self, *, binary: bool) -> None:
        self.binary = binary

    def jaxpr(self, jaxpr: Any, consts: Any, where: str) -> dict[str, Any]:
        scope = _Scope()
        doc: dict[str, Any] = {}
        const_docs = [{"var": scope.name(v), "value": self.array(c)}
                      for v, c in zip(jaxpr.constvars, consts)]
        doc["invars"] = [{"var": scope.name(v), "aval": _aval(v.aval)} for v in jaxpr.invars]
        doc["eqns"] = [out for i, e in enumerate(jaxpr.eqns)
                       for out in self.eqns(e, scope, _join(where, f"eqn {i}"))]
        doc["outvars"] = [self.atom(a, scope) for a in jaxpr.outvars]
        # Array literals (rare) were hoisted into consts while walking.
        const_docs += [{"var": n, "value": self.array(v)} for n, v in scope.hoisted]
        if const_docs:
            doc = {"consts": const_docs, **doc}
        return doc

    def eqns(self, eqn: Any, scope: _Scope, where: str) -> list[dict[str, Any]]:
        """The document's equations for one of jax's: one, or a few for a primitive
        that a newer jax added and the format spells with older ones."""
        name = eqn.primitive.name
        where = f"{where} ({name})"
        if eqn.effects:
            raise JaxprEncodeError(f"{where}: has effects {sorted(map(str, eqn.effects))}; "
                                   "the format carries pure evaluation only")
        if name in _SPELLED_WITH_OLDER:
            return _SPELLED_WITH_OLDER[name](self, eqn, scope, where)
        name = _RENAMED.get(name, name)
        params = _PARAM_FILTERS.get(name, _keep)(dict(eqn.params), where)
        if name == "top_k":  # jax 0.8: of the last axis only, with no axis param
            params.setdefault("axis", eqn.invars[0].aval.ndim - 1)
        out: dict[str, Any] = {"primitive": name}
        if params:  # first, so that a param out of scope (a sharding) is what is named
            out["params"] = {k: self.value(v, f"{where} param {k!r}")
                             for k, v in sorted(params.items())}
        if name not in wire.JAXPR_PRIMITIVES:
            raise JaxprEncodeError(
                f"{where}: primitive {name!r} is not in the jitserve jaxpr format (version "
                f"{wire.JAXPR_FORMAT_VERSION}), which carries pure programs on one device "
                f"(docs/jaxpr-format.md). This SDK spells what jax {SUPPORTED_JAX} binds in "
                f"the format's names; this is jax {_jax_version()}. Use format='jax_export', "
                "or a jax in that range")
        out["invars"] = [self.atom(a, scope) for a in eqn.invars]
        out["outvars"] = [{"var": scope.binder(v), "aval": _aval(v.aval)} for v in eqn.outvars]
        return [out]

    def atom(self, atom: Any, scope: _Scope) -> Any:
        if not hasattr(atom, "val"):  # a Var
            return scope.names[atom]
        val = np.asarray(atom.val)
        if val.ndim:
            return scope.hoist(val)
        out = {"literal": _scalar(val), "dtype": _dtype_name(atom.aval.dtype)}
        if atom.aval.weak_type:
            out["weak_type"] = True
        return out

    def array(self, x: Any) -> dict[str, Any]:
        return _wire_array(np.asarray(x), binary=self.binary)

    def value(self, v: Any, where: str) -> Any:
        """A param value in its plain-data spelling (the decoder's codecs read it back)."""
        from jax.extend import core as jcore

        if isinstance(v, enum.Enum):  # before int: IntEnums (FftType) are ints too
            return v.name
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, np.bool_):
            return bool(v)
        if isinstance(v, (int, np.integer)):
            return int(v)
        if isinstance(v, (float, np.floating)):
            return _float(v)
        if isinstance(v, (complex, np.complexfloating)):
            return [_float(v.real), _float(v.imag)]
        if isinstance(v, jcore.ClosedJaxpr):
            return self.jaxpr(v.jaxpr, v.consts, f"{where} >")
        if isinstance(v, jcore.Jaxpr):
            if v.constvars:
                raise JaxprEncodeError(f"{where}: an open jaxpr with constvars but no values")
            return self.jaxpr(v, [], f"{where} >")
        if isinstance(v, jcore.Primitive):
            return v.name
        if type(v).__name__ == "PRNGImpl":  # a NamedTuple of functions: send its name
            return v.name
        if isinstance(v, tuple) and hasattr(v, "_fields"):  # dimension-number records
            return {f: self.value(getattr(v, f), where) for f in v._fields}
        if isinstance(v, (tuple, list)):
            return [self.value(x, where) for x in v]
        if isinstance(v, np.ndarray):
            return self.array(v)
        return _special_value(v, where)


class _Scope:
    """Variable names of one jaxpr: a, b, ..., z, ba, bb, ..."""

    def __init__(self) -> None:
        self.names: dict[Any, str] = {}
        self.hoisted: list[tuple[str, np.ndarray]] = []
        self._count = 0

    def fresh(self) -> str:
        n, self._count = self._count, self._count + 1
        letters = ""
        while True:
            n, r = divmod(n, 26)
            letters = chr(ord("a") + r) + letters
            if not n:
                return letters

    def name(self, var: Any) -> str:
        self.names[var] = self.fresh()
        return self.names[var]

    def binder(self, var: Any) -> str:
        return "_" if type(var).__name__ == "DropVar" else self.name(var)

    def hoist(self, value: np.ndarray) -> str:
        name = self.fresh()
        self.hoisted.append((name, value))
        return name


# -- params: what the format keeps of each primitive -------------------------------------------


def _keep(params: dict[str, Any], where: str) -> dict[str, Any]:
    return params


def _only(*names: str) -> Callable[[dict[str, Any], str], dict[str, Any]]:
    # Differentiation rules, remat policies and other callables never reach the
    # document: the format carries evaluation only.
    def select(params: dict[str, Any], where: str) -> dict[str, Any]:
        return {k: params[k] for k in names if k in params}
    return select


def _jit_params(params: dict[str, Any], where: str) -> dict[str, Any]:
    inline = params.get("inline")
    if isinstance(inline, enum.Enum):
        # jax 0.11: an Inline policy. Only JAX_EARLY is what True was; every other
        # policy leaves the call to the compiler, as False did.
        params["inline"] = inline.name == "JAX_EARLY"
    if params.get("compiler_options_kvs"):
        raise JaxprEncodeError(f"{where}: compiler options on a nested jit are not supported")
    for key in ("in_shardings", "out_shardings"):
        if any(not _is_default_sharding(s) for s in params.get(key, ())):
            raise JaxprEncodeError(f"{where}: {key} must be unspecified; sharding is out of scope")
    for key in ("in_layouts", "out_layouts"):
        if any(x is not None for x in params.get(key, ())):
            raise JaxprEncodeError(f"{where}: {key} must be default; layouts are out of scope")
    if not getattr(params.get("ctx_mesh"), "empty", True):
        raise JaxprEncodeError(f"{where}: a nested jit under a mesh is out of scope")
    return _only("jaxpr", "name", "keep_unused", "inline")(params, where)


def _close(*pairs: tuple[str, str]) -> Callable[[dict[str, Any], str], dict[str, Any]]:
    # Scatter-like primitives keep an open jaxpr and its consts in two params;
    # the document nests one closed jaxpr instead.
    def close(params: dict[str, Any], where: str) -> dict[str, Any]:
        from jax.extend.core import ClosedJaxpr

        params = dict(params)
        for jaxpr_key, consts_key in pairs:
            jaxpr, consts = params[jaxpr_key], params.pop(consts_key, ())
            params[jaxpr_key] = None if jaxpr is None else ClosedJaxpr(jaxpr, list(consts))
        return params
    return close


def _scan_params(params: dict[str, Any], where: str) -> dict[str, Any]:
    ft_in = params.pop("ft_in", None)
    params.pop("ft_out", None)  # the outputs' tree: the equation's outvars, for plain arrays
    if ft_in is not None:
        # jax 0.11: consts, carry and xs as one flat tree, whose leaves are None for
        # plain arrays; the format counts the first two.
        if any(v is not None for v in ft_in.vals):
            raise JaxprEncodeError(f"{where}: a scan over values that are not plain arrays "
                                   "(hijax types) is out of scope")
        consts, carry, _ = ft_in.unpack()
        params["num_consts"], params["num_carry"] = len(consts), len(carry)
    if params.pop("_split_transpose", False):
        raise JaxprEncodeError(f"{where}: _split_transpose=True is out of scope")
    # jax before 0.10: which inputs are linear, a hint for transposition only.
    params.pop("linear", None)
    return params


_SCATTERS = ("scatter", "scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max")
_PARAM_FILTERS: dict[str, Callable[[dict[str, Any], str], dict[str, Any]]] = {
    "jit": _jit_params,
    "scan": _scan_params,
    "closed_call": _only("call_jaxpr"),
    "custom_jvp_call": _only("call_jaxpr", "num_consts", "symbolic_zeros"),
    "custom_vjp_call": _only("call_jaxpr", "num_consts", "symbolic_zeros"),
    "remat2": _only("jaxpr", "prevent_cse", "differentiated"),
    "reduce": _only("jaxpr", "dimensions"),
    "reduce_window": _close(("jaxpr", "consts")),
    "select_and_scatter": _close(("select_jaxpr", "select_consts"), ("scatter_jaxpr", "scatter_consts")),
    **{name: _close(("update_jaxpr", "update_consts")) for name in _SCATTERS},
}


def _is_default_sharding(s: Any) -> bool:
    if s is None or type(s).__name__ == "UnspecifiedValue":
        return True
    mesh, spec = getattr(s, "mesh", None), getattr(s, "spec", None)
    return bool(getattr(mesh, "empty", False)) and spec is not None and all(p is None for p in spec)


def _special_value(v: Any, where: str) -> Any:
    """Values with one plain spelling that are not plain Python types."""
    kind = type(v).__name__
    if _is_default_sharding(v) and kind != "NoneType":
        return None  # the compiler's choice, as for no sharding at all
    if kind in ("Mesh", "AbstractMesh") and getattr(v, "empty", False):
        return None
    if kind == "Tolerance":
        return {"atol": _float(v.atol), "rtol": _float(v.rtol), "ulps": int(v.ulps)}
    if kind == "ArrayCopySemantics":  # a pybind11 enum, not an enum.Enum
        return v.name
    if _is_dtype(v):
        return _dtype_name(v)
    raise JaxprEncodeError(f"{where}: cannot encode a {kind} ({str(v)[:60]}); the format "
                           "carries arrays, numbers, strings, dtypes, enums and nested jaxprs")


# -- other jax releases: their primitives in the format's names ----------------------------------

#: The jax releases whose jaxprs this writer spells in the format (the ``jit`` extra's
#: range in pyproject.toml; a test keeps the two equal).
SUPPORTED_JAX = ">=0.8.0,<0.12"

# jax 0.11 names closed_call eval_jaxpr.
_RENAMED = {"eval_jaxpr": "closed_call"}


def _jax_version() -> str:
    import jax

    return str(jax.__version__)


def _one_minus_square(enc: _Encoder, eqn: Any, scope: _Scope, where: str) -> list[dict[str, Any]]:
    # jax 0.11's 1 - x², spelled (1 + x) * (1 - x), as older jax computes tanh's derivative
    # (exact arithmetic: an accuracy hint has nothing to choose).
    (x,), (out,) = eqn.invars, eqn.outvars
    _plain_params(eqn, where)
    one, xa, aval = _literal(1, out.aval.dtype), enc.atom(x, scope), _aval(out.aval)
    plus, minus = scope.fresh(), scope.fresh()
    return [_eqn("add", [one, xa], [(plus, aval)]),
            _eqn("sub", [one, xa], [(minus, aval)]),
            _eqn("mul", [plus, minus], [(scope.binder(out), aval)])]


def _log2(enc: _Encoder, eqn: Any, scope: _Scope, where: str) -> list[dict[str, Any]]:
    # jax 0.11's log2, spelled as older jax's jnp.log2: log(x) / log(2), by parts for complex.
    (x,), (out,) = eqn.invars, eqn.outvars
    params = {k: enc.value(v, f"{where} param {k!r}") for k, v in _plain_params(eqn, where).items()}
    dtype, aval = np.dtype(out.aval.dtype), _aval(out.aval)
    log = scope.fresh()
    eqns = [_eqn("log", [enc.atom(x, scope)], [(log, aval)], params)]
    if dtype.kind != "c":
        return eqns + [_eqn("div", [log, _literal(np.log(2.0), dtype)], [(scope.binder(out), aval)])]
    part_dtype = np.empty(0, dtype).real.dtype
    part = {**aval, "dtype": _dtype_name(part_dtype)}
    ln2 = _literal(np.log(2.0), part_dtype)
    re, im, re2, im2 = (scope.fresh() for _ in range(4))
    return eqns + [_eqn("real", [log], [(re, part)]), _eqn("imag", [log], [(im, part)]),
                   _eqn("div", [re, ln2], [(re2, part)]), _eqn("div", [im, ln2], [(im2, part)]),
                   _eqn("complex", [re2, im2], [(scope.binder(out), aval)])]


_SPELLED_WITH_OLDER: dict[str, Callable[[_Encoder, Any, _Scope, str], list[dict[str, Any]]]] = {
    "one_minus_square": _one_minus_square,
    "log2": _log2,
}


def _plain_params(eqn: Any, where: str) -> dict[str, Any]:
    # An elementwise primitive's params: none, or log's accuracy (kept only when set).
    params = dict(eqn.params)
    accuracy = params.pop("accuracy", None)
    if params:
        raise JaxprEncodeError(f"{where}: params {sorted(params)} are out of scope")
    return {} if accuracy is None else {"accuracy": accuracy}


def _literal(value: Any, dtype: Any) -> dict[str, Any]:
    return {"literal": _scalar(np.asarray(value, dtype)), "dtype": _dtype_name(dtype)}


def _eqn(primitive: str, invars: list[Any], outvars: list[tuple[str, dict[str, Any]]],
         params: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"primitive": primitive}
    if params:
        out["params"] = params
    out["invars"] = invars
    out["outvars"] = [{"var": var, "aval": aval} for var, aval in outvars]
    return out


# -- plain-data spellings ----------------------------------------------------------------------


def _is_dtype(v: Any) -> bool:
    return isinstance(v, np.dtype) or hasattr(v, "_impl") and type(v).__name__ == "KeyTy"


def _dtype_name(dtype: Any) -> str:
    if type(dtype).__name__ == "KeyTy":
        return f"key<{dtype._impl.name}>"
    try:
        return wire.dtype_name(dtype)
    except wire.WireError as e:
        raise JaxprEncodeError(str(e)) from None


def _aval(aval: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"shape": [int(d) for d in aval.shape], "dtype": _dtype_name(aval.dtype)}
    if getattr(aval, "weak_type", False):
        out["weak_type"] = True
    return out


def _check_top_dtype(aval: Any, what: str) -> None:
    # Program inputs and outputs travel as wire arrays, which have no key type.
    if type(aval.dtype).__name__ == "KeyTy":
        raise JaxprEncodeError(f"{what} is a PRNG key ({aval.str_short()}); pass "
                               "jax.random.key_data(key) and wrap it inside the function")


def _float(x: Any) -> float | str:
    # JSON has no NaN or infinity; both encodings spell them as strings.
    f = float(x)
    if math.isnan(f):
        return "nan"
    if math.isinf(f):
        return "inf" if f > 0 else "-inf"
    return f


def _scalar(val: np.ndarray) -> Any:
    kind = val.dtype.kind
    if kind == "b":
        return bool(val)
    if kind in "iu":
        return int(val)
    if kind == "c":
        return [_float(val.real), _float(val.imag)]
    return _float(val)


def _wire_array(x: np.ndarray, *, binary: bool) -> dict[str, Any]:
    # The shared wire codec, with base64 text in JSON: exact, unlike decimal lists.
    out = wire.encode_array(x)
    out["data"] = bytes(out["data"]) if binary else base64.b64encode(out["data"]).decode("ascii")
    return out


def _arrays_to_wire(tree: Any, *, binary: bool) -> Any:
    if isinstance(tree, np.ndarray):
        return _wire_array(tree, binary=binary)
    if isinstance(tree, Mapping):
        return {k: _arrays_to_wire(v, binary=binary) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_arrays_to_wire(v, binary=binary) for v in tree]
    return tree


def _check_format(format: str) -> None:
    if format not in _FORMATS:
        raise ValueError(f"format must be one of {_FORMATS}, got {format!r}")


def _dump(doc: Any, format: str) -> bytes:
    if format == "msgpack":
        return msgpack.packb(doc, use_bin_type=True)
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _join(where: str, what: str) -> str:
    return f"{where} {what}" if where else what
