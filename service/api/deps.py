"""What route handlers receive: the app's ``Services``, and values read off the request.

The lifespan in ``service.app`` builds the collaborators once, in dependency
order, and hands them to the app as one frozen ``Services``; a handler takes it
through ``ServicesDep``, never through module globals or ``app.state``::

    @router.get("/v1/futures/{future_id}")
    async def get_future(future_id: str, services: ServicesDep, owner: Owner): ...

The other aliases are values of the request itself: the caller (``Owner``), its
body under the limits (``Body``, ``ProgramBody``), ``?wait`` (``WaitSeconds``) and
whether it asked for JSON (``AsJSON``).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from jitserve.compiler import Catalog

from ..calls.calls import Calls
from ..calls.drain import Drain
from ..calls.executor import Executor
from ..calls.futures import FutureStore
from ..calls.models import ModelRegistry
from ..calls.programs import ProgramStore
from ..calls.tenants import Tenants
from ..calls.warming import Warming
from ..cluster import OWNER_HEADER, PEER_HEADER, TO_HEADER, Cluster, scope_path
from ..console import Console
from ..errors import ServiceError, Unauthorized, Unavailable
from ..metrics import Metrics
from ..runtimes import RuntimePool
from ..settings import Settings
from .auth import authenticate
from .bodies import BodyReader, wants_json

__all__ = [
    "AsJSON",
    "Body",
    "Owner",
    "ProgramBody",
    "Services",
    "ServicesDep",
    "WaitSeconds",
    "bearer_token",
    "get_owner",
    "get_services",
    "refused_owner",
    "request_cluster",
    "request_owner",
    "services_of",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Services:
    """Everything a request may use, built once per server by its lifespan.

    Attributes:
      settings: the server's configuration.
      metrics: what ``/metrics`` shows.
      runtimes: the supervised processes that decode, compile and run programs.
      tenants: who owns which program and executable, and their quotas.
      futures: this process's futures.
      executor: sends runs to the runtimes and settles their futures.
      programs: decoded programs, per tenant.
      calls: the domain's entry: compile, execute, put.
      models: model names of programs (``/v2``, and ``?name=`` on upload).
      catalog: what the executable caches hold, for listings.
      drain: refuses new work once SIGTERM came.
      cluster: the other replicas (``None`` without Redis).
      warming: the ``--warm`` manifest's compiles (``None`` without one).
      console: the last minutes of this process, for ``/console``.
    """

    settings: Settings
    metrics: Metrics
    runtimes: RuntimePool
    tenants: Tenants
    futures: FutureStore
    executor: Executor
    programs: ProgramStore
    calls: Calls
    models: ModelRegistry
    catalog: Catalog
    drain: Drain
    cluster: Cluster | None
    warming: Warming | None
    console: Console


def services_of(request: Request) -> Services:
    """The running app's ``Services`` (``service.app``: its lifespan made them)."""
    services: Services = request.app.services
    return services


async def get_services(request: Request) -> Services:
    """``services_of``, as a dependency (``async``: FastAPI runs a plain function's in a
    thread, a hop per request)."""
    return services_of(request)


ServicesDep = Annotated[Services, Depends(get_services)]


# The OpenAPI's bearer scheme (Swagger's Authorize button); ``auth.authenticate``
# words the 401, so a missing or non-bearer header reaches it as ``None``.
_bearer = HTTPBearer(auto_error=False, description="an API key (JITSERVE_API_KEYS), when set")
Bearer = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


async def get_owner(request: Request, credentials: Bearer) -> str | None:
    """The caller's owner id (``request_owner``); ``credentials`` puts the bearer
    scheme in the OpenAPI."""
    return request_owner(request)


def request_owner(request: Request) -> str | None:
    """The caller's owner id (API-key digest), or ``None`` when auth is off.

    A request another replica forwarded (``service.cluster``) is signed by it, and
    names the owner it authenticated; it is served here, never forwarded again.
    """
    services = services_of(request)
    signature = request.headers.get(PEER_HEADER)
    if signature is None:
        return authenticate(bearer_token(request), services.settings)
    cluster = services.cluster
    if cluster is None:
        raise Unauthorized("a peer request, but this server is no replica (REDIS_URL unset)")
    owner = request.headers.get(OWNER_HEADER) or None
    cluster.signing.check(signature, request.scope["method"], scope_path(request.scope), owner)
    meant = request.headers.get(TO_HEADER)
    if meant is not None and meant != cluster.replica_id:
        # A replica lost, and this process started at its address before the sender
        # knew: what it asks of that one's futures is none of this one's to serve.
        raise Unavailable(f"this is replica {cluster.replica_id}, not replica {meant}, "
                          "which the request was forwarded to")
    request.state.forwarded = True
    return owner


def refused_owner(request: Request) -> str | None:
    """Whose a refused request was, for the console's errors by key: the owner of its
    valid key, else ``None`` (its key is no key: nobody's)."""
    try:
        return request_owner(request)
    except ServiceError:
        return None


def bearer_token(request: Request) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (as ``HTTPBearer`` reads it)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token if token and scheme.lower() == "bearer" else None


def request_cluster(request: Request, services: Services) -> Cluster | None:
    """The replicas, for a request this replica may forward; ``None`` without Redis,
    and for a request that was forwarded here (served here, whatever it names).
    Read after ``request_owner``, which marks a forwarded request."""
    # request_owner's mark, read from the dict behind ``request.state``: an absent
    # attribute of a ``State`` costs a raised and caught ``AttributeError``
    if request.scope.get("state", {}).get("forwarded", False):
        return None
    return services.cluster


async def get_body(request: Request, services: ServicesDep) -> BodyReader:
    """A reader for the request body, bounded by ``max_body_bytes``.

    A reader rather than the bytes, so a handler can drop a big body as soon
    as it is decoded (FastAPI would hold a dependency's value until the end).
    """
    settings = services.settings
    return BodyReader(request, settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                      metrics=services.metrics)


async def get_program_body(request: Request, services: ServicesDep) -> BodyReader:
    """A body reader for program uploads, bounded by ``max_program_bytes`` too."""
    settings = services.settings
    if settings.max_program_bytes < settings.max_body_bytes:
        return BodyReader(request, settings.max_program_bytes, "JITSERVE_MAX_PROGRAM_BYTES",
                          timeout_s=settings.body_timeout_s, metrics=services.metrics)
    return await get_body(request, services)


async def get_as_json(request: Request) -> bool:
    return wants_json(request)


async def get_wait_s(
    services: ServicesDep,
    wait: Annotated[int | None, Query(ge=0, description="milliseconds to wait for the result")]
    = None,
) -> float:
    """The ``?wait=<ms>`` of a request in seconds, capped at ``max_wait_ms``."""
    return min(wait or 0, services.settings.max_wait_ms) / 1000


Owner = Annotated[str | None, Depends(get_owner)]
Body = Annotated[BodyReader, Depends(get_body)]
ProgramBody = Annotated[BodyReader, Depends(get_program_body)]
AsJSON = Annotated[bool, Depends(get_as_json)]
WaitSeconds = Annotated[float, Depends(get_wait_s)]
