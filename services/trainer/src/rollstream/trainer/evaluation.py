"""Held-out evaluation: rounds of evaluation tasks through the same streams, never trained on.

A round is the `eval_prompts` prompts of the held-out set (prompts.held_out: the same ones every
round), fed after step N: N = 0 before the first step, every `eval_every` steps, and the last
step (with eval_only, one round of the model as it is, and no training: `rollstream eval`). Each task asks `eval_samples` completions (1: greedy).

1. Feed (`feed`: in the step's own commit script, so the round and the version it evaluates
   appear together; at start for step 0). Each task goes to rs:{run}:eval_prompts and into the
   trainer's task map with `eval` set, and the round's marker `round:<N>` into
   rs:{run}:eval_results, so a restarted trainer neither feeds a round twice nor forgets one.
   Generators take evaluation tasks before training tasks, whatever waits downstream
   (generator/service.py); the reward service scores them from the task map like any other.
2. Take (`take`): the trainer's loop hands over every group whose task in its map is an
   evaluation task, checked against it as a training group is. Its result (the version that
   sampled it, rewards, full marks, tokens) goes into rs:{run}:eval_results with the group's
   acknowledgement, the trainer's `evaluated` counter and the set groups:evaluated, in one
   script: nothing trains on it.
3. Report (`report_ready`): once every task of a round has its result, or eval_timeout_s after
   it was fed with what came in (groups dead-lettered upstream never come): an EvalMetrics entry in rs:{run}:evals, and the
   round's results and tasks deleted, in one script; the caller then writes steps.jsonl,
   Prometheus, the trackers and the log.

Over a round's P prompts with k = eval_samples completions each, r_pj the reward of completion
j of prompt p and c_pj = 1 when it has full marks (`full_marks`), 0 else:
    reward_mean = mean_pj r_pj
    accuracy    = mean_pj c_pj            (pass@1)
    pass@k      = mean_p max_j c_pj       (some completion of the k right)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from rollstream.core import redis_policy, run_keys, streams, validation
from rollstream.trainer import prompts
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.prompts import Encode, feed_task
from rollstream.v1 import rollout_pb2

ROUND_PREFIX = "round:"  # eval_results field of a round's marker; task ids are the other fields


def full_marks(completion: rollout_pb2.Completion) -> bool:
    """The answer has full marks: the component named `answer` at 1 or more (every built-in
    recipe has one, beside e.g. `format`); for a recipe without one, every component of
    positive weight at 1 or more; with no components (a custom scorer), a reward of 1 or more."""
    components = list(completion.reward_components)
    answer = [c for c in components if c.name == "answer"]
    if answer:
        return answer[0].value >= 1.0
    weighted = [c for c in components if c.weight > 0]
    if weighted:
        return all(c.value >= 1.0 for c in weighted)
    return completion.reward >= 1.0


@dataclass
class Result:
    """One evaluation group's outcome."""

    version: int
    rewards: list[float]
    correct: list[bool]
    tokens: int  # completion tokens, all of the group's completions

    @classmethod
    def of(cls, group: rollout_pb2.RolloutGroup) -> "Result":
        return cls(
            version=group.policy_version,
            rewards=[float(c.reward) for c in group.completions],
            correct=[full_marks(c) for c in group.completions],
            tokens=sum(len(c.token_ids) for c in group.completions),
        )

    def to_json(self) -> str:
        return json.dumps(
            {"version": self.version, "rewards": self.rewards, "correct": self.correct, "tokens": self.tokens}
        )

    @classmethod
    def from_json(cls, text: bytes | str) -> "Result":
        d = json.loads(text)
        return cls(
            version=int(d["version"]),
            rewards=[float(r) for r in d["rewards"]],
            correct=[bool(c) for c in d["correct"]],
            tokens=int(d["tokens"]),
        )


@dataclass
class Round:
    """A round fed and not yet reported: its step, how many tasks, when, and the results in."""

    step: int
    fed: int
    fed_at: float
    results: dict[str, Result] = field(default_factory=dict)

    def metrics(self, samples: int) -> rollout_pb2.EvalMetrics:
        results = list(self.results.values())
        rewards = [r for res in results for r in res.rewards]
        correct = [c for res in results for c in res.correct]
        versions = [res.version for res in results]
        return rollout_pb2.EvalMetrics(
            step=self.step,
            version=min(versions, default=0),
            version_max=max(versions, default=0),
            prompts=len(results),
            prompts_fed=self.fed,
            samples=samples,
            reward_mean=sum(rewards) / len(rewards) if rewards else 0.0,
            accuracy=sum(correct) / len(correct) if correct else 0.0,
            pass_at_k=sum(any(res.correct) for res in results) / len(results) if results else 0.0,
            completion_tokens=sum(res.tokens for res in results) / len(rewards) if rewards else 0.0,
            time=time.time(),
        )


