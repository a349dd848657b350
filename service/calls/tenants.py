"""Who owns what: each tenant's programs and executables, over shared storage.

A tenant is an API key (its owner digest, ``service.auth``). Storage stays shared
and content-addressed underneath; this index says which ids each tenant may see,
list, run, compile and delete. A program is a tenant's once it uploaded those
bytes; an executable is a tenant's once it was looked up for one of the tenant's
programs (compiled, or found in a cache). Anything else is "not found" to it,
with the same message as an unknown id, so ids cannot be probed.

Without API keys there is one tenant (owner ``None``) and nothing is scoped:
every stored program and executable is visible, as before tenants existed; only
``DELETE /v1/programs/{id}`` is remembered, so a deleted program reads as unknown
until it is uploaded again.

The index lives in this process's memory: after a restart a tenant owns nothing
until it uploads again (the upload then answers 201, and the bytes are still
stored, so nothing is decoded twice). See docs/service.md.

    tenants = Tenants(quotas, scoped=True)
    created = tenants.claim_program(owner, program_id, size, stored_before=True)  # a 201?
    tenants.sees_program(other_owner, program_id)               # False: not the other's
"""

from __future__ import annotations

import dataclasses
import hashlib

from .quotas import CompileBudget, QuotaExceeded, Quotas

__all__ = ["Tenants", "scope_of"]


def scope_of(owner: str | None, *, scoped: bool, shared: bool) -> str:
    """The part that keeps ``owner``'s executables its own (``compiler.keys.key_parts``):
    ``""`` (the one shared cache) without keys, or when keys share executables."""
    if not scoped or shared or not owner:
        return ""
    return hashlib.sha256(b"jitserve tenant scope\0" + owner.encode()).hexdigest()[:32]


@dataclasses.dataclass
class _Holdings:
    """One tenant's share of the index."""

    programs: dict[str, int] = dataclasses.field(default_factory=dict)  # id -> bytes
    program_bytes: int = 0
    executables: dict[str, str] = dataclasses.field(default_factory=dict)  # id -> program id


class Tenants:
    """The ownership index of this process, and the quotas on what it indexes.

    Args:
      quotas: every tenant's quotas (enforced only when ``scoped``); none if omitted.
      scoped: whether tenants are kept apart (API keys on). ``False``: one tenant
        that sees everything stored, and no quotas.
      share_executables: whether tenants share compiled executables
        (``JITSERVE_TENANT_SHARE_EXECUTABLES``); by default each has keys of its own
        (``scope``), so that a cache hit says nothing about another tenant.
    """

    def __init__(self, quotas: Quotas | None = None, *, scoped: bool = False,
                 share_executables: bool = False) -> None:
        self.quotas = quotas = quotas or Quotas.unlimited()
        self.scoped = scoped
        self.share_executables = share_executables
        self._scopes: dict[str | None, str] = {}  # every call asks: hashed once per key
        self.compiles = CompileBudget(quotas.compiles_per_minute)
        self._holdings: dict[str, _Holdings] = {}
        self._deleted: set[str] = set()  # unscoped: programs deleted and not uploaded since

    def scope(self, owner: str | None) -> str:
        """The key part of ``owner``'s executables (``scope_of``)."""
        scope = self._scopes.get(owner)
        if scope is None:
            scope = self._scopes[owner] = scope_of(owner, scoped=self.scoped,
                                                   shared=self.share_executables)
        return scope

    def sees_everything(self, owner: str | None) -> bool:
        """Whether nothing is scoped for ``owner`` (no API keys): it sees all that is stored."""
        return not self._scoped(owner)

    # -- programs ----------------------------------------------------------------------

    def sees_program(self, owner: str | None, program_id: str) -> bool:
        """Whether ``owner`` may use ``program_id`` (if it is stored)."""
        if not self._scoped(owner):
            return program_id not in self._deleted
        return program_id in self._of(owner).programs

    def check_program_room(self, owner: str | None, program_id: str, size: int) -> None:
        """``QuotaExceeded`` if taking ``program_id`` of ``size`` bytes would pass the quota."""
        if not self._scoped(owner):
            return
        mine = self._of(owner)
        if program_id in mine.programs:
            return
        limit = self.quotas.program_bytes
        if mine.program_bytes + size > limit:
            raise QuotaExceeded(
                "program_bytes",
                f"this API key holds {mine.program_bytes:,} bytes of programs and this one is "
                f"{size:,}, over its quota of {limit:,} (JITSERVE_TENANT_MAX_PROGRAM_BYTES); "
                "DELETE /v1/programs/{id} the ones you no longer need")

    def claim_program(self, owner: str | None, program_id: str, size: int,
                      stored_before: bool) -> bool:
        """Make ``program_id`` the owner's; whether it is new to the owner (a 201).

        ``stored_before``: whether the storage had the bytes already, which is the
        answer when nothing is scoped. ``QuotaExceeded`` past the program-bytes quota.
        """
        if not self._scoped(owner):
            if program_id in self._deleted:
                self._deleted.discard(program_id)
                return True
            return not stored_before
        mine = self._of(owner)
        if program_id in mine.programs:
            return False
        self.check_program_room(owner, program_id, size)
        mine.programs[program_id] = size
        mine.program_bytes += size
        return True

    def drop_program(self, owner: str | None, program_id: str) -> bool:
        """Take ``program_id`` (and its executables) from the owner; whether it had it."""
        if not self._scoped(owner):
            if program_id in self._deleted:
                return False
            self._deleted.add(program_id)
            return True
        mine = self._of(owner)
        size = mine.programs.pop(program_id, None)
        if size is None:
            return False
        mine.program_bytes -= size
        for executable_id in [e for e, p in mine.executables.items() if p == program_id]:
            del mine.executables[executable_id]
        return True

    # -- executables ---------------------------------------------------------------------

    def sees_executable(self, owner: str | None, executable_id: str) -> bool:
        """Whether ``owner`` may read the record of ``executable_id`` (if it is cached)."""
        return not self._scoped(owner) or executable_id in self._of(owner).executables

    def executables_of(self, owner: str | None) -> list[str]:
        """The owner's executable ids, sorted (the order of its listing)."""
        return sorted(self._of(owner).executables) if self._scoped(owner) else []

    def check_executable_room(self, owner: str | None, executable_id: str) -> None:
        """``QuotaExceeded`` if one more distinct executable would pass the owner's quota."""
        if not self._scoped(owner):
            return
        mine = self._of(owner).executables
        if executable_id not in mine and len(mine) >= self.quotas.executables:
            raise QuotaExceeded(
                "executables",
                f"this API key holds {len(mine)} executables, its quota "
                "(JITSERVE_TENANT_MAX_EXECUTABLES); call ones it has, or DELETE programs "
                "it no longer needs (their executables go with them)")

    def claim_executable(self, owner: str | None, executable_id: str, program_id: str) -> None:
        """Make ``executable_id`` (looked up for ``program_id``) the owner's."""
        if self._scoped(owner):
            self.check_executable_room(owner, executable_id)
            self._of(owner).executables[executable_id] = program_id

    # -- internals -------------------------------------------------------------------------

    def _scoped(self, owner: str | None) -> bool:
        return self.scoped and owner is not None

    def _of(self, owner: str | None) -> _Holdings:
        assert owner is not None
        return self._holdings.setdefault(owner, _Holdings())
