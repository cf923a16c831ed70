"""Issue 42, "forged answers": the trainer owns the task.

With only the generator's Redis password, a group written to `rollouts` carried its own
answer and tests, the reward scored its `text`, and the trainer trained `token_ids` nothing
tied to that text: a whole step of forged groups was trained. Now the trainer records every
task it feeds in rs:{<run>}:tasks (a key the generator's user cannot touch), the reward
scores with the task's answer and refuses groups of tasks it does not hold, and the trainer
trains a group only if its prompt is the task's and each completion's text is its tokens
decoded. Real redis-server with the ACL users, real services, the real feeder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from transformers import AutoTokenizer

from helpers import dead_letters, wait_for
from procs import start_service
from rollstream.core import redis_acl, redis_policy, validation
from rollstream.core.run_keys import RunKeys
from rollstream.core.streams import StreamStage
from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.prompts import PromptFeeder, chat_encoder
from rollstream.v1 import rollout_pb2
from synthetic import Decode, tokenizer_decode


def role_flags(secrets_root: Path, role: str) -> list[str]:
    return ["--redis-username", role, "--redis-password-file", str(redis_acl.password_file(secrets_root, role))]


def feeder(
    client: redis_policy.Client, keys: RunKeys, model: Path, buffer: int, max_staleness: int = 1
) -> PromptFeeder:
    """The trainer's feeder, as the trainer's user, with the tiny model's chat template."""
    settings = TrainerSettings(
        run=keys.run, prompt_buffer=buffer, group_size=2, consumer="trainer-0", max_staleness=max_staleness
    )
    stage = StreamStage.for_service(client, settings, "ready", "trainer")
    encode = chat_encoder(AutoTokenizer.from_pretrained(str(model), local_files_only=True))
    return PromptFeeder(settings, client, stage, PromptFeeder.position(client, keys, 0), encode)


def group_for(
    task_id: str, group_id: str, answer: str, texts: list[str], prompt_ids: list[int]
) -> rollout_pb2.RolloutGroup:
    return rollout_pb2.RolloutGroup(
        group_id=group_id, task_id=task_id, policy_version=0, prompt_ids=prompt_ids, answer=answer, task_kind="arithmetic", group_size=len(texts),
        completions=[rollout_pb2.Completion(text=t, token_ids=[5, 6], behaviour_logprobs=[-0.5, -0.5], finish_reason="stop") for t in texts],
    )  # fmt: skip


def honest(
    task: rollout_pb2.PromptTask, group_id: str, tokens: list[list[int]], decode: Decode
) -> rollout_pb2.RolloutGroup:
    """A group of `task` as the reward writes it to `ready`: the task's prompt, each completion's text its tokens decoded."""
    completions = [rollout_pb2.Completion(token_ids=t, behaviour_logprobs=[-4.0] * len(t), text=decode(t), reward=float(k), finish_reason="length")
                   for k, t in enumerate(tokens)]  # fmt: skip
    return rollout_pb2.RolloutGroup(
        group_id=group_id, task_id=task.task_id, policy_version=0, prompt_ids=task.prompt_ids, completions=completions, answer=task.answer,
        metadata_json=task.metadata_json, task_kind=task.task_kind, group_size=task.group_size, scored=True,
    )  # fmt: skip


def test_the_generator_user_cannot_touch_the_task_map(connect_as, keys: RunKeys) -> None:
    generator = connect_as("generator")
    for call in (lambda: generator.hset(keys.tasks, "t", b"x"), lambda: generator.hget(keys.tasks, "t"),
                 lambda: generator.eval("return redis.call('HSET', KEYS[1], 't', 'x')", 1, keys.tasks)):  # fmt: skip
        with pytest.raises(redis.RedisError) as e:
            call()
        assert redis_policy.is_denied(e.value), e.value


