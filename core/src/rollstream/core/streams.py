"""The rollout buffer: Redis streams read through consumer groups.

One `StreamStage` is one consumer of one input stream. Its contract:
- `read()` first returns this consumer's own pending entries (after a restart under the
  same name), then takes over entries left pending by another, dead consumer (idle for
  `claim_idle_ms`: XPENDING IDLE + XCLAIM), then reads new ones (XREADGROUP `>`). Entries delivered more than
  `max_deliveries` times go to the dead-letter stream instead of being returned.
  `read_valid()` adds decoding and validation: a bad entry is dead-lettered alone.
- `commit()` writes the outputs to the next stream(s) and acknowledges the inputs in one
  Lua script, which Redis runs atomically: a crash leaves either nothing done (the inputs
  stay pending and are claimed again) or everything. Unlike MULTI/EXEC, a script stops at
  the first failing command, and the ack comes last: an output that cannot be written
  (WRONGTYPE, OOM) leaves its input pending instead of acknowledging it away. The script
  writes only while its inputs are still pending on the caller, so a commit retried after
  a lost reply, or one racing a take-over, writes nothing twice. The trainer still
  deduplicates by group_id (a stage slower than claim_idle_ms is taken over and its work
  done twice; only the first commit lands).
- `dead_letter()` moves an entry to `rs:{<run>}:dead` with its reason, atomically with its ack,
  counted as `dead_<source>` in the reading role's own counters (RunKeys.counters).
- `trim()` deletes entries that every consumer group has acknowledged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import redis
from google.protobuf.message import Message

from rollstream.core import redis_policy, validation
from rollstream.core.config import CommonSettings, consumer_name
from rollstream.core.run_keys import STAGE_READER, RunKeys, as_text, trim_acknowledged
from rollstream.v1 import rollout_pb2

# The consumer group that keeps `dead` a stream (StreamStage.__init__); nobody reads with it.
DEAD_GROUP = "keep"

M = TypeVar("M")


@dataclass
class Entry:
    id: bytes
    fields: validation.Fields
    deliveries: int


# Runs a list of commands in order, atomically. KEYS: every key touched (Redis Cluster needs
# them declared; one run's keys share a slot). ARGV: group, consumer, the number of input
# ids and the ids, then the number of commands and per command its argc, name, the index
# of its key in KEYS and the remaining arguments.
#
# The inputs must all still be pending on this consumer, else nothing is written and 0 is
# returned (the idempotence of the module docstring). Redis has no rollback, so the script
# then checks, before writing anything, that no command can fail on what the keys hold:
# each key's type against its command (WRONGTYPE), and each field it will HINCRBY, which
# must be absent or an integer that cannot overflow (at most 18 digits). One bad key or
# field refuses the whole list with an error that names it and ends in "nothing written"
# (redis_policy.is_refused_write). SET is not checked: it replaces whatever the key holds.
# Under maxmemory, Redis refuses a script's first write (OOM) before anything is applied.
# What remains, an error in a command itself, stops at that command (redis.call raises),
# with the ack last.
_RUN_COMMANDS = """
local group, consumer = ARGV[1], ARGV[2]
local m = tonumber(ARGV[3])
for j = 1, m do
  local id = ARGV[3 + j]
  if #redis.call('XPENDING', KEYS[1], group, id, id, 1, consumer) == 0 then
    return 0
  end
