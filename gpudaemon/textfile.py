"""Reading a small file the user named (config, profile, token, kubeconfig): only a
regular file, only up to a size limit, and never blocking. And the one way the agent
writes a file whole (`write_atomic`): the label and NFD outputs, the GPU fault record.

`--config /dev/zero` would otherwise read forever (MemoryError), and a FIFO or a
terminal on `/dev/stdin` would hang the agent before it logs anything. Symlinks are
followed on purpose: a Kubernetes ConfigMap or Secret mount is a chain of links to a
regular file.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from gpudaemon.errors import UsageError

MIB = 1 << 20

_KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
    stat.S_IFSOCK: "a socket",
}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _open_regular(path: str, what: str, error: type[UsageError]) -> tuple[int, int]:
    """An fd open for reading on a regular file, and its size. O_NONBLOCK: opening a
    FIFO with no writer returns at once (then fstat refuses it) instead of waiting."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise error(f"{what} {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {path}: {_kind(st.st_mode)}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def check_regular_file(
    path: str, what: str, max_bytes: int, error: type[UsageError] = UsageError
) -> None:
    """Raise `error` (one line) unless `path` is a readable regular file of at most
    `max_bytes`; reads nothing (for files a library opens itself, e.g. kubeconfig)."""
    fd, size = _open_regular(path, what, error)
    os.close(fd)
    if size > max_bytes:
        raise error(f"{what} {path}: larger than {max_bytes} bytes ({size})")


def read_text_file(
    path: str, what: str, max_bytes: int, error: type[UsageError] = UsageError
) -> str:
    """The UTF-8 text of a regular file of at most `max_bytes`, else `error` with one
    line naming `what` and the path."""
    fd, _ = _open_regular(path, what, error)
    chunks: list[bytes] = []
    total = 0
    try:
        while True:
            try:
                chunk = os.read(fd, min(MIB, max_bytes + 1 - total))
            except OSError as e:
                raise error(f"{what} {path}: {e.strerror or e}") from None
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:  # also catches a file that grows while read
                raise error(f"{what} {path}: larger than {max_bytes} bytes")
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{what} {path}: not a UTF-8 text file") from None


def write_atomic(
    path: Path, data: bytes, mode: int = 0o644, *, fsync: bool = False, dir_mode: int = 0o777
) -> None:
    """Write a sibling temp file (created exclusively) and rename it over `path`: a
    reader, or a crash, sees the old file or the new one, never half of one. Raises
    OSError."""
    path.parent.mkdir(mode=dir_mode, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
