"""Rebuild a JAX ClosedJaxpr from a parsed jaxpr document (untrusted input).

The decoder walks the document once, top to bottom. Every variable is bound
exactly once in its jaxpr and used only after; every equation's primitive comes
from the allowlist (``_prims.SPECS``), its params from their typed codecs,
and its output types from JAX's abstract evaluation of that primitive, compared
with the types the document declares. Nested jaxprs are decoded the same way
with their own scope. Sizes are counted as they are read, so a document that
is too big stops at the first equation past a limit.

Errors name where they are: ``eqn 3 > while body > eqn 1 (add): ill-typed: ...``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax._src import core
from jax._src.linear_util import DebugInfo
from jax._src.literals import TypedNdArray
from jax._src.random import prng

from jitserve.compiler.errors import (
    CompilerError,
    InvalidProgram,
    LimitExceeded,
    UnsafeProgram,
    first_line,
)
from jitserve.compiler.jaxpr._data import (
    check_keys,
    decode_array,
    decode_scalar,
    decode_shape,
    parse_document_bytes,
    require,
    wire_dtype,
)
from jitserve.compiler.jaxpr._limits import JaxprLimits
from jitserve.compiler.jaxpr._params import REQUIRED, BadParam
from jitserve.compiler.jaxpr._prims import INLINED, OMIT, REFUSED, SPECS, PrimSpec
from jitserve.wire import DTYPES

__all__ = ["Decoder", "check_header", "lookup_dtype", "parse", "rebuild"]

_JAXPR_KEYS = frozenset({"invars", "eqns", "outvars"})
_EQN_KEYS = frozenset({"primitive", "invars", "outvars"})
_DROP = "_"  # an output binder that discards its value
# An output binder: its name, its declared aval (a ShapedArray) or None, where it is.
_Binder = tuple[str, Any, str]
_MAX_NAME = 128
# Rebuilt jaxprs have no Python source to point at; names and paths stay unknown.
_DEBUG_INFO = DebugInfo("jitserve jaxpr document", "<jaxpr document>", None, None)


@dataclasses.dataclass
class _Scope:
    """The variables and equations of one jaxpr being rebuilt."""

    where: str
    env: dict[str, core.Var | core.Literal] = dataclasses.field(default_factory=dict)
    constvars: list[core.Var] = dataclasses.field(default_factory=list)
    consts: list[Any] = dataclasses.field(default_factory=list)
    invars: list[core.Var] = dataclasses.field(default_factory=list)
    eqns: list[core.JaxprEqn] = dataclasses.field(default_factory=list)


def _join(where: str, what: str) -> str:
    return f"{where} > {what}" if where else what


class Decoder:
    """Decodes one document; holds the counters its limits are checked against."""

    def __init__(self, limits: JaxprLimits) -> None:
        self.limits = limits
        self.n_eqns = 0
        self.n_vars = 0

    # -- jaxprs --------------------------------------------------------------------

    def jaxpr(self, doc: Any, where: str, depth: int) -> core.ClosedJaxpr:
        """A closed jaxpr from its document; ``where`` is its path for errors."""
        if depth > self.limits.max_depth:
            raise LimitExceeded(f"{where}: jaxprs nest deeper than {self.limits.max_depth}")
        label = where or "jaxpr"
        check_keys(doc, label, required=_JAXPR_KEYS, optional=frozenset({"consts"}))
        scope = _Scope(where)
        for i, item in enumerate(require(doc.get("consts", []), list, label, "consts")):
            self._const(scope, item, _join(where, f"const {i}"))
        for i, item in enumerate(require(doc["invars"], list, label, "invars")):
            scope.invars.append(self._bind_new(scope, item, _join(where, f"invar {i}")))
        for i, item in enumerate(require(doc["eqns"], list, label, "eqns")):
            self._eqn(scope, item, i, depth)
        outs = require(doc["outvars"], list, label, "outvars")
        outvars = [self._atom(scope, a, _join(where, f"outvar {i}")) for i, a in enumerate(outs)]
        jaxpr = core.Jaxpr(scope.constvars, scope.invars, outvars, scope.eqns, core.no_effects,
                           debug_info=_DEBUG_INFO)
        return core.ClosedJaxpr(jaxpr, scope.consts)

    def _const(self, scope: _Scope, item: Any, where: str) -> None:
        check_keys(item, where, required=frozenset({"var", "value"}))
        value = self.array(item["value"], where)
        aval = core.ShapedArray(value.shape, value.dtype)
        var = core.Var(aval)
        self._name(scope, item["var"], var, where)
        scope.constvars.append(var)
        scope.consts.append(value)

    def array(self, doc: Any, where: str) -> np.ndarray:
        return decode_array(doc, where, max_elements=self.limits.max_literal_elements,
                            max_rank=self.limits.max_rank)

    # -- variables -----------------------------------------------------------------

    def _bind_new(self, scope: _Scope, item: Any, where: str) -> core.Var:
        """An input binder: ``{"var": name, "aval": ...}``; the aval is required."""
        check_keys(item, where, required=frozenset({"var", "aval"}))
        var = core.Var(self.aval(item["aval"], where))
        self._name(scope, item["var"], var, where)
        return var

    def _name(self, scope: _Scope, name: Any, atom: Any, where: str) -> None:
        require(name, str, where, "a variable name")
        if not 0 < len(name) <= _MAX_NAME or name == _DROP:
            raise InvalidProgram(f"{where}: {name!r:.40} is not a variable name "
                                 f"(1 to {_MAX_NAME} characters, not '_')")
        if name in scope.env:
            raise InvalidProgram(f"{where}: variable {name!r} is defined twice")
        self.n_vars += 1
        if self.n_vars > self.limits.max_vars:
            raise LimitExceeded(f"{where}: more than {self.limits.max_vars} variables")
        scope.env[name] = atom

    def _atom(self, scope: _Scope, item: Any, where: str) -> core.Var | core.Literal:
        """A use: a variable name, or ``{"literal": value, "dtype": ...}``."""
        if isinstance(item, str):
            if item not in scope.env:
                raise InvalidProgram(f"{where}: uses undefined variable {item!r:.40}")
            return scope.env[item]
        check_keys(item, where, required=frozenset({"literal", "dtype"}),
                   optional=frozenset({"weak_type"}))
        dtype = wire_dtype(item["dtype"], where)
        weak = require(item.get("weak_type", False), bool, where, "weak_type")
        with np.errstate(all="ignore"):  # 1e300 as float16 is inf, as JAX would make it
            value = np.asarray(decode_scalar(item["literal"], dtype, where)).astype(dtype)
        aval = core.ShapedArray((), dtype, weak_type=weak)
        return core.Literal(TypedNdArray(value, aval=aval), aval)

    def aval(self, doc: Any, where: str) -> core.ShapedArray:
        """``{"shape", "dtype", "weak_type"?}`` to a ShapedArray (PRNG key dtypes allowed)."""
        check_keys(doc, where, required=frozenset({"shape", "dtype"}), optional=frozenset({"weak_type"}))
        shape = decode_shape(doc["shape"], where, max_rank=self.limits.max_rank,
                             max_elements=self.limits.max_array_elements)
        weak = require(doc.get("weak_type", False), bool, where, "weak_type")
        return core.ShapedArray(shape, self.dtype(doc["dtype"], where), weak_type=weak)

    def dtype(self, name: Any, where: str) -> Any:
        """A wire dtype name, or ``key<impl>`` for a typed PRNG key."""
        try:
            return lookup_dtype(name)
        except BadParam as e:
            raise InvalidProgram(f"{where}: {e}") from None

    # -- equations -----------------------------------------------------------------

    def _eqn(self, scope: _Scope, doc: Any, index: int, depth: int) -> None:
        path = _join(scope.where, f"eqn {index}")
        where = path
        self.n_eqns += 1
        if self.n_eqns > self.limits.max_eqns:
            raise LimitExceeded(f"{where}: more than {self.limits.max_eqns} equations")
        check_keys(doc, where, required=_EQN_KEYS, optional=frozenset({"params"}))
        name = doc["primitive"]
        spec = self._spec(name, where)
        where = f"{where} ({name})"
        ins = require(doc["invars"], list, where, "invars")
        invars = [self._atom(scope, a, f"{where} input {k}") for k, a in enumerate(ins)]
        in_avals = [a.aval for a in invars]
        params = self._params(spec, name, doc.get("params", {}), where, path, depth)
        params = self._finish_params(spec, params, in_avals, where)
        binders = self._binders(doc["outvars"], where)
        if name in INLINED:
            atoms = self._inline(scope, params, invars)
            self._bind_atoms(scope, binders, atoms, where)
        else:
            out_avals = self._abstract_eval(spec, in_avals, params, where)
            outvars = self._bind_vars(scope, binders, out_avals, where)
            scope.eqns.append(core.new_jaxpr_eqn(invars, outvars, spec.primitive, params,
                                                 core.no_effects))

    def _spec(self, name: Any, where: str) -> PrimSpec:
        require(name, str, where, "primitive")
        if name in REFUSED:
            raise UnsafeProgram(f"{where}: primitive {name!r} is not allowed: it {REFUSED[name]}")
        spec = SPECS.get(name)
        if spec is None:
            raise InvalidProgram(f"{where}: unknown primitive {name!r:.60}")
        return spec

    def _params(self, spec: PrimSpec, prim: str, doc: Any, where: str, path: str,
                depth: int) -> dict[str, Any]:
        """Decodes every param by its codec; ``path`` (no primitive suffix) prefixes nested jaxprs."""
        require(doc, Mapping, where, "params")
        unknown = set(doc) - set(spec.params)
        if unknown:
            raise InvalidProgram(f"{where}: unknown param(s) {sorted(map(str, unknown))[:5]}; "
                                 f"{prim} takes {sorted(spec.params) or 'none'}")
        ctx = _ParamCtx(self, path, prim, depth)
        params: dict[str, Any] = {}
        for key, param in spec.params.items():
            if key not in doc:
                if param.default is REQUIRED:
                    raise InvalidProgram(f"{where}: missing param {key!r}")
                if param.default is not OMIT:
                    params[key] = self._default(param, ctx, where, key)
                continue
            try:
                params[key] = param.codec(doc[key], ctx)
            except BadParam as e:
                raise InvalidProgram(f"{where}: param {key!r}: {e}") from None
        return params

    def _default(self, param: Any, ctx: _ParamCtx, where: str, key: str) -> Any:
        # Defaults are written in the document's spelling (enum names) so that
        # one codec turns both into JAX values.
        if isinstance(param.default, str):
            try:
                return param.codec(param.default, ctx)
            except BadParam as e:  # pragma: no cover - a bug in the schema table
                raise InvalidProgram(f"{where}: default of {key!r}: {e}") from None
        return param.default

    def _finish_params(self, spec: PrimSpec, params: dict[str, Any], in_avals: Sequence[Any],
                       where: str) -> dict[str, Any]:
        try:
            if spec.check is not None:
                spec.check(in_avals, params)
            if spec.finalize is not None:
                params = spec.finalize(params, in_avals)
        except BadParam as e:
            raise InvalidProgram(f"{where}: ill-typed: {e}") from None
        return params

    def _abstract_eval(self, spec: PrimSpec, in_avals: list[Any], params: dict[str, Any],
                       where: str) -> list[core.AbstractValue]:
        """The output avals JAX computes for the equation; refuses effects."""
        try:
            out, effects = spec.primitive.abstract_eval(*in_avals, **params)
        except CompilerError:
            raise
        except Exception as e:  # noqa: BLE001 - JAX's shape rules raise many types
            raise InvalidProgram(f"{where}: ill-typed: {first_line(e, 500, typed=True)}") from None
        if effects:
            raise UnsafeProgram(f"{where}: has effects {sorted(map(str, effects))}; "
                                "the format carries pure evaluation only")
        out_avals = list(out) if spec.primitive.multiple_results else [out]
        for k, aval in enumerate(out_avals):
            self._check_size(aval, f"{where} output {k}")
        return out_avals

    def _inline(self, scope: _Scope, params: dict[str, Any], invars: list[Any]) -> list[Any]:
        """Splices a call's body into ``scope``; returns the atoms of its outputs."""
        body: core.ClosedJaxpr = params["call_jaxpr"] if "call_jaxpr" in params else params["jaxpr"]
        # The body was decoded for this equation alone, so its Var objects can
        # move into the enclosing jaxpr as they are.
        subst: dict[core.Var, Any] = dict(zip(body.jaxpr.invars, invars))
        scope.constvars.extend(body.jaxpr.constvars)
        scope.consts.extend(body.consts)
        for eqn in body.jaxpr.eqns:
            scope.eqns.append(eqn.replace(invars=[_subst(subst, a) for a in eqn.invars]))
        return [_subst(subst, a) for a in body.jaxpr.outvars]

    def _binders(self, doc: Any, where: str) -> list[_Binder]:
        """The output binders: ``name`` or ``{"var": name, "aval"?: ...}``; ``"_"`` drops."""
        result: list[_Binder] = []
        for k, item in enumerate(require(doc, list, where, "outvars")):
            at = f"{where} output {k}"
            if isinstance(item, str):
                result.append((item, None, at))
                continue
            check_keys(item, at, required=frozenset({"var"}), optional=frozenset({"aval"}))
            aval = self.aval(item["aval"], at) if "aval" in item else None
            result.append((item["var"], aval, at))
        return result

    def _check_arity(self, binders: list[_Binder], n: int, where: str) -> None:
        if len(binders) != n:
            raise InvalidProgram(f"{where}: binds {len(binders)} outputs but the equation has {n}")

    def _check_declared(self, declared: Any, actual: Any, where: str) -> None:
        if declared is not None and not core.typematch(declared, actual):
            raise InvalidProgram(f"{where}: declared {declared.str_short()} but the equation "
                                 f"computes {actual.str_short()}")

    def _bind_vars(self, scope: _Scope, binders: list[_Binder], out_avals: list[Any],
                   where: str) -> list[core.Var]:
        self._check_arity(binders, len(out_avals), where)
        outvars: list[core.Var] = []
        for (name, declared, at), aval in zip(binders, out_avals):
            self._check_declared(declared, aval, at)
            if name == _DROP:
                outvars.append(core.DropVar(aval))
                continue
            var = core.Var(aval)
            self._name(scope, name, var, at)
            outvars.append(var)
        return outvars

    def _bind_atoms(self, scope: _Scope, binders: list[_Binder], atoms: list[Any], where: str) -> None:
        self._check_arity(binders, len(atoms), where)
        for (name, declared, at), atom in zip(binders, atoms):
            self._check_declared(declared, atom.aval, at)
            if name != _DROP:
                self._name(scope, name, atom, at)

    def _check_size(self, aval: Any, where: str) -> None:
        shape = getattr(aval, "shape", ())
        if len(shape) > self.limits.max_rank:
            raise LimitExceeded(f"{where}: rank {len(shape)} exceeds the limit of {self.limits.max_rank}")
        size = math.prod(shape)
        if size > self.limits.max_array_elements:
            raise LimitExceeded(f"{where}: {aval.str_short()} has {size} elements; "
                                f"the limit is {self.limits.max_array_elements}")


