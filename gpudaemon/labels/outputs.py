"""Where labels go besides the API server: stdout, a JSON file, an NFD feature file,
or none (the API server writer is gpudaemon.agent.nodelabels).

Each skips the write when nothing changed and writes files atomically (temp file +
rename), so NFD's local source never reads a half-written file.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from gpudaemon.errors import SinkError
from gpudaemon.labels import Labels, LabelSet
from gpudaemon.schedule import Job
from gpudaemon.textfile import write_atomic


def _check(ls: LabelSet) -> None:
    if not isinstance(ls.labels, Labels):
        raise SinkError("refusing labels that did not pass through sanitize_value")


def atomic_write(path: Path, text: str) -> None:
    try:
        write_atomic(path, text.encode())
    except OSError as e:
        raise SinkError(f"cannot write {path}: {e.strerror or e}") from None


class LocalOutput:
    """What a local output adds to LabelSink: no jobs of its own, and no Lease, so the
    data's freshness is not its concern."""

    def jobs(self) -> Sequence[Job]:
        return ()

    def set_freshness(self, fresh: Callable[[], bool]) -> None:
        pass

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


class _ChangeTracking(LocalOutput):
    def __init__(self) -> None:
        self._last: dict[str, dict[str, str]] | None = None

    def apply(self, ls: LabelSet) -> bool:
        """Write when the set differs from the last one written; True if it wrote."""
        _check(ls)
        d = ls.as_dict()
        if d == self._last:
            return False
        self._write(ls)
        self._last = d
        return True

    def _write(self, ls: LabelSet) -> None:
        raise NotImplementedError


class StdoutSink(_ChangeTracking):
    name = "stdout"

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__()
        self.stream = stream or sys.stdout

    def _write(self, ls: LabelSet) -> None:
        self.stream.write(json.dumps(ls.as_dict(), indent=2, sort_keys=True) + "\n")
        self.stream.flush()


class FileSink(_ChangeTracking):
    name = "file"

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = Path(path)

    def _write(self, ls: LabelSet) -> None:
        atomic_write(self.path, json.dumps(ls.as_dict(), indent=2, sort_keys=True) + "\n")


class NfdSink(_ChangeTracking):
    """GPU Feature Discovery's format: one `key=value` line per label. NFD's local
    source takes labels only, so the annotation is not written here."""

    name = "nfd"

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = Path(path)

    def _write(self, ls: LabelSet) -> None:
        atomic_write(self.path, "".join(f"{k}={v}\n" for k, v in sorted(ls.labels.items())))


class NullSink(LocalOutput):
    """`labels.to: none`: metrics and history only, no labels anywhere."""

    name = "none"

    def apply(self, ls: LabelSet) -> bool:
        _check(ls)
        return False
