"""Bytes <-> models. The only outcome of bad bytes is a typed :class:`MessageRejected`.

Decoding is: refuse oversized bodies before parsing, parse with orjson, look the
``type`` up in the registry, then validate with pydantic. Each failure has its
own reason code, which is what the consumer dead-letters the message with.
"""

from __future__ import annotations

from typing import Annotated, TypeVar, Union

import orjson
from pydantic import Field, TypeAdapter, ValidationError

from mesh.constants import MAX_MESSAGE_BYTES
from mesh.errors import MessageRejected
from mesh.wire.catalog import MESSAGE_TYPES
from mesh.wire.models import Message
from mesh.wire.reasons import Reason

M = TypeVar("M", bound=Message)

REGISTRY: dict[str, type[Message]] = {cls.TYPE: cls for cls in MESSAGE_TYPES}


def encode(message: Message) -> bytes:
    """Serialise a message to JSON bytes in one pass through the model's own serialiser
    (integers outside 64 bits, which JSON allows, included). An ``ADDED_FIELDS`` field left
    unset is left out, for receivers that predate it."""
    added: frozenset[str] = getattr(message, "ADDED_FIELDS", frozenset())
    unset = {name for name in added if getattr(message, name, 0) is None} if added else None
    return message.__pydantic_serializer__.to_json(message, exclude=unset or None)


# Every message type as one union told apart by ``type``: a valid body is parsed and
# validated in one pass; only a body that fails it is diagnosed step by step (``decode``).
_ANY_MESSAGE: TypeAdapter[Message] = TypeAdapter(
    Annotated[Union[tuple(MESSAGE_TYPES)], Field(discriminator="type")]  # type: ignore[arg-type]  # noqa: UP007 - a union built at run time
)


def decode(body: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Parse and validate any known message; raise :class:`MessageRejected` otherwise."""
    if len(body) <= max_bytes:
        try:
            return _ANY_MESSAGE.validate_json(body, strict=True)
        except ValidationError:
            pass  # say exactly why, below
    if len(body) > max_bytes:
        raise MessageRejected(
            Reason.MESSAGE_TOO_LARGE, f"{len(body)} bytes is over the {max_bytes}-byte limit"
        )
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MessageRejected(Reason.MALFORMED_JSON, str(exc)) from None
    if not isinstance(obj, dict):
        raise MessageRejected(Reason.MALFORMED_JSON, "a message must be a JSON object")
    type_name = obj.get("type")
    if not isinstance(type_name, str):
        raise MessageRejected(Reason.MISSING_TYPE, "the message has no string 'type' field")
    cls = REGISTRY.get(type_name)
    if cls is None:
        raise MessageRejected(Reason.UNKNOWN_MESSAGE_TYPE, f"unknown message type {type_name!r}")
    return _validate(cls, body)


def decode_as(body: bytes, *expected: type[M], max_bytes: int = MAX_MESSAGE_BYTES) -> M:
    """Decode, and insist the message is one of ``expected``.

    With one expected type the body is validated in a single pass (the heartbeat path);
    only a body that fails it is diagnosed step by step for its reason code.
    """
    if len(expected) == 1 and len(body) <= max_bytes:
        try:
            # The model's own validator, called directly: what ``model_validate_json`` does,
            # less its Python wrapper (a fifth of a heartbeat's decoding).
            return expected[0].__pydantic_validator__.validate_json(body, strict=True)  # type: ignore[no-any-return]
        except ValidationError:
            pass
    message = decode(body, max_bytes=max_bytes)
    if not isinstance(message, expected):
        names = ", ".join(cls.TYPE for cls in expected)
        raise MessageRejected(
            Reason.UNEXPECTED_MESSAGE_TYPE, f"got {message.type!r} where {names} was expected"
        )
    return message


def _validate(cls: type[M], body: bytes) -> M:
    # Strict JSON validation: "42" is not an int and "true" is not a bool, exactly as the
    # committed JSON Schemas say. Python callers building models are unaffected.
    try:
        return cls.model_validate_json(body, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        reason = (
            Reason.UNKNOWN_FIELD
            if any(e["type"] == "extra_forbidden" for e in errors)
            else Reason.SCHEMA_VIOLATION
        )
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in errors[:5]
        )
        raise MessageRejected(reason, f"{cls.TYPE}: {detail}") from None
