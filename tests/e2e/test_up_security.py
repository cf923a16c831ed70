"""`rollstream up` on its embedded Redis, attacked from an outside process while it trains:
every outsider action of the security review is refused (NOAUTH / NOPERM on Redis,
UNAUTHENTICATED / PERMISSION_DENIED on gRPC), and the run goes on, its services serving
their own work under their own credentials (docs/security.md)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest
import redis

from helpers import MIN_WAIT_S, code_of, dead_letters, still_running, wait_for
from rollstream.core import credentials, validation
from rollstream.core.grpc_auth import ClientCredentials
from rollstream.core.grpc_utils import channel
from rollstream.core.run_keys import RunKeys
from rollstream.v1 import generator_pb2_grpc, rollout_pb2, trainer_pb2, trainer_pb2_grpc, weights_pb2

pytestmark = pytest.mark.e2e


def rollstream_cmd() -> str:
    return str(Path(sys.executable).parent / "rollstream")


def forged_group(keys: RunKeys) -> dict[bytes, bytes]:
    group = rollout_pb2.RolloutGroup(
        group_id="forged",
        task_id="forged",
        prompt_ids=[1, 2],
        policy_version=0,
        scored=True,
        completions=[rollout_pb2.Completion(token_ids=[3, 4], behaviour_logprobs=[-0.1, -0.1], reward=100.0)],
    )
    return validation.encode(group)


def forged_answers(admin: redis.Redis, keys: RunKeys, model: Path) -> dict[str, rollout_pb2.RolloutGroup]:
    """Issue 42's forged answers, as the generator's user can write them to `rollouts`: a
    made-up task, a real task claiming another answer (its text that answer, its tokens that
    text), a real task whose text is not its tokens. Each at most 6 tokens (the run's limit)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    _, fields = admin.xrevrange(keys.stream("prompts"), count=1)[
        0
    ]  # what a generator reads with XREADGROUP: the newest task
    task = validation.decode(fields, rollout_pb2.PromptTask)
    chat = [{"role": m.role, "content": m.content} for m in task.messages]
    prompt = list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))
    claimed = str(int(task.answer) + 100)

    def group(group_id: str, task_id: str, answer: str, text: str, tokens_of: str) -> rollout_pb2.RolloutGroup:
        ids = tokenizer.encode(tokens_of, add_special_tokens=False)
        completion = rollout_pb2.Completion(
            token_ids=ids, behaviour_logprobs=[-0.1] * len(ids), text=text, finish_reason="stop"
        )
        return rollout_pb2.RolloutGroup(group_id=group_id, task_id=task_id, policy_version=int(admin.get(keys.version) or 0), prompt_ids=prompt,
                                        answer=answer, task_kind="arithmetic", group_size=4, completions=[completion] * 4)  # fmt: skip

    return {
        "made-up-task": group("made-up-task", f"{keys.run}-99999999", "5", "5", "5"),
        "forged-answer": group("forged-answer", task.task_id, claimed, claimed, claimed),
        "text-not-tokens": group("text-not-tokens", task.task_id, task.answer, task.answer, "zzz"),
    }


