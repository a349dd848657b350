"""``/v1/programs/{program_id}/batching``: opt a program in to dynamic batching.

The configuration is the caller's (per API key), for one of its programs;
``service.batching`` does the batching. See docs/batching.md.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from jitserve.wire import ErrorCode

from ...calls.batching import MAX_BATCH_SIZE, MAX_DELAY_MS, BatchingConfig, batch_dimension
from ..deps import Owner, ServicesDep, get_owner
from ..openapi import errors

__all__ = ["router"]

router = APIRouter(prefix="/v1/programs", tags=["programs"], dependencies=[Depends(get_owner)],
                   responses=errors(ErrorCode.UNAUTHORIZED, ErrorCode.NOT_FOUND))


class BatchingRequest(BaseModel):
    """How to batch a program's concurrent calls (Triton's and Ray Serve's two knobs)."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(ge=1, le=MAX_BATCH_SIZE, strict=True, description=(
        "the most rows (summed leading dimensions of the calls) one run takes"))
    max_delay_ms: float = Field(2.0, ge=0, le=MAX_DELAY_MS, allow_inf_nan=False, description=(
        "the longest the first call of a batch waits for others, in milliseconds"))


class BatchingInfo(BaseModel):
    """A program's batching, as its caller configured it (``enabled: false`` when off)."""

    program_id: str
    enabled: bool
    max_batch_size: int | None = None
    max_delay_ms: float | None = None
    batch_dimension: str | None = Field(None, description=(
        "the symbolic leading dimension of the program's inputs and outputs"))


def _info(program_id: str, config: BatchingConfig | None, dim: str | None) -> BatchingInfo:
    if config is None:
        return BatchingInfo(program_id=program_id, enabled=False)
    return BatchingInfo(program_id=program_id, enabled=True, batch_dimension=dim,
                        **config.to_json())


@router.put("/{program_id}/batching", response_model=BatchingInfo,
            responses=errors(ErrorCode.BAD_REQUEST, ErrorCode.NOT_BATCHABLE,
                             ErrorCode.UNAVAILABLE))
async def set_batching(program_id: str, body: BatchingRequest, services: ServicesDep,
                       owner: Owner) -> BatchingInfo:
    """Batch the caller's concurrent calls of this program (docs/batching.md).

    Refused with ``422 not_batchable`` unless every input and output of the program
    leads with one symbolic dimension (``jax.export`` with ``symbolic_shape("b, ...")``).
    """
    program = await services.programs.get(program_id, owner)
    config = BatchingConfig(body.max_batch_size, float(body.max_delay_ms))
    await services.calls.batcher.store(owner, program, config)
    return _info(program_id, config, batch_dimension(program))


@router.get("/{program_id}/batching", response_model=BatchingInfo)
async def get_batching(program_id: str, services: ServicesDep, owner: Owner) -> BatchingInfo:
    """The caller's batching of this program."""
    program = await services.programs.get(program_id, owner)
    batcher = services.calls.batcher
    await batcher.refresh(owner, program_id, force=True)
    config = batcher.config(owner, program_id)
    return _info(program_id, config, batch_dimension(program) if config else None)


@router.delete("/{program_id}/batching", response_model=BatchingInfo)
async def delete_batching(program_id: str, services: ServicesDep, owner: Owner) -> BatchingInfo:
    """Stop batching the caller's calls of this program (queued ones still run)."""
    program = await services.programs.get(program_id, owner)
    await services.calls.batcher.store(owner, program, None)
    return _info(program_id, None, None)
