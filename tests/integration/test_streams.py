"""rollstream.core.streams against a real redis-server: commit atomicity, dead letters,
take-over of stale entries, max_deliveries, restarts, trimming, and what MULTI/EXEC does
(and does not) guarantee when a command fails inside the transaction."""

from __future__ import annotations

import time

import pytest
import redis

from helpers import write
from rollstream.core import run_keys, streams, validation
from rollstream.core.run_keys import RunKeys
from rollstream.core.streams import Entry, StreamStage
from rollstream.v1 import rollout_pb2

SRC, DST, GROUP = "rollouts", "scored", "reward"
IDLE = 100  # ms; the take-over tests sleep past it (a lower bound, never an upper one)


def _group(i: int) -> rollout_pb2.RolloutGroup:
    return rollout_pb2.RolloutGroup(
        group_id=f"g{i}",
        task_id=f"t{i}",
        prompt_ids=[1, 2, 3],
        completions=[rollout_pb2.Completion(token_ids=[4, 5], behaviour_logprobs=[-0.5, -1.0])],
    )


def _feed(client: redis.Redis, keys: RunKeys, n: int, start: int = 0) -> list[bytes]:
    return [write(client, keys, SRC, _group(start + i)) for i in range(n)]


def _stage(client: redis.Redis, keys: RunKeys, consumer: str, **kw) -> StreamStage:
    return StreamStage(client, keys, SRC, GROUP, consumer, **kw)


def _pending_ids(client: redis.Redis, keys: RunKeys, group: str = GROUP, stream: str | None = None) -> list[bytes]:
    rows = client.xpending_range(stream or keys.stream(SRC), group, min="-", max="+", count=1000)
    return [r["message_id"] for r in rows]


def _stream_ids(client: redis.Redis, key: str) -> list[bytes]:
    return [eid for eid, _ in client.xrange(key)]


def _ids(entries: list[Entry]) -> list[bytes]:
    return [e.id for e in entries]


def _sleep_past_idle() -> None:
    # Deliberate: taking over entries idle for claim_idle_ms is what these tests test, and
    # only time makes an entry idle (a lower bound on the sleep, never an upper one).
    time.sleep(IDLE / 1000 * 1.5)


# --- read / commit --------------------------------------------------------------------------


def test_read_then_commit_moves_and_acks_in_one_step(rclient: redis.Redis, keys: RunKeys) -> None:
    ids = _feed(rclient, keys, 3)
    stage = _stage(rclient, keys, "A")
    entries = stage.read(count=10, block_ms=10)
    assert _ids(entries) == ids
    assert all(e.deliveries == 1 for e in entries)
    assert _pending_ids(rclient, keys) == ids  # read but not yet committed: pending

    groups = [validation.decode(e.fields, rollout_pb2.RolloutGroup) for e in entries]
    for g in groups:
        g.scored = True
    stage.commit(entries[:2], outputs=[(DST, g) for g in groups[:2]])

    out = rclient.xrange(keys.stream(DST))
    assert [validation.decode(f, rollout_pb2.RolloutGroup).group_id for _, f in out] == ["g0", "g1"]
    assert all(validation.decode(f, rollout_pb2.RolloutGroup).scored for _, f in out)
    assert _pending_ids(rclient, keys) == ids[2:]  # only the uncommitted one is still pending
    # Nothing new to read: committed entries do not come back.
    assert stage.read(count=10, block_ms=10) == []


