"""Least privilege on Redis: one ACL user per service role, and a read-only `observer`.

`ROLE_RULES` below is the whole policy: for each user, the commands it may send and the keys
it may touch (by name under `rs:{<run>}:`, for every run). `render_acl_file(passwords,
reference_stage)` turns it into a `users.acl` for `redis-server --aclfile` (passwords only as
sha256 hashes), and `ensure_redis_credentials(root, reference_stage)` writes each user's
password file (kept when it exists) and that ACL file into the layout of
rollstream.core.credentials. The users are the roles of
credentials.ROLES and `observer` (`REDIS_USERS`): a Redis user only, with no gRPC token.

Where the lists come from (keep them in step with the code; tests/integration/test_redis_acl.py
does each user's real work as that user and checks the server's ACL LOG stays empty):

- every client: PING (redis-py's health checks), INFO (redis_policy.connect asks `INFO
  cluster` to pick the cluster client), SELECT (a `/<db>` in the URL), and for a Redis
  Cluster, CLUSTER SLOTS and COMMAND (the cluster client's slot map and key positions).
  redis_policy.connect turns CLIENT SETINFO off, so no user needs CLIENT (whose KILL, LIST
  and PAUSE reach other clients' connections).
- every stream stage (rollstream.core.streams.StreamStage): XGROUP CREATE, XREADGROUP,
  XPENDING, XCLAIM, XACK; the commit script through EVALSHA (SCRIPT LOAD when the server
  does not have it yet), which runs XPENDING, TYPE, then the stage's writes (XADD, HINCRBY,
  ...) as the caller: Redis checks a script's commands and keys against the caller's ACL
  too, and HGET (the script reads each counter field it will HINCRBY first); dead letters
  (XADD `dead`, HINCRBY the role's own `stats:<role>`); trimming (XINFO GROUPS, XPENDING,
  XTRIM).
- back-pressure, run_keys.waiting: EVAL of a script running EXISTS, XINFO GROUPS, XLEN,
  XRANGE on the stream it measures.
- the trainer's dashboard (core/dashboard.py, as `observer`): XINFO GROUPS/CONSUMERS, XLEN,
  XRANGE, XREVRANGE, TYPE on every stage's stream and `dead`, HGETALL each role's
  `stats:<role>` and the registry, GET `version`, ZRANGEBYSCORE the heartbeats, TIME.

Counters: each writer counts in its own hash, `stats:<role>` (run_keys.RunKeys.counters),
and only that role's user may write it. One shared `stats` hash let the generator's
password poison the trainer's `trained` field (HSET it to "x"), and a key pattern cannot
give a user some fields of a hash. Readers sum the four (run_keys.read_counters).

The admin user (`up`'s own client, `rollstream status`, the tests' checks) has every key and
command except Redis's @dangerous category (CONFIG, SAVE, BGSAVE, DEBUG, FLUSHALL, SHUTDOWN,
ACL SETUSER/LOAD, MODULE, REPLICAOF, MIGRATE, CLIENT KILL, KEYS, ...): with the admin
password, CONFIG SET dir/dbfilename + SAVE would write a file wherever the server's owner
may. Back from that category, read-only: INFO (redis_policy.connect's cluster check, the
server's version; @dangerous on 6.2 and 7), ACL LOG (what the server refused, for
diagnosis), CLUSTER SLOTS (a cluster client's slot map). No rollstream user has a
dangerous command that writes or reconfigures anything; changing the ACL is editing
users.acl and restarting the server (`up` writes it at every start).

What a key pattern cannot say: Redis 6.2 gives a user the same access to every key it may
touch (read and write alike), and on 7 an EVAL's declared keys count as written too. A user
that may read a key may therefore write it with any write command it has. So the
generator's back-pressure over `rollouts`, `scored` and `ready` runs as `observer`, a user
with read commands only (no XADD, no XACK, nothing that writes: a script it runs can write
nothing either), and the generator's own user has neither `scored` nor `ready`: a stolen
generator password cannot put a forged, self-rewarded group where the trainer reads. The
trainer, which feeds `prompts`, could still read them. What each role cannot do is
everything else: another stage's keys, another role's counters, the trainer's ledger and
version (but the generator reads the version), any command outside its list, and every
administrative command (DEBUG, CONFIG, FLUSHALL, KEYS, ACL, MONITOR, SHUTDOWN, SCRIPT
FLUSH/KILL, MODULE, REPLICAOF, CLIENT, ...); the `admin` user (the operator: `rollstream
status`, `up`'s own reads) has the non-dangerous ones among them, SCRIPT KILL included. A
script may still busy the server (a loop) until the admin's SCRIPT KILL: EVAL is the price
of the atomic commit.

A deployment with a reference stage (beta > 0) gets a reward user without `ready`
(`reference_stage=True`: `rollstream up` decides it from its flags, `rollstream secrets
--reference` for compose and Kubernetes): there `ready` is the reference's alone, so a stolen
reward password cannot write a group straight where the trainer reads, past the reference
and its own ref log-probs. Without a reference stage the reward writes `ready` itself.

Key patterns are Redis globs, in which `{` and `}` are plain characters: `rs:{*}:ready`
matches `rs:{<any run>}:ready` and not a key without the braces.
"""

