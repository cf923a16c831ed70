"""A custom reward service for rollstream that uses only a Redis client and protobuf.

It reads RolloutGroups from rs:{<run>}:rollouts with its own consumer group, looks up each
group's task in the trainer's task map rs:{<run>}:tasks (a group of a task the trainer did
not feed is dead-lettered; the answer and metadata to score with are the task's, never the
group's), gives every completion a reward, and writes the group to rs:{<run>}:scored (or :ready when the
reference stage is skipped), acknowledging the input in the same Lua script. It imports
nothing from rollstream: the message classes come from proto/rollstream/v1/rollout.proto
(python generate_stubs.py), and docs/custom-reward.md is the whole contract.

The grader here is deliberately simple and checkable: reward 1.0 when the completion has
an even number of tokens, else 0.0. Replace `score()` with yours.

    python generate_stubs.py
    python parity_reward.py --redis-url redis://127.0.0.1:6379/0 --run demo --output-stage ready
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

import redis

SCHEMA = b"1"  # the `schema` field this code reads and writes
MAX_DELIVERIES = 5  # an entry read this often without being acknowledged goes to the dead letters

# Write the output (or the dead letter), acknowledge the input, count it: one atomic step,
# the script of docs/custom-reward.md. It writes only while the entry is still pending on
# this consumer, so a commit retried after a lost reply, or one whose entry was taken over
# meanwhile, writes nothing (returns 0). It checks every key and the counter before it
# writes anything, so what a key holds (another type, a counter that is not an integer)
# refuses the whole commit ("... nothing written"), never half of it.
# KEYS: input stream, output stream, our counters (rs:{<run>}:stats:reward, the only hash
# the reward user may write). ARGV: group, consumer, entry id, counter field, output MAXLEN
# ("0": none), then the output entry's field/value pairs.
COMMIT = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1, ARGV[2]) == 0 then
  return 0
end
-- Check before writing (Redis has no rollback): a key of another type, or a counter that
-- is not an integer, refuses the commit whole, the entry still pending.
local want = {'stream', 'stream', 'hash'}
for k = 1, 3 do
  local have = redis.call('TYPE', KEYS[k])['ok']
  if have ~= 'none' and have ~= want[k] then
    return redis.error_reply('WRONGTYPE ' .. KEYS[k] .. ' is a ' .. have .. ': nothing written')
  end
end
local count = redis.call('HGET', KEYS[3], ARGV[4])
local digits = count and string.match(count, '^%-?([1-9]%d*)$')
if count and count ~= '0' and not (digits and #digits <= 18) then
  return redis.error_reply('NOTCOUNTER ' .. ARGV[4] .. ' of ' .. KEYS[3] .. ' is not an integer: nothing written')
end
if ARGV[5] == '0' then
  redis.call('XADD', KEYS[2], '*', unpack(ARGV, 6))
else
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', unpack(ARGV, 6))
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
return 1
"""


def score(completion, answer: str) -> tuple[float, str]:
    """(reward, component name) for one completion. Yours goes here."""
    return (1.0 if len(completion.token_ids) % 2 == 0 else 0.0), "parity"


