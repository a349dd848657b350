"""Confine where a runtime process may create, change or remove files: Landlock.

Landlock (Linux 5.13+) lets an unprivileged process give up rights to the file
system for itself and every process it starts later. A runtime calls
``confine`` once, before jax starts (while it has one thread: a ruleset binds
the calling thread, and the threads and processes it creates from then on).
After that, a program that escapes into native code can still read and execute
what the runtime's user may, but it can write, truncate, create, remove, link or
rename files only under the directories it was given (the cache directory, the
shared-memory directory), plus single files such as ``/dev/null``.

The rights handled here are those that change the file system:

- ``WRITE_FILE`` (open a file for writing), ``TRUNCATE`` (ABI 3+);
- ``REMOVE_DIR``, ``REMOVE_FILE``;
- ``MAKE_CHAR``, ``MAKE_DIR``, ``MAKE_REG``, ``MAKE_SOCK``, ``MAKE_FIFO``,
  ``MAKE_BLOCK``, ``MAKE_SYM``;
- ``REFER`` (ABI 2+: link or rename a file into another directory).

Reading, executing, listing directories and device ``ioctl``s are left alone:
jax, XLA and Python open many files of their own, and none of that changes the
host. Descriptors opened before ``confine`` (the pipe to the API process,
stderr) keep working: Landlock checks when a file is opened, not each write.

Where the kernel has no Landlock (too old, not in ``lsm=``, or a seccomp
profile that forbids the system calls), ``confine`` logs a warning and returns
``None``: the runtime goes on unconfined, as with the network namespace.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import struct
from collections.abc import Iterable
from pathlib import Path

__all__ = ["abi_version", "confine"]

log = logging.getLogger("jitserve.runtime")

# System call numbers. From 424 on, every architecture shares one table (x86_64,
# aarch64, arm, riscv, ppc64, s390x: 444, 445, 446), except alpha, which adds 110.
_OFFSET = 110 if platform.machine().startswith("alpha") else 0
_SYS_CREATE_RULESET = 444 + _OFFSET
_SYS_ADD_RULE = 445 + _OFFSET
_SYS_RESTRICT_SELF = 446 + _OFFSET

_CREATE_RULESET_VERSION = 1 << 0  # flag: return the ABI version, create nothing
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

# LANDLOCK_ACCESS_FS_* (include/uapi/linux/landlock.h)
_WRITE_FILE = 1 << 1
_REMOVE_DIR = 1 << 4
_REMOVE_FILE = 1 << 5
_MAKE_CHAR = 1 << 6
_MAKE_DIR = 1 << 7
_MAKE_REG = 1 << 8
_MAKE_SOCK = 1 << 9
_MAKE_FIFO = 1 << 10
_MAKE_BLOCK = 1 << 11
_MAKE_SYM = 1 << 12
_REFER = 1 << 13  # ABI 2
_TRUNCATE = 1 << 14  # ABI 3

_WRITES_ABI1 = (_WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE_CHAR | _MAKE_DIR | _MAKE_REG
                | _MAKE_SOCK | _MAKE_FIFO | _MAKE_BLOCK | _MAKE_SYM)
# The rights that apply to a file (not a directory): a rule on a file may grant only these.
_FILE_RIGHTS = _WRITE_FILE | _TRUNCATE


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    libc.prctl.restype = ctypes.c_int
    return libc


def _syscall(libc: ctypes.CDLL, number: int, *args: int | bytes | None) -> int:
    """``syscall(number, *args)``, every argument a full machine word (``syscall`` reads
    longs); raises ``OSError`` with the errno on failure."""
    words = [ctypes.c_char_p(a) if isinstance(a, bytes) else ctypes.c_long(a or 0) for a in args]
    result = libc.syscall(ctypes.c_long(number), *words)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(result)


def _allow(libc: ctypes.CDLL, ruleset: int, path: Path, rights: int) -> None:
    """Add a rule: ``rights`` on ``path`` and, for a directory, everything beneath it."""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        # struct landlock_path_beneath_attr is packed: u64 allowed_access, s32 parent_fd.
        rule = struct.pack("<Qi", rights, fd)
        _syscall(libc, _SYS_ADD_RULE, ruleset, _RULE_PATH_BENEATH, rule, 0)
    finally:
        os.close(fd)


def abi_version() -> int:
    """The kernel's Landlock ABI version (1 for 5.13, ...), or 0 where Landlock is
    unavailable: not built, not enabled (``ENOSYS``, ``EOPNOTSUPP``), or forbidden."""
    if not hasattr(os, "O_PATH"):  # not Linux
        return 0
    try:
        return _syscall(_libc(), _SYS_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION)
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
            log.debug("landlock_create_ruleset(VERSION) failed: %s", e)
        return 0


def confine(writable: Iterable[Path], *, writable_files: Iterable[Path] = ()) -> str | None:
    """Allow this process (and what it starts) to change files only under ``writable``
    and in ``writable_files``; reading and executing stay unrestricted.

    Directories in ``writable`` that do not exist are skipped (so are missing
    files): create them first. Returns a short description of the confinement, or
    ``None`` after logging a warning when the kernel lacks Landlock or a step
    fails; it never raises for that, so a runtime still starts unconfined.
    Call it while the process has a single thread.
    """
    abi = abi_version()
    if abi <= 0:
        log.warning("runtime may write wherever its user may: the kernel has no Landlock")
        return None
    handled = _WRITES_ABI1
    if abi >= 2:
        handled |= _REFER
    if abi >= 3:
        handled |= _TRUNCATE
    dirs = [Path(d) for d in writable]
    files = [Path(f) for f in writable_files]
    libc = _libc()
    allowed: list[str] = []
    try:
        # struct landlock_ruleset_attr: handled_access_fs first. Later ABIs add fields
        # (handled_access_net, scoped); a shorter size is accepted and leaves them 0.
        ruleset_attr = struct.pack("<Q", handled)
        ruleset = _syscall(libc, _SYS_CREATE_RULESET, ruleset_attr, len(ruleset_attr), 0)
        try:
            for path, rights, present in [*((d, handled, d.is_dir()) for d in dirs),
                                          *((f, handled & _FILE_RIGHTS, f.exists()) for f in files)]:
                if present:
                    _allow(libc, ruleset, path, rights)
                    allowed.append(str(path))
            # Required to restrict oneself without CAP_SYS_ADMIN; also keeps set-uid
            # programs from regaining what was given up.
            if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(err)}")
            _syscall(libc, _SYS_RESTRICT_SELF, ruleset, 0)
        finally:
            os.close(ruleset)
    except OSError as e:
        log.warning("runtime may write wherever its user may: Landlock failed (%s)", e)
        return None
    where = ", ".join(allowed) or "nowhere"
    return f"Landlock ABI {abi}, writes only to {where}"
