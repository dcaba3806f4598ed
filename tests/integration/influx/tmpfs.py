"""A real, small tmpfs for full-disk tests: mounted fresh, filled for real, enlarged
with a remount. Needs root (CI runs as root); a mount that fails is a test failure,
never a skip, so a full-disk test cannot pass without a full disk."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(
            f"mount {' '.join(args)} failed ({proc.stderr.strip()}): the full-disk tests "
            "need root and a kernel that allows tmpfs mounts"
        )


@contextlib.contextmanager
def small_tmpfs(where: Path, size: str = "256k") -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where))
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def resize(where: Path, size: str) -> None:
    _mount("-o", f"remount,size={size}", str(where))


def fill(where: Path, name: str = "filler") -> int:
    """Write until the file system says ENOSPC; returns the bytes written."""
    total = 0
    fd = os.open(where / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        block = b"\xaa" * 4096
        while True:
            try:
                n = os.write(fd, block)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                break
            if n == 0:
                break
            total += n
        # the last few bytes of a partly filled page
        for size in (1024, 256, 64, 16, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\xaa" * size) == size:
                    total += size
    finally:
        os.close(fd)
    return total