from __future__ import annotations

from pathlib import Path

from rollstream.core.credentials import ROLES, digest, ensure_secret, redis_dir, write_secret

ADMIN = "admin"
# Read-only back-pressure over the stages downstream of the generator (module docstring).
OBSERVER = "observer"
# Every Redis ACL user: the roles (each also has a gRPC token) and the observer (Redis only).
REDIS_USERS = (*ROLES, OBSERVER)
ACL_FILE = "users.acl"

# Commands, grouped by what needs them (see the module docstring).
_CONNECTION = ("ping", "info", "select", "cluster|slots", "command")
_STAGE = (
    "xgroup|create",
    "xreadgroup",
    "xpending",
    "xclaim",
    "xack",
    "evalsha",
    "script|load",
    "type",
    "hget",
    "xadd",
    "hincrby",
    "xinfo|groups",
    "xtrim",
)
# The admin user: everything but @dangerous, and back from it only what reads (module docstring).
ADMIN_RULES = "~* &* +@all -@dangerous +info +acl|log +cluster|slots"
_WAITING = ("eval", "exists", "xlen", "xrange")

# user -> (commands, keys under rs:{<run>}:). One table, the whole policy.
ROLE_RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # prompts -> rollouts; staleness against version; the ledger set of generated groups; the
    # registry (heartbeat: TIME, HSET, ZADD, with its version; leave: HDEL, ZREM). Its back-pressure runs as
    # the observer: neither `scored` nor `ready` is the generator's.
    "generator": (
        (*_CONNECTION, *_STAGE, "get", "sadd", "time", "hset", "zadd", "hdel", "zrem"),
        ("prompts", "eval_prompts", "rollouts", "version", "dead", "stats:generator", "groups:generated", "generators", "generators:seen",
         "generators:versions"),
    ),
    # rollouts -> scored, or ready when the run has no reference stage (--output-stage); with
    # one, `ready` is taken off this list (rules(), reference_stage).
    # For a custom reward service (docs/custom-reward.md, which shows this line): XAUTOCLAIM
    # to take over, and EVAL for its commit script (no more than EVALSHA + SCRIPT LOAD allow).
    # The task map (HMGET `tasks`): what it scores with is what the trainer fed.
    "reward": (
        (*_CONNECTION, *_STAGE, "xautoclaim", "eval", "hmget"),
        ("rollouts", "scored", "ready", "dead", "stats:reward", "tasks"),
    ),
    # scored -> ready.
    "reference": (
        (*_CONNECTION, *_STAGE),
        ("scored", "ready", "dead", "stats:reference"),
    ),
    # ready -> the step's ledger (groups sets, stats, version, metrics, trained_log); feeds
    # prompts (XADD + SET fed in the commit script, after waiting + trimming them); reads its
    # position (GET fed), the trained log (XRANGE; XREVRANGE for its end, XTRIM after a
    # checkpoint), the run's step (HGET), duplicates (SISMEMBER); reads and prunes the
    # generator registry; writes the task map with the prompts it feeds (HSET in the commit
    # script), checks groups against it (HMGET), sweeps it (HLEN, HDEL). The generator has no
    # access to `tasks`: it takes its tasks from `prompts`.
    "trainer": (
        (*_CONNECTION, *_STAGE, *_WAITING, "get", "set", "hget", "hset", "sadd", "sismember", "del",
         "xrevrange", "time", "zrangebyscore", "hgetall", "hdel", "zrem", "hmget", "hlen"),
        ("ready", "prompts", "eval_prompts", "fed", "version", "metrics", "stats:trainer", "trained_log", "dead", "groups:trained", "groups:stale", "groups:evaluated",
         "generators", "generators:seen", "generators:versions", "tasks", "evals", "eval_results"),
    ),
    # The generator's back-pressure (run_keys.waiting on rollouts, scored, ready) and the
    # trainer's dashboard (status.collect over every stage, the ledger's counters, the
    # registry, the last step): read commands only, so neither it nor a script it runs
    # writes anything anywhere.
    OBSERVER: (
        (*_CONNECTION, "eval", "evalsha", "script|load", "exists", "xinfo|groups", "xlen", "xrange",
         "xinfo|consumers", "xrevrange", "type", "time", "get", "hgetall", "zrangebyscore"),
        ("rollouts", "scored", "ready", "prompts", "dead", "stats:generator", "stats:reward", "stats:reference", "stats:trainer",
         "version", "metrics", "evals", "generators", "generators:seen", "generators:versions"),
    ),
}  # fmt: skip


