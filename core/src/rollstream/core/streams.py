"""The rollout buffer: Redis streams read through consumer groups.

One `StreamStage` is one consumer of one input stream. Its contract:
- `read()` first returns this consumer's own pending entries (after a restart under the
  same name), then takes over entries left pending by another, dead consumer (idle for
  `claim_idle_ms`: XPENDING IDLE + XCLAIM), then reads new ones (XREADGROUP `>`). Entries delivered more than
  `max_deliveries` times go to the dead-letter stream instead of being returned.
- `commit()` writes the outputs to the next stream(s) and acknowledges the inputs in one
  Lua script, which Redis runs atomically: a crash leaves either nothing done (the inputs
  stay pending and are claimed again) or everything. Unlike MULTI/EXEC, a script stops at
  the first failing command, and the ack comes last: an output that cannot be written
  (WRONGTYPE, OOM) leaves its input pending instead of acknowledging it away. Duplicates
  can only come from a take-over racing a slow consumer; the trainer deduplicates by
  group_id.
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
from rollstream.core.config import CommonSettings, consumer_name
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


# Runs a list of commands in order. The commands arrive flattened in ARGV: count, then per
# command its argc and arguments (the key first). Keys travel inside ARGV, which is fine on
# a single Redis (not on Redis Cluster).
# Redis has no rollback, so the script first checks every key's type against its command
# and refuses the whole list (writing nothing) if one would fail with WRONGTYPE: then a
# failed commit leaves no half-written output behind. Under maxmemory, Redis refuses a
# script's first write (OOM) before anything is applied. What remains, an error in a
# command itself, stops at that command (redis.call raises), with the ack last.
_RUN_COMMANDS = """
local expected = {XADD = 'stream', XACK = 'stream', HINCRBY = 'hash', SADD = 'set'}
local i = 1
local n = tonumber(ARGV[i]); i = i + 1
for _ = 1, n do
  local argc = tonumber(ARGV[i])
  local want = expected[string.upper(ARGV[i + 1])]
  if want then
    local have = redis.call('TYPE', ARGV[i + 2])['ok']
    if have ~= 'none' and have ~= want then
      return redis.error_reply('WRONGTYPE ' .. ARGV[i + 1] .. ' on ' .. ARGV[i + 2] .. ', a ' .. have .. ': nothing written')
    end
  end
  i = i + 1 + argc
end
i = 2
for _ = 1, n do
  local argc = tonumber(ARGV[i]); i = i + 1
  redis.call(unpack(ARGV, i, i + argc - 1))
  i = i + argc