class _ParamCtx:
    """The ``DecodeCtx`` codecs of one equation see."""

    def __init__(self, decoder: Decoder, where: str, prim: str, depth: int) -> None:
        self.decoder, self.where, self.prim, self.depth = decoder, where, prim, depth
        self.max_rank = decoder.limits.max_rank
        self.max_unroll = decoder.limits.max_unroll

    def jaxpr(self, doc: Any, label: str) -> core.ClosedJaxpr:
        return self.decoder.jaxpr(doc, _join(self.where, f"{self.prim} {label}"), self.depth + 1)

    def dtype(self, name: Any) -> Any:
        return lookup_dtype(name)


def lookup_dtype(name: Any) -> Any:
    """The dtype a document names: a wire dtype, or ``key<impl>`` for a typed PRNG key."""
    if isinstance(name, str) and name.startswith("key<") and name.endswith(">"):
        impl = prng.prngs.get(name[4:-1])
        if impl is None:
            raise BadParam(f"unknown PRNG key type {name!r:.60}; expected key<IMPL> with IMPL "
                           f"one of {sorted(prng.prngs)}")
        return prng.KeyTy(impl)
    if not isinstance(name, str) or name not in DTYPES:
        raise BadParam(f"unknown dtype {name!r:.60}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def _subst(subst: dict[core.Var, Any], atom: Any) -> Any:
    return subst.get(atom, atom) if isinstance(atom, core.Var) else atom


# -- the document as a whole ---------------------------------------------------------

_HEADER_KEYS = frozenset({"format", "version", "jaxpr"})


def parse(data: Any, limits: JaxprLimits) -> Mapping[str, Any]:
    """The document tree from bytes (JSON or msgpack) or an already parsed mapping."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        data = parse_document_bytes(bytes(data), max_bytes=limits.max_document_bytes)
    tree: Mapping[str, Any] = require(data, Mapping, "document", "a jaxpr document")
    return tree


def check_header(tree: Mapping[str, Any], name: str, oldest: int, newest: int) -> int:
    """The document's format version, once it is one this server reads."""
    check_keys(tree, "document", required=_HEADER_KEYS, optional=frozenset({"producer"}))
    if tree["format"] != name:
        raise InvalidProgram(f"document: format is {tree['format']!r:.60}, expected {name!r}")
    version: int = require(tree["version"], int, "document", "version")
    if version > newest:
        raise InvalidProgram(f"document: format version {version} is newer than this server "
                             f"reads ({oldest} to {newest}); upgrade the server or write version {newest}")
    if version < oldest:
        raise InvalidProgram(f"document: format version {version} is no longer read "
                             f"(this server reads {oldest} to {newest}); re-encode it")
    return version


def rebuild(doc: Any, limits: JaxprLimits) -> core.ClosedJaxpr:
    """Decode the top-level jaxpr, then run JAX's checker over the whole program."""
    closed = Decoder(limits).jaxpr(doc, "", 0)
    try:
        core.check_jaxpr(closed.jaxpr)
    except Exception as e:  # noqa: BLE001 - JaxprTypeError, or whatever a rule raises
        raise InvalidProgram("JAX's jaxpr checker rejected the program: "
                             f"{first_line(e, 500, typed=True)}") from None
    return closed
