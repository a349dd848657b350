"""Dependencies of the route handlers, as ``Annotated`` aliases.

Everything shared lives on ``app.state`` (made by the lifespan in ``app.py``);
handlers receive it through these aliases, never through module globals::

    @router.get("/v1/futures/{future_id}")
    async def get_future(future_id: str, futures: FutureStoreDep, owner: Owner): ...
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from jitserve.compiler import Catalog

from ..calls.calls import Calls
from ..calls.futures import FutureStore
from ..calls.programs import ProgramStore
from ..calls.tenants import Tenants
from ..cluster import OWNER_HEADER, PEER_HEADER, Cluster, scope_path
from ..errors import Unauthorized
from ..metrics import Metrics
from ..runtimes import RuntimePool
from ..settings import Settings
from .auth import authenticate
from .bodies import BodyReader, wants_json

__all__ = [
    "AsJSON",
    "Body",
    "CallsDep",
    "CatalogDep",
    "ClusterDep",
    "FutureStoreDep",
    "MetricsDep",
    "Owner",
    "ProgramBody",
    "ProgramStoreDep",
    "RuntimesDep",
    "SettingsDep",
    "TenantsDep",
    "WaitSeconds",
    "bearer_token",
    "request_cluster",
    "request_owner",
]


def _state(request: Request) -> Any:
    return request.app.state


async def get_settings(request: Request) -> Settings:
    return _state(request).settings


async def get_runtimes(request: Request) -> RuntimePool:
    return _state(request).runtimes


async def get_programs(request: Request) -> ProgramStore:
    return _state(request).programs


async def get_catalog(request: Request) -> Catalog:
    """What the executable caches hold, and whether the shared one is up."""
    return _state(request).catalog


async def get_futures(request: Request) -> FutureStore:
    return _state(request).futures


async def get_calls(request: Request) -> Calls:
    return _state(request).calls


async def get_metrics(request: Request) -> Metrics:
    return _state(request).metrics


async def get_tenants(request: Request) -> Tenants:
    """Who owns which programs and executables (``service.tenants``)."""
    return _state(request).tenants


SettingsDep = Annotated[Settings, Depends(get_settings)]
RuntimesDep = Annotated[RuntimePool, Depends(get_runtimes)]
ProgramStoreDep = Annotated[ProgramStore, Depends(get_programs)]
FutureStoreDep = Annotated[FutureStore, Depends(get_futures)]
CallsDep = Annotated[Calls, Depends(get_calls)]
CatalogDep = Annotated[Catalog, Depends(get_catalog)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
TenantsDep = Annotated[Tenants, Depends(get_tenants)]


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
    state = _state(request)
    signature = request.headers.get(PEER_HEADER)
    if signature is None:
        return authenticate(bearer_token(request), state.settings)
    cluster: Cluster | None = getattr(state, "cluster", None)
    if cluster is None:
        raise Unauthorized("a peer request, but this server is no replica (REDIS_URL unset)")
    owner = request.headers.get(OWNER_HEADER) or None
    cluster.signing.check(signature, request.scope["method"], scope_path(request.scope), owner)
    request.state.forwarded = True
    return owner


def bearer_token(request: Request) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header (as ``HTTPBearer`` reads it)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token if token and scheme.lower() == "bearer" else None


def request_cluster(request: Request) -> Cluster | None:
    """``get_cluster`` for a handler that takes no dependencies (after ``request_owner``)."""
    # request_owner's mark, read from the dict behind ``request.state``: an absent
    # attribute of a ``State`` costs a raised and caught ``AttributeError``
    if request.scope.get("state", {}).get("forwarded", False):
        return None
    return getattr(_state(request), "cluster", None)


async def get_cluster(request: Request) -> Cluster | None:
    """The replicas, for a request this replica may forward; ``None`` without Redis,
    and for a request that was forwarded here (served here, whatever it names)."""
    return request_cluster(request)


async def get_body(request: Request, settings: SettingsDep, metrics: MetricsDep) -> BodyReader:
    """A reader for the request body, bounded by ``max_body_bytes``.

    A reader rather than the bytes, so a handler can drop a big body as soon
    as it is decoded (FastAPI would hold a dependency's value until the end).
    """
    return BodyReader(request, settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                      metrics=metrics)


async def get_program_body(request: Request, settings: SettingsDep,
                           metrics: MetricsDep) -> BodyReader:
    """A body reader for program uploads, bounded by ``max_program_bytes`` too."""
    if settings.max_program_bytes < settings.max_body_bytes:
        return BodyReader(request, settings.max_program_bytes, "JITSERVE_MAX_PROGRAM_BYTES",
                          timeout_s=settings.body_timeout_s, metrics=metrics)
    return await get_body(request, settings, metrics)


async def get_as_json(request: Request) -> bool:
    return wants_json(request)


async def get_wait_s(
    settings: SettingsDep,
    wait: Annotated[int | None, Query(ge=0, description="milliseconds to wait for the result")]
    = None,
) -> float:
    """The ``?wait=<ms>`` of a request in seconds, capped at ``max_wait_ms``."""
    return min(wait or 0, settings.max_wait_ms) / 1000


Owner = Annotated[str | None, Depends(get_owner)]
# Declared after Owner in a handler, so the request's signature is checked first.
ClusterDep = Annotated[Cluster | None, Depends(get_cluster)]
Body = Annotated[BodyReader, Depends(get_body)]
ProgramBody = Annotated[BodyReader, Depends(get_program_body)]
AsJSON = Annotated[bool, Depends(get_as_json)]
WaitSeconds = Annotated[float, Depends(get_wait_s)]
