"""The rollout buffer: Redis streams read through consumer groups.

One `StreamStage` is one consumer of one input stream. Its contract:
- `read()` first takes over entries left pending by a dead consumer (XAUTOCLAIM after
  `claim_idle_ms`), then reads new ones (XREADGROUP `>`). Entries delivered more than
  `max_deliveries` times go to the dead-letter stream instead of being returned.
- `commit()` writes the outputs to the next stream(s) and acknowledges the inputs in one
  MULTI/EXEC transaction: a crash before EXEC leaves the inputs pending (they are claimed
  again), a crash after it has already written and acknowledged. Nothing is lost;
  duplicates can only come from a take-over racing a slow consumer, and the trainer
  deduplicates by group_id.
- `dead_letter()` moves an entry to `rs:<run>:dead` with its reason, atomically with its ack.
- `trim()` deletes entries that every consumer group has acknowledged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis
from google.protobuf.message import Message

from rollstream.core import codec
from rollstream.v1 import rollout_pb2

STAGES = ("prompts", "rollouts", "scored", "ready")


@dataclass(frozen=True)
class RunKeys:
    """Every Redis key of a run. A run name isolates experiments sharing one Redis."""

    run: str

    def stream(self, stage: str) -> str:
        return f"rs:{self.run}:{stage}"

    @property
    def dead(self) -> str:
        return f"rs:{self.run}:dead"

    @property
    def metrics(self) -> str:
        return f"rs:{self.run}:metrics"

    @property
    def stats(self) -> str:
        """Hash of counters: generated, trained, stale, dead, ... (HINCRBY, in the same transactions)."""
        return f"rs:{self.run}:stats"

    @property
    def version(self) -> str:
        """The trainer's current policy version (string integer)."""
        return f"rs:{self.run}:version"

    @property
    def generators(self) -> str:
        """Hash generator_id -> gRPC address, for discovery when none are configured."""
        return f"rs:{self.run}:generators"

    def groups(self, outcome: str) -> str:
        """Set of group ids per outcome: generated, trained, stale (the accounting ledger)."""
        return f"rs:{self.run}:groups:{outcome}"


@dataclass
class Entry:
    id: bytes
    fields: codec.Fields
    deliveries: int


Extra = Callable[[redis.client.Pipeline], None]


def connect(url: str) -> redis.Redis:
    """A client that returns bytes (entries carry protobuf bytes), with a health check."""
    client = redis.Redis.from_url(url, decode_responses=False, health_check_interval=30, socket_keepalive=True)
    return client


def current_version(client: redis.Redis, keys: RunKeys) -> int:
    value = client.get(keys.version)
    return int(value) if value is not None else 0


