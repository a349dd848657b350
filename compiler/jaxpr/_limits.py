"""The bounds on one jaxpr document, part of the compiler's ``Limits``."""

from __future__ import annotations

import dataclasses

__all__ = ["JaxprLimits"]


@dataclasses.dataclass(frozen=True)
class JaxprLimits:
    """Bounds on one document, so that a small upload cannot become a huge program.

    Exceeding any of them raises ``LimitExceeded`` naming the equation. The
    server builds them from its settings (``JITSERVE_JAXPR_MAX_*``) as the
    ``jaxpr`` field of ``compiler.records.Limits``; ``max_document_bytes``
    follows the program byte limit there (``JITSERVE_MAX_PROGRAM_BYTES``).

    Attributes:
      max_document_bytes: size of the encoded document.
      max_eqns: equations, counted over all nested jaxprs.
      max_depth: nesting of jaxprs inside params (a while inside a cond inside a scan...).
      max_vars: bound variables, counted over all nested jaxprs.
      max_literal_elements: elements of one constant array (consts and array params).
      max_array_elements: elements of any array the program names or computes,
        so that a broadcast or iota cannot ask for an absurd buffer.
      max_rank: axes of any array.
      max_unroll: the ``unroll`` of a scan, which copies the body at compile time.
    """

    max_document_bytes: int = 64 << 20
    max_eqns: int = 100_000
    max_depth: int = 32
    max_vars: int = 1_000_000
    max_literal_elements: int = 1 << 20
    max_array_elements: int = 1 << 32
    max_rank: int = 32
    max_unroll: int = 1024