def test_commit_extra_ops_run_in_the_same_transaction(rclient: redis.Redis, keys: RunKeys) -> None:
    _feed(rclient, keys, 2)
    stage = _stage(rclient, keys, "A")
    entries = stage.read(count=10, block_ms=10)
    handed: list[object] = []

    def ledger(ops: streams.Ops) -> None:
        handed.append(ops)
        assert rclient.xlen(keys.stream(DST)) == 0  # queued, not yet run
        ops.sadd(keys.groups("generated"), "g0", "g1")
        ops.hincrby(keys.counters("reward"), "scored", 2)
        ops.set(keys.version, 3)

    stage.commit(entries, outputs=[(DST, _group(0))], extra=ledger)
    assert len(handed) == 1 and isinstance(handed[0], streams.Ops)
    # Outputs first, then the extra ops, then the ack, all in the one script call.
    kinds = [c[0] for c in handed[0].commands]
    assert kinds == ["XADD", "SADD", "HINCRBY", "SET", "XACK"]
    assert rclient.smembers(keys.groups("generated")) == {b"g0", b"g1"}
    assert rclient.hget(keys.counters("reward"), "scored") == b"2"
    assert run_keys.current_version(rclient, keys) == 3
    assert rclient.xlen(keys.stream(DST)) == 1
    assert _pending_ids(rclient, keys) == []


def test_commit_with_no_entries_only_writes(rclient: redis.Redis, keys: RunKeys) -> None:
    stage = _stage(rclient, keys, "A")
    stage.commit([], outputs=[(DST, _group(7))])
    assert rclient.xlen(keys.stream(DST)) == 1


# --- dead letters ---------------------------------------------------------------------------


def test_dead_letter_records_reason_and_original_fields_and_acks(rclient: redis.Redis, keys: RunKeys) -> None:
    good = _feed(rclient, keys, 1)[0]
    bad_fields = {"type": b"rollstream.v1.RolloutGroup", "schema": b"1", "data": b"\xff\xff\xff"}
    bad = rclient.xadd(keys.stream(SRC), bad_fields)
    stage = _stage(rclient, keys, "A")
    entries = stage.read(count=10, block_ms=10)
    assert _ids(entries) == [good, bad]

    with pytest.raises(validation.EntryError) as err:
        validation.decode(entries[1].fields, rollout_pb2.RolloutGroup)
    stage.dead_letter(entries[1], str(err.value))

    dead = rclient.xrange(keys.dead)
    assert len(dead) == 1
    _, fields = dead[0]
    letter = validation.decode(fields, rollout_pb2.DeadLetter)
    assert letter.reason == str(err.value) and "does not parse" in letter.reason
    assert fields[b"reason"] == letter.reason.encode()  # readable with plain redis-cli
    assert dict(letter.original_fields) == bad_fields
    assert (letter.source_stream, letter.source_id) == (keys.stream(SRC), bad.decode())
    assert (letter.consumer_group, letter.consumer, letter.deliveries) == (GROUP, "A", 1)
    assert letter.dead_at > 0
    assert rclient.hget(keys.counters("reward"), f"dead_{SRC}") == b"1"
    assert _pending_ids(rclient, keys) == [good]  # the dead one is acked, the good one not


# --- take-over ------------------------------------------------------------------------------


def test_stale_entry_is_taken_over_by_another_consumer(rclient: redis.Redis, keys: RunKeys) -> None:
    ids = _feed(rclient, keys, 2)
    a = _stage(rclient, keys, "A", claim_idle_ms=IDLE)
    got = a.read(count=1, block_ms=10)
    assert _ids(got) == ids[:1]  # A takes one and dies without acking

    patient = _stage(rclient, keys, "P", claim_idle_ms=60_000)
    # Nothing is idle for a minute: P takes the next new entry, not A's.
    mine = patient.read(count=1, block_ms=10)
    assert _ids(mine) == ids[1:]
    patient.commit(mine)

    _sleep_past_idle()
    b = _stage(rclient, keys, "B", claim_idle_ms=IDLE)
    taken = b.read(count=10, block_ms=10)
    assert _ids(taken) == ids[:1]
    assert taken[0].deliveries == 2
    assert validation.decode(taken[0].fields, rollout_pb2.RolloutGroup).group_id == "g0"
    owners = rclient.xpending_range(keys.stream(SRC), GROUP, min="-", max="+", count=10)
    assert [(o["message_id"], o["consumer"]) for o in owners] == [(ids[0], b"B")]

    b.commit(taken, outputs=[(DST, _group(0))])
    assert _pending_ids(rclient, keys) == []
    # A comes back and commits late: its entry is no longer pending on it, so the commit
    # writes nothing (no duplicate downstream) and says so.
    assert a.commit(got, outputs=[(DST, _group(0))]) is False
    assert rclient.xlen(keys.stream(DST)) == 1
    # Nor can it dead-letter what is no longer its own, and it is not told it did.
    told: list[bytes] = []
    a.on_dead_letter = lambda e, r: told.append(e.id)
    a.dead_letter(got[0], "too late")
    assert told == [] and rclient.xlen(keys.dead) == 0