def test_reward_scores_the_trainers_answer_and_refuses_unknown_tasks(
    tmp_path: Path,
    server: EmbeddedRedis,
    secrets_root: Path,
    admin: redis.Redis,
    connect_as,
    keys: RunKeys,
    tiny_model_dir: Path,
) -> None:
    """(1) a group of a made-up task is dead-lettered, never scored; (2) a group of a real
    task that claims another answer (its text matching that answer) is scored against the
    answer the trainer fed, and goes on carrying that one."""
    assert feeder(connect_as("trainer"), keys, tiny_model_dir, buffer=2).top_up(version=0) == 2
    generator = connect_as("generator")
    prompts = StreamStage(generator, keys, "prompts", "generators", "gen-0")
    taken = prompts.read(2, 100)
    real = [validation.decode(entry.fields, rollout_pb2.PromptTask) for entry in taken]
    forged_answer = str(int(real[0].answer) + 100)
    groups = [
        group_for("made-up-task", "made-up", "5", ["The answer is 5", "The answer is 5"], [1, 2, 3]),
        group_for(real[0].task_id, real[0].task_id, forged_answer, [f"The answer is {forged_answer}"] * 2, [1, 2, 3]),
        group_for(
            real[1].task_id, real[1].task_id, real[1].answer, [f"The answer is {real[1].answer}", "no idea"], [1, 2, 3]
        ),
    ]
    # Written as the generator writes, with its user: its commit, acknowledging the tasks taken.
    assert prompts.commit(taken, outputs=[("rollouts", g) for g in groups])
    reward = start_service("reward", tmp_path, "--redis-url", server.url, "--run", keys.run, "--block-ms", "50", "--output-stage", "scored",
                           *role_flags(secrets_root, "reward"))  # fmt: skip
    try:
        reward.wait_ready()
        wait_for(
            lambda: admin.xlen(keys.stream("scored")) + admin.xlen(keys.dead) >= 3,
            60,
            "3 groups scored or dead",
            [reward],
        )
    finally:
        assert reward.stop() == 0, reward.log()[-3000:]
    scored = {
        g.group_id: g
        for g in (validation.decode(f, rollout_pb2.RolloutGroup) for _, f in admin.xrange(keys.stream("scored")))
    }
    dead = dead_letters(admin, keys)
    assert set(dead) == {"made-up"} and set(scored) == {real[0].task_id, real[1].task_id}
    assert f"task 'made-up-task' is not in {keys.tasks}" in dead["made-up"]
    forged = scored[real[0].task_id]
    assert [c.reward for c in forged.completions] == pytest.approx([0.1, 0.1])  # the format only: wrong answer
    assert forged.answer == real[0].answer
    assert [c.reward for c in scored[real[1].task_id].completions] == pytest.approx([1.1, 0.0])


def test_trainer_trains_only_the_tokens_of_the_text_of_a_task_it_fed(
    tmp_path: Path, server: EmbeddedRedis, secrets_root: Path, admin: redis.Redis, keys: RunKeys, tiny_model_dir: Path
) -> None:
    """(1) and (3): in `ready` (written here as the reward would), groups of a made-up task,
    with text that is not their tokens decoded, with another prompt, or claiming another
    answer are dead-lettered with the reason; two honest groups train the step."""
    trainer = start_service(
        "trainer", tmp_path, "--redis-url", server.url, "--run", keys.run, "--model", str(tiny_model_dir), "--threads", "1",
        "--consumer", "trainer-0", "--groups-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--prompt-buffer", "2",
        "--lr", "1e-3", "--beta", "0", "--max-staleness", "100", "--block-ms", "100", "--steps", "1", "--linger",
        *role_flags(secrets_root, "trainer"),
    )  # fmt: skip
    try:
        trainer.wait_ready()
        wait_for(lambda: admin.hlen(keys.tasks) == 2, 60, "2 tasks fed", [trainer])
        tasks = [rollout_pb2.PromptTask.FromString(admin.hget(keys.tasks, f"{keys.run}-{n:08d}")) for n in range(2)]
        assert all(t.prompt_ids for t in tasks)  # rendered by the trainer, with its tokenizer
        decode = tokenizer_decode(tiny_model_dir)
        tokens = [[40, 41, 42], [50, 51, 52, 53]]
        unknown = honest(tasks[0], "unknown", tokens, decode)
        unknown.task_id = f"{keys.run}-00000099"
        text = honest(tasks[0], "text", tokens, decode)
        text.completions[1].text = "The answer is " + tasks[0].answer
        prompt = honest(tasks[1], "prompt", tokens, decode)
        prompt.prompt_ids[-1] = prompt.prompt_ids[-1] + 1
        answer = honest(tasks[1], "answer", tokens, decode)
        answer.answer = answer.answer + "0"
        # The forged ones first: the code before the task map trained the first two it read.
        for g in (
            unknown,
            text,
            prompt,
            answer,
            honest(tasks[0], tasks[0].task_id, tokens, decode),
            honest(tasks[1], tasks[1].task_id, tokens, decode),
        ):
            admin.xadd(keys.stream("ready"), validation.encode(g))
        wait_for(lambda: admin.get(keys.version) == b"1", 120, "step 1 committed", [trainer])
        trained = {m.decode() for m in admin.smembers(keys.groups("trained"))}
        dead = dead_letters(admin, keys)
    finally:
        trainer.stop()
    assert trained == {tasks[0].task_id, tasks[1].task_id}
    assert set(dead) == {"unknown", "text", "prompt", "answer"}
    assert f"is not in {keys.tasks}" in dead["unknown"]
    assert "completion 1: text 'The answer is" in dead["text"] and "is not its token_ids decoded" in dead["text"]
    assert "prompt_ids" in dead["prompt"] and "are not task" in dead["prompt"]
    assert "answer" in dead["answer"] and "is not the task's" in dead["answer"]


