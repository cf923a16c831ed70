"""Fault injection around a real `rollstream up` on the tiny model.

`FaultRun` starts `rollstream up` (embedded redis-server, every service as a process) and
fires faults at points chosen from observed progress (a step appearing in the metrics
stream) plus a delay drawn from a seeded RNG, never at fixed times alone:

- `kill9(name)`: SIGKILL a service (trainer, generator-0, reward-0, reference-0) or the
  embedded redis-server ("redis"); `up` must restart it.
- `redis_sleep(s)`: the server stalls s seconds (SIGSTOP: the admin user has no DEBUG).
- `redis_stop(s)`: SIGSTOP the redis-server, SIGCONT after s seconds.
- `cpu_hog(n, s)`: n busy-loop processes for at most s seconds.

After `up` has exited, `open_ledger()` starts a redis-server on the run's own data folder
(it replays the AOF, so this also checks that what the run acknowledged was durable) and
`check_invariants()` reads the accounting there. Everything a run starts is stopped in
`close()`, by pid, whatever happened.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from helpers import wait_for
from procs import alive
from rollstream.core import credentials, redis_acl, validation
from rollstream.core.run_keys import RunKeys, id_tuple, read_counters
from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.trainer.evaluation import ROUND_PREFIX
from rollstream.v1 import rollout_pb2

SERVICES = ("trainer", "generator-0", "reward-0", "reference-0")
# Which consumer group reads which stream of RolloutGroups (prompts hold tasks, not groups).
GROUP_STREAMS = ("rollouts", "scored", "ready")
# A delivery-count dead letter says only that consumers kept stopping; the brief requires a
# specific reason, i.e. the error that made the last consumer give up.
_GENERIC_DELIVERIES = re.compile(r"^\s*delivered \d+ times\b")
_SPECIFIC_CAUSE = re.compile(r"last error|error:", re.IGNORECASE)


class FaultRunError(AssertionError):
    """The run did not do what the test needs; the message carries the logs."""


@dataclass(frozen=True)
class RunShape:
    """The `up` flags of a fault run (small: a step takes about a second on the tiny model)."""

    steps: int = 8
    group_size: int = 4
    groups_per_step: int = 2
    max_new_tokens: int = 6
    beta: float = 0.05
    checkpoint_every: int = 1
    threads: int = 1
    reward: str = "builtin"  # `up --reward`: "external" starts no reward service (the test brings one)
    # `up --colocate`: sync, the generator inside the trainer's process (no generator-0); async
    # (max_staleness 1), the same, sampling from its own copy; off, a generator process
    colocate: str = "off"
    # `up --generator.backend`: "vllm" needs vllm in this venv, so such a run is a vLLM-tier
    # test (tests/vllm/test_vllm_colocated.py), eager (the engine starts in seconds on CPU)
    generator_backend: str = "transformers"
    # Held-out rounds (`up --trainer.eval-*`): None leaves the profile's (the demo's: 32 greedy prompts at the first and last step).
    eval_prompts: int | None = None
    eval_every: int | None = None
    eval_samples: int | None = None

    @property
    def colocated(self) -> bool:
        return self.colocate != "off"


@dataclass
class FaultRecord:
    """What was done and when, for the failure message (and to prove the fault landed mid-run)."""

    what: str
    at_step: int
    monotonic: float


class FaultRun:
    def __init__(self, model_dir: Path, workdir: Path, seed: int, shape: RunShape = RunShape(), run: str = ""):
        self.model_dir = Path(model_dir)
        self.workdir = Path(workdir)
        self.seed = seed
        self.rng = random.Random(seed)
        self.shape = shape
        self.run = run or f"f{seed}"
        self.keys = RunKeys(self.run)
        self.proc: subprocess.Popen[bytes] | None = None
        self.faults: list[FaultRecord] = []
        self.misfires: list[str] = []  # faults that could not be injected (the run proved nothing about them)
        self._hogs: list[subprocess.Popen[bytes]] = []
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        self._stopped_pids: set[int] = set()  # SIGSTOPped redis pids, always SIGCONTed in close()
        self._client: redis.Redis | None = None
        self._client_url = ""
        self._ledger: EmbeddedRedis | None = None

    # -- the run ------------------------------------------------------------------------

    @property
    def up_log(self) -> Path:
        return self.workdir / "up.log"

    def start(self) -> FaultRun:
        s = self.shape
        cmd = [
            str(Path(sys.executable).parent / "rollstream"),
            "up",
            "--model",
            str(self.model_dir),
            "--workdir",
            str(self.workdir),
            "--run",
            self.run,
            "--trainer.steps",
            str(s.steps),
            "--trainer.group-size",
            str(s.group_size),
            "--trainer.groups-per-step",
            str(s.groups_per_step),
            "--trainer.max-new-tokens",
            str(s.max_new_tokens),
            "--threads",
            str(s.threads),
            "--trainer.checkpoint-every",
            str(s.checkpoint_every),
            "--trainer.beta",
            str(s.beta),
            "--external-reward" if s.reward == "external" else "--no-external-reward",
            "--colocate",
            s.colocate,
            *(["--trainer.max-staleness", "1"] if s.colocate == "async" else []),
            "--generator.backend",
            s.generator_backend,
            *(["--generator.enforce-eager"] if s.generator_backend == "vllm" else []),
            *[
                arg
                for flag, value in (("prompts", s.eval_prompts), ("every", s.eval_every), ("samples", s.eval_samples))
                if value is not None
                for arg in (f"--trainer.eval-{flag}", str(value))
            ],
        ]
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
        with self.up_log.open("ab") as log:
            # Own session: the test's Ctrl-C must reach `up` only through close().
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def state(self, name: str) -> dict | None:
        """W/state/<name>.json (`redis` for the embedded redis-server), or None while absent."""
        path = self.workdir / "state" / f"{name}.json"
        try:
            return json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None  # not written yet, or being replaced

    def pid(self, name: str, timeout_s: float = 180.0) -> int:
        """The live pid of a service (waits for its state file: a restarted child writes it
        once it serves, so a kill lands on a started process)."""

        def live_pid() -> int | None:
            st = self.state(name)
            return int(st["pid"]) if st is not None and alive(int(st["pid"])) else None

        return wait_for(
            live_pid,
            timeout_s,
            f"a live {name}",
            check=lambda: self._check_upalive(f"the pid of {name}"),
            details=self.logs_tail,
            poll_s=0.1,
        )

    def redis_url(self, timeout_s: float = 120.0) -> str:

        def url() -> str | None:
            st = self.state("redis")
            return str(st["url"]) if st is not None else None

        return wait_for(
            url,
            timeout_s,
            "state/redis.json",
            check=lambda: self._check_upalive("state/redis.json"),
            details=self.logs_tail,
            poll_s=0.1,
        )

    def admin(self) -> dict[str, str]:
        """Credentials of the embedded Redis's `admin` user (`up` runs it with an ACL file: the
        default user is off), as redis-py keyword arguments."""
        password = credentials.read_secret(
            redis_acl.password_file(self.workdir / "credentials", redis_acl.ADMIN), "admin password"
        )
        return {"username": redis_acl.ADMIN, "password": password}

    def _check_upalive(self, what: str) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise FaultRunError(
                f"`rollstream up` exited with {self.proc.returncode} while waiting for {what}\n{self.logs_tail()}"
            )

    def connected(self) -> redis.Redis:
        """An admin client of the run's Redis (again after a restarted redis-server moved)."""
        url = self.redis_url()
        if self._client is None or url != self._client_url:
            if self._client is not None:
                self._client.close()
            self._client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2, **self.admin())
            self._client_url = url
        return self._client

    def max_step(self) -> int | None:
        """The highest step in the metrics stream, or None while Redis does not answer (a
        fault may be stalling it: that is the point)."""
        try:
            entries = self.connected().xrevrange(self.keys.metrics, count=50)
        except redis.RedisError:
            return None
        steps = [0]
        for _eid, fields in entries:
            try:
                steps.append(int(validation.decode(fields, rollout_pb2.StepMetrics).step))
            except validation.EntryError:
                continue
        return max(steps)

    def eval_rounds(self) -> dict[int, bool] | None:
        """The held-out rounds fed so far, each with whether it is reported (the trainer's
        markers in eval_results, trainer/evaluation.py), or None while Redis does not answer."""
        try:
            markers = self.connected().hgetall(self.keys.eval_results)
        except redis.RedisError:
            return None
        return {
            int(k.decode().removeprefix(ROUND_PREFIX)): bool(json.loads(v).get("reported"))
            for k, v in markers.items()
            if k.decode().startswith(ROUND_PREFIX)
        }

    def wait_step(self, step: int, timeout_s: float) -> int:
        """Wait until the metrics stream shows `step` >= 1 (or later); returns the step seen."""

        def reached() -> int | None:
            seen = self.max_step()
            return seen if seen is not None and seen >= step else None

        return wait_for(
            reached, timeout_s, f"step {step}", check=lambda: self._check_upalive(f"step {step}"),
            details=lambda: f"last step seen: {self.max_step()}\n{self.logs_tail()}", poll_s=0.1,
        )  # fmt: skip

    def fault_point(self, first: int = 0, span: int | None = None) -> tuple[int, float]:
        """A seeded random point of the run: after step k (first <= k <= first + span; by
        default 0 <= k < steps / 2; 0: once every service serves, before the first step)
        plus a delay of 0-0.4 s, so it lands anywhere in the next step's work (a step of the
        tiny model takes 0.2-1 s) and well before the last step: for the fault to miss the
        run, the run would have to do several steps within the delay."""
        span = max(1, self.shape.steps // 2 - 1) if span is None else span
        return self.rng.randint(first, first + span), round(self.rng.uniform(0.0, 0.4), 2)

    def at_random_point(self, timeout_s: float, first: int = 0, span: int | None = None) -> int:
        """Wait for the seeded fault point (see fault_point); returns its step k (the step
        actually seen when the fault fires is in its FaultRecord)."""
        step, delay = self.fault_point(first, span)
        if step == 0:
            for name in self.services():
                self.pid(name, timeout_s)
        else:
            self.wait_step(step, timeout_s)
        time.sleep(delay)  # bounded, seeded; the point itself comes from observed progress
        return step

    def services(self) -> tuple[str, ...]:
        """The services `up` starts for this shape (the reference only with beta > 0)."""
        left_out = {"reference-0"} if self.shape.beta <= 0 else set()
        if self.shape.reward == "external":
            left_out.add("reward-0")
        if self.shape.colocated:
            left_out.add("generator-0")
        return tuple(s for s in SERVICES if s not in left_out)

    def wait_exit(self, timeout_s: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise FaultRunError(
                f"`rollstream up` did not finish within {timeout_s}s (last step seen: {self.max_step()})\n{self.logs_tail()}"
            ) from None

    def summary(self) -> dict:
        path = self.workdir / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}

    # -- faults -------------------------------------------------------------------------

    def _record(self, what: str, step: int | None) -> None:
        self.faults.append(FaultRecord(what, step or 0, time.monotonic()))

    def kill9(self, name: str) -> int:
        """SIGKILL a service, or the embedded redis-server (`redis`); returns the pid killed."""
        pid = self.pid(name)
        if not self._owned(name, pid):
            raise FaultRunError(f"pid {pid} from state/{name}.json is not this run's {name}")
        step = self.max_step()
        os.kill(pid, signal.SIGKILL)
        self._record(f"kill -9 {name} (pid {pid})", step)
        return pid

    def redis_sleep(self, seconds: float) -> threading.Thread:
        """The server stalls `seconds`, as `DEBUG SLEEP seconds` made it: the admin user has no
        DEBUG any more (@dangerous, issue 42), so a SIGSTOP does it, the same to every client
        (connections accepted by the kernel, no reply until it ends)."""
        return self.redis_stop(seconds)

    def redis_stop(self, seconds: float) -> threading.Thread:
        """SIGSTOP the redis-server; a thread sends SIGCONT after `seconds` (close() does too)."""
        pid = self.pid("redis")
        if not self._owned("redis", pid):
            raise FaultRunError(f"pid {pid} from state/redis.json is not this run's redis-server")
        step = self.max_step()
        os.kill(pid, signal.SIGSTOP)
        self._stopped_pids.add(pid)
        self._record(f"SIGSTOP redis for {seconds}s (pid {pid})", step)

        def resume() -> None:
            self._closing.wait(seconds)  # close() ends the stop early
            self._cont(pid)

        thread = threading.Thread(target=resume, name="sigcont", daemon=True)
        thread.start()
        self._threads.append(thread)
        return thread

    def _cont(self, pid: int) -> None:
        if pid in self._stopped_pids:
            self._stopped_pids.discard(pid)
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def cpu_hog(self, n_procs: int, seconds: float) -> None:
        """n busy-loop processes, each ending by itself after `seconds` (and killed in close())."""
        loop = f"import time\nend = time.monotonic() + {float(seconds)}\nwhile time.monotonic() < end:\n    pass\n"
        for _ in range(n_procs):
            self._hogs.append(
                subprocess.Popen([sys.executable, "-c", loop], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            )
        self._record(f"cpu hog: {n_procs} busy processes for up to {seconds}s", 0)

    def _owned(self, name: str, pid: int) -> bool:
        """The pid is really this run's process (not a reused pid): services carry their state
        file in their command line, redis-server its unix socket (its port, on TCP)."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return False
        if name == "redis":
            url = str((self.state("redis") or {}).get("url", ""))
            listens = (
                redis.connection.parse_url(url).get("path")
                if url.startswith("unix")
                else ":" + url.rsplit(":", 1)[-1].split("/")[0]
            )
            return "redis-server" in cmdline and bool(listens) and str(listens) in cmdline
        return str(self.workdir / "state" / f"{name}.json") in cmdline

    # -- after the run ------------------------------------------------------------------

    def open_ledger(self) -> redis.Redis:
        """A redis-server on the run's data folder (replaying its AOF), once `up` has exited."""
        assert self.proc is not None and self.proc.poll() is not None, "open the ledger only after `up` exited"
        self._ledger = EmbeddedRedis(self.workdir / "redis").start(timeout_s=60.0)
        return redis.Redis.from_url(self._ledger.url, socket_timeout=30)

    def logs_tail(self, lines: int = 25) -> str:
        """The tails of up's output, every service log and the redis-server log."""
        paths = [self.up_log, *sorted((self.workdir / "logs").glob("*.log")), self.workdir / "redis" / "redis.log"]
        out = [
            f"seed={self.seed} run={self.run} workdir={self.workdir} faults={[(f.what, f.at_step) for f in self.faults]}"
        ]
        for path in paths:
            if path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path.relative_to(self.workdir)} (last {lines} lines)\n" + "\n".join(text))
        return "\n".join(out)

    def close(self) -> None:
        """Stop everything this run started: SIGCONT a stopped Redis, end the hogs, stop `up`
        (it stops its children), then SIGKILL whatever of its children is left, by pid."""
        self._closing.set()
        for pid in list(self._stopped_pids):
            self._cont(pid)
        for hog in self._hogs:
            if hog.poll() is None:
                hog.kill()
            hog.wait(timeout=30)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        # Services carry W/state/<name>.json in their command line: found even between a
        # restart's start and its state file. redis-server renames itself: by its state file.
        leftovers = set(_pids_with(str(self.workdir / "state") + "/"))
        st = self.state("redis")
        if st is not None and self._owned("redis", int(st["pid"])):
            leftovers.add(int(st["pid"]))
        for pid in leftovers:
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for thread in self._threads:
            thread.join(timeout=60)
        if self._client is not None:
            self._client.close()
        if self._ledger is not None:
            self._ledger.stop()

    def __enter__(self) -> FaultRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pids_with(marker: str) -> list[int]:
    """Processes whose command line contains `marker`."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
            except OSError:
                continue  # gone meanwhile
    return out


# -- the invariants ---------------------------------------------------------------------


@dataclass
class Ledger:
    """Where every generated group ended, and what is wrong (`violations`, empty when good)."""

    generated: int = 0
    trained: int = 0
    stale: int = 0
    dead: int = 0
    waiting: int = 0
    evaluated: int = 0  # held-out groups (never trained)
    duplicates_waiting: int = 0  # copies still queued of groups already trained/stale/dead (harmless)
    dead_letters: list[tuple[str, str]] = field(default_factory=list)  # (source stage, reason)
    stats: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def describe(self) -> str:
        reasons = "\n".join(f"  [{s}] {r[:300]}" for s, r in self.dead_letters[:20])
        return (
            f"groups: generated={self.generated} trained={self.trained} stale={self.stale} dead={self.dead} evaluated={self.evaluated} "
            f"waiting={self.waiting} (+{self.duplicates_waiting} queued duplicates of finished groups)\n"
            f"stats: {self.stats}\ndead letters ({len(self.dead_letters)}):\n{reasons}\n"
            + ("violations:\n" + "\n".join(f"  - {v}" for v in self.violations) if self.violations else "no violations")
        )


def _members(client: redis.Redis, key: str) -> set[str]:
    return {m.decode() for m in client.smembers(key)}


def _group_id(fields: validation.Fields) -> str | None:
    try:
        return validation.decode(fields, rollout_pb2.RolloutGroup).group_id or None
    except validation.EntryError:
        return None


def waiting_groups(client: redis.Redis, keys: RunKeys) -> set[str]:
    """Group ids some consumer group has not finished with: pending on a consumer, or after
    the group's last-delivered id (unread). Acknowledged entries not trimmed yet do not count."""
    out: set[str] = set()
    for stage in GROUP_STREAMS:
        key = keys.stream(stage)
        if not client.exists(key):
            continue
        groups = client.xinfo_groups(key)
        entries = client.xrange(key)  # a fault run's streams hold a few dozen entries
        if not groups:
            out |= {gid for _eid, fields in entries if (gid := _group_id(fields))}
            continue
        waiting_ids: set[bytes] = set()
        for g in groups:
            last = id_tuple(g["last-delivered-id"])
            waiting_ids |= {eid for eid, _f in entries if id_tuple(eid) > last}
            if g["pending"]:
                pending = client.xpending_range(key, g["name"], min="-", max="+", count=int(g["pending"]) + 10)
                waiting_ids |= {p["message_id"] for p in pending}
        out |= {gid for eid, fields in entries if eid in waiting_ids and (gid := _group_id(fields))}
    return out


def is_generic_reason(reason: str) -> bool:
    """Empty, or a delivery count without the error that made the consumers give up."""
    if not reason.strip():
        return True
    return bool(_GENERIC_DELIVERIES.match(reason)) and not _SPECIFIC_CAUSE.search(reason)


def check_invariants(
    client: redis.Redis,
    keys: RunKeys,
    *,
    steps: int,
    groups_per_step: int,
    versions: dict[str, int] | None = None,
    colocated: bool = False,
) -> Ledger:
    """The accounting after a run (see the module docstring of test_faults.py for why each holds):

    1. every generated group is in exactly one of trained / stale / dead / waiting, and no
       group is trained or dropped as stale without having been generated;
    2. nothing trained twice: stats[trained] == |trained| == steps x groups_per_step (each
       trained group is in the final weights: a step lost to a crash must not leave its
       groups marked trained, and a replayed step must not count them again);
       stats[stale] == |stale|; stats[dead_<stage>] == the dead letters from that stage;
    3. every dead letter has a readable `reason` field (the same as its DeadLetter's) that is
       specific, not just a delivery count;
    4. (with `versions`: summary.json's final versions) every generator serves the trainer's
       version, and that version is `steps` (`colocated`: the generator is the trainer's own
       process and model, so there is no separate generator version to check).
    """
    ledger = Ledger()
    v = ledger.violations
    generated = _members(client, keys.groups("generated"))
    trained = _members(client, keys.groups("trained"))
    stale = _members(client, keys.groups("stale"))
    evaluated = _members(client, keys.groups("evaluated"))  # held-out groups: never trained
    ledger.stats = read_counters(client, keys)[0]

    dead: set[str] = set()
    dead_by_stage: dict[str, int] = {}
    for _eid, fields in client.xrange(keys.dead):
        try:
            letter = validation.decode(fields, rollout_pb2.DeadLetter)
        except validation.EntryError as e:
            v.append(f"a dead letter does not decode as DeadLetter: {e}")
            continue
        stage = letter.source_stream.rsplit(":", 1)[-1]
        dead_by_stage[stage] = dead_by_stage.get(stage, 0) + 1
        plain = fields.get(b"reason", b"").decode(errors="replace")
        ledger.dead_letters.append((stage, letter.reason))
        if plain != letter.reason:
            v.append(
                f"dead letter {letter.source_id} from {stage}: readable reason field {plain!r} differs from the DeadLetter's {letter.reason!r}"
            )
        if is_generic_reason(letter.reason):
            v.append(f"dead letter {letter.source_id} from {stage} has no specific reason: {letter.reason!r}")
        if stage in GROUP_STREAMS:
            gid = _group_id({k.encode(): val for k, val in letter.original_fields.items()})
            if gid:
                dead.add(gid)

    waiting_all = waiting_groups(client, keys)
    finished = trained | stale | dead | evaluated
    waiting = waiting_all - finished
    ledger.generated, ledger.trained, ledger.stale, ledger.dead = (
        len(generated),
        len(trained),
        len(stale),
        len(dead & generated),
    )
    ledger.waiting, ledger.duplicates_waiting = len(waiting & generated), len(waiting_all & finished)
    ledger.evaluated = len(evaluated)

    # 1. One outcome per group, and no group lost.
    for a_name, a, b_name, b in (
        ("trained", trained, "stale", stale),
        ("trained", trained, "dead", dead),
        ("stale", stale, "dead", dead),
        ("evaluated", evaluated, "trained", trained),
        ("evaluated", evaluated, "stale", stale),
        ("evaluated", evaluated, "dead", dead),
    ):
        both = a & b
        if both:
            v.append(f"{len(both)} group(s) both {a_name} and {b_name}: {sorted(both)[:5]}")
    lost = generated - finished - waiting
    if lost:
        v.append(f"{len(lost)} generated group(s) lost (not trained, stale, dead or waiting): {sorted(lost)[:5]}")
    unknown = (trained | stale) - generated
    if unknown:
        v.append(f"{len(unknown)} trained/stale group(s) never recorded as generated: {sorted(unknown)[:5]}")

    # 2. Nothing trained twice; counters agree with the sets.
    st = ledger.stats
    if st.get("trained", 0) != len(trained):
        v.append(
            f"stats trained={st.get('trained', 0)} but {len(trained)} distinct groups trained (a group counted twice, or one not recorded)"
        )
    if len(trained) != steps * groups_per_step:
        v.append(
            f"{len(trained)} groups marked trained, expected {steps} steps x {groups_per_step} = {steps * groups_per_step} (in the final weights)"
        )
    if st.get("evaluated", 0) != len(evaluated):
        v.append(f"stats evaluated={st.get('evaluated', 0)} but {len(evaluated)} distinct groups evaluated")
    if st.get("stale", 0) != len(stale):
        v.append(f"stats stale={st.get('stale', 0)} but {len(stale)} distinct stale groups")
    for stage, n in sorted(dead_by_stage.items()):
        if st.get(f"dead_{stage}", 0) != n:
            v.append(f"stats dead_{stage}={st.get(f'dead_{stage}', 0)} but {n} dead letters from {stage}")

    # 4. Final versions.
    if versions is not None:
        trainer_version = versions.get("trainer")
        gens = {k: val for k, val in versions.items() if k.startswith("generator")}
        if trainer_version != steps:
            v.append(f"final trainer version {trainer_version}, expected {steps} (summary versions: {versions})")
        if not gens and not colocated:
            v.append(f"no generator version recorded at the end (summary versions: {versions})")
        if gens and colocated:
            v.append(f"a colocated run with a generator process: {sorted(gens)}")
        for name, gv in sorted(gens.items()):
            if gv != trainer_version:
                v.append(f"{name} serves version {gv} at the end, the trainer {trainer_version}")
    return ledger