end
return n
"""


class Ops:
    """Commands to run atomically with a commit; the same method names as a redis-py pipeline."""

    def __init__(self) -> None:
        self.commands: list[list[bytes | str | int | float]] = []

    def xadd(self, key: str, fields: dict, maxlen: int | None = None, approximate: bool = True) -> None:
        trim: list[bytes | str | int | float] = ["MAXLEN", "~" if approximate else "=", maxlen] if maxlen else []
        flat: list[bytes | str | int | float] = [x for kv in fields.items() for x in kv]
        self.commands.append(["XADD", key, *trim, "*", *flat])

    def xack(self, key: str, group: str, *ids: bytes) -> None:
        self.commands.append(["XACK", key, group, *ids])

    def hincrby(self, key: str, field: str, amount: int = 1) -> None:
        self.commands.append(["HINCRBY", key, field, amount])

    def sadd(self, key: str, *members: str) -> None:
        if members:
            self.commands.append(["SADD", key, *members])

    def set(self, key: str, value: str | int) -> None:
        self.commands.append(["SET", key, value])

    def argv(self) -> list[bytes | str | int | float]:
        out: list[bytes | str | int | float] = [len(self.commands)]
        for command in self.commands:
            out.append(len(command))
            out.extend(command)
        return out


Extra = Callable[[Ops], None]


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
        self._own_cursor: bytes | str = "0"
        self._own_pending_done = False
        self._run_commands = client.register_script(_RUN_COMMANDS)
        self.ensure_group(self.client, self.stream, self.group)

    @staticmethod
    def ensure_group(client: redis.Redis, stream: str, group: str) -> None:
        """Create the group at the start of the stream (idempotent; creates the stream too)."""
        try:
            client.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    @classmethod
    def for_service(cls, client: redis.Redis, settings: CommonSettings, source: str, group: str) -> "StreamStage":
        """The stage a service reads: its run, consumer name and delivery settings."""
        return cls(
            client, RunKeys(settings.run), source, group, consumer_name(settings),
            claim_idle_ms=settings.claim_idle_ms, max_deliveries=settings.max_deliveries,
        )

    # -- reading ---------------------------------------------------------------------

    def read(self, count: int, block_ms: int) -> list[Entry]:
        entries = self._read_own_pending(count) if not self._own_pending_done else []
        if not entries:
            entries = self._claim_stale(count)
        if not entries:
            entries = self._read_new(count, block_ms)
        return self._filter_over_delivered(entries)

    def _read_own_pending(self, count: int) -> list[Entry]:
        """After a restart under the same consumer name, our own unacked entries come first,
        each once (a cursor walks the history; it restarts only after a failed commit)."""
        reply = self.client.xreadgroup(self.group, self.consumer, {self.stream: self._own_cursor}, count=count)
        entries = self._entries(reply)
        if entries:
            self._own_cursor = entries[-1].id
        else:
            self._own_pending_done = True
        return self._with_deliveries(entries)

    def _claim_stale(self, count: int) -> list[Entry]:
        """Take over entries idle for claim_idle_ms on *other* consumers (XAUTOCLAIM would also
        hand us back entries we hold ourselves, e.g. a trainer filling its batch)."""
        pending = self.client.xpending_range(self.stream, self.group, min="-", max="+", count=count * 8, idle=self.claim_idle_ms)
        ids = [p["message_id"] for p in pending if _text(p["consumer"]) != self.consumer][:count]
        if not ids:
            return []
        claimed = self.client.xclaim(self.stream, self.group, self.consumer, self.claim_idle_ms, ids)
        entries = [Entry(id=eid, fields=fields or {}, deliveries=0) for eid, fields in claimed if eid is not None]
        # Entries trimmed away while pending have no fields any more: nothing to process.
        present = {e.id for e in entries if e.fields}
        gone = [i for i in ids if i not in present]
        if gone:
            self.client.xack(self.stream, self.group, *gone)
        return self._with_deliveries([e for e in entries if e.fields])

    def touch(self, entries: Sequence[Entry]) -> None:
        """Reset the idle time of entries we hold but have not committed yet, so that other
        consumers do not take them over (XCLAIM JUSTID does not count a delivery)."""
        if entries:
            self.client.xclaim(self.stream, self.group, self.consumer, 0, [e.id for e in entries], justid=True)

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
        # Our pending list may hold other entries inside this id range (a trainer filling its
        # batch), hence the margin on count.
        pending = self.client.xpending_range(
            self.stream, self.group, min=entries[0].id, max=entries[-1].id, count=4 * len(entries) + 100, consumername=self.consumer
        )
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
        """Write `outputs` (stage name, message), run `extra`, then ack `entries`, in one script:
        atomic against crashes. A key of the wrong type refuses the whole commit before
        anything is written (WRONGTYPE); the entries stay pending and come back."""
        ops = Ops()
        for stage, message in outputs:
            ops.xadd(self.keys.stream(stage), codec.encode(message))
        if extra is not None:
            extra(ops)
        if entries:
            ops.xack(self.stream, self.group, *[e.id for e in entries])
        self._execute(ops)

    def _execute(self, ops: Ops) -> None:
        try:
            self._run_commands(args=ops.argv())
        except redis.RedisError:
            # Whatever we hold is still pending: re-read our own pending entries first next time.
            self._own_pending_done = False
            self._own_cursor = "0"
            raise

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
        ops = Ops()
        ops.xadd(self.keys.dead, fields, maxlen=100_000)
        ops.hincrby(self.keys.stats, f"dead_{self.source}", 1)
        ops.xack(self.stream, self.group, entry.id)
        self._execute(ops)

    # -- housekeeping ----------------------------------------------------------------

    def trim(self) -> int:
        """Delete entries of the input stream that every group has acknowledged."""
        return trim_acknowledged(self.client, self.stream)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


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
