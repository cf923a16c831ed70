"""A run's Redis keys (`RunKeys`) and what is read or written beside a stream's consumer
groups without being one of them: the policy version, the counters, what still waits, trimming
what every group acknowledged, and the generator registry. The consumer itself is StreamStage
(streams.py).

The generator registry is where the trainer pushes weights when no addresses are configured.
Each generator writes its address (hash `generators`: id -> host:port) and a heartbeat
(sorted set `generators:seen`: id -> last beat, in ms of the Redis server's clock, so hosts
with skewed clocks agree), and with each beat the policy version it holds (hash
`generators:versions`: id -> version, -1 before its first weights), which `rollstream status`
compares with the trainer's. A generator that stops beating for GENERATOR_TTL_S is dead: the
trainer drops it from every key and pushes to it no more; a restarted generator registers again.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from rollstream.core import redis_policy

STAGES = ("prompts", "rollouts", "scored", "ready")
# The role that reads each stage: what it dead-letters from that stage (dead_<stage>) is
# counted in its own counters (RunKeys.counters).
STAGE_READER = {
    "prompts": "generator",
    "eval_prompts": "generator",
    "rollouts": "reward",
    "scored": "reference",
    "ready": "trainer",
}
COUNTER_ROLES = ("generator", "reward", "reference", "trainer")
GENERATOR_TTL_S = 30.0  # a generator that has not beaten for this long is dead
BEAT_EVERY_S = GENERATOR_TTL_S / 6


@dataclass(frozen=True)
class RunKeys:
    """Every Redis key of a run: `rs:{<run>}:<name>`. A run name isolates experiments sharing
    one Redis; the braces are a Redis Cluster hash tag, so all of a run's keys live in one
    slot and the commit script may touch any of them (many runs spread over the shards)."""

    run: str

    @property
    def prefix(self) -> str:
        return f"rs:{{{self.run}}}:"

    def stream(self, stage: str) -> str:
        return f"{self.prefix}{stage}"

    @property
    def dead(self) -> str:
        return f"{self.prefix}dead"

    @property
    def metrics(self) -> str:
        return f"{self.prefix}metrics"

    def counters(self, role: str) -> str:
        """Hash of one role's counters (`rs:{<run>}:stats:<role>`: generated, scored, trained,
        dead_<stage>, ..., HINCRBY in the same scripts as the work they count). Each role's
        ACL may write its own hash only, so no writer can poison another's counter; readers
        sum them (read_counters)."""
        if role not in COUNTER_ROLES:
            raise ValueError(f"no counters for role {role!r}: one of {', '.join(COUNTER_ROLES)}")
        return f"{self.prefix}stats:{role}"

    @property
    def version(self) -> str:
        """The trainer's current policy version (string integer)."""
        return f"{self.prefix}version"

    @property
    def fed(self) -> str:
        """Prompts fed so far (string integer), written with the tasks: the feeder's position."""
        return f"{self.prefix}fed"

    @property
    def trained_log(self) -> str:
        """Groups trained since the last checkpoint, with their step: replayed on resume."""
        return f"{self.prefix}trained_log"

    @property
    def generators(self) -> str:
        """Hash generator_id -> gRPC address, for discovery when none are configured."""
        return f"{self.prefix}generators"

    @property
    def generators_seen(self) -> str:
        """Sorted set generator_id -> last heartbeat (ms, server clock): liveness of the registry."""
        return f"{self.prefix}generators:seen"

    @property
    def generators_versions(self) -> str:
        """Hash generator_id -> the policy version it held at its last heartbeat (-1: none yet)."""
        return f"{self.prefix}generators:versions"

    @property
    def tasks(self) -> str:
        """Hash task_id -> PromptTask bytes (its prompt_ids rendered): every task the trainer
        fed and has not yet swept. The trainer alone writes it, with the prompts it feeds; the
        reward scores with its answers, the trainer checks groups against it."""
        return f"{self.prefix}tasks"

    @property
    def evals(self) -> str:
        """Stream of EvalMetrics: one entry per held-out evaluation round (trainer/evaluation.py)."""
        return f"{self.prefix}evals"

    @property
    def eval_results(self) -> str:
        """Hash task_id -> one eval group's result (JSON), written with the group's ack and
        dropped when its round is reported: a restarted trainer finishes the round."""
        return f"{self.prefix}eval_results"

    def groups(self, outcome: str) -> str:
        """Set of group ids per outcome: generated, trained, stale (the accounting ledger)."""
        return f"{self.prefix}groups:{outcome}"


# How many entries of a stream are still waiting for some consumer group: for each group,
# its pending entries plus the entries after its last-delivered id (counted up to a limit
# server-side, so no payload crosses the wire); the largest over the groups. A stream no
# group reads yet: all of it. Redis 7's XINFO `lag` says the same, but 6.2 lacks it.
_WAITING = """
local limit = tonumber(ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then return redis.call('XLEN', KEYS[1]) end
local most = 0
for _, g in ipairs(groups) do
  local info = {}
  for k = 1, #g, 2 do info[g[k]] = g[k + 1] end
  local unread = #redis.call('XRANGE', KEYS[1], '(' .. info['last-delivered-id'], '+', 'COUNT', limit)
  local waiting = info['pending'] + unread
  if waiting > most then most = waiting end
end
return most
"""


