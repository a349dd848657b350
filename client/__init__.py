"""jitserve's Python client: send jax programs to a server, get array futures back.

Example::

    import numpy as np
    from jitserve.client import Client

    with Client("http://127.0.0.1:8000") as c:
        f = c.jit(lambda x, n: x * n, static_argnums=(1,))
        y = f(np.ones(3, np.float32), 2)   # a RemoteArray, returned at once
        z = f(y, 3)                        # y never leaves the server
        print(z.result(timeout=10))        # [6. 6. 6.]

Importing this package needs only numpy, httpx, msgpack, ml_dtypes and tqdm; jax
is imported on the first ``jit`` (or ``device_put``) call.
"""

from __future__ import annotations

from jitserve import wire
from jitserve.client import errors
from jitserve.client._aot import MemoryAnalysis, RemoteCompiled, RemoteLowered, RemoteTraced
from jitserve.client._async import AsyncClient
from jitserve.client._jit import AsyncRemoteFunction, RemoteFunction
from jitserve.client._models import NOT_GIVEN, Aval, CompileInfo, FutureInfo, NotGiven, ProgramInfo, Timeout
from jitserve.client._remote import AsyncRemoteArray, RemoteArray
from jitserve.client._sync import Client
from jitserve.client.errors import (
    APIError,
    BadRequest,
    CompileError,
    ConnectError,
    FutureCancelled,
    FutureError,
    FutureExpired,
    FutureFailed,
    FuturePending,
    HostCallbackError,
    JitserveError,
    JitserveTimeout,
    NotFound,
    PayloadTooLarge,
    ProgramError,
    ProtocolError,
    RequestTimeout,
    ServerError,
    TooManyRequests,
    TransportError,
    Unauthorized,
)
from jitserve.wire import WireError

__version__ = "0.1.0"

__all__ = [
    "APIError",
    "AsyncClient",
    "AsyncRemoteArray",
    "AsyncRemoteFunction",
    "Aval",
    "BadRequest",
    "Client",
    "CompileError",
    "CompileInfo",
    "ConnectError",
    "FutureCancelled",
    "FutureError",
    "FutureExpired",
    "FutureFailed",
    "FutureInfo",
    "FuturePending",
    "HostCallbackError",
    "JitserveError",
    "JitserveTimeout",
    "MemoryAnalysis",
    "NOT_GIVEN",
    "NotFound",
    "NotGiven",
    "PayloadTooLarge",
    "ProgramError",
    "ProgramInfo",
    "ProtocolError",
    "RemoteArray",
    "RemoteCompiled",
    "RemoteFunction",
    "RemoteLowered",
    "RemoteTraced",
    "RequestTimeout",
    "ServerError",
    "Timeout",
    "TooManyRequests",
    "TransportError",
    "Unauthorized",
    "WireError",
    "errors",
    "wire",
]