def key_pattern(name: str) -> str:
    """The glob for key `name` of every run: `rs:{*}:<name>`."""
    return f"rs:{{*}}:{name}"


def rules(role: str, reference_stage: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A role's (commands, keys) in a deployment with or without a reference stage: with
    one, `ready` is the reference's alone and the reward user loses it."""
    commands, keys = ROLE_RULES[role]
    if reference_stage and role == "reward":
        keys = tuple(k for k in keys if k != "ready")
    return commands, keys


def acl_rules(role: str, reference_stage: bool = False) -> str:
    """A user's rules, as on its `user` line after the password (no password)."""
    if role == ADMIN:
        return ADMIN_RULES
    commands, keys = rules(role, reference_stage)
    # resetchannels: no pub/sub for anyone (6.2's default would allow every channel).
    return " ".join(["resetchannels", *(f"~{key_pattern(k)}" for k in keys), "-@all", *(f"+{c}" for c in commands)])


def render_acl_file(passwords: dict[str, str], reference_stage: bool = False) -> str:
    """users.acl for every user of REDIS_USERS, each password stored as `#<sha256>`.
    The default user is off: a client that does not authenticate can do nothing. With
    `reference_stage` the reward user may not write `ready` (rules)."""
    missing = [r for r in REDIS_USERS if not passwords.get(r)]
    unknown = sorted(set(passwords) - set(REDIS_USERS))
    if missing or unknown:
        raise ValueError(
            f"passwords needed for exactly {', '.join(REDIS_USERS)} (missing: {missing or 'none'}, unknown: {unknown or 'none'})"
        )
    # Nothing but `user` lines: redis-server refuses comments and blank lines in an ACL file.
    lines = ["user default reset resetchannels"]
    # `reset` first: off, no password, no keys, no commands; then exactly what the user gets.
    lines += [
        f"user {user} reset on #{digest(passwords[user])} {acl_rules(user, reference_stage)}" for user in REDIS_USERS
    ]
    return "\n".join(lines) + "\n"


def acl_file(root: Path) -> Path:
    return redis_dir(root) / ACL_FILE


def password_file(root: Path, role: str) -> Path:
    return redis_dir(root) / f"{role}.password"


def ensure_redis_credentials(root: Path, reference_stage: bool = False) -> dict[str, str]:
    """A password per user of REDIS_USERS under `<root>/redis/` (kept if its file exists,
    so a restarted `rollstream up` and its running services keep working; delete a file to
    rotate that user's password) and users.acl rendered from them, written now (a changed
    table takes effect at the next server start). `reference_stage`: the deployment runs a
    reference stage, so the reward user may not write `ready`. Returns user -> password."""
    passwords = {user: ensure_secret(password_file(root, user), f"{user} redis password") for user in REDIS_USERS}
    # Hashes only, but the server is its only reader: 0600 like the rest.
    write_secret(acl_file(root), render_acl_file(passwords, reference_stage).rstrip("\n"))
    return passwords