def current_version(client: redis_policy.Client, keys: RunKeys) -> int:
    """The trainer's policy version. A value that is not an integer (written by someone
    else) reads as 0 until the trainer's next step writes it again: no reader dies of it."""
    value = client.get(keys.version)
    try:
        return int(value) if value is not None else 0
    except ValueError:
        return 0


def read_counters(client: redis_policy.Client, keys: RunKeys) -> tuple[dict[str, int], list[str]]:
    """The run's counters: every role's hash (RunKeys.counters) summed field by field (each
    role writes its own fields, so a sum is a merge: `step` and `groups_per_step` are the
    trainer's alone). Also what could not be read, one line each: a key that is not a hash,
    a field that is not an integer (skipped; the commit that would count it refuses)."""
    totals: dict[str, int] = {}
    problems: list[str] = []
    for role in COUNTER_ROLES:
        key = keys.counters(role)
        try:
            raw = client.hgetall(key)
        except redis.ResponseError as e:
            problems.append(f"{key}: {redis_policy.short(e)}")
            continue
        for field, value in raw.items():
            name = as_text(field)
            try:
                totals[name] = totals.get(name, 0) + int(value)
            except ValueError:
                problems.append(f"{key}: field {name!r} is not an integer")
    return totals, problems


def waiting(client: redis_policy.Client, stream: str, limit: int = 1000) -> int:
    """Entries of `stream` some consumer group has not acknowledged yet (pending + unread),
    counting unread ones up to `limit`: what back-pressure should count, not XLEN, which
    includes acknowledged entries not trimmed yet."""
    return int(client.eval(_WAITING, 1, stream, limit))


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def id_tuple(eid: bytes | str) -> tuple[int, int]:
    """A stream entry id as (ms, seq), for comparisons."""
    ms, _, seq = as_text(eid).partition("-")
    return int(ms), int(seq or 0)


def trim_acknowledged(client: redis_policy.Client, stream: str) -> int:
    """XTRIM MINID to the oldest entry some group still needs (pending or undelivered)."""
    try:
        groups = client.xinfo_groups(stream)
    except redis.ResponseError:
        return 0
    if not groups:
        return 0  # nobody has read it yet: everything is still needed
    needed_by_group: list[tuple[int, int]] = []
    for g in groups:
        # Everything up to last-delivered is acknowledged unless pending. This reading of
        # last-delivered may already be stale; it only grows, so a stale one trims less.
        ms, seq = id_tuple(g["last-delivered-id"])
        needed = (ms, seq + 1)
        if g["pending"]:
            # Another consumer may ack the last pending entry between the two calls: then
            # XPENDING has no min, and the bound above holds.
            oldest = client.xpending(stream, g["name"])["min"]
            if oldest is not None:
                needed = id_tuple(oldest)
        needed_by_group.append(needed)
    floor = min(needed_by_group)
    return int(client.xtrim(stream, minid=f"{floor[0]}-{floor[1]}", approximate=False))


def _now_ms(client: redis_policy.Client) -> int:
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def heartbeat(
    client: redis_policy.Client, keys: RunKeys, generator_id: str, address: str, version: int | None = None
) -> None:
    """Register (or refresh) one generator, with the policy version it holds (None: none yet).
    Every key carries the run's hash tag: one slot."""
    now = _now_ms(client)
    pipe = client.pipeline(transaction=False)
    pipe.hset(keys.generators, generator_id, address)
    pipe.zadd(keys.generators_seen, {generator_id: now})
    pipe.hset(keys.generators_versions, generator_id, -1 if version is None else int(version))
    pipe.execute()


def leave(client: redis_policy.Client, keys: RunKeys, generator_id: str) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.hdel(keys.generators, generator_id)
    pipe.zrem(keys.generators_seen, generator_id)
    pipe.hdel(keys.generators_versions, generator_id)
    pipe.execute()


def held_versions(client: redis_policy.Client, keys: RunKeys) -> dict[str, int | None]:
    """id -> the policy version each registered generator reported at its last beat (None: no
    weights yet, or a value that is not an integer)."""
    out: dict[str, int | None] = {}
    for k, v in client.hgetall(keys.generators_versions).items():
        try:
            n = int(v)
        except ValueError:
            n = -1
        out[k.decode(errors="replace")] = n if n >= 0 else None
    return out


def live_generators(
    client: redis_policy.Client, keys: RunKeys, ttl_s: float = GENERATOR_TTL_S, forget: bool = True
) -> dict[str, str]:
    """id -> address of the generators that beat within `ttl_s`; forgets the others (unless
    not `forget`: a read-only look, for `rollstream status`)."""
    cutoff = _now_ms(client) - int(ttl_s * 1000)
    dead = [m.decode(errors="replace") for m in client.zrangebyscore(keys.generators_seen, "-inf", f"({cutoff}")]
    addresses = {
        k.decode(errors="replace"): v.decode(errors="replace") for k, v in client.hgetall(keys.generators).items()
    }
    seen = {m.decode(errors="replace") for m in client.zrangebyscore(keys.generators_seen, cutoff, "+inf")}
    # A hash entry with no heartbeat at all (written by an older generator) counts as dead too.
    dead += [g for g in addresses if g not in seen and g not in dead]
    for generator_id in dead if forget else []:
        leave(client, keys, generator_id)
    return {g: a for g, a in addresses.items() if g in seen}