def test_outsiders_are_refused_and_the_run_goes_on(tiny_model_dir: Path, tmp_path: Path) -> None:
    run = "guarded"
    keys = RunKeys(run)
    cmd = [
        rollstream_cmd(),
        "up",
        "--model",
        str(tiny_model_dir),
        "--trainer.steps",
        "1000000",
        "--run",
        run,
        "--workdir",
        str(tmp_path),
        "--trainer.group-size",
        "4",
        "--trainer.groups-per-step",
        "2",
        "--trainer.max-new-tokens",
        "6",
        "--threads",
        "1",
        "--colocate",
        "off",  # a generator process, its own ports and credentials to attack
        "--trainer.checkpoint-every",
        "0",  # the trained log keeps every step: what the forged group trained with
        # The forged groups wait behind the generator's in each stream: on a loaded machine they reach the
        # trainer steps after they were written, and must neither go stale nor find their task swept.
        "--trainer.max-staleness",
        "1000",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    creds = tmp_path / "credentials"
    try:
        up_running = still_running(proc, "up")
        state = tmp_path / "state"
        wait_for(lambda: (state / "generator-0.json").exists() and (state / "redis.json").exists(), 300, "up to start its services",
                 check=up_running, poll_s=0.5)  # fmt: skip
        url = json.loads((tmp_path / "state" / "redis.json").read_text())[
            "url"
        ]  # a unix socket in the 0700 workdir: no port
        sock = redis.connection.parse_url(url)["path"]
        admin = redis.Redis(
            unix_socket_path=sock,
            username="admin",
            password=credentials.read_secret(creds / "redis" / "admin.password", "admin"),
        )
        wait_for(lambda: admin.xlen(keys.metrics) >= 1, 300, "a first step", check=up_running, poll_s=0.5)

        # Redis: no password, no access at all; a service's own user only for its own work.
        anonymous = redis.Redis(unix_socket_path=sock)
        with pytest.raises(redis.AuthenticationError):
            anonymous.xadd(keys.stream("ready"), forged_group(keys))
        generator = redis.Redis(
            unix_socket_path=sock,
            username="generator",
            password=credentials.read_secret(creds / "redis" / "generator.password", "g"),
        )
        reward = redis.Redis(
            unix_socket_path=sock,
            username="reward",
            password=credentials.read_secret(creds / "redis" / "reward.password", "r"),
        )
        observer = redis.Redis(
            unix_socket_path=sock,
            username="observer",
            password=credentials.read_secret(creds / "redis" / "observer.password", "o"),
        )
        for refused in (
            lambda: reward.xadd(keys.stream("prompts"), {"x": "y"}),  # another stage's stream
            lambda: generator.xadd(keys.stream("ready"), forged_group(keys)),  # a self-rewarded group for the trainer
            lambda: observer.xadd(keys.stream("ready"), forged_group(keys)),  # the generator's back-pressure reads only
            lambda: generator.set(keys.version, 10**6),  # the trainer's version
            lambda: generator.hset(keys.tasks, f"{run}-99999999", b"x"),  # the trainer's task map
            lambda: generator.xadd(keys.metrics, {"x": "y"}),
            lambda: generator.execute_command("DEBUG", "SLEEP", "6"),
            lambda: generator.flushall(),
            lambda: generator.config_set("appendonly", "no"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                refused()

        forged = forged_answers(admin, keys, tiny_model_dir)
        for g in forged.values():  # XADD to rollouts: the generator's own lane
            generator.xadd(keys.stream("rollouts"), validation.encode(g))

        # gRPC: the trainer's and generators' sockets, from another process's point of view.
        trainer_address = json.loads((tmp_path / "state" / "trainer.json").read_text())["grpc_address"]
        generator_address = json.loads((tmp_path / "state" / "generator-0.json").read_text())["grpc_address"]
        generator_token = ClientCredentials(token=credentials.read_secret(creds / "grpc" / "generator.token", "g"))
        admin_token = ClientCredentials(token=credentials.read_secret(creds / "grpc" / "admin.token", "a"))
        anchor = [
            weights_pb2.WeightChunk(
                header=weights_pb2.WeightHeader(kind="anchor", version=10**6, total_bytes=1), data=b"x"
            )
        ]
        with channel(generator_address) as ch:
            assert (
                code_of(lambda: generator_pb2_grpc.GeneratorStub(ch).PushWeights(iter(anchor), timeout=30))
                == grpc.StatusCode.UNAUTHENTICATED
            )
        with channel(generator_address, generator_token) as ch:
            # No bearer token opens a push (the trainer signs: tests/e2e/test_up_registry_attack.py).
            assert (
                code_of(lambda: generator_pb2_grpc.GeneratorStub(ch).PushWeights(iter(anchor), timeout=30))
                == grpc.StatusCode.UNAUTHENTICATED
            )
        with channel(trainer_address) as ch:
            stub = trainer_pb2_grpc.TrainerStub(ch)
            assert (
                code_of(lambda: list(stub.FetchWeights(trainer_pb2.FetchWeightsRequest(), timeout=30)))
                == grpc.StatusCode.UNAUTHENTICATED
            )
            assert (
                code_of(
                    lambda: stub.SaveCheckpoint(
                        trainer_pb2.SaveCheckpointRequest(path=str(tmp_path / "evil")), timeout=30
                    )
                )
                == grpc.StatusCode.UNAUTHENTICATED
            )
        with channel(trainer_address, generator_token) as ch:
            assert (
                code_of(
                    lambda: trainer_pb2_grpc.TrainerStub(ch).SaveCheckpoint(
                        trainer_pb2.SaveCheckpointRequest(), timeout=30
                    )
                )
                == grpc.StatusCode.PERMISSION_DENIED
            )
        with channel(trainer_address, admin_token) as ch:  # even the operator writes only under the checkpoint folder
            evil = trainer_pb2.SaveCheckpointRequest(path=str(tmp_path / "evil"))
            assert (
                code_of(lambda: trainer_pb2_grpc.TrainerStub(ch).SaveCheckpoint(evil, timeout=60))
                == grpc.StatusCode.PERMISSION_DENIED
            )
        assert not (tmp_path / "evil").exists()

        # The run goes on: more steps, nothing forged trained, nothing dead-lettered, and each
        # service does its work as its own user: the server denies none of them anything.
        admin.acl_log_reset()  # what was denied so far is the attacks above
        steps_then = admin.xlen(keys.metrics)
        wait_for(
            lambda: admin.xlen(keys.metrics) >= steps_then + 2,
            300,
            "2 more steps after the attacks",
            check=up_running,
            poll_s=0.5,
        )
        assert not admin.sismember(keys.groups("trained"), "forged")

        wait_for(lambda: "forged-answer" in {m.decode() for m in admin.smembers(keys.groups("trained"))} and len(dead_letters(admin, keys)) == 2, 300,
                 "the forged groups refused or trained as scored", check=up_running, poll_s=0.5,
                 details=lambda: f"dead letters {dead_letters(admin, keys)}, forged-answer stale: {admin.sismember(keys.groups('stale'), 'forged-answer')}")  # fmt: skip
        dead = dead_letters(admin, keys)  # nothing honest among them
        assert set(dead) == {"made-up-task", "text-not-tokens"}, dead
        assert (
            f"is not in {keys.tasks}" in dead["made-up-task"]
            and "is not its token_ids decoded" in dead["text-not-tokens"]
        )
        # The forged answer was scored against the real one (format only: 0.1), and trains no signal.
        trained = [
            validation.decode({k: v for k, v in f.items() if k != b"step"}, rollout_pb2.RolloutGroup)
            for _, f in admin.xrange(keys.trained_log)
        ]
        (as_trained,) = [g for g in trained if g.group_id == "forged-answer"]
        assert as_trained.answer == str(int(forged["forged-answer"].answer) - 100)
        assert [c.reward for c in as_trained.completions] == pytest.approx([0.1] * 4)
        assert admin.acl_log() == []

        # The operator's view: `rollstream status` as admin works; without credentials it says why.
        ok = subprocess.run(
            [
                rollstream_cmd(),
                "status",
                "--redis-url",
                url,
                "--run",
                run,
                "--redis-username",
                "admin",
                "--redis-password-file",
                str(creds / "redis" / "admin.password"),
            ],
            capture_output=True,
            text=True,
            timeout=MIN_WAIT_S,
        )
        assert ok.returncode == 0 and keys.stream("ready") in ok.stdout, ok.stdout + ok.stderr
        refused = subprocess.run(
            [rollstream_cmd(), "status", "--redis-url", url, "--run", run],
            capture_output=True,
            text=True,
            timeout=MIN_WAIT_S,
        )
        assert refused.returncode != 0 and "auth" in (refused.stdout + refused.stderr).lower(), (
            refused.stdout + refused.stderr
        )

        # The trainer's dashboard reads every stage as the read-only observer: nothing of its
        # look is refused, and no password of any user is in what it serves.
        admin.acl_log_reset()
        http = f"http://127.0.0.1:{json.loads((tmp_path / 'state' / 'trainer.json').read_text())['http_port']}"
        pipeline = httpx.get(f"{http}/api/pipeline", timeout=30)
        view = pipeline.json()
        assert view["ok"] and view["errors"] == [] and view["trainer"]["step"] >= steps_then + 2, view
        assert {s["name"] for s in view["stages"] if s["active"]} == {
            "generator",
            "reward",
            "trainer",
        }  # beta 0: no reference stage
        assert [s["consumers"] for s in view["stages"] if s["name"] == "trainer"][0], view
        assert view["generators"] and view["last_step"] is not None
        served = (
            pipeline.text
            + httpx.get(f"{http}/api/steps", timeout=30).text
            + httpx.get(f"{http}/metrics", timeout=30).text
        )
        for user in ("admin", "trainer", "generator", "reward", "observer"):
            assert credentials.read_secret(creds / "redis" / f"{user}.password", user) not in served, user
        assert admin.acl_log() == []
        admin.close()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=MIN_WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "dashboard: http://127.0.0.1:" in out, out