class ParityReward:
    def __init__(self, args: argparse.Namespace, pb) -> None:
        self.pb = pb  # the generated rollout_pb2 module
        self.r = redis.Redis.from_url(args.redis_url)
        self.group = args.group
        self.consumer = args.consumer
        self.block_ms = args.block_ms
        self.claim_idle_ms = args.claim_idle_ms
        prefix = f"rs:{{{args.run}}}:"  # the {run} hash tag: one Redis Cluster slot per run
        self.source, self.output = prefix + "rollouts", prefix + args.output_stage
        self.dead, self.stats = prefix + "dead", prefix + "stats:reward"
        self.tasks = prefix + "tasks"  # task_id -> PromptTask, written by the trainer only
        self.commit = self.r.register_script(COMMIT)
        self.stopping = False
        try:
            self.r.xgroup_create(self.source, self.group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def run(self) -> None:
        # 1. What we read before a restart (same consumer name) and never acknowledged.
        while not self.stopping:
            entries = self.read("0")
            if not entries:
                break
            self.handle(entries, check_deliveries=True)
        next_trim = time.monotonic()
        while not self.stopping:
            # 2. Entries a dead consumer left pending, then 3. new ones.
            claimed = self.claim()
            if claimed:
                self.handle(claimed, check_deliveries=True)
            else:
                self.handle(self.read(">", block=True), check_deliveries=False)
            if time.monotonic() >= next_trim:
                self.trim()
                next_trim = time.monotonic() + 5.0

    def read(self, start: str, block: bool = False) -> list[tuple[bytes, dict[bytes, bytes]]]:
        reply = self.r.xreadgroup(
            self.group, self.consumer, {self.source: start}, count=16, block=self.block_ms if block else None
        )
        return [(eid, fields) for _stream, items in reply or [] for eid, fields in items if fields]

    def claim(self) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Entries idle for claim_idle_ms on *another* consumer (XPENDING IDLE + XCLAIM, as the
        built-in stages do: XAUTOCLAIM would also hand us back entries we still hold)."""
        pending = self.r.xpending_range(self.source, self.group, min="-", max="+", count=128, idle=self.claim_idle_ms)
        ids = [p["message_id"] for p in pending if p["consumer"].decode() != self.consumer][:16]
        if not ids:
            return []
        claimed = [
            (eid, fields)
            for eid, fields in self.r.xclaim(self.source, self.group, self.consumer, self.claim_idle_ms, ids)
            if eid is not None
        ]
        gone = [i for i in ids if i not in {eid for eid, fields in claimed if fields}]
        if gone:  # trimmed away while pending (Redis 6.2 hands them over empty): nothing to score
            self.r.xack(self.source, self.group, *gone)
        return [(eid, fields) for eid, fields in claimed if fields]

    def handle(self, entries: list[tuple[bytes, dict[bytes, bytes]]], check_deliveries: bool) -> None:
        deliveries = self.deliveries([eid for eid, _ in entries]) if check_deliveries else {}
        for eid, fields in entries:
            if deliveries.get(eid, 1) > MAX_DELIVERIES:
                self.dead_letter(
                    eid, fields, f"delivered {deliveries[eid]} times without being acknowledged", deliveries[eid]
                )
                continue
            try:
                group = self.decode(fields)
                task = self.task(group)
            except ValueError as e:
                self.dead_letter(eid, fields, str(e), deliveries.get(eid, 1))
                continue
            # What the trainer asked, whatever the group claims (the trainer refuses a group
            # whose answer, metadata or kind are not its task's).
            group.answer, group.metadata_json, group.task_kind = task.answer, task.metadata_json, task.task_kind
            if not group.scored:  # already scored upstream: forward as it is
                for c in group.completions:
                    reward, name = score(c, group.answer)
                    c.reward = reward
                    del c.reward_components[:]
                    c.reward_components.add(name=name, value=reward, weight=1.0, status="ok")
                group.scored = True
            out = [b"type", b"rollstream.v1.RolloutGroup", b"schema", SCHEMA, b"data", group.SerializeToString()]
            self.checked_commit(
                [self.source, self.output, self.stats], [self.group, self.consumer, eid, "scored", "0", *out]
            )

    def checked_commit(self, keys: list[str], args: list) -> None:
        """The commit script; while it refuses for what a key holds, say so and try again
        every 10 s (the entry stays pending on us) until an operator fixes the key."""
        while True:
            try:
                self.commit(keys=keys, args=args)
                return
            except redis.ResponseError as e:
                if "nothing written" not in str(e) or self.stopping:
                    raise
                print(f"commit refused, retrying in 10 s: {e}", file=sys.stderr, flush=True)
                time.sleep(10)

    def decode(self, fields: dict[bytes, bytes]):
        if fields.get(b"type") != b"rollstream.v1.RolloutGroup":
            raise ValueError(f"type is {fields.get(b'type')!r}, expected rollstream.v1.RolloutGroup")
        if fields.get(b"schema") != SCHEMA:
            raise ValueError(f"schema {fields.get(b'schema')!r} is not supported (this service reads 1)")
        group = self.pb.RolloutGroup()
        try:
            group.ParseFromString(fields.get(b"data", b""))
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError or whatever its parser raises on hostile bytes
            raise ValueError(f"data does not parse as rollstream.v1.RolloutGroup: {e}") from None
        if not group.group_id or not group.completions:
            raise ValueError("RolloutGroup without group_id or completions")
        return group

    def task(self, group):
        """The task the trainer fed for this group (HMGET rs:{<run>}:tasks <task_id>)."""
        (raw,) = self.r.hmget(self.tasks, [group.task_id])
        if raw is None:
            raise ValueError(f"task {group.task_id!r} is not in {self.tasks}: not a task the trainer fed")
        task = self.pb.PromptTask()
        task.ParseFromString(raw)
        return task

    def deliveries(self, ids: list[bytes]) -> dict[bytes, int]:
        """How often each entry was delivered (our pending entries list knows)."""
        wanted = set(ids)
        pending = self.r.xpending_range(
            self.source, self.group, min="-", max="+", count=10_000, consumername=self.consumer
        )
        return {p["message_id"]: int(p["times_delivered"]) for p in pending if p["message_id"] in wanted}

    def dead_letter(self, eid: bytes, fields: dict[bytes, bytes], reason: str, deliveries: int = 1) -> None:
        letter = self.pb.DeadLetter(
            source_stream=self.source, source_id=eid.decode(), consumer_group=self.group, consumer=self.consumer,
            reason=reason, deliveries=deliveries, original_fields={k.decode(errors="replace"): v for k, v in fields.items()},
            dead_at=time.time(),  # seconds since the epoch
        )  # fmt: skip
        out = [
            b"type",
            b"rollstream.v1.DeadLetter",
            b"schema",
            SCHEMA,
            b"data",
            letter.SerializeToString(),
            b"reason",
            reason.encode(),
        ]
        self.checked_commit(
            [self.source, self.dead, self.stats], [self.group, self.consumer, eid, "dead_rollouts", "100000", *out]
        )
        print(f"dead letter {eid.decode()}: {reason}", file=sys.stderr, flush=True)

    def trim(self) -> None:
        """Delete input entries every group has acknowledged: the generators measure the
        groups in flight by stream lengths, so an untrimmed input stream stalls them."""
        floor = None
        for g in self.r.xinfo_groups(self.source):
            if g["pending"]:
                needed = _id(self.r.xpending(self.source, g["name"])["min"])
            else:
                ms, seq = _id(g["last-delivered-id"])
                needed = (ms, seq + 1)
            floor = needed if floor is None or needed < floor else floor
        if floor is not None:
            self.r.xtrim(self.source, minid=f"{floor[0]}-{floor[1]}", approximate=False)


def _id(eid: bytes) -> tuple[int, int]:
    ms, _, seq = eid.decode().partition("-")
    return int(ms), int(seq or 0)


def main() -> int:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--run", default="demo", help="run name: the streams are rs:{<run>}:<stage>")
    parser.add_argument("--group", default="custom-reward", help="our consumer group on rs:{<run>}:rollouts")
    parser.add_argument(
        "--consumer",
        default=f"{socket.gethostname()}-{os.getpid()}",
        help="stable name: a restart resumes its pending entries",
    )
    parser.add_argument(
        "--output-stage",
        choices=["scored", "ready"],
        default="scored",
        help="ready when the run has no reference stage (beta = 0)",
    )
    parser.add_argument(
        "--stubs", default=str(here / "generated"), help="folder holding rollout_pb2.py (python generate_stubs.py)"
    )
    parser.add_argument("--block-ms", type=int, default=500)
    parser.add_argument(
        "--claim-idle-ms", type=int, default=30_000, help="take over entries a dead consumer left pending this long"
    )
    args = parser.parse_args()

    sys.path.insert(0, args.stubs)
    pb = importlib.import_module("rollout_pb2")
    service = ParityReward(args, pb)

    def stop(signum: int, frame: object) -> None:
        service.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(
        f"parity reward: {service.source} -> {service.output} as {args.group}/{args.consumer}",
        file=sys.stderr,
        flush=True,
    )
    service.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
