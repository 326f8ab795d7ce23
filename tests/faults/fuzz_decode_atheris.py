"""Coverage-guided fuzzing of the wire decoder with atheris (optional; not collected by pytest).

The promise under test (``mesh.wire.codec``): the only outcome of bad bytes is a typed
:class:`~mesh.errors.MessageRejected` carrying a known :class:`~mesh.wire.Reason`; a body over
the size limit is refused with ``MESSAGE_TOO_LARGE`` whatever it holds. Each input is decoded
the ways the manager decodes: any message, and as each of its three queues expects (announce,
rpc, heartbeats), once with the default limit and once with a small one.

atheris is not a project dependency. In a throw-away venv::

    python3 -m venv /tmp/ath && /tmp/ath/bin/pip install atheris -e .
    /tmp/ath/bin/python tests/faults/fuzz_decode_atheris.py -runs=100000
    /tmp/ath/bin/python tests/faults/fuzz_decode_atheris.py -max_total_time=60

Any other exception, or a rejection without a known reason, crashes the run with the input
saved as ``crash-*`` (libFuzzer's usual output).
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from mesh.errors import MessageRejected
    from mesh.wire import Message, Reason
    from mesh.wire.codec import decode, decode_as

from mesh.manager.intake import _ANNOUNCE_TYPES, _RPC_TYPES
from mesh.wire import Heartbeat

EXPECTED: tuple[tuple[type[Message], ...], ...] = (_ANNOUNCE_TYPES, _RPC_TYPES, (Heartbeat,))
REASONS = frozenset(Reason)
SMALL_LIMIT = 64


def check(body: bytes, expected: tuple[type[Message], ...] | None, max_bytes: int | None) -> None:
    kwargs = {} if max_bytes is None else {"max_bytes": max_bytes}
    try:
        message = (
            decode(body, **kwargs) if expected is None else decode_as(body, *expected, **kwargs)
        )
    except MessageRejected as exc:
        if exc.reason not in REASONS:
            raise AssertionError(f"rejection with an unknown reason {exc.reason!r}") from exc
        if max_bytes is not None and len(body) > max_bytes:
            assert exc.reason == Reason.MESSAGE_TOO_LARGE, exc.reason
        return
    assert isinstance(message, expected or Message), type(message)
    assert max_bytes is None or len(body) <= max_bytes


def test_one_input(data: bytes) -> None:
    for expected in (None, *EXPECTED):
        check(data, expected, None)
        check(data, expected, SMALL_LIMIT)


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
