"""The one table printer of the benchmarks: a Markdown table with aligned columns, so
a run's output pastes straight into docs/benchmarks.md."""

from __future__ import annotations

from collections.abc import Sequence


def table(header: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> str:
    cells = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
             for r in cells]  # fmt: skip
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return (f"\n{title}\n" if title else "") + "\n".join(lines)


def print_table(header: Sequence[str], rows: Sequence[Sequence[object]], title: str = "") -> None:
    print(table(header, rows, title))