def test_entry_delivered_more_than_max_deliveries_goes_to_dead(rclient: redis.Redis, keys: RunKeys) -> None:
    (eid,) = _feed(rclient, keys, 1)
    max_deliveries = 2
    assert _ids(_stage(rclient, keys, "A", claim_idle_ms=IDLE, max_deliveries=max_deliveries).read(10, 10)) == [eid]
    _sleep_past_idle()
    b = _stage(rclient, keys, "B", claim_idle_ms=IDLE, max_deliveries=max_deliveries)
    second = b.read(10, 10)
    assert _ids(second) == [eid] and second[0].deliveries == 2  # == max: still delivered
    _sleep_past_idle()
    told: list[tuple[bytes, str]] = []
    c = _stage(
        rclient,
        keys,
        "C",
        claim_idle_ms=IDLE,
        max_deliveries=max_deliveries,
        on_dead_letter=lambda e, r: told.append((e.id, r)),
    )
    assert c.read(10, 10) == []  # third delivery > max: dead-lettered instead
    # ...and reported like every other dead letter (the service's counter and log line).
    assert [(i, "delivered 3 times" in r) for i, r in told] == [(eid, True)]

    dead = rclient.xrange(keys.dead)
    assert len(dead) == 1
    letter = validation.decode(dead[0][1], rollout_pb2.DeadLetter)
    assert "max_deliveries=2" in letter.reason and "delivered 3 times" in letter.reason
    assert letter.deliveries == 3 and letter.source_id == eid.decode() and letter.consumer == "C"
    assert (
        validation.decode({k.encode(): v for k, v in letter.original_fields.items()}, rollout_pb2.RolloutGroup).group_id
        == "g0"
    )
    assert _pending_ids(rclient, keys) == []
    # The stage goes on: new entries still flow.
    (new,) = _feed(rclient, keys, 1, start=1)
    assert _ids(c.read(10, 10)) == [new]


def test_restarted_consumer_with_same_name_gets_its_pending_entries_first(rclient: redis.Redis, keys: RunKeys) -> None:
    first = _feed(rclient, keys, 2)
    before = _stage(rclient, keys, "A", claim_idle_ms=60_000)
    assert _ids(before.read(count=2, block_ms=10)) == first  # then "crashes" without acking
    later = _feed(rclient, keys, 1, start=2)

    restarted = _stage(rclient, keys, "A", claim_idle_ms=60_000)
    own = restarted.read(count=10, block_ms=10)
    assert _ids(own) == first  # its own pending entries, not the newer one
    assert all(e.deliveries >= 2 for e in own)  # XREADGROUP 0 counts as a delivery
    restarted.commit(own)
    assert _ids(restarted.read(count=10, block_ms=10)) == later
    assert _pending_ids(rclient, keys) == later


def test_own_pending_entries_are_returned_once_not_on_every_read(rclient: redis.Redis, keys: RunKeys) -> None:
    """After a restart, read() re-reads the PEL from 0 on every call until it is empty, so a
    caller that holds entries across reads (the trainer buffers groups until it has
    groups_per_step) gets the same entries again and again, each time with a higher delivery
    count, until they are dead-lettered while still being held."""
    first = _feed(rclient, keys, 2)
    _stage(rclient, keys, "A", claim_idle_ms=60_000).read(count=2, block_ms=10)
    later = _feed(rclient, keys, 1, start=2)
    restarted = _stage(rclient, keys, "A", claim_idle_ms=60_000, max_deliveries=3)
    assert _ids(restarted.read(count=10, block_ms=10)) == first
    # Still holding `first` (not committed yet): the next read must move on.
    assert _ids(restarted.read(count=10, block_ms=10)) == later
    assert rclient.xlen(keys.dead) == 0