def test_the_map_is_swept_behind_staleness_and_survives_a_restart(
    connect_as, admin: redis.Redis, keys: RunKeys, tiny_model_dir: Path
) -> None:
    """Tasks leave the map once their groups can only be stale (taken, then max_staleness
    versions passed), never while a generator holds them; a restarted feeder finds where the
    map starts; a forged entry the generator appends to `prompts` moves nothing."""
    trainer, generator = connect_as("trainer"), connect_as("generator")
    first = feeder(trainer, keys, tiny_model_dir, buffer=4, max_staleness=1)
    assert first.top_up(version=0) == 4
    prompts = StreamStage(generator, keys, "prompts", "generators", "gen-0")
    taken = prompts.read(2, 100)
    assert prompts.commit(taken, outputs=[("rollouts", group_for(validation.decode(e.fields, rollout_pb2.PromptTask).task_id, "g", "1", ["1"], [1]))
                                          for e in taken])  # fmt: skip
    ids = [f"{keys.run}-{n:08d}" for n in range(8)]

    def held() -> list[bool]:
        return [bool(admin.hexists(keys.tasks, i)) for i in ids]

    assert first.top_up(version=1) == 2  # tasks 0 and 1 taken at version 1; 4 and 5 fed
    assert held() == [True] * 6 + [False] * 2
    first.top_up(version=2)  # 2 is not past 1 + max_staleness
    assert held() == [True] * 6 + [False] * 2
    first.top_up(version=3)
    assert held() == [False] * 2 + [True] * 4 + [False] * 2

    # A restarted trainer: a new feeder at the same position; tasks 2..5 are still in flight.
    second = feeder(trainer, keys, tiny_model_dir, buffer=4, max_staleness=1)
    assert second.fed == 6
    taken = prompts.read(4, 100)  # 2..5, then a forged head that claims a later position
    forged = rollout_pb2.PromptTask.FromString(admin.hget(keys.tasks, ids[5]))
    forged.task_id = f"{keys.run}-00099999"
    generator.xadd(keys.stream("prompts"), validation.encode(forged))
    assert prompts.commit(taken[:2], outputs=[])  # 2 and 3 done; 4 and 5 still held by the generator
    second.top_up(version=10)
    second.top_up(version=20)
    assert held()[:6] == [False] * 4 + [True] * 2
    assert prompts.commit(taken[2:], outputs=[])  # 4, 5 done: the forged entry is now the head
    second.top_up(version=30)
    second.top_up(version=40)
    assert held()[:6] == [False] * 4 + [True] * 2  # not ours (the map does not hold it): no mark
    head = prompts.read(2, 100)  # a generator takes the forged entry and task 6, and is done with the forged one
    assert validation.decode(head[0].fields, rollout_pb2.PromptTask).task_id == forged.task_id
    assert prompts.commit(head[:1], outputs=[])
    second.top_up(version=50)
    second.top_up(version=60)
    assert held()[:7] == [False] * 6 + [True]  # up to task 6, which the generator still holds
    assert admin.hlen(keys.tasks) == second.fed - 6


