"""The MIG GPU-instance profiles of each simulated model, as `nvidia-smi mig -lgip`
shows them: slices, memory, SMs and engines. Real NVML reports the same facts per MIG
device (nvmlDeviceGetAttributes_v2), so only the simulator needs this table.

Sources: `nvidia-smi mig -lgip` output on A100-SXM4-40GB, A100-SXM4-80GB and
H100 80GB HBM3 (memory in GiB to two decimals, times 1024: 9.50 GiB is 9728 MiB). The
H200 rows follow the same output format but have not been checked on a lent H200 yet
(docs/labels.md says so).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile with one full-size compute instance in it."""

    name: str  # "1g.10gb", "1g.10gb+me"
    slices: int  # GPU-instance (compute) slices, of 7
    memory_slices: int  # memory slices, of 8
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    max_instances: int


_Row = tuple[str, int, int, int, int, int, int, int, int, int, int]


def _table(*rows: _Row) -> dict[str, MigProfile]:
    return {r[0]: MigProfile(*r) for r in rows}


# name, slices, memory slices, MiB, SMs, CE, DEC, ENC, JPEG, OFA, max instances
_A100_40GB = _table(
    ("1g.5gb", 1, 1, 4864, 14, 1, 0, 0, 0, 0, 7),
    ("1g.5gb+me", 1, 1, 4864, 14, 1, 1, 0, 1, 1, 1),
    ("1g.10gb", 1, 2, 9856, 14, 1, 1, 0, 0, 0, 4),
    ("2g.10gb", 2, 2, 9856, 28, 2, 1, 0, 0, 0, 3),
    ("3g.20gb", 3, 4, 19968, 42, 3, 2, 0, 0, 0, 2),
    ("4g.20gb", 4, 4, 19968, 56, 4, 2, 0, 0, 0, 1),
    ("7g.40gb", 7, 8, 40192, 98, 7, 5, 0, 1, 1, 1),
)
_A100_80GB = _table(
    ("1g.10gb", 1, 1, 9728, 14, 1, 0, 0, 0, 0, 7),
    ("1g.10gb+me", 1, 1, 9728, 14, 1, 1, 0, 1, 1, 1),
    ("1g.20gb", 1, 2, 19968, 14, 1, 1, 0, 0, 0, 4),
    ("2g.20gb", 2, 2, 19968, 28, 2, 1, 0, 0, 0, 3),
    ("3g.40gb", 3, 4, 40192, 42, 3, 2, 0, 0, 0, 2),
    ("4g.40gb", 4, 4, 40192, 56, 4, 2, 0, 0, 0, 1),
    ("7g.80gb", 7, 8, 81152, 98, 7, 5, 0, 1, 1, 1),
)
_H100_80GB = _table(
    ("1g.10gb", 1, 1, 9984, 16, 1, 1, 0, 1, 0, 7),
    ("1g.10gb+me", 1, 1, 9984, 16, 1, 1, 0, 1, 1, 1),
    ("1g.20gb", 1, 2, 20224, 26, 1, 1, 0, 1, 0, 4),
    ("2g.20gb", 2, 2, 20224, 32, 2, 2, 0, 2, 0, 3),
    ("3g.40gb", 3, 4, 40448, 60, 3, 3, 0, 3, 0, 2),
    ("4g.40gb", 4, 4, 40448, 64, 4, 4, 0, 4, 0, 1),
    ("7g.80gb", 7, 8, 81152, 132, 8, 7, 0, 7, 1, 1),
)
_H200_141GB = _table(
    ("1g.18gb", 1, 1, 16384, 16, 1, 1, 0, 1, 0, 7),
    ("1g.18gb+me", 1, 1, 16384, 16, 1, 1, 0, 1, 1, 1),
    ("1g.35gb", 1, 2, 33280, 26, 1, 1, 0, 1, 0, 4),
    ("2g.35gb", 2, 2, 33280, 32, 2, 2, 0, 2, 0, 3),
    ("3g.71gb", 3, 4, 67072, 60, 3, 3, 0, 3, 0, 2),
    ("4g.71gb", 4, 4, 67072, 64, 4, 4, 0, 4, 0, 1),
    ("7g.141gb", 7, 8, 133888, 132, 8, 7, 0, 7, 1, 1),
)


def profiles_for(name: str, memory_total_mib: int) -> dict[str, MigProfile] | None:
    """The profile table of a GPU model by its NVML name and memory, None if not MIG."""
    if "A100" in name:
        return _A100_40GB if memory_total_mib <= 48 * 1024 else _A100_80GB
    if "H100" in name:
        return _H100_80GB
    if "H200" in name:
        return _H200_141GB
    return None


def layout_error(table: dict[str, MigProfile], instances: tuple[str, ...]) -> str | None:
    """Why these instances cannot share one GPU, or None. Checks the slice budgets (7
    compute, 8 memory) and each profile's instance limit, not NVML's placements."""
    for p in instances:
        if p not in table:
            return f"unknown MIG profile {p!r} for this GPU (known: {', '.join(table)})"
    counts = Counter(instances)
    for p, n in counts.items():
        if n > table[p].max_instances:
            return f"{n}x {p} is more than the {table[p].max_instances} this GPU allows"
    compute = sum(table[p].slices for p in instances)
    memory = sum(table[p].memory_slices for p in instances)
    if compute > 7 or memory > 8:
        return (
            f"the instances need {compute} compute slices and {memory} memory slices; "
            "a GPU has 7 and 8"
        )
    return None
