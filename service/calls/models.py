"""Model names: a named program, versioned (what the Open Inference Protocol calls a model).

``POST /v1/programs?name=NAME`` names the uploaded program; the model ``NAME``'s
versions are the programs uploaded under that name, numbered 1, 2, 3... in upload
order. Uploading bytes a name already holds gives back their version, so a client
that uploads on every start does not grow versions. Without a version, a model
means its latest one.

Names are per tenant (API key) when keys are on, as programs are: two keys may
each have a model ``resnet`` and see only their own. A version whose program the
tenant deleted (``DELETE /v1/programs/{id}``) is hidden until the bytes are
uploaded again, when it comes back with its number.

The registry is metadata and lives in the API process: after a restart names are
empty until programs are uploaded again, and with several replicas behind one
Redis each replica has its own names (as the tenants' ownership index does).

    models = ModelRegistry(tenants)
    models.add(owner, "resnet", program_id)      # 1, then 2 for other bytes
    models.resolve(owner, "resnet", None)        # (2, that program's id)
"""

from __future__ import annotations

import re

from ..errors import BadRequest, NotFound
from .tenants import Tenants

__all__ = ["ModelRegistry", "NAME_PATTERN"]

#: What a model name may be: it appears in URL paths, metrics and logs as it is.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
_NAME = re.compile(NAME_PATTERN)
_VERSION = re.compile(r"[0-9]{1,9}")


class ModelRegistry:
    """Model names and their versions, per tenant.

    Args:
      tenants: who sees which program (a deleted program's version is hidden).
    """

    def __init__(self, tenants: Tenants | None = None) -> None:
        self._tenants = tenants or Tenants()
        # (owner, name) -> program ids; version k is entry k - 1.
        self._versions: dict[tuple[str | None, str], list[str]] = {}

    def add(self, owner: str | None, name: str, program_id: str) -> int:
        """Name ``program_id`` ``name`` for ``owner``; its version (an existing one for
        bytes the name already holds)."""
        if not _NAME.match(name):
            raise BadRequest(f"model name {name!r:.140} must match {NAME_PATTERN}")
        versions = self._versions.setdefault((owner, name), [])
        if program_id in versions:
            return versions.index(program_id) + 1
        versions.append(program_id)
        return len(versions)

    def versions(self, owner: str | None, name: str) -> list[tuple[int, str]]:
        """``owner``'s visible versions of ``name``, oldest first: ``(version, program_id)``."""
        ids = self._versions.get((owner, name), [])
        return [(k, pid) for k, pid in enumerate(ids, 1)
                if self._tenants.sees_program(owner, pid)]

    def resolve(self, owner: str | None, name: str, version: str | None) -> tuple[int, str]:
        """The version ``version`` of ``name`` (``None`` or ``""``: the latest) and its program id.

        ``NotFound`` naming the model, or the versions it has.
        """
        visible = self.versions(owner, name)
        if not visible:
            raise NotFound(f"unknown model {name!r:.140}; name a program with "
                           f"POST /v1/programs?name={name:.140}")
        if not version:
            return visible[-1]
        if not _VERSION.fullmatch(version):
            raise BadRequest(f"model version {version!r:.40} must be a number such as 1; "
                             f"model {name!r} has versions {[k for k, _ in visible]}")
        for k, program_id in visible:
            if k == int(version):
                return k, program_id
        raise NotFound(f"model {name!r} has no version {version}; its versions are "
                       f"{[k for k, _ in visible]}")