class StreamStage:
    """A consumer in group `group` of the stream `rs:<run>:<source>`."""

    def __init__(
        self,
        client: redis.Redis,
        keys: RunKeys,
        source: str,
        group: str,
        consumer: str,
        *,
        claim_idle_ms: int = 30_000,
        max_deliveries: int = 5,
    ):
        self.client = client
        self.keys = keys
        self.source = source
        self.stream = keys.stream(source)
        self.group = group
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self._claim_cursor = b"0-0"
        self._own_pending_done = False
        self.ensure_group(self.client, self.stream, self.group)

    @staticmethod
    def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
        """Create the group at the start of the stream (idempotent; creates the stream too)."""
        try:
            client.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    # -- reading ---------------------------------------------------------------------

    def read(self, count: int, block_ms: int) -> list[Entry]:
        entries = self._read_own_pending(count) if not self._own_pending_done else []
        if not entries:
            entries = self._claim_stale(count)
        if not entries:
            entries = self._read_new(count, block_ms)
        return self._filter_over_delivered(entries)

    def _read_own_pending(self, count: int) -> list[Entry]:
        """After a restart under the same consumer name, our own unacked entries come first."""
        reply = self.client.xreadgroup(self.group, self.consumer, {self.stream: "0"}, count=count)
        entries = self._entries(reply)
        if not entries:
            self._own_pending_done = True
        return self._with_deliveries(entries)

    def _claim_stale(self, count: int) -> list[Entry]:
        reply = self.client.xautoclaim(
            self.stream, self.group, self.consumer, min_idle_time=self.claim_idle_ms, start_id=self._claim_cursor, count=count
        )
        self._claim_cursor = reply[0]
        claimed = [Entry(id=eid, fields=fields, deliveries=0) for eid, fields in reply[1] if eid is not None]
        # Entries trimmed away while pending come back without fields (6.2) or in reply[2] (7.x).
        gone = [e.id for e in claimed if not e.fields] + list(reply[2] if len(reply) > 2 else [])
        if gone:
            self.client.xack(self.stream, self.group, *gone)
        return self._with_deliveries([e for e in claimed if e.fields])

    def _read_new(self, count: int, block_ms: int) -> list[Entry]:
        reply = self.client.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        return [Entry(id=e.id, fields=e.fields, deliveries=1) for e in self._entries(reply)]

    @staticmethod
    def _entries(reply) -> list[Entry]:
        out: list[Entry] = []
        for _stream, items in reply or []:
            for eid, fields in items:
                out.append(Entry(id=eid, fields=fields or {}, deliveries=1))
        return out

    def _with_deliveries(self, entries: list[Entry]) -> list[Entry]:
        """Fill in each entry's delivery count from the pending entries list."""
        if not entries:
            return entries
        pending = self.client.xpending_range(self.stream, self.group, min=entries[0].id, max=entries[-1].id, count=len(entries) * 4)
        counts = {p["message_id"]: p["times_delivered"] for p in pending}
        for e in entries:
            e.deliveries = int(counts.get(e.id, 1))
        return entries

    def _filter_over_delivered(self, entries: list[Entry]) -> list[Entry]:
        keep = []
        for e in entries:
            if e.deliveries > self.max_deliveries:
                self.dead_letter(e, f"delivered {e.deliveries} times (max_deliveries={self.max_deliveries}) without being acknowledged")
            elif not e.fields:
                self.client.xack(self.stream, self.group, e.id)
            else:
                keep.append(e)
        return keep

    # -- writing ---------------------------------------------------------------------

    def commit(self, entries: Sequence[Entry], outputs: Sequence[tuple[str, Message]] = (), extra: Extra | None = None) -> None:
        """Write `outputs` (stage name, message) and ack `entries` in one transaction."""
        pipe = self.client.pipeline(transaction=True)
        for stage, message in outputs:
            pipe.xadd(self.keys.stream(stage), codec.encode(message))
        if extra is not None:
            extra(pipe)
        if entries:
            pipe.xack(self.stream, self.group, *[e.id for e in entries])
        pipe.execute()

    def dead_letter(self, entry: Entry, reason: str) -> None:
        letter = rollout_pb2.DeadLetter(
            source_stream=self.stream,
            source_id=entry.id.decode(),
            consumer_group=self.group,
            consumer=self.consumer,
            reason=reason,
            deliveries=entry.deliveries,
            original_fields={k.decode(errors="replace"): v for k, v in entry.fields.items()},
            dead_at=time.time(),
        )
        fields = codec.encode(letter)
        fields["reason"] = reason.encode()  # readable with plain redis-cli
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.keys.dead, fields, maxlen=100_000, approximate=True)
        pipe.hincrby(self.keys.stats, f"dead_{self.source}", 1)
        pipe.xack(self.stream, self.group, entry.id)
        pipe.execute()

    # -- housekeeping ----------------------------------------------------------------

    def trim(self) -> int:
        """Delete entries of the input stream that every group has acknowledged."""
        return trim_acknowledged(self.client, self.stream)


def _id_tuple(eid: bytes | str) -> tuple[int, int]:
    s = eid.decode() if isinstance(eid, bytes) else eid
    ms, _, seq = s.partition("-")
    return int(ms), int(seq or 0)


def trim_acknowledged(client: redis.Redis, stream: str) -> int:
    """XTRIM MINID to the oldest entry some group still needs (pending or undelivered)."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return 0
    if not groups:
        return 0  # nobody has read it yet: everything is still needed
    floor: tuple[int, int] | None = None
    for g in groups:
        if g["pending"]:
            summary = client.xpending(stream, g["name"])
            needed = _id_tuple(summary["min"])
        else:
            ms, seq = _id_tuple(g["last-delivered-id"])
            needed = (ms, seq + 1)  # everything up to last-delivered is acknowledged
        floor = needed if floor is None or needed < floor else floor
    assert floor is not None
    return int(client.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=False))


def write(client: redis.Redis, keys: RunKeys, stage: str, message: Message) -> bytes:
    """Append one message to a stage's stream (used by feeders and tests)."""
    return client.xadd(keys.stream(stage), codec.encode(message))
