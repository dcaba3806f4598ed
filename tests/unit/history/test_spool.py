"""The on-disk spool: order, durability across reopen, crash repair, the byte bound."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpudaemon.errors import SpoolError
from gpudaemon.history.spool import Spool


def drain(spool: Spool) -> list[str]:
    out: list[str] = []
    while (seg := spool.oldest()) is not None:
        out += spool.read(seg).decode().splitlines()
        spool.remove(seg)
    return out


def test_segments_come_back_oldest_first(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=20)
    for i in range(10):
        spool.append([f"p{i}a", f"p{i}b"])
    assert spool.points == 20
    assert len(spool) > 1  # rolled over into several segments
    assert drain(spool) == [f"p{i}{s}" for i in range(10) for s in "ab"]
    assert spool.points == 0
    assert list(tmp_path.glob("seg-*")) == []


def test_spool_survives_reopen(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=16)
    spool.append(["one", "two"])
    spool.append(["three"])
    spool.close()
    again = Spool(tmp_path, max_bytes=1 << 20, segment_bytes=16)
    assert again.points == 3
    again.append(["four"])
    assert drain(again) == ["one", "two", "three", "four"]


def test_torn_last_line_is_cut_on_reopen(tmp_path: Path) -> None:
    spool = Spool(tmp_path, max_bytes=1 << 20)
    spool.append(["whole line"])
    spool.close()
    seg = next(tmp_path.glob("seg-*.lp"))
    with open(seg, "ab") as f:
        f.write(b"half a li")  # the process died mid-write
    again = Spool(tmp_path, max_bytes=1 << 20)
    assert again.points == 1
    assert drain(again) == ["whole line"]


def test_overflow_drops_oldest_segments_and_reports_how_many_points(tmp_path: Path) -> None:
    line = "x" * 99  # 100 bytes with the newline
    spool = Spool(tmp_path, max_bytes=1000, segment_bytes=200)
    dropped = 0
    for i in range(30):
        dropped += spool.append([f"{i:02d}" + line[2:]])
    assert spool.size_bytes <= 1000
    assert dropped + spool.points == 30
    kept = [int(s[:2]) for s in drain(spool)]
    assert kept == list(range(30 - len(kept), 30))  # the newest survive, contiguous


def test_second_process_cannot_share_a_spool(tmp_path: Path) -> None:
    first = Spool(tmp_path, max_bytes=1000)
    with pytest.raises(SpoolError, match="in use"):
        Spool(tmp_path, max_bytes=1000)
    first.close()
    Spool(tmp_path, max_bytes=1000).close()


def test_unwritable_directory_is_a_spool_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(SpoolError):
        Spool(blocker / "spool", max_bytes=1000)
