"""Only :mod:`mesh.transport.aiormq_bridge` reaches below aio-pika's and aiormq's public API.

Import contracts cannot say this (every transport module imports aiormq, for its exceptions
at least), so this reads the code: each internal the bridge lists is named in the bridge and
in no other module of the mesh (comments aside). Whether the internals are still
where the bridge expects them is checked against the installed libraries by
``tests/integration/test_aiormq_internals.py``.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import mesh
from mesh.transport import aiormq_bridge

INTERNALS = {
    "aiormq's frame buffer": r"\bFRAME_BUFFER_SIZE\b",
    "a channel's confirm futures": r"\.confirmations\b",
    "a channel's message IDs of returns": r"\.message_id_delivery_tag\b",
    "a channel's next delivery tag, written": r"\.delivery_tag\s*[-+]?=(?!=)",
    "a channel's lock": r"\.lock\b",
    "the connection's writer queue": r"\.write_queue\b",
    "aiormq's frame for its writer": r"\bChannelFrame\b",
    "a channel's largest body frame": r"\.max_content_size\b",
    "aiormq's blocked flag": r"_Connection__",
    "the aiormq connection under aio-pika's": r"connection\.transport\b",
    "aio-pika's reconnect URL": r"\byarl\b",
    "aio-pika's reconnect interval": r"\"reconnect_interval\"\s*,\s*5",
}


def code_of(path: Path) -> str:
    """The module's text with its comments blanked (a comment may name an internal)."""
    lines = path.read_text().splitlines(keepends=True)
    for token in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if token.type != tokenize.COMMENT:
            continue
        (first, start), (last, end) = token.start, token.end
        for row in range(first, last + 1):
            line = lines[row - 1]
            a = start if row == first else 0
            b = end if row == last else len(line.rstrip("\n"))
            lines[row - 1] = line[:a] + " " * (b - a) + line[b:]
    return "".join(lines)


def test_every_internal_the_bridge_lists_is_used_in_the_bridge() -> None:
    bridge = Path(aiormq_bridge.__file__)
    code = code_of(bridge)
    unused = [what for what, pattern in INTERNALS.items() if not re.search(pattern, code)]
    assert unused == []


def test_no_module_but_the_bridge_reaches_below_the_libraries_public_api() -> None:
    root = Path(mesh.__file__).parent
    bridge = Path(aiormq_bridge.__file__)
    found = []
    for path in sorted(root.rglob("*.py")):
        if path == bridge:
            continue
        code = code_of(path)
        for what, pattern in INTERNALS.items():
            if re.search(pattern, code):
                found.append(f"{path.relative_to(root.parent)}: {what}")
    assert found == []
