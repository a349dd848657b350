"""The compiler's records that the API process holds, and the rules it checks calls by.

``Program`` (an uploaded program's signature, around its bytes), ``MemoryStats`` (an
executable's device bytes), ``Limits`` (what an untrusted program may be), and the
signature rules ``check_inputs`` and ``check_donate``. None of it imports jax: the API
process, which never decodes, lowers, compiles or runs a program, never loads it
(``tests/test_layout.py``). The decoders that make these records live in ``programs``,
``safety`` and ``compile``, which the runtimes and compile workers import.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from jitserve.compiler.errors import LimitExceeded, SignatureMismatch
from jitserve.compiler.jaxpr import JaxprLimits
from jitserve.wire import Aval, ProgramFormat

__all__ = ["Limits", "MemoryStats", "Program", "check_donate", "check_inputs"]

logger = logging.getLogger("jitserve.compiler")


@dataclasses.dataclass(frozen=True)
class Program:
    """An uploaded program, decoded and validated.

    Attributes:
      program_id: sha256 hex of ``payload``; the content address.
      format: which decoder read it.
      payload: the bytes as uploaded.
      in_avals: flat input leaves; dynamic dims are ``None`` (raw ``?``) or ``str``
        (jax.export symbolic dims).
      out_avals: flat output leaves, when known before compiling.
      in_tree, out_tree: the pytree structures (``compiler.trees``), when known.
      platforms: platforms the program was made for; empty when it does not say.
      name: the exported function's name, when the artifact says (jax_export); for
        logs, untrusted.
      nr_devices: the devices one run takes: a sharded program's (a ``jax_export``'s
        ``nr_devices``, a module's ``mhlo.num_partitions`` x ``mhlo.num_replicas``).
      sharding: a sharded ``jax_export``'s mesh (axis name to size) and each input's
        and output's sharding as exported (``PartitionSpec`` text, else HLO
        sharding text; ``None`` unspecified); ``None`` for other programs.
    """

    program_id: str
    format: ProgramFormat
    payload: bytes = dataclasses.field(repr=False)
    in_avals: tuple[Aval, ...]
    out_avals: tuple[Aval, ...] | None
    in_tree: Any = None
    out_tree: Any = None
    platforms: tuple[str, ...] = ()
    name: str = ""
    nr_devices: int = 1
    sharding: dict[str, Any] | None = None

    @property
    def is_static(self) -> bool:
        return all(a.is_static for a in self.in_avals)

    @classmethod
    def from_json(cls, doc: dict[str, Any], payload: bytes) -> Program:
        """The program ``to_json`` (plus ``name``) described, around its ``payload``."""
        out = doc.get("out_avals")
        return cls(program_id=doc["program_id"], format=ProgramFormat(doc["format"]),
                   payload=payload, in_avals=tuple(Aval.from_json(a) for a in doc["in_avals"]),
                   out_avals=None if out is None else tuple(Aval.from_json(a) for a in out),
                   in_tree=doc.get("in_tree"), out_tree=doc.get("out_tree"),
                   platforms=tuple(doc.get("platforms") or ()), name=str(doc.get("name") or ""),
                   nr_devices=int(doc.get("nr_devices", 1)), sharding=doc.get("sharding"))

    def to_json(self) -> dict[str, Any]:
        return {
            "program_id": self.program_id,
            "format": self.format.value,
            "in_avals": [a.to_json() for a in self.in_avals],
            "out_avals": None if self.out_avals is None else [a.to_json() for a in self.out_avals],
            "in_tree": self.in_tree,
            "out_tree": self.out_tree,
            "platforms": list(self.platforms),
            "nr_devices": self.nr_devices,
            "sharding": self.sharding,
        }


@dataclasses.dataclass(frozen=True)
class Limits:
    """Bounds on one untrusted program.

    Attributes:
      max_program_bytes: size of the uploaded bytes, checked before parsing.
      max_ops: operations in the module, nested regions included.
      max_nesting: depth of nested regions (while bodies, conds, reducers).
      max_tensor_bytes: bytes of any one tensor type in the module, and of any input.
      max_inputs: number of flat inputs to @main.
      jaxpr: bounds on a ``jaxpr`` document (equations, nesting, arrays), checked
        as it is decoded; its ``max_document_bytes`` should match ``max_program_bytes``,
        which is checked first anyway.
    """

    max_program_bytes: int = 64 << 20
    max_ops: int = 200_000
    max_nesting: int = 64
    max_tensor_bytes: int = 16 << 30
    max_inputs: int = 4096
    jaxpr: JaxprLimits = JaxprLimits()

    def check_program_bytes(self, data: bytes) -> None:
        """Refuse ``data`` over ``max_program_bytes`` (``LimitExceeded``), naming the setting
        and the usual cause, before anything parses it."""
        if len(data) > self.max_program_bytes:
            raise LimitExceeded(
                f"program is {len(data):,} bytes, over the limit of {self.max_program_bytes:,} "
                "(JITSERVE_MAX_PROGRAM_BYTES; the arrays a function closes over are constants "
                "of its program: pass big ones as arguments)")


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """XLA's buffer assignment of one executable, in device bytes: known before it runs.

    Read from the loaded executable (``get_compiled_memory_stats``), which works for
    deserialized executables too, and kept in the executable's meta as ``memory``.

    Attributes:
      argument_bytes: the inputs.
      output_bytes: the outputs.
      alias_bytes: outputs that reuse an input's buffer (0 unless inputs are donated).
      temp_bytes: intermediates, allocated for the run and freed after it: a while
        loop's carry, say, which no declared output shows.
      generated_code_bytes: the executable's own code (0 where the backend keeps none
        on the device, as on CPU).
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int = 0

    @property
    def run_bytes(self) -> int:
        """Device bytes one run allocates beyond its inputs: intermediates and outputs."""
        return self.temp_bytes + self.output_bytes - self.alias_bytes

    def over(self, limit: int) -> str | None:
        """Why one run cannot fit in ``limit`` device bytes; ``None`` if it can."""
        if self.run_bytes <= limit:
            return None
        alias = f" - {self.alias_bytes:,} aliased to inputs" if self.alias_bytes else ""
        return (f"one run of this program needs {self.run_bytes:,} bytes of device memory "
                f"({self.temp_bytes:,} for intermediates + {self.output_bytes:,} for outputs"
                f"{alias}), over the limit of {limit:,} bytes (JITSERVE_MAX_EXECUTION_BYTES)")

    def to_json(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: Any) -> MemoryStats | None:
        """The stats of a meta's ``memory``; ``None`` if absent or malformed (an older entry)."""
        try:
            return cls(**{f.name: int(doc[f.name]) for f in dataclasses.fields(cls)
                          if f.name in doc or f.default is dataclasses.MISSING})
        except (TypeError, KeyError, ValueError):
            return None

    @classmethod
    def of(cls, loaded: Any) -> MemoryStats | None:
        """The stats of a loaded executable; ``None`` where the backend cannot tell."""
        try:
            s = loaded.get_compiled_memory_stats()
            return cls(int(s.argument_size_in_bytes), int(s.output_size_in_bytes),
                       int(s.alias_size_in_bytes), int(s.temp_size_in_bytes),
                       int(s.generated_code_size_in_bytes))
        except Exception as e:  # a backend without memory analysis: nothing to bound
            logger.debug("no memory analysis for an executable: %s", e)
            return None


def check_donate(donate: Sequence[int], n: int) -> tuple[int, ...]:
    """``donate`` as sorted unique input indices; ``SignatureMismatch`` past ``n`` inputs.

    The one home of the rule: the compiler keys on it, and the service checks a call's
    ``donate`` with it before anything is queued."""
    out = tuple(sorted(set(donate)))
    if out and not 0 <= out[0] <= out[-1] < n:
        raise SignatureMismatch(f"donate names inputs {list(out)}; the program takes {n}")
    return out


def check_inputs(expected: Sequence[Aval], avals: Sequence[Aval]) -> None:
    """Raise ``SignatureMismatch`` naming the first of ``avals`` that does not fit ``expected``:
    an executable's inputs, or a program's, whose dynamic dimensions fit any size.

    The one home of the rule, for the compiler and the service alike."""
    if len(avals) != len(expected):
        raise SignatureMismatch(f"program takes {len(expected)} inputs, got {len(avals)}")
    for i, (want, got) in enumerate(zip(expected, avals)):
        if want is not got and not want.matches(got):
            raise SignatureMismatch(f"input {i}: expected {want}, got {got}")
