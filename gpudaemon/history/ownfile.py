"""Only the spool's own regular files are opened: every name is checked with lstat
and O_NOFOLLOW (type, owner, one link) before SQLite opens it, so a symlink, a FIFO or
a device in its place is a clear error, not a write to someone else's file."""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
from pathlib import Path

from gpudaemon.errors import SpoolError


def spool_error(path: Path, e: OSError | sqlite3.Error, what: str = "") -> SpoolError:
    if isinstance(e, OSError):
        reason = e.strerror or str(e)
    else:
        reason = str(e) or type(e).__name__
        if getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
            reason = os.strerror(errno.ENOSPC)  # the same words as a full disk elsewhere
    return SpoolError(f"spool {path}: {what + ': ' if what else ''}{reason}", reason)


def check_own_file(path: Path) -> os.stat_result | None:
    """lstat `path`: None if absent; a SpoolError unless it is a regular file of ours
    with one link (a hard link could be someone else's file under our name)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise spool_error(path, e) from None
    problem = _not_ours(st)
    if problem:
        raise SpoolError(
            f"spool {path}: {problem}; the spool only opens its own regular files: move it away",
            problem,
        )
    return st


def _not_ours(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        kind = {
            stat.S_IFIFO: "a FIFO",
            stat.S_IFCHR: "a character device",
            stat.S_IFBLK: "a block device",
            stat.S_IFSOCK: "a socket",
            stat.S_IFDIR: "a directory",
        }.get(stat.S_IFMT(st.st_mode), "not a regular file")
        return f"is {kind}, not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not by this process (uid {os.geteuid()})"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} hard links"
    return ""


def open_own(path: Path, flags: int) -> int:
    """os.open that never follows a link, never blocks on a FIFO, and accepts only a
    regular file of ours."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SpoolError(
                f"spool {path}: is a symbolic link; the spool only opens its own regular "
                "files: move it away",
                f"{path.name} is a symbolic link",
            ) from None
        raise spool_error(path, e) from None
    problem = _not_ours(os.fstat(fd))
    if problem:
        os.close(fd)
        raise SpoolError(
            f"spool {path}: {problem}; the spool only opens its own regular files: move it away",
            f"{path.name} {problem}",
        )
    return fd
