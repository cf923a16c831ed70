"""The fault suite: `rollstream up` on the tiny model (with the reference service: beta > 0)
survives each fault, and the accounting holds afterwards (docs/design.md, "Failure and trust model").

One fault per run (three kills of seeded services in `kill9-random-x3`), fired at a seeded
random point chosen from observed progress (after step k appears in the metrics stream, or
once every service serves, plus a seeded delay); the CPU hog runs for the whole run. After
`up` has exited 0, the run's Redis is reopened from its AOF and checked:
- the run reached its last step, the faults landed before it, and `up` restarted what was killed;
- every generated group is trained, stale, dead (with a specific reason) or still waiting,
  exactly one of them; none trained twice; the counters agree with the sets;
- every generator serves the trainer's final version (summary.json `versions`, recorded by
  `up` after the last step, while the services still run).

Seeds: ROLLSTREAM_FAULT_SEED shifts every case's seed (the seed is in each failure message).
`test_invariant_checker_catches_a_broken_ledger` (default suite, no processes) shows that the
checker fails each kind of violation, so a passing fault run means something.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from faults.harness import FaultRun, RunShape, check_invariants
from helpers import wait_for
from procs import alive
from rollstream.core import steplog, validation
from rollstream.core.redis_policy import SOCKET_TIMEOUT_S
from rollstream.core.run_keys import RunKeys
from rollstream.v1 import rollout_pb2

SHAPE = RunShape(steps=10)
BASE_SEED = int(os.environ.get("ROLLSTREAM_FAULT_SEED", "0"))
# Generous deadlines (a loaded 2-core machine): they only bound a run that hangs.
FIRST_STEPS_S = 300.0
RUN_S = 480.0

Inject = Callable[[FaultRun], None]

FAULTS: dict[str, Inject] = {
    "kill9-trainer": lambda run: run.kill9("trainer"),
    "kill9-generator": lambda run: run.kill9("generator-0"),
    "kill9-reward": lambda run: run.kill9("reward-0"),
    "kill9-reference": lambda run: run.kill9("reference-0"),
    "kill9-redis": lambda run: run.kill9("redis"),
    # The issue's stall: longer than the services' socket timeout was (5 s) when it was written.
    "redis-debug-sleep-7s": lambda run: run.redis_sleep(7),
    # Longer than the services' socket timeout as it is now, whatever it is: their calls
    # time out mid-command (replies lost, commits retried) rather than just waiting.
    "redis-debug-sleep-past-timeout": lambda run: run.redis_sleep(SOCKET_TIMEOUT_S + 3),
    "redis-sigstop-10s": lambda run: run.redis_stop(10),
}
CPU_HOG = "cpu-hog-2"
# The same faults against a colocated run (`up --colocate sync`: the generator is in the trainer's
# process, so killing it kills both).
COLOCATED = {"colocated-kill9-trainer": "kill9-trainer", "colocated-kill9-random-x3": "kill9-random-x3"}
# ... and against its asynchronous variant (`up --colocate async`: the generator's own copy).
COLOCATED_ASYNC = {
    "colocated-async-kill9-trainer": "kill9-trainer",
    "colocated-async-kill9-random-x3": "kill9-random-x3",
}
# Three kills in one run, each of a service (or redis-server) drawn by the seed, at
# successive points: a restart overlapping the next fault, a trainer resumed twice...
CHAOS = "kill9-random-x3"
CHAOS_KILLS = 3
# The process `up` restarts after each kill (redis-server is checked by its pid instead).
RESTARTED = {
    "kill9-trainer": "trainer",
    "kill9-generator": "generator-0",
    "kill9-reward": "reward-0",
    "kill9-reference": "reference-0",
}


@pytest.mark.faults
@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", [*FAULTS, CHAOS, CPU_HOG, *COLOCATED, *COLOCATED_ASYNC])
def test_run_survives_fault(case: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    seed = BASE_SEED + zlib.crc32(case.encode()) % 1000  # stable per case, whatever cases are added
    kind = COLOCATED.get(case) or COLOCATED_ASYNC.get(case) or case
    shape = dataclasses.replace(
        SHAPE, colocate="sync" if case in COLOCATED else "async" if case in COLOCATED_ASYNC else "off"
    )
    with FaultRun(tiny_model_dir, tmp_path / "run", seed=seed, shape=shape, run=f"{case}-{seed}") as run:
        if kind == CPU_HOG:
            run.cpu_hog(2, seconds=RUN_S + FIRST_STEPS_S)  # the whole run; ended in close() at the latest
        run.start()
        killed: list[tuple[str, int]] = []  # (name, pid)
        if kind == CHAOS:
            names = [*run.services(), "redis"]
            point = -1
            for _ in range(CHAOS_KILLS):
                # After step 0-2, then each one step after the previous point (plus the seeded
                # delay): all drawn by step 4 of 10, leaving room for restarts in between.
                point = run.at_random_point(FIRST_STEPS_S, first=point + 1, span=2 if point < 0 else 0)
                name = run.rng.choice(names)
                killed.append((name, run.kill9(name)))
        elif kind != CPU_HOG:
            run.at_random_point(FIRST_STEPS_S)
            if kind == "kill9-redis":
                killed.append(("redis", run.pid("redis")))
            elif kind in RESTARTED:
                killed.append((RESTARTED[kind], 0))
            FAULTS[kind](run)
        rc = run.wait_exit(RUN_S)
        summary = run.summary()
        context = f"[{case}] up exited {rc}; summary: { {k: summary.get(k) for k in ('steps', 'versions', 'restarts', 'stats')} }"
        assert rc == 0, f"{context}\n{run.logs_tail()}"

        # The faults really happened, mid-run (else this run proved nothing), and `up`
        # restarted what was killed.
        assert not run.misfires, f"{context}: fault(s) not injected: {run.misfires}"
        late = [f for f in run.faults if f.at_step >= SHAPE.steps]
        assert not late, f"{context}: fault(s) landed after the last step: {late}\n{run.logs_tail()}"
        for name in {n for n, _pid in killed if n != "redis"}:
            kills = sum(n == name for n, _pid in killed)
            restarts = summary.get("restarts", {}).get(name, 0)
            assert restarts >= kills, (
                f"{context}: {name} killed {kills} time(s), restarted {restarts}\n{run.logs_tail()}"
            )
        redis_pids = {pid for n, pid in killed if n == "redis"}
        if redis_pids:
            assert (run.state("redis") or {}).get("pid") not in redis_pids, (
                f"{context}: redis-server was not restarted\n{run.logs_tail()}"
            )

        # The run reached its last step.
        assert summary.get("steps") == SHAPE.steps, (
            f"{context}: {summary.get('steps')} steps, expected {SHAPE.steps}\n{run.logs_tail()}"
        )
        assert "versions" in summary, f"{context}: summary.json has no final `versions`\n{run.logs_tail()}"

        # The accounting, read from the run's own Redis reopened on its AOF.
        client = run.open_ledger()
        try:
            ledger = check_invariants(
                client,
                run.keys,
                steps=SHAPE.steps,
                groups_per_step=SHAPE.groups_per_step,
                versions=summary["versions"],
                colocated=shape.colocated,
            )
        finally:
            client.close()
        print(f"\n[{case}] seed={seed} faults={[(f.what, f.at_step) for f in run.faults]}\n{ledger.describe()}")
        assert not ledger.violations, f"{context}\n{ledger.describe()}\n{run.logs_tail()}"


# Rounds of 8 prompts x 4 samples at steps 0, 2, 4, ... 10: long enough on the tiny model to be
# caught in flight (fed, not yet reported) by a poll every 20 ms.
EVAL_SHAPE = dataclasses.replace(SHAPE, colocate="sync", eval_prompts=8, eval_every=2, eval_samples=4)
EVAL_KILL_TRIES = 3  # a kill that lands after the round was reported is tried again at the next round


@pytest.mark.faults
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_held_out_round_in_flight_survives_kill9_of_the_colocated_trainer(tiny_model_dir: Path, tmp_path: Path) -> None:
    """kill -9 of `up --colocate`'s trainer (and its generator with it) while a held-out round
    is fed and not reported: the restarted trainer completes the round from what its markers
    and results in Redis say, reports every round exactly once and complete, and the ledger
    holds with the held-out groups counted apart (evaluated, never trained)."""
    case = "colocated-kill9-trainer-mid-eval"
    seed = BASE_SEED + zlib.crc32(case.encode()) % 1000
    shape = EVAL_SHAPE
    assert shape.eval_prompts and shape.eval_every
    rounds = list(range(0, shape.steps + 1, shape.eval_every))
    with FaultRun(tiny_model_dir, tmp_path / "run", seed=seed, shape=shape, run=f"{case}-{seed}") as run:
        run.start()
        first = run.rng.choice(rounds[1:3])  # a round fed with a step's commit (not the one at start), seeded
        landed: list[int] = []
        kills = 0
        for _ in range(EVAL_KILL_TRIES):

            def in_flight() -> int | None:
                fed = run.eval_rounds() or {}
                waiting = [step for step, reported in fed.items() if not reported and step >= first]
                return min(waiting, default=None)

            step = wait_for(in_flight, RUN_S, f"a held-out round from step {first} fed and not reported", check=lambda: run._check_upalive("a round"),
                            details=run.logs_tail, poll_s=0.02)  # fmt: skip
            assert step is not None  # wait_for returns once it is
            pid = run.kill9("trainer")
            kills += 1
            wait_for(lambda: not alive(pid), 60, f"the killed trainer (pid {pid}) to be gone", poll_s=0.05)
            # Only the trainer reports a round: unreported now, it was in flight when the trainer died.
            if not (run.eval_rounds() or {}).get(step, True):
                landed.append(step)
                break
            first = step + 1
        assert landed, (
            f"[{case}] no kill landed while a round was in flight ({EVAL_KILL_TRIES} tries)\n{run.logs_tail()}"
        )
        rc = run.wait_exit(RUN_S)
        summary = run.summary()
        context = f"[{case}] seed={seed} kills={kills}, the last with round {landed} in flight; up exited {rc}; summary: { {k: summary.get(k) for k in ('steps', 'restarts', 'stats')} }"
        assert rc == 0, f"{context}\n{run.logs_tail()}"
        assert summary.get("restarts", {}).get("trainer", 0) >= kills, f"{context}\n{run.logs_tail()}"
        assert summary.get("steps") == shape.steps, f"{context}\n{run.logs_tail()}"

        client = run.open_ledger()
        try:
            reported = [
                validation.decode(fields, rollout_pb2.EvalMetrics) for _id, fields in client.xrange(run.keys.evals)
            ]
            ledger = check_invariants(
                client,
                run.keys,
                steps=shape.steps,
                groups_per_step=shape.groups_per_step,
                versions=summary["versions"],
                colocated=True,
            )
        finally:
            client.close()
        # Every round reported once, with all its prompts (none by the timeout's partial report).
        assert [m.step for m in reported] == rounds, f"{context}: rounds reported {[m.step for m in reported]}"
        assert all(
            m.prompts == m.prompts_fed == shape.eval_prompts and m.samples == shape.eval_samples for m in reported
        ), f"{context}: {reported}"
        assert [h["step"] for h in summary["held_out"]] == rounds, f"{context}: {summary['held_out']}"
        lines = [
            json.loads(line) for line in (run.workdir / steplog.FILE_NAME).read_text().splitlines() if line.strip()
        ]
        eval_lines = [r["step"] for r in lines if r.get("kind") == steplog.EVAL_KIND]
        assert eval_lines.count(landed[0]) == 1 and all(eval_lines.count(s) <= 1 for s in rounds), (
            f"{context}: eval lines at steps {eval_lines}"
        )
        print(f"\n{context}\n{ledger.describe()}")
        assert not ledger.violations, f"{context}\n{ledger.describe()}\n{run.logs_tail()}"
        assert (
            ledger.evaluated == len(rounds) * shape.eval_prompts and ledger.stats.get("evaluated") == ledger.evaluated
        ), f"{context}\n{ledger.describe()}"


def _group(gid: str) -> dict[str, bytes]:
    return validation.encode(
        rollout_pb2.RolloutGroup(
            group_id=gid, prompt_ids=[1], completions=[rollout_pb2.Completion(token_ids=[2], behaviour_logprobs=[-1.0])]
        )
    )


def _dead_letter(client: redis.Redis, keys: RunKeys, stage: str, gid: str, reason: str) -> None:
    letter = rollout_pb2.DeadLetter(
        source_stream=keys.stream(stage), source_id="1-0", reason=reason, original_fields=_group(gid)
    )
    client.xadd(keys.dead, {**validation.encode(letter), "reason": reason.encode()})


def test_invariant_checker_catches_a_broken_ledger(rclient: redis.Redis, keys: RunKeys) -> None:
    """A hand-made ledger of one step of 2 groups: first consistent (no violation), then
    broken in each way the fault suite must catch."""
    ready = keys.stream("ready")
    rclient.sadd(keys.groups("generated"), "g1", "g2", "g3", "g4", "g5")
    rclient.sadd(keys.groups("trained"), "g1", "g2")
    rclient.sadd(keys.groups("stale"), "g3")
    rclient.hset(keys.counters("trainer"), mapping={"trained": 2, "stale": 1})
    rclient.hset(keys.counters("reference"), "dead_scored", 1)
    _dead_letter(rclient, keys, "scored", "g4", "group g4: 3 reference log-probs for 2 tokens")
    # g1 was read and acknowledged (not waiting though not trimmed yet); g5 is unread.
    rclient.xadd(ready, _group("g1"))
    rclient.xgroup_create(ready, "trainer", id="0")
    read = rclient.xreadgroup("trainer", "t", {ready: ">"}, count=1)
    rclient.xack(ready, "trainer", read[0][1][0][0])
    rclient.xadd(ready, _group("g5"))

    good = check_invariants(rclient, keys, steps=1, groups_per_step=2, versions={"trainer": 1, "generator-0": 1})
    assert good.violations == [], good.describe()
    assert (good.generated, good.trained, good.stale, good.dead, good.waiting) == (5, 2, 1, 1, 1), good.describe()

    rclient.sadd(keys.groups("generated"), "g6")  # lost: in no outcome
    rclient.sadd(keys.groups("stale"), "g2")  # two outcomes
    rclient.hincrby(keys.counters("trainer"), "trained", 1)  # counted twice
    _dead_letter(
        rclient,
        keys,
        "rollouts",
        "g7",
        "delivered 6 times (max_deliveries=5) without being acknowledged: each consumer stopped",
    )
    bad = check_invariants(rclient, keys, steps=1, groups_per_step=2, versions={"trainer": 1, "generator-0": 0})
    found = "\n".join(bad.violations)
    for expected in (
        "lost",
        "both trained and stale",
        "stats trained=3",
        "no specific reason",
        "stats dead_rollouts=0",
        "generator-0 serves version 0",
    ):
        assert expected in found, f"{expected!r} not reported:\n{bad.describe()}"
