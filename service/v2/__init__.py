"""The Open Inference Protocol (KServe v2, Triton's protocol) over jitserve's programs.

A program uploaded with ``POST /v1/programs?name=NAME`` is version 1, 2, ... of
the model ``NAME`` (``service.calls.models``); ``rest`` serves ``/v2`` and ``grpc_server`` the
``GRPCInferenceService`` on ``JITSERVE_GRPC_PORT``, both through ``infer``, which
runs inferences as ``/v1`` executes that wait (docs/v2.md). ``grpc_server`` needs
grpcio and is imported only when the gRPC port is set (``start_grpc``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .infer import Inference, Model
from .rest import router

if TYPE_CHECKING:
    import grpc

    from ..api.deps import Services

__all__ = ["Inference", "Model", "router", "start_grpc"]


async def start_grpc(services: Services, version: str) -> grpc.aio.Server | None:
    """The started gRPC server for a running app's ``services`` when ``grpc_port`` is set,
    else ``None``; ``version`` is the server's.

    Called by the app's lifespan once its services are up; ``await server.stop(grace)``
    ends it.
    """
    if services.settings.grpc_port is None:
        return None
    try:
        from . import grpc_server
    except ImportError as e:
        raise RuntimeError(f"JITSERVE_GRPC_PORT is set, but gRPC cannot load ({e}); install "
                           "the server extra: pip install 'jitserve[server]'") from e
    return await grpc_server.start(services, version)
