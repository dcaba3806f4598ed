"""Is a spooled line InfluxDB line protocol? The spool checks every line before it
stores it, and again before it sends a row back (a damaged file): one bad line costs
only itself, never a batch."""

from __future__ import annotations

import re

# One line of our line protocol is ~500 bytes; anything this long is not ours.
MAX_LINE_BYTES = 64 << 10

# Line protocol as InfluxDB parses it, strict enough to keep out what cannot be a
# point: NUL padding, a torn line, text that is not a point at all.
_NAME = r"(?:[^,= \\\x00-\x1f\x7f]++|\\[^\x00-\x1f\x7f])++"
_MEASUREMENT = r"(?:[^, \\\x00-\x1f\x7f]++|\\[^\x00-\x1f\x7f])++"
_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_VALUE = rf'(?:-?\d+i|\d+u|{_NUM}|t|T|true|True|TRUE|f|F|false|False|FALSE|"(?:[^"\\]|\\.)*")'
_LINE = re.compile(
    rf"{_MEASUREMENT}(?:,{_NAME}={_NAME})* {_NAME}={_VALUE}(?:,{_NAME}={_VALUE})* -?\d{{1,19}}"
)


def valid_line(line: bytes) -> bool:
    """True if `line` (no newline) is one well-formed point of line protocol."""
    if not line or len(line) > MAX_LINE_BYTES:
        return False
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return _LINE.fullmatch(text) is not None


_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")


def plausible_line(line: bytes) -> bool:
    """The cheap check for rows read back for replay (a full check costs more than the
    rest of the replay): what a damaged row looks like (empty, NUL or control bytes,
    not UTF-8, too long). A subtler bad line is refused by InfluxDB, and the writer
    counts exactly that line as rejected."""
    if not line or len(line) > MAX_LINE_BYTES or _CONTROL.search(line):
        return False
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return line.count(b" ") >= 2
