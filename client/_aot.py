"""Ahead of time, as ``jax.jit(f).lower(x).compile()``: ``RemoteLowered`` and ``RemoteCompiled``.

``f.lower(*args)`` traces ``f`` for those arguments' signature, as a call would, and
sends nothing but the question of the server's platforms (asked once per client):
its ``as_text()`` is the program the server will compile, its ``out_info`` the
outputs' shapes and dtypes. ``compile()`` uploads the program if the server lacks
it and has the server compile it (or find it in a cache), for the arguments
``lower`` was given, donations included (donating is part of what XLA compiles):
so a training loop's first step does not wait for a compile, and
``cost_analysis()`` and ``memory_analysis()`` are the server's XLA's, of the
executable its calls run. A ``RemoteCompiled`` is called as the function is, with
arguments of the signature it was compiled for; others raise ``TypeError``, as
jax's ``Compiled`` does.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from jitserve import wire
from jitserve.client._models import CompileInfo
from jitserve.client._trace import Compiled
from jitserve.client.errors import NotFound

if TYPE_CHECKING:
    from jitserve.client._base import Op
    from jitserve.client._jit import _RemoteFunctionBase

__all__ = ["MemoryAnalysis", "RemoteCompiled", "RemoteLowered", "RemoteTraced"]


@dataclasses.dataclass(frozen=True)
class MemoryAnalysis:
    """XLA's account of the device bytes one run needs, with the field names of the
    stats jax's ``Compiled.memory_analysis()`` gives."""

    argument_size_in_bytes: int
    output_size_in_bytes: int
    alias_size_in_bytes: int
    temp_size_in_bytes: int
    generated_code_size_in_bytes: int


class RemoteTraced:
    """A function traced for one signature (``RemoteFunction.trace``), as ``jax.stages.Traced``.

    Attributes:
      jaxpr: the traced ``ClosedJaxpr``, of the flattened arguments (typed keys as
        their data), as the program has it.
      out_info: the outputs' pytree of ``jax.ShapeDtypeStruct`` (typed keys as key dtypes).
      fun_name: the function's name.
    """

    def __init__(self, fn: _RemoteFunctionBase, args: tuple[Any, ...], kwargs: dict[str, Any],
                 jaxpr: Any, out_info: Any) -> None:
        self._fn, self._args, self._kwargs = fn, args, kwargs
        self.jaxpr, self.out_info = jaxpr, out_info
        self.fun_name = fn._name

    def __repr__(self) -> str:
        return f"RemoteTraced({self.fun_name})"

    def lower(self) -> Any:
        """``RemoteFunction.lower`` of the traced arguments: a ``RemoteLowered``.
        ``AsyncClient``'s is awaited."""
        return self._fn.lower(*self._args, **self._kwargs)


class RemoteLowered:
    """A function traced for one signature (``RemoteFunction.lower``), as ``jax.stages.Lowered``."""

    def __init__(self, fn: _RemoteFunctionBase, key: Hashable, compiled: Compiled,
                 donate: tuple[int, ...], format: str) -> None:
        self._fn, self._key, self._compiled = fn, key, compiled
        self._donate, self._format = donate, format

    def __repr__(self) -> str:
        return f"RemoteLowered({self._fn._name}, program {self.program_id[:12]})"

    @property
    def program_id(self) -> str:
        """The program's id on the server (the sha256 of its bytes)."""
        return self._compiled.program_id

    @property
    def in_tree(self) -> Any:
        """The ``PyTreeDef`` of the dynamic arguments, ``((args...), {kwargs})``, as jax's."""
        return cast(tuple[Any, ...], self._key)[2]  # _RemoteFunctionBase._key: statics, then it

    @property
    def out_tree(self) -> Any:
        """The ``PyTreeDef`` of the outputs."""
        return self._compiled.out_tree

    @property
    def out_info(self) -> Any:
        """The outputs' pytree of ``jax.ShapeDtypeStruct`` (typed keys as key dtypes)."""
        compiled = self._compiled
        return out_info_of(compiled.out_tree, compiled.out_avals, compiled.out_keys,
                           compiled.out_shardings)

    def as_text(self) -> str:
        """The program the server compiles, as text: StableHLO (MLIR) for the default
        format, the jaxpr document (JSON) for ``format="jaxpr"``."""
        program = self._compiled.program
        if self._format == "jaxpr":
            return json.dumps(wire.unpackb(program), indent=1, default=_array_text)
        import jax

        return str(jax.export.deserialize(bytearray(program)).mlir_module())

    def compile(self, compiler_options: dict[str, Any] | None = None) -> Any:
        """Have the server compile the program (or find it in a cache), for the
        arguments ``lower`` was given: a ``RemoteCompiled``. ``compiler_options``: as
        ``jax.stages.Lowered.compile``'s, added to (and over) the function's own; its
        calls run with them. ``AsyncClient``'s is awaited."""
        options = {**self._fn._compiler_options, **check_options(compiler_options)}
        return self._fn._client._drive(self._op_compile(options))  # type: ignore[attr-defined]

    def _op_compile(self, options: dict[str, Any]) -> Op[RemoteCompiled]:
        fn, compiled = self._fn, self._compiled
        yield from fn._op_ensure_uploaded(compiled)
        client = fn._client
        try:
            info = yield from client._op_compile(compiled.program_id, None, "", self._donate,
                                                 options)
        except NotFound:  # the server lost the program (a restart, a delete): again, once
            client._forget_programs([compiled.program_id])
            yield from fn._op_ensure_uploaded(compiled, check=False)
            info = yield from client._op_compile(compiled.program_id, None, "", self._donate,
                                                 options)
        record = yield from client._op_executable(info.executable_id)
        return RemoteCompiled(self, info, record, options)


