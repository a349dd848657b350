"""Models and inferences of the Open Inference Protocol, below REST and gRPC.

A model is a named program (``service.calls.models``); its metadata is the
program's signature. Input and output names come from the program's pytrees
where they hold dict keys (``f({"x": ..., "y": ...})`` takes ``x`` and ``y``;
nested dicts join keys with dots: ``params.w``); every other leaf is
``input_<i>`` / ``output_<i>`` by its flat position. Dimensions known only once
inputs arrive (jax.export symbolic dims, StableHLO ``?``) are ``-1``.

An inference is a ``/v1`` execute that waits: the inputs, matched to the
program's by name and checked against its datatypes and shapes, go through
``Calls.execute`` (the same caches, runtimes, quotas and metrics), the answer
waits for the future, fetches its outputs as ``GET /v1/futures/{id}/result``
does, and deletes the future, so nothing outlives the request.

    inference = Inference.of(services)        # the app's Services (service.api.deps)
    model = await inference.model(owner, "double", None)     # the latest version
    outputs = await inference.infer(owner, model, [InputTensor("x", "FP32", [2], data=[1, 2])])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jitserve.compiler.records import Program
from jitserve.wire import Aval, ErrorCode, FutureStatus

from ..api.deps import Services
from ..calls.calls import Calls
from ..calls.drain import Drain
from ..calls.futures import Future, FutureStore
from ..calls.models import ModelRegistry
from ..calls.programs import ProgramStore
from ..errors import BadRequest, FutureCancelled, FutureFailed
from ..runtimes import RuntimePool
from .errors import CallFailed
from .tensors import datatype_of, dtype_of, from_data, from_raw, shape_of

__all__ = ["Inference", "InputTensor", "Model", "OutputTensor", "RequestedOutput", "TensorSpec",
           "leaf_names"]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output of a model, as v2 names it (``datatype`` is ``""`` when v2 has none)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    aval: Aval

    @classmethod
    def of(cls, name: str, aval: Aval) -> TensorSpec:
        shape = tuple(d if isinstance(d, int) else -1 for d in aval.shape)
        return cls(name, datatype_of(aval.dtype) or "", shape, aval)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class Model:
    """One version of a model: its program and signature in v2's terms.

    Attributes:
      name, version: as the client names it; ``versions``: every visible version.
      inputs, outputs: the signature (``outputs`` is empty when the program's output
        avals are only known once it compiles).
      refusal: why v2 cannot run the program (a dtype v2 lacks), or ``None``.
    """

    name: str
    version: int
    versions: tuple[int, ...]
    program: Program
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    refusal: str | None

    @classmethod
    def of(cls, name: str, version: int, versions: Sequence[int], program: Program) -> Model:
        inputs = _specs(program.in_avals, program.in_tree, "input")
        outputs = _specs(program.out_avals or (), program.out_tree, "output")
        unsupported = [s for s in (*inputs, *outputs) if not s.datatype]
        refusal = None
        if unsupported:
            s = unsupported[0]
            refusal = (f"model {name!r} version {version}: {s.name} is {s.aval.dtype}, which the "
                       "Open Inference Protocol has no datatype for; call the program through "
                       f"/v1/programs/{program.program_id}/execute")
        return cls(name, version, tuple(versions), program, inputs, outputs, refusal)

    @property
    def platform(self) -> str:
        return f"jitserve_{self.program.format.value}"

    def check(self) -> None:
        """``BadRequest`` when v2 cannot run this model."""
        if self.refusal is not None:
            raise BadRequest(self.refusal)

    def metadata(self) -> dict[str, Any]:
        """The model metadata document (REST), whose fields the gRPC answer has too."""
        self.check()
        return {"name": self.name, "versions": [str(v) for v in self.versions],
                "platform": self.platform, "inputs": [s.to_json() for s in self.inputs],
                "outputs": [s.to_json() for s in self.outputs]}


@dataclasses.dataclass
class InputTensor:
    """An input as a request states it (unchecked, ``name`` too: ``_arrays`` checks it):
    JSON/typed ``data``, or ``raw`` bytes."""

    name: Any
    datatype: Any
    shape: Any
    data: Any = None
    raw: Any = None


@dataclasses.dataclass(frozen=True)
class RequestedOutput:
    """An output a request asks for; ``binary`` says how REST answers it (``None``: the default)."""

    name: str
    binary: bool | None = None


@dataclasses.dataclass(frozen=True)
class OutputTensor:
    """An output of an inference, on the host."""

    name: str
    datatype: str
    array: np.ndarray
    binary: bool


class Inference:
    """Finds models and runs inferences for the REST and gRPC front ends.

    Args:
      models, programs, calls, futures, runtimes: the app's (``Services``).
      wait_s: the longest an inference waits for its future (compile and run); the
        compile and execution time limits end it sooner.
      drain: the server's drain, which refuses new calls after SIGTERM; none if omitted.
    """

    def __init__(self, models: ModelRegistry, programs: ProgramStore, calls: Calls,
                 futures: FutureStore, runtimes: RuntimePool, *,
                 wait_s: float, drain: Drain | None = None) -> None:
        self._drain = drain
        self._models = models
        self._programs = programs
        self._calls = calls
        self._futures = futures
        self._runtimes = runtimes
        self._wait_s = wait_s

    @classmethod
    def of(cls, services: Services) -> Inference:
        """The inferences of a running app (``service.api.deps.Services``)."""
        return cls(services.models, services.programs, services.calls, services.futures,
                   services.runtimes, wait_s=services.settings.call_timeout_s,
                   drain=services.drain)

    def ready(self) -> bool:
        """Whether every runtime is up (the server's readiness for inferences)."""
        runtimes = self._runtimes.describe()
        return bool(runtimes) and all(r["state"] == "up" for r in runtimes)

    async def model(self, owner: str | None, name: str, version: str | None) -> Model:
        """``owner``'s model ``name`` at ``version`` (the latest when empty); ``NotFound`` if none."""
        number, program_id = self._models.resolve(owner, name, version)
        program = await self._programs.get(program_id, owner)
        versions = [k for k, _ in self._models.versions(owner, name)]
        return Model.of(name, number, versions, program)

    async def infer(self, owner: str | None, model: Model, inputs: Sequence[InputTensor],
                    requested: Sequence[RequestedOutput] = (),
                    binary: bool = False) -> list[OutputTensor]:
        """Run ``model`` on ``inputs``; the outputs ``requested`` (all when empty), in that order.

        ``binary``: how outputs whose request does not say are to be answered (REST).
        """
        model.check()
        arrays = _arrays(model, inputs)
        if model.outputs:
            _check_requested(model.outputs, requested)
        if self._drain is not None:
            self._drain.check_accepting()  # a 503 once this replica drains (service/calls/drain.py)
        call = await self._calls.execute(model.program, arrays, "", owner)
        del arrays  # the executor holds them until they are sent
        fut = call.future
        try:
            host = await self._outputs(fut)
        finally:
            self._futures.delete(fut)
        specs = model.outputs or _specs(fut.out_avals, fut.out_tree, "output")
        return _answer(specs, host, requested, binary)

    async def _outputs(self, fut: Future) -> list[np.ndarray]:
        """The outputs of ``fut`` once it is final, on the host; its error if it failed."""
        if not await fut.wait_final(self._wait_s):
            raise CallFailed(ErrorCode.EXECUTION_TIMEOUT,
                             f"the inference did not finish within {self._wait_s:g} s")
        if fut.status is FutureStatus.FAILED:
            error = fut.error or {}
            raise CallFailed(str(error.get("code", "internal")), str(error.get("message", "")))
        if fut.status is not FutureStatus.DONE or fut.outputs is None:
            raise FutureCancelled("the inference was cancelled before it finished")
        try:
            return await self._calls.outputs(fut)
        except FutureFailed as e:
            cause = e.extra.get("cause") or {}
            raise CallFailed(str(cause.get("code", "internal")),
                             f"the inference's outputs were lost: {cause.get('message', e)}") from None


def leaf_names(tree: Any, count: int, prefix: str) -> list[str]:
    """Names of the ``count`` leaves of the pytree ``tree`` (``compiler.trees`` JSON).

    A leaf reached through dict keys is named by them, joined with dots; any other
    is ``<prefix>_<i>``. Names that would repeat (or a tree that does not have
    ``count`` leaves) fall back to ``<prefix>_<i>`` for all.
    """
    paths: list[tuple[str, ...]] = []
    _walk(tree, (), paths, depth=0)
    positional = [f"{prefix}_{i}" for i in range(count)]
    if len(paths) != count:
        return positional
    names = [".".join(p) if p else positional[i] for i, p in enumerate(paths)]
    return names if len(set(names)) == count else positional


def _walk(node: Any, keys: tuple[str, ...], out: list[tuple[str, ...]], depth: int) -> None:
    if node is None or depth > 64:
        out.append(keys)
    elif isinstance(node, dict) and isinstance(node.get("dict"), dict):
        for key, child in node["dict"].items():
            _walk(child, (*keys, str(key)), out, depth + 1)
    elif isinstance(node, dict) and not node.get("none"):
        children = node.get("tuple", node.get("list", node.get("children", [])))
        for child in children if isinstance(children, list) else []:
            _walk(child, keys, out, depth + 1)


def _specs(avals: Sequence[Aval], tree: Any, prefix: str) -> tuple[TensorSpec, ...]:
    names = leaf_names(tree, len(avals), prefix)
    return tuple(TensorSpec.of(n, a) for n, a in zip(names, avals))


def _arrays(model: Model, inputs: Sequence[InputTensor]) -> list[np.ndarray]:
    """The request's inputs as arrays in the program's order, each checked against its spec."""
    given: dict[str, InputTensor] = {}
    for t in inputs:
        if not isinstance(t.name, str) or not t.name:
            raise BadRequest(f"every input needs a name; model {model.name!r} takes "
                             f"{_names(model.inputs)}")
        if t.name in given:
            raise BadRequest(f"input {t.name!r:.100} is given twice")
        given[t.name] = t
    known = {s.name for s in model.inputs}
    unknown = [n for n in given if n not in known]
    if unknown:
        raise BadRequest(f"model {model.name!r} has no input {unknown[0]!r:.100}; its inputs "
                         f"are {_names(model.inputs)}")
    missing = [s.name for s in model.inputs if s.name not in given]
    if missing:
        raise BadRequest(f"input {missing[0]!r} is missing; model {model.name!r} takes "
                         f"{_names(model.inputs)}")
    return [_array(spec, given[spec.name]) for spec in model.inputs]


def _array(spec: TensorSpec, t: InputTensor) -> np.ndarray:
    where = f"input {spec.name!r}"
    if t.datatype != spec.datatype:
        raise BadRequest(f"{where} has datatype {t.datatype!r:.40}, but the model takes "
                         f"{spec.datatype}")
    shape = shape_of(t.shape, where)
    if len(shape) != len(spec.shape) or any(
            want >= 0 and want != got for want, got in zip(spec.shape, shape)):
        raise BadRequest(f"{where} has shape {list(shape)}, but the model takes "
                         f"{list(spec.shape)} (-1: any size)")
    if t.raw is not None:
        return from_raw(t.raw, spec.datatype, shape, where)
    if t.data is None:
        raise BadRequest(f"{where} has no data (JSON 'data', or binary data with "
                         "'binary_data_size')")
    return from_data(t.data, dtype_of(spec.datatype, where), shape, where)


def _check_requested(specs: Sequence[TensorSpec], requested: Sequence[RequestedOutput]) -> None:
    known = {s.name for s in specs}
    for r in requested:
        if r.name not in known:
            raise BadRequest(f"the model has no output {r.name!r:.100}; its outputs are "
                             f"{_names(specs)}")


def _answer(specs: Sequence[TensorSpec], host: Sequence[np.ndarray],
            requested: Sequence[RequestedOutput], binary: bool) -> list[OutputTensor]:
    _check_requested(specs, requested)
    index = {s.name: k for k, s in enumerate(specs)}
    wanted = requested or [RequestedOutput(s.name) for s in specs]
    out = []
    for r in wanted:
        k = index[r.name]
        datatype = specs[k].datatype
        if not datatype:
            raise BadRequest(f"output {r.name!r} is {specs[k].aval.dtype}, which the Open "
                             "Inference Protocol has no datatype for")
        out.append(OutputTensor(r.name, datatype, np.asarray(host[k]),
                                binary if r.binary is None else r.binary))
    return out


def _names(specs: Sequence[TensorSpec]) -> list[str]:
    return [s.name for s in specs]