class Evaluator:
    """The trainer's side of held-out evaluation: feeds rounds, takes their groups, reports them."""

    def __init__(
        self, settings: TrainerSettings, client: redis_policy.Client, stage: streams.StreamStage, encode: Encode
    ):
        self.settings = settings
        self.client = client
        self.stage = stage  # the trainer's `ready` stage: its commit script acks eval groups with their results
        self.keys = stage.keys
        self.encode = encode
        self.prompts = prompts.held_out(settings) if settings.eval_prompts else []
        self.fed_steps: set[int] = set()  # every round ever fed (reported or not)
        self.rounds: dict[int, Round] = {}  # fed, not reported
        self.load()

    @property
    def enabled(self) -> bool:
        return bool(self.prompts)

    def task_id(self, step: int, n: int) -> str:
        return f"{self.keys.run}-eval-{step:08d}-{n:05d}"

    @staticmethod
    def step_of(task_id: str) -> int:
        """N of a task id `<run>-eval-<N>-<n>`."""
        return int(task_id.rsplit("-", 2)[-2])

    def load(self) -> None:
        """The rounds fed before this process (a restart): markers and results from Redis."""
        if not self.enabled:
            return
        stored = {
            (k.decode() if isinstance(k, bytes) else k): v
            for k, v in self.client.hgetall(self.keys.eval_results).items()
        }
        markers = {
            int(k.removeprefix(ROUND_PREFIX)): json.loads(v) for k, v in stored.items() if k.startswith(ROUND_PREFIX)
        }
        self.fed_steps.update(markers)
        self.rounds = {
            step: Round(step, int(m["fed"]), float(m["at"])) for step, m in markers.items() if not m.get("reported")
        }
        for task_id, value in stored.items():
            live = self.rounds.get(self.step_of(task_id)) if not task_id.startswith(ROUND_PREFIX) else None
            if live is not None:
                live.results[task_id] = Result.from_json(value)

    def due(self, step: int) -> bool:
        """Whether a round is to be fed after `step` and has not been."""
        s = self.settings
        if not self.enabled or step in self.fed_steps:
            return False
        return (
            s.eval_only
            or step == 0
            or (s.eval_every > 0 and step % s.eval_every == 0)
            or (s.steps > 0 and step == s.steps)
        )

    def feed(self, ops: streams.Ops, step: int, version: int) -> None:
        """Add the round after `step` to `ops` (run with the step's commit, or alone)."""
        s = self.settings
        greedy = s.eval_samples == 1
        sampling = rollout_pb2.SamplingParams(
            temperature=0.0 if greedy else s.temperature,
            top_p=1.0 if greedy else s.top_p,
            max_new_tokens=s.max_new_tokens,
        )
        stream = self.keys.stream("eval_prompts")
        for n, p in enumerate(self.prompts):
            task = rollout_pb2.PromptTask(
                task_id=self.task_id(step, n),
                messages=[rollout_pb2.ChatMessage(role=r, content=c) for r, c in p.messages],
                answer=p.answer,
                group_size=s.eval_samples,
                sampling=sampling,
                fed_at_version=version,
                task_kind=p.task_kind,
                metadata_json=p.metadata_json,
                eval=True,
            )
            feed_task(ops, self.keys, stream, task, self.encode(p.messages))
        at = time.time()
        ops.hset(
            self.keys.eval_results,
            f"{ROUND_PREFIX}{step:08d}",
            json.dumps({"fed": len(self.prompts), "at": at, "version": version}),
        )
        self.fed_steps.add(step)
        self.rounds[step] = Round(step, len(self.prompts), at)

    def take(self, groups: Iterable[tuple[streams.Entry, rollout_pb2.RolloutGroup]]) -> None:
        """Record evaluation groups (checked against their tasks) and acknowledge them, in one
        script; a group of a round already reported, or one whose result is in (a duplicate),
        is only acknowledged."""
        entries: list[streams.Entry] = []
        new: dict[str, Result] = {}
        group_ids: list[str] = []
        for entry, group in groups:
            entries.append(entry)
            live = self.rounds.get(self.step_of(group.task_id))
            if live is not None and group.task_id not in live.results and group.task_id not in new:
                new[group.task_id] = Result.of(group)
                group_ids.append(group.group_id)
        if not entries:
            return
        counters = self.stage.counters

        def ledger(ops: streams.Ops) -> None:
            for task_id, result in new.items():
                ops.hset(self.keys.eval_results, task_id, result.to_json())
            ops.hincrby(counters, "evaluated", len(new))
            ops.sadd(
                self.keys.groups("evaluated"), *group_ids
            )  # the ledger's fifth outcome, beside trained, stale, dead, waiting
            ops.hincrby(counters, "eval_duplicates", len(entries) - len(new))

        self.stage.commit(entries, extra=ledger)
        for task_id, result in new.items():
            self.rounds[self.step_of(task_id)].results[task_id] = result

    def report_ready(self) -> list[rollout_pb2.EvalMetrics]:
        """Report every round whose tasks all have results, or that was fed eval_timeout_s ago
        or more (with what came in); returns their metrics, oldest first."""
        now = time.time()
        done = [
            r
            for r in sorted(self.rounds.values(), key=lambda r: r.step)
            if len(r.results) >= r.fed or now - r.fed_at >= self.settings.eval_timeout_s
        ]
        reported = []
        for r in done:
            metrics = r.metrics(self.settings.eval_samples)
            task_ids = [self.task_id(r.step, n) for n in range(r.fed)]
            ops = streams.Ops()
            ops.xadd(self.keys.evals, validation.encode(metrics), maxlen=10_000, approximate=True)
            ops.hset(
                self.keys.eval_results,
                f"{ROUND_PREFIX}{r.step:08d}",
                json.dumps({"fed": r.fed, "at": r.fed_at, "reported": True}),
            )
            ops.hdel(self.keys.eval_results, *task_ids)
            ops.hdel(self.keys.tasks, *task_ids)
            self.stage.apply(ops)
            del self.rounds[r.step]
            reported.append(metrics)
        if reported:
            run_keys.trim_acknowledged(self.client, self.keys.stream("eval_prompts"))
        return reported

    def waiting(self) -> bool:
        """A round fed and not yet reported."""
        return bool(self.rounds)
