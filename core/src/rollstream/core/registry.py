"""The generator registry: where the trainer pushes weights when no addresses are configured.

Each generator writes its address (hash `generators`: id -> host:port) and a heartbeat
(sorted set `generators:seen`: id -> last beat, in ms of the Redis server's clock, so hosts
with skewed clocks agree), and with each beat the policy version it holds (hash
`generators:versions`: id -> version, -1 before its first weights), which `rollstream status`
compares with the trainer's. A generator that stops beating for `ttl_s` is dead: the trainer
drops it from every key and pushes to it no more; a restarted generator registers again.
"""

from __future__ import annotations

from rollstream.core import redis_policy
from rollstream.core.run_keys import RunKeys

TTL_S = 30.0
BEAT_EVERY_S = TTL_S / 6


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


def versions(client: redis_policy.Client, keys: RunKeys) -> dict[str, int | None]:
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


def live(client: redis_policy.Client, keys: RunKeys, ttl_s: float = TTL_S, forget: bool = True) -> dict[str, str]:
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