def test_a_consumer_does_not_take_over_its_own_in_flight_entries(rclient: redis.Redis, keys: RunKeys) -> None:
    """The contract: read() takes over entries left pending by a *dead* consumer. XAUTOCLAIM
    does not skip the caller's own entries, so a consumer that holds entries longer than
    claim_idle_ms (the trainer waiting for a full batch) gets them again as new deliveries."""
    ids = _feed(rclient, keys, 1)
    a = _stage(rclient, keys, "A", claim_idle_ms=IDLE)
    assert _ids(a.read(count=10, block_ms=10)) == ids
    _sleep_past_idle()
    assert a.read(count=10, block_ms=10) == []


# --- trimming -------------------------------------------------------------------------------


def test_trim_deletes_only_what_every_group_acknowledged(rclient: redis.Redis, keys: RunKeys) -> None:
    ids = _feed(rclient, keys, 6)
    fast = StreamStage(rclient, keys, SRC, "fast", "f")
    slow = StreamStage(rclient, keys, SRC, "slow", "s")
    fast.commit(fast.read(count=10, block_ms=10))  # fast has acked all 6
    got = slow.read(count=4, block_ms=10)  # slow has read 4 ...
    slow.commit([e for e in got if e.id in (ids[0], ids[1], ids[3])])  # ... and acked 0, 1, 3

    deleted = fast.trim()
    assert deleted == 2
    # ids[2] is pending in slow; ids[3] is acked but after it; 4 and 5 slow has not read.
    assert _stream_ids(rclient, keys.stream(SRC)) == ids[2:]
    assert slow.trim() == 0  # idempotent

    slow.commit([e for e in got if e.id == ids[2]])
    assert run_keys.trim_acknowledged(rclient, keys.stream(SRC)) == 2
    assert _stream_ids(rclient, keys.stream(SRC)) == ids[4:]  # slow never read 4 and 5

    slow.commit(slow.read(count=10, block_ms=10))
    assert run_keys.trim_acknowledged(rclient, keys.stream(SRC)) == 2
    assert rclient.xlen(keys.stream(SRC)) == 0
    # The groups still work after the stream is emptied.
    (new,) = _feed(rclient, keys, 1, start=9)
    assert _ids(fast.read(count=10, block_ms=10)) == [new]


def test_trim_survives_the_last_pending_entry_acked_by_another_worker_midway(redis_url: str, keys: RunKeys) -> None:
    """XINFO GROUPS says pending, and before XPENDING another worker acks it all (seen in
    CI with two reward workers): XPENDING then has no min. Trim to last-delivered, no crash."""

    class AckedMidway(redis.Redis):
        def xinfo_groups(self, name):
            groups = super().xinfo_groups(name)
            other.commit(pending)  # the other worker's commit lands between the two calls
            return groups

    client = AckedMidway.from_url(redis_url)
    ids = _feed(client, keys, 4)
    other = StreamStage(client, keys, SRC, GROUP, "other")
    pending = other.read(count=3, block_ms=10)
    assert run_keys.trim_acknowledged(client, keys.stream(SRC)) == 3
    assert _stream_ids(client, keys.stream(SRC)) == ids[3:]  # never delivered: kept
    client.close()


def test_trim_keeps_everything_for_a_group_that_has_not_read(rclient: redis.Redis, keys: RunKeys) -> None:
    ids = _feed(rclient, keys, 3)
    fast = StreamStage(rclient, keys, SRC, "fast", "f")
    StreamStage.ensure_group(rclient, keys.stream(SRC), "idle")
    fast.commit(fast.read(count=10, block_ms=10))
    assert fast.trim() == 0
    assert _stream_ids(rclient, keys.stream(SRC)) == ids


