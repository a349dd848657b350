"""Small value objects: configuration (``Timeout``, ``NOT_GIVEN``) and the API's documents."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any, Final

import httpx

from jitserve import wire
from jitserve.client.errors import ProtocolError
from jitserve.wire import Aval, FutureStatus

__all__ = [
    "CompileInfo",
    "DEFAULT_RUN_AHEAD",
    "DEFAULT_TIMEOUT",
    "FutureInfo",
    "NOT_GIVEN",
    "NotGiven",
    "ProgramInfo",
    "Timeout",
]

#: Calls of jitted functions a client lets be on their way at once, by default
#: (``Client(run_ahead=)``; ``0`` turns running ahead off).
DEFAULT_RUN_AHEAD = 32

_FINAL = frozenset(s.value for s in FutureStatus if s.is_final)


class NotGiven(enum.Enum):
    """The type of ``NOT_GIVEN``: tells "argument not given" from an explicit ``None``."""

    NOT_GIVEN = "NOT_GIVEN"

    def __repr__(self) -> str:
        return "NOT_GIVEN"

    def __bool__(self) -> bool:
        return False


NOT_GIVEN: Final = NotGiven.NOT_GIVEN


@dataclasses.dataclass(frozen=True)
class Timeout:
    """How long the client waits, in seconds (``None``: no limit).

    Attributes:
      request: one HTTP exchange, not counting a long-poll wait the client asked for.
      connect: opening a connection; defaults to ``request``.
      poll: the longest wait asked of the server per long-poll request; a longer
        wait is a loop of these, so no proxy ever sees a very long request.
      hold: how long a call of a jitted function whose outputs are small
        (``wire.INLINE_OUTPUTS_BYTES`` in all) lets the server hold its answer for
        them. Outputs ready by then come back with the answer, so
        ``np.asarray(f(x))`` costs one round trip instead of two; past it the call
        returns as a call with ``0`` does, as soon as the run is queued. A
        signature whose calls keep missing it stops asking for a while
        (``RemoteFunction``).

    >>> Timeout(10.0, connect=2.0)
    Timeout(request=10.0, connect=2.0, poll=30.0, hold=0.002)
    """

    request: float | None = 60.0
    connect: float | None | NotGiven = NOT_GIVEN
    poll: float = 30.0
    hold: float = 0.002

    def __post_init__(self) -> None:
        if self.connect is NOT_GIVEN:
            object.__setattr__(self, "connect", self.request)
        if not self.poll > 0:
            raise ValueError(f"poll must be a positive number of seconds, got {self.poll!r}")
        if not 0 <= self.hold <= self.poll:
            raise ValueError(f"hold must be from 0 to poll ({self.poll!r}) seconds, "
                             f"got {self.hold!r}")

    @classmethod
    def of(cls, value: Timeout | float | None) -> Timeout:
        """``value`` as a ``Timeout``: a number or ``None`` sets ``request`` and ``connect``."""
        return value if isinstance(value, Timeout) else cls(value)

    def to_httpx(self, wait: float = 0.0) -> httpx.Timeout:
        """The httpx timeout of one request that asks the server to wait ``wait`` seconds."""
        read = None if self.request is None else self.request + wait
        connect = None if isinstance(self.connect, NotGiven) else self.connect  # set in __post_init__
        return httpx.Timeout(read, connect=connect)


#: The ``Timeout`` a client gets when none is given.
DEFAULT_TIMEOUT: Final = Timeout()


def _field(doc: Any, key: str, types: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(doc, Mapping):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(doc).__name__}")
    if key not in doc or not isinstance(doc[key], types):
        raise ProtocolError(f"{what}: field {key!r} is missing or not {types}: {doc!r:.300}")
    return doc[key]


def _avals(obj: Any) -> tuple[Aval, ...] | None:
    if obj is None:
        return None
    if not isinstance(obj, Sequence) or isinstance(obj, (str, bytes)):
        raise ProtocolError(f"avals must be a list, got {obj!r:.200}")
    try:
        return tuple(Aval.from_json(a) for a in obj)
    except wire.WireError as e:
        raise ProtocolError(f"bad aval from the server: {e}") from None


@dataclasses.dataclass(frozen=True)
class ProgramInfo:
    """An uploaded program (``POST /v1/programs``, ``GET /v1/programs/{id}``).

    ``in_tree``/``out_tree`` are the JSON pytree forms of docs/api.md ("Trees").
    """

    program_id: str
    format: str
    in_avals: tuple[Aval, ...]
    out_avals: tuple[Aval, ...] | None
    in_tree: Any
    out_tree: Any
    platforms: tuple[str, ...]

    @classmethod
    def from_json(cls, doc: Any) -> ProgramInfo:
        what = "program document"
        return cls(
            program_id=_field(doc, "program_id", str, what),
            format=_field(doc, "format", str, what),
            in_avals=_avals(_field(doc, "in_avals", list, what)) or (),
            out_avals=_avals(doc.get("out_avals")),
            in_tree=doc.get("in_tree"),
            out_tree=doc.get("out_tree"),
            platforms=tuple(doc.get("platforms") or ()),
        )


@dataclasses.dataclass(frozen=True)
class CompileInfo:
    """An executable (``POST /v1/programs/{id}/compile``).

    ``tier`` says where it came from: ``memory``, ``disk``, ``redis`` or ``compiled``.
    """

    executable_id: str
    tier: str
    compile_seconds: float
    in_avals: tuple[Aval, ...]
    out_avals: tuple[Aval, ...]
    out_tree: Any

    @classmethod
    def from_json(cls, doc: Any) -> CompileInfo:
        what = "compile answer"
        return cls(
            executable_id=_field(doc, "executable_id", str, what),
            tier=_field(doc, "tier", str, what),
            compile_seconds=float(_field(doc, "compile_seconds", (int, float), what)),
            in_avals=_avals(_field(doc, "in_avals", list, what)) or (),
            out_avals=_avals(_field(doc, "out_avals", list, what)) or (),
            out_tree=doc.get("out_tree"),
        )


@dataclasses.dataclass(frozen=True)
class FutureInfo:
    """A future's state (``GET /v1/futures/{id}``).

    ``timings`` has ``queued_s``, ``compile_s`` and ``run_s``; ``created`` and
    ``expires_at`` are what the server sent (Unix seconds).
    """

    future_id: str
    status: str
    out_avals: tuple[Aval, ...]
    out_tree: Any = None
    error: dict[str, Any] | None = None
    timings: dict[str, Any] = dataclasses.field(default_factory=dict)
    created: Any = None
    expires_at: Any = None

    @property
    def done(self) -> bool:
        """Whether the future finished: ``done``, ``failed`` or ``cancelled``."""
        return self.status in _FINAL



    @classmethod
    def from_json(cls, doc: Any) -> FutureInfo:
        what = "future document"
        error = doc.get("error") if isinstance(doc, Mapping) else None
        return cls(
            future_id=_field(doc, "future_id", str, what),
            status=_field(doc, "status", str, what),
            out_avals=_avals(doc.get("out_avals")) or (),
            out_tree=doc.get("out_tree"),
            error=dict(error) if isinstance(error, Mapping) else None,
            timings=dict(doc.get("timings") or {}),
            created=doc.get("created"),
            expires_at=doc.get("expires_at"),
        )