def test_the_task_map_decides_what_is_evaluated_and_a_forged_eval_id_is_dead_lettered(
    tmp_path: Path, server: EmbeddedRedis, secrets_root: Path, admin: redis.Redis, keys: RunKeys, tiny_model_dir: Path
) -> None:
    """Issue 43's held-out groups against forgers: a group whose task is a training task is
    trained though it claims `eval`; a group of an evaluation task is evaluated (never trained)
    though it claims none; a group of an `eval`-looking task id the trainer never fed (a garbage
    round), or one claiming a version the trainer has not published, is dead-lettered with the
    reason, and the trainer goes on to report the round."""
    trainer = start_service(
        "trainer", tmp_path, "--redis-url", server.url, "--run", keys.run, "--model", str(tiny_model_dir), "--threads", "1",
        "--consumer", "trainer-0", "--groups-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--prompt-buffer", "2",
        "--lr", "1e-3", "--beta", "0", "--max-staleness", "100", "--block-ms", "100", "--steps", "1", "--linger",
        "--eval-prompts", "2", "--eval-every", "0", *role_flags(secrets_root, "trainer"),
    )  # fmt: skip
    try:
        trainer.wait_ready()
        train_ids = [f"{keys.run}-{n:08d}" for n in range(2)]
        eval_ids = [f"{keys.run}-eval-00000000-{n:05d}" for n in range(2)]  # the round before the first step
        wait_for(lambda: admin.hlen(keys.tasks) == 4, 60, "2 training and 2 evaluation tasks fed", [trainer])
        tasks = {t: rollout_pb2.PromptTask.FromString(admin.hget(keys.tasks, t)) for t in train_ids + eval_ids}
        assert [tasks[t].eval for t in train_ids + eval_ids] == [False, False, True, True] and admin.xlen(
            keys.stream("eval_prompts")
        ) == 2
        decode = tokenizer_decode(tiny_model_dir)
        tokens = [[40, 41, 42], [50, 51, 52, 53]]
        claims_eval = honest(tasks[train_ids[0]], train_ids[0], tokens, decode)
        claims_eval.eval = True
        claims_training = honest(tasks[eval_ids[0]], eval_ids[0], tokens[:1], decode)
        assert not claims_training.eval
        garbage = honest(tasks[eval_ids[1]], "garbage", tokens[:1], decode)
        garbage.task_id, garbage.eval = f"{keys.run}-eval-xx-yy", True
        for g in (claims_eval, claims_training, garbage, honest(tasks[train_ids[1]], train_ids[1], tokens, decode)):
            admin.xadd(keys.stream("ready"), validation.encode(g))
        wait_for(lambda: admin.get(keys.version) == b"1", 120, "step 1 committed", [trainer])
        assert admin.xlen(keys.evals) == 0  # one of the round's two tasks answered
        future = honest(tasks[eval_ids[1]], "future", tokens[:1], decode)
        future.policy_version = 999  # would make the round read "versions 0-999"
        admin.xadd(keys.stream("ready"), validation.encode(future))
        admin.xadd(keys.stream("ready"), validation.encode(honest(tasks[eval_ids[1]], eval_ids[1], tokens[:1], decode)))
        wait_for(lambda: admin.xlen(keys.evals) >= 1, 120, "the round of step 0 reported", [trainer])
        # A copy of an evaluated group after its round was reported (its task left the map): a duplicate, not a dead letter.
        admin.xadd(keys.stream("ready"), validation.encode(claims_training))
        wait_for(
            lambda: admin.hget(keys.counters("trainer"), "duplicates") == b"1" or admin.xlen(keys.dead) > 2,
            120,
            "the copy handled",
            [trainer],
        )
        trained = {m.decode() for m in admin.smembers(keys.groups("trained"))}
        evaluated = {m.decode() for m in admin.smembers(keys.groups("evaluated"))}
        stats = {k.decode(): int(v) for k, v in admin.hgetall(keys.counters("trainer")).items()}
        rounds = [validation.decode(f, rollout_pb2.EvalMetrics) for _, f in admin.xrange(keys.evals)]
        dead = dead_letters(admin, keys)
    finally:
        assert trainer.stop() == 0, trainer.log()[-3000:]
    assert trained == set(train_ids) and evaluated == set(eval_ids)
    assert (
        stats["trained"] == 2
        and stats["evaluated"] == 2
        and stats.get("eval_duplicates", 0) == 0
        and stats["duplicates"] == 1
    ), stats
    assert [(m.step, m.prompts, m.prompts_fed, m.samples) for m in rounds] == [(0, 2, 2, 1)]
    assert (
        set(dead) == {"garbage", "future"} and f"task '{keys.run}-eval-xx-yy' is not in {keys.tasks}" in dead["garbage"]
    )
    assert "policy_version 999 is newer than the trainer's 1" in dead["future"]