def test_trim_without_any_group_deletes_nothing(rclient: redis.Redis, keys: RunKeys) -> None:
    ids = _feed(rclient, keys, 3)
    assert run_keys.trim_acknowledged(rclient, keys.stream(SRC)) == 0
    assert _stream_ids(rclient, keys.stream(SRC)) == ids
    assert run_keys.trim_acknowledged(rclient, keys.stream("no-such-stage")) == 0
    assert not rclient.exists(keys.stream("no-such-stage"))


# --- failures inside the transaction ---------------------------------------------------------


def test_multi_exec_does_not_roll_back_a_command_failing_at_exec(rclient: redis.Redis, keys: RunKeys) -> None:
    """The Redis fact that rules MULTI/EXEC out for commit(): a command that fails when EXEC
    runs it (INCR on a stream: WRONGTYPE) fails alone; the commands around it, an XACK
    included, are applied, and redis-py raises only afterwards. A commit built that way would
    ack an input whose output was never written."""
    (eid,) = _feed(rclient, keys, 1)
    stage = _stage(rclient, keys, "A")
    assert _ids(stage.read(count=10, block_ms=10)) == [eid]
    pipe = rclient.pipeline(transaction=True)
    pipe.hincrby(keys.counters("reward"), "scored", 1)
    pipe.incr(keys.stream(SRC))  # WRONGTYPE at EXEC time
    pipe.xack(keys.stream(SRC), GROUP, eid)
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        pipe.execute()
    assert rclient.hget(keys.counters("reward"), "scored") == b"1"
    assert _pending_ids(rclient, keys) == []  # acked although the transaction "failed"


def test_multi_exec_aborts_everything_on_a_queue_time_error(rclient: redis.Redis, keys: RunKeys) -> None:
    """An error found while queueing (wrong arity, unknown command) makes EXEC answer
    EXECABORT: nothing at all is applied."""
    pipe = rclient.pipeline(transaction=True)
    pipe.hincrby(keys.counters("reward"), "scored", 1)
    pipe.execute_command("XADD", keys.stream(DST))  # wrong number of arguments
    with pytest.raises(redis.ResponseError, match="wrong number of arguments"):
        pipe.execute()
    assert rclient.hget(keys.counters("reward"), "scored") is None
    assert not rclient.exists(keys.stream(DST))


def test_failing_op_inside_commit_writes_nothing_and_leaves_the_input_pending(
    rclient: redis.Redis, keys: RunKeys
) -> None:
    """commit() checks every key's type before it writes: a command that would fail with
    WRONGTYPE refuses the whole commit, so nothing is half-written (Redis has no rollback),
    the input stays pending and comes back, and the retry writes its output once."""
    (eid,) = _feed(rclient, keys, 1)
    stage = _stage(rclient, keys, "A", claim_idle_ms=60_000)
    entries = stage.read(count=10, block_ms=10)

    def bad_ledger(ops: streams.Ops) -> None:
        ops.hincrby(keys.counters("reward"), "scored", 1)
        ops.hincrby(keys.stream(SRC), "oops", 1)  # WRONGTYPE: the key is a stream
        ops.sadd(keys.groups("generated"), "g0")

    with pytest.raises(redis.ResponseError, match="WRONGTYPE HINCRBY on .*, a stream: nothing written"):
        stage.commit(entries, outputs=[(DST, _group(0))], extra=bad_ledger)
    assert rclient.xlen(keys.stream(DST)) == 0  # the output, before the bad command: not written
    assert rclient.hget(keys.counters("reward"), "scored") is None
    assert not rclient.exists(keys.groups("generated"))
    assert _pending_ids(rclient, keys) == [eid]  # the ack never ran

    # The same stage gets the entry back on its next read and commits it properly, once.
    # A failed call in this process does not count a delivery (only a restart does).
    again = stage.read(count=10, block_ms=10)
    assert _ids(again) == [eid] and again[0].deliveries == 1
    stage.commit(again, outputs=[(DST, _group(0))], extra=lambda ops: ops.hincrby(keys.counters("reward"), "scored", 1))
    assert _pending_ids(rclient, keys) == []
    assert rclient.xlen(keys.stream(DST)) == 1
    assert rclient.hget(keys.counters("reward"), "scored") == b"1"


