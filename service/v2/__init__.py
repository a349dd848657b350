"""The Open Inference Protocol (KServe v2, Triton's protocol) over jitserve's programs.

A program uploaded with ``POST /v1/programs?name=NAME`` is version 1, 2, ... of
the model ``NAME`` (``models``); ``rest`` serves ``/v2`` and ``grpc_server`` the
``GRPCInferenceService`` on ``JITSERVE_GRPC_PORT``, both through ``infer``, which
runs inferences as ``/v1`` executes that wait (docs/v2.md). ``grpc_server`` needs
grpcio and is imported only when the gRPC port is set (``start_grpc``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .infer import Inference, Model
from .models import NAME_PATTERN, ModelRegistry, get_models
from .rest import router

if TYPE_CHECKING:
    import grpc
    from fastapi import FastAPI

    from ..settings import Settings

__all__ = ["Inference", "Model", "ModelRegistry", "NAME_PATTERN", "get_models", "router", "start_grpc"]


async def start_grpc(app: FastAPI, settings: Settings) -> grpc.aio.Server | None:
    """The started gRPC server for ``app`` when ``settings.grpc_port`` is set, else ``None``.

    Called by the app's lifespan once its state is up; ``await server.stop(grace)`` ends it.
    """
    if settings.grpc_port is None:
        return None
    try:
        from . import grpc_server
    except ImportError as e:
        raise RuntimeError(f"JITSERVE_GRPC_PORT is set, but gRPC cannot load ({e}); install "
                           "the server extra: pip install 'jitserve[server]'") from e
    return await grpc_server.start(app, settings)