end
local expected = {XADD = 'stream', XACK = 'stream', HINCRBY = 'hash', HSET = 'hash', HDEL = 'hash', SADD = 'set'}
local first = 4 + m
local n = tonumber(ARGV[first])
local i = first + 1
for _ = 1, n do
  local argc = tonumber(ARGV[i])
  local name = string.upper(ARGV[i + 1])
  local want = expected[name]
  if want then
    local key = KEYS[tonumber(ARGV[i + 2])]
    local have = redis.call('TYPE', key)['ok']
    if have ~= 'none' and have ~= want then
      return redis.error_reply('WRONGTYPE ' .. name .. ' on ' .. key .. ', a ' .. have .. ': nothing written')
    end
    if name == 'HINCRBY' and have == 'hash' then
      local value = redis.call('HGET', key, ARGV[i + 3])
      local digits = value and string.match(value, '^%-?([1-9]%d*)$')
      if value and value ~= '0' and not (digits and #digits <= 18) then
        local shown = string.gsub(string.sub(value, 1, 40), '[^%w%p ]', '?')
        return redis.error_reply('NOTCOUNTER field ' .. ARGV[i + 3] .. ' of ' .. key .. " holds '" .. shown ..
          "', not an integer counter: nothing written")
      end
    end
  end
  i = i + 1 + argc
end
i = first + 1
for _ = 1, n do
  local argc = tonumber(ARGV[i])
  local call = {ARGV[i + 1], KEYS[tonumber(ARGV[i + 2])]}
  for k = i + 3, i + argc do
    call[#call + 1] = ARGV[k]
  end
  redis.call(unpack(call))
  i = i + 1 + argc
end
return 1
"""

Arg = bytes | str | int | float


class Ops:
    """Commands to run atomically with a commit; the same method names as a redis-py pipeline."""

    def __init__(self) -> None:
        self.commands: list[tuple[str, str, list[Arg]]] = []

    def xadd(self, key: str, fields: dict, maxlen: int | None = None, approximate: bool = True) -> None:
        trim: list[Arg] = ["MAXLEN", "~" if approximate else "=", maxlen] if maxlen else []
        flat: list[Arg] = [x for kv in fields.items() for x in kv]
        self.commands.append(("XADD", key, [*trim, "*", *flat]))

    def xack(self, key: str, group: str, *ids: bytes) -> None:
        self.commands.append(("XACK", key, [group, *ids]))

    def hincrby(self, key: str, field: str, amount: int = 1) -> None:
        self.commands.append(("HINCRBY", key, [field, amount]))

    def sadd(self, key: str, *members: str) -> None:
        if members:
            self.commands.append(("SADD", key, list(members)))

    def set(self, key: str, value: str | int) -> None:
        self.commands.append(("SET", key, [value]))

    def hset(self, key: str, field: str, value: Arg) -> None:
        self.commands.append(("HSET", key, [field, value]))

    def hdel(self, key: str, *fields: str) -> None:
        if fields:
            self.commands.append(("HDEL", key, list(fields)))

    def keys_and_argv(
        self, source: str, group: str, consumer: str, inputs: Sequence[bytes]
    ) -> tuple[list[str], list[Arg]]:
        keys = [source]
        index = {source: 1}
        argv: list[Arg] = [group, consumer, len(inputs), *inputs, len(self.commands)]
        for name, key, args in self.commands:
            if key not in index:
                keys.append(key)
                index[key] = len(keys)
            argv.extend([2 + len(args), name, index[key], *args])
        return keys, argv


Extra = Callable[[Ops], None]


class StreamStage:
    """A consumer in group `group` of the stream `rs:{<run>}:<source>`.

    With `health`, transient Redis errors in `commit` and `dead_letter` are waited out
    (the script is idempotent, so a retry after a lost reply writes nothing twice), so work
    done is never thrown away for a blip, and so is a commit the script refuses whole (a
    poisoned key: slowly, until fixed); `read` errors propagate to the caller's loop."""

    def __init__(
        self,
        client: redis_policy.Client,
        keys: RunKeys,
        source: str,
        group: str,
        consumer: str,
        *,
        claim_idle_ms: int = 30_000,
        max_deliveries: int = 5,
        health: redis_policy.RedisHealth | None = None,
        on_dead_letter: Callable[[Entry, str], None] | None = None,
    ):
        self.client = client
        self.keys = keys
        self.source = source
        self.stream = keys.stream(source)
        if source not in STAGE_READER:
            raise ValueError(f"no stage {source!r}: one of {', '.join(STAGE_READER)}")
        # The reading role's own counters: its dead letters (dead_<source>) and, through
        # services, what it did (the only counter hash its ACL lets it write).
        self.counters = keys.counters(STAGE_READER[source])
        self.group = group
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms
        self.max_deliveries = max_deliveries
        self.health = health
        # Told of every entry this stage moves to the dead letters, whichever path moved it
        # (unparseable, over-delivered, unusable after the work): the service's counter and log.
        self.on_dead_letter = on_dead_letter
        self._own_cursor: bytes | str = "0"
        self._own_pending_done = False
        # After a failed call in this process, our own pending entries are re-read without
        # counting a delivery: Redis trouble is not the entry's fault.
        self._reread_quietly = False
        self._run_commands = client.register_script(_RUN_COMMANDS)
        self.ensure_group(self.client, self.stream, self.group)
        # `dead`, which every stage writes, made a stream now: while it does not exist, any
        # role (all may HINCRBY, some HSET or SADD) could create it as another type, and
        # every dead letter after would be refused. A key changes type only by DEL, which no
        # stage role but the trainer has. A group with nothing to read is what creates an
        # empty stream; one already poisoned is said by the first dead letter's refusal.
        try:
            self.ensure_group(self.client, keys.dead, DEAD_GROUP)
        except redis.ResponseError as e:
            if "WRONGTYPE" not in str(e):
                raise

    @staticmethod
    def ensure_group(client: redis_policy.Client, stream: str, group: str) -> None:
        """Create the group at the start of the stream (idempotent; creates the stream too)."""
        try:
            client.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    @classmethod
    def for_service(
        cls,
        client: redis_policy.Client,
        settings: CommonSettings,
        source: str,
        group: str,
        health: redis_policy.RedisHealth | None = None,
        on_dead_letter: Callable[[Entry, str], None] | None = None,
    ) -> "StreamStage":
        """The stage a service reads: its run, consumer name and delivery settings."""
        return cls(
            client,
            RunKeys(settings.run),
            source,
            group,
            consumer_name(settings),
            claim_idle_ms=settings.claim_idle_ms,
            max_deliveries=settings.max_deliveries,
            health=health,
            on_dead_letter=on_dead_letter,
        )

    # -- reading ---------------------------------------------------------------------

    def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to `count` entries: ours pending, others' orphans, then new ones (waiting up to
        `block_ms` for them; None: not at all)."""
        try:
            entries = self._read_own_pending(count) if not self._own_pending_done else []
            if not entries:
                entries = self._claim_stale(count)
            if not entries:
                entries = self._read_new(count, block_ms)
            return self._filter_over_delivered(entries)
        except redis_policy.ERRORS as e:
            # A reply may have been lost with entries delivered to us: read our own pending
            # entries again first. A stream or group deleted under us (FLUSHALL, a Redis
            # restarted without its data) is created again.
            self.reread_own_pending()
            if "NOGROUP" in str(e):
                self.ensure_group(self.client, self.stream, self.group)
            raise

    def read_valid(self, count: int, block_ms: int | None, parse: Callable[[Entry], M]) -> list[tuple[Entry, M]]:
        """`read`, then `parse` each entry (decode + validate, raising validation.EntryError with
        the reason); an entry that fails goes to the dead-letter stream alone, with its
        reason, and the others are returned."""
        good: list[tuple[Entry, M]] = []
        for entry in self.read(count, block_ms):
            try:
                good.append((entry, parse(entry)))
            except validation.EntryError as e:
                self.dead_letter(entry, str(e))
        return good

    def reread_own_pending(self) -> None:
        """Return our own pending entries again on the next reads, without counting a
        delivery: after a failure anywhere in the caller's turn (or in a call of ours),
        entries it had read may be in no one's hands but ours."""
        self._own_pending_done = False
        self._own_cursor = "0"
        self._reread_quietly = True

    def _read_own_pending(self, count: int) -> list[Entry]:
        """Our own unacked entries come first, each once (a cursor walks the history; it
        restarts after a failed call). After a restart under the same consumer name they
        count a delivery (the process may have died of them); after a failed call in this
        process they do not (XCLAIM with RETRYCOUNT keeps the count)."""
        if not self._reread_quietly:
            reply = self.client.xreadgroup(self.group, self.consumer, {self.stream: self._own_cursor}, count=count)
            entries = self._with_deliveries(self._entries(reply))
        else:
            low = "-" if self._own_cursor == "0" else b"(" + _as_bytes(self._own_cursor)
            pending = self.client.xpending_range(
                self.stream, self.group, min=low, max="+", count=count, consumername=self.consumer
            )
            entries = []
            for p in pending:
                claimed = self.client.xclaim(
                    self.stream, self.group, self.consumer, 0, [p["message_id"]], retrycount=int(p["times_delivered"])
                )
                fields = claimed[0][1] if claimed and claimed[0][0] is not None else None
                entries.append(Entry(id=p["message_id"], fields=fields or {}, deliveries=int(p["times_delivered"])))
        if entries:
            self._own_cursor = entries[-1].id
        else:
            self._own_pending_done = True
            self._reread_quietly = False
        return entries

    def held_by_others(self) -> int:
        """Entries other consumers of this group hold and may still be working on: pending
        with them, and not idle past claim_idle_ms (those are orphans, which this consumer's
        own reads claim)."""
        try:
            summary = self.client.xpending(self.stream, self.group)
        except redis.ResponseError as e:
            if "NOGROUP" in str(
                e
            ):  # stream or group gone (a flushed Redis): nobody holds anything; read() makes it again
                return 0
            raise
        others = sum(int(c["pending"]) for c in summary.get("consumers") or [] if as_text(c["name"]) != self.consumer)
        if others == 0:
            return 0
        return others - len(self._idle_on_others(int(summary["pending"])))

    def _idle_on_others(self, count: int) -> list[bytes]:
        """Ids of the entries idle past claim_idle_ms on *other* consumers, among the first
        `count` pending entries idle that long: orphans, up for a take-over."""
        pending = self.client.xpending_range(
            self.stream, self.group, min="-", max="+", count=count, idle=self.claim_idle_ms
        )
        return [p["message_id"] for p in pending if as_text(p["consumer"]) != self.consumer]

    def _claim_stale(self, count: int) -> list[Entry]:
        """Take over entries idle for claim_idle_ms on *other* consumers (XAUTOCLAIM would also
        hand us back entries we hold ourselves, e.g. a trainer filling its batch)."""
        ids = self._idle_on_others(count * 8)[:count]
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

    def _read_new(self, count: int, block_ms: int | None) -> list[Entry]:
        return self._entries(
            self.client.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        )

    @staticmethod
    def _entries(reply) -> list[Entry]:
        return [
            Entry(id=eid, fields=fields or {}, deliveries=1) for _stream, items in reply or [] for eid, fields in items
        ]

    def _with_deliveries(self, entries: list[Entry]) -> list[Entry]:
        """Fill in each entry's delivery count from the pending entries list."""
        if not entries:
            return entries
        # Our pending list may hold other entries inside this id range (a trainer filling its
        # batch), hence the margin on count.
        pending = self.client.xpending_range(
            self.stream,
            self.group,
            min=entries[0].id,
            max=entries[-1].id,
            count=4 * len(entries) + 100,
            consumername=self.consumer,
        )
        counts = {p["message_id"]: p["times_delivered"] for p in pending}
        for e in entries:
            e.deliveries = int(counts.get(e.id, 1))
        return entries

    def _filter_over_delivered(self, entries: list[Entry]) -> list[Entry]:
        keep = []
        for e in entries:
            if e.deliveries > self.max_deliveries:
                self.dead_letter(
                    e,
                    f"delivered {e.deliveries} times (max_deliveries={self.max_deliveries}) without being acknowledged: "
                    f"each consumer that took it stopped before committing it (crash, kill or an error it could not survive)",
                )
            elif not e.fields:
                self.client.xack(self.stream, self.group, e.id)
            else:
                keep.append(e)
        return keep

    # -- writing ---------------------------------------------------------------------

    def commit(
        self, entries: Sequence[Entry], outputs: Sequence[tuple[str, Message]] = (), extra: Extra | None = None
    ) -> bool:
        """Write `outputs` (stage name, message), run `extra`, then ack `entries`, in one script:
        atomic against crashes, and idempotent. Returns False (nothing written) when the
        entries are no longer pending on us: an earlier try of this very commit went
        through, or another consumer took them over. A key of the wrong type or a counter
        field that is not an integer refuses the whole commit before anything is written;
        the entries stay pending. With `health`, such a refusal is waited out like an
        outage but said as what it is (redis_policy.RedisHealth.call, wait_out_refusals):
        not ready, an ERROR line naming the key, a slow retry until an operator fixes it."""
        ops = Ops()
        for stage, message in outputs:
            ops.xadd(self.keys.stream(stage), validation.encode(message))
        if extra is not None:
            extra(ops)
        if entries:
            ops.xack(self.stream, self.group, *[e.id for e in entries])
        return self._execute(ops, [e.id for e in entries])

    def _execute(self, ops: Ops, inputs: Sequence[bytes]) -> bool:
        keys, argv = ops.keys_and_argv(self.stream, self.group, self.consumer, inputs)

        def run() -> bool:
            return bool(self._run_commands(keys=keys, args=argv))

        try:
            if self.health is None:
                return run()
            return self.health.call(run, f"commit to {self.stream}", wait_out_refusals=True)
        except redis_policy.ERRORS + (redis_policy.Stopped,):
            # Whatever we hold is still pending: re-read our own pending entries first next time.
            self.reread_own_pending()
            raise

    def apply(self, ops: Ops) -> None:
        """Run `ops` atomically with no input to acknowledge (a feeder's writes)."""
        self._execute(ops, [])

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
        fields = validation.encode(letter)
        fields["reason"] = reason.encode()  # readable with plain redis-cli
        ops = Ops()
        ops.xadd(self.keys.dead, fields, maxlen=100_000)
        ops.hincrby(self.counters, f"dead_{self.source}", 1)
        ops.xack(self.stream, self.group, entry.id)
        # Not moved (False) when the entry was taken over meanwhile: its new owner decides.
        if self._execute(ops, [entry.id]) and self.on_dead_letter is not None:
            self.on_dead_letter(entry, reason)

    # -- housekeeping ----------------------------------------------------------------

    def trim(self) -> int:
        """Delete entries of the input stream that every group has acknowledged."""
        return trim_acknowledged(self.client, self.stream)


def _as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