def test_a_counter_that_is_not_an_integer_refuses_the_whole_commit(rclient: redis.Redis, keys: RunKeys) -> None:
    """HINCRBY on a field holding text would fail after the output and the ledger set were
    written (no rollback): the script reads each field it will count first, and refuses
    the whole commit, naming the field, with nothing written and the input still pending.
    Fields too long to count safely (19 digits could overflow) and leading zeros (which
    HINCRBY refuses) are refused alike; an integer field is counted on."""
    (eid,) = _feed(rclient, keys, 1)
    stage = _stage(rclient, keys, "A", claim_idle_ms=60_000)
    entries = stage.read(count=10, block_ms=10)
    counters = keys.counters("reward")

    def ledger(ops: streams.Ops) -> None:
        ops.sadd(keys.groups("generated"), "g0")
        ops.hincrby(counters, "scored", 1)

    for poison in ("x", "9" * 19, "007", "1.5", "", "-0"):
        rclient.hset(counters, "scored", poison)
        with pytest.raises(
            redis.ResponseError,
            match=f"NOTCOUNTER field scored of {counters} holds .*not an integer counter: nothing written",
        ):
            stage.commit(entries, outputs=[(DST, _group(0))], extra=ledger)
        assert rclient.xlen(keys.stream(DST)) == 0 and not rclient.exists(keys.groups("generated"))
        assert _pending_ids(rclient, keys) == [eid]
    rclient.hset(counters, "scored", "-" + "9" * 18)  # an integer, however odd: counted on
    assert stage.commit(entries, outputs=[(DST, _group(0))], extra=ledger) is True
    assert rclient.hget(counters, "scored") == b"-" + b"9" * 17 + b"8"
    assert rclient.xlen(keys.stream(DST)) == 1 and _pending_ids(rclient, keys) == []


def test_set_replaces_a_key_of_another_type(rclient: redis.Redis, keys: RunKeys) -> None:
    """SET cannot fail on what the key holds (it replaces it): the script does not refuse a
    commit for it, so the trainer's version written as a hash by someone else is just
    written again."""
    stage = _stage(rclient, keys, "A")
    rclient.hset(keys.version, "x", 1)
    ops = streams.Ops()
    ops.set(keys.version, 3)
    stage.apply(ops)
    assert rclient.get(keys.version) == b"3"


# --- back-pressure: what really waits -------------------------------------------------------


def test_waiting_counts_unacknowledged_entries_not_stream_length(rclient: redis.Redis, keys: RunKeys) -> None:
    stream = keys.stream(SRC)
    assert run_keys.waiting(rclient, stream) == 0  # no stream yet
    _feed(rclient, keys, 5)
    assert run_keys.waiting(rclient, stream) == 5  # no group reads it yet: all of it waits
    stage = _stage(rclient, keys, "A")
    assert run_keys.waiting(rclient, stream) == 5  # a group that has read nothing: 5 unread
    got = stage.read(count=3, block_ms=10)
    assert run_keys.waiting(rclient, stream) == 5  # 3 pending + 2 unread
    stage.commit(got[:2])
    # Two acknowledged and not trimmed: XLEN still says 5, but only 3 wait.
    assert rclient.xlen(stream) == 5 and run_keys.waiting(rclient, stream) == 3
    assert run_keys.waiting(rclient, stream, limit=1) == 2  # unread counted up to the limit
    # A second group that has read nothing makes everything wait again: the slowest counts.
    StreamStage.ensure_group(rclient, stream, "audit")
    assert run_keys.waiting(rclient, stream) == 5