class RemoteCompiled:
    """A function compiled on the server for one signature (``RemoteLowered.compile``), as
    ``jax.stages.Compiled``: call it as the function.

    Attributes:
      executable_id: the server's id of the executable (``GET /v1/executables/{id}``).
      tier: where the server found it: ``compiled``, ``memory``, ``disk`` or ``redis``.
      compile_seconds: how long its compile took.
    """

    def __init__(self, lowered: RemoteLowered, info: CompileInfo,
                 record: dict[str, Any] | None, options: dict[str, Any]) -> None:
        self._lowered, self._options = lowered, options
        self._text: str | None = None
        self.executable_id = info.executable_id
        self.tier = info.tier
        self.compile_seconds = info.compile_seconds
        self._record = record or {}

    def __repr__(self) -> str:
        return (f"RemoteCompiled({self._lowered._fn._name}, executable "
                f"{self.executable_id[:12]}, {self.tier})")

    @property
    def out_info(self) -> Any:
        return self._lowered.out_info

    @property
    def in_tree(self) -> Any:
        return self._lowered.in_tree

    @property
    def out_tree(self) -> Any:
        return self._lowered.out_tree

    def as_text(self) -> Any:
        """XLA's optimized HLO of the executable, as the server compiled it and as
        ``jax.stages.Compiled.as_text()`` prints it (fusions, layouts, the schedule);
        the program before XLA's passes is ``RemoteLowered.as_text()``. Asked of the
        server once. ``AsyncClient``'s is awaited."""
        return self._lowered._fn._client._drive(self._op_text())  # type: ignore[attr-defined]

    def _op_text(self) -> Op[str]:
        if self._text is None:
            self._text = yield from self._lowered._fn._client._op_executable_text(
                self.executable_id)
        return self._text

    def cost_analysis(self) -> dict[str, float] | None:
        """The server's XLA's estimates for one run: ``flops``, ``transcendentals`` and
        ``bytes accessed``, as jax's ``Compiled.cost_analysis()`` names them; ``None``
        where its backend gives none."""
        cost = self._record.get("cost")
        if not isinstance(cost, dict):
            return None
        names = {"flops": "flops", "transcendentals": "transcendentals",
                 "bytes_accessed": "bytes accessed"}  # the server's -> jax's
        return {jax_name: float(cost[name]) for name, jax_name in names.items()
                if isinstance(cost.get(name), (int, float))}

    def memory_analysis(self) -> MemoryAnalysis | None:
        """XLA's device bytes of one run on the server; ``None`` where its backend gives none."""
        memory = self._record.get("memory")
        if not isinstance(memory, dict):
            return None
        return MemoryAnalysis(
            int(memory.get("argument_bytes", 0)), int(memory.get("output_bytes", 0)),
            int(memory.get("alias_bytes", 0)), int(memory.get("temp_bytes", 0)),
            int(memory.get("generated_code_bytes", 0)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The function's call, for arguments of the compiled signature (``TypeError`` else):
        ``AsyncClient``'s is awaited."""
        lowered = self._lowered
        return lowered._fn._call(args, kwargs, lowered._key,  # type: ignore[attr-defined]
                                 self._options)


def out_info_of(out_tree: Any, out_avals: Sequence[Any], out_keys: Sequence[Any],
                shardings: Sequence[Any] = ()) -> Any:
    """The outputs' pytree of ``jax.ShapeDtypeStruct`` of a program's flat outputs
    (wire avals; per output its ``KeyType`` or ``None``; its sharding, where known)."""
    import jax

    leaves = []
    for aval, key, sharding in zip(out_avals, out_keys, shardings or (None,) * len(out_avals)):
        shape = tuple(aval.shape)
        if key is not None:
            leaves.append(jax.ShapeDtypeStruct(shape[:len(shape) - key.data_ndim], key.dtype))
        else:
            leaves.append(jax.ShapeDtypeStruct(shape, wire.dtype_from_name(aval.dtype),
                                               sharding=sharding))
    return jax.tree_util.tree_unflatten(out_tree, leaves)


def check_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``jax.jit``'s ``compiler_options``, as a new dict: XLA option names to bools,
    numbers or strings (``TypeError`` otherwise). The server says which names it allows."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"compiler_options must be a dict of XLA option names to values, "
                        f"got {type(options).__name__}")
    for name, value in options.items():
        if not isinstance(name, str) or not isinstance(value, (bool, int, float, str)):
            raise TypeError(f"compiler_options: {name!r:.100} -> {value!r:.100}: names are "
                            "strings, values bools, numbers or strings")
    return dict(options)


def _array_text(value: Any) -> Any:
    """A constant of a jaxpr document, for JSON: its values when small, else its shape."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(value)} bytes>"
    array = np.asarray(value)
    if array.size <= 16:
        return array.tolist()
    return f"<{array.dtype} array of shape {list(array.shape)}>"
