"""Stream entries: `type` (full protobuf message name), `schema` (integer) and `data` (bytes).

This is the whole wire contract of the Redis streams; docs/custom-reward.md restates it
for people writing a stage in another language.
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf.message import DecodeError, Message

SCHEMA_VERSION = 1

M = TypeVar("M", bound=Message)

Fields = dict[bytes, bytes]


class EntryError(ValueError):
    """A stream entry that cannot be decoded; the message is the dead-letter reason."""


def encode(message: Message) -> dict[str, bytes]:
    return {
        "type": message.DESCRIPTOR.full_name.encode(),
        "schema": str(SCHEMA_VERSION).encode(),
        "data": message.SerializeToString(),
    }


def decode(fields: Fields, cls: type[M]) -> M:
    """Parse an entry as `cls`, or raise EntryError saying exactly what is wrong."""
    expected = cls.DESCRIPTOR.full_name
    missing = [k for k in (b"type", b"schema", b"data") if k not in fields]
    if missing:
        raise EntryError(f"missing field(s) {', '.join(m.decode() for m in missing)}")
    type_name = fields[b"type"].decode(errors="replace")
    if type_name != expected:
        raise EntryError(f"type is {type_name!r}, expected {expected!r}")
    try:
        schema = int(fields[b"schema"])
    except ValueError:
        raise EntryError(f"schema {fields[b'schema']!r} is not an integer") from None
    if schema != SCHEMA_VERSION:
        raise EntryError(f"schema {schema} is not supported (this build reads {SCHEMA_VERSION})")
    message = cls()
    try:
        message.ParseFromString(fields[b"data"])
    except DecodeError as e:
        raise EntryError(f"data does not parse as {expected}: {e}") from None
    return message