def test_held_by_others_counts_what_other_live_consumers_hold(rclient: redis.Redis, keys: RunKeys) -> None:
    """What the generators' back-pressure adds to the room: entries pending with another
    consumer of the group, not our own, not unread ones, not those idle past claim_idle_ms."""
    a = _stage(rclient, keys, "A", claim_idle_ms=600_000)  # nobody looks dead, however loaded the machine
    b = _stage(rclient, keys, "B", claim_idle_ms=600_000)
    assert a.held_by_others() == 0  # no stream, no group yet: nothing held, no error
    _feed(rclient, keys, 6)
    StreamStage.ensure_group(rclient, keys.stream(SRC), GROUP)
    got_b = b.read(count=3, block_ms=10)
    a.read(count=2, block_ms=10)
    assert (a.held_by_others(), b.held_by_others()) == (3, 2)  # one entry is still unread
    b.commit(got_b[:1])
    assert a.held_by_others() == 2
    # With a short claim_idle_ms, B's entries, once idle past it, are up for claims (B looks dead).
    a_quick = _stage(rclient, keys, "A", claim_idle_ms=IDLE)
    _sleep_past_idle()
    assert a_quick.held_by_others() == 0


def test_a_commit_retried_after_a_lost_reply_writes_nothing_twice(rclient: redis.Redis, keys: RunKeys) -> None:
    _feed(rclient, keys, 1)
    stage = _stage(rclient, keys, "A")
    got = stage.read(count=1, block_ms=10)
    assert (
        stage.commit(
            got, outputs=[(DST, _group(0))], extra=lambda ops: ops.hincrby(keys.counters("reward"), "scored", 1)
        )
        is True
    )
    # The same commit again, as after a timeout whose first try had gone through.
    assert (
        stage.commit(
            got, outputs=[(DST, _group(0))], extra=lambda ops: ops.hincrby(keys.counters("reward"), "scored", 1)
        )
        is False
    )
    assert rclient.xlen(keys.stream(DST)) == 1 and rclient.hget(keys.counters("reward"), "scored") == b"1"


def test_reread_after_a_failure_does_not_count_deliveries(rclient: redis.Redis, keys: RunKeys) -> None:
    (eid,) = _feed(rclient, keys, 1)
    stage = _stage(rclient, keys, "A", max_deliveries=2)
    assert _ids(stage.read(count=1, block_ms=10)) == [eid]
    # Ten failed turns in a row (Redis trouble): the entry comes back each time, still at
    # one delivery, and is never dead-lettered for it.
    for _ in range(10):
        stage.reread_own_pending()
        again = stage.read(count=1, block_ms=10)
        assert _ids(again) == [eid] and again[0].deliveries == 1
    assert rclient.xlen(keys.dead) == 0


def test_read_valid_dead_letters_each_bad_entry_alone(rclient: redis.Redis, keys: RunKeys) -> None:
    good = _feed(rclient, keys, 1)
    rclient.xadd(keys.stream(SRC), {"type": "junk"})
    good += _feed(rclient, keys, 1, start=1)
    seen: list[str] = []
    stage = _stage(rclient, keys, "A", on_dead_letter=lambda e, r: seen.append(r))
    parsed = stage.read_valid(10, 10, lambda e: validation.decode(e.fields, rollout_pb2.RolloutGroup))
    assert [e.id for e, _ in parsed] == good
    assert [g.group_id for _, g in parsed] == ["g0", "g1"]
    assert len(seen) == 1 and "missing field(s) schema, data" in seen[0]
    (dead,) = rclient.xrange(keys.dead)
    assert dead[1][b"reason"] == seen[0].encode()


def test_keys_of_a_run_share_one_cluster_slot(keys: RunKeys) -> None:
    from redis.crc import key_slot

    names = [keys.stream(s) for s in run_keys.STAGES] + [
        keys.dead,
        keys.metrics,
        *map(keys.counters, run_keys.COUNTER_ROLES),
        keys.version,
        keys.fed,
        keys.trained_log,
        keys.generators,
        keys.generators_seen,
        keys.generators_versions,
        keys.groups("trained"),
    ]
    assert all(n.startswith(f"rs:{{{keys.run}}}:") for n in names)
    assert len({key_slot(n.encode()) for n in names}) == 1
