"""`rollstream up --seed`: the seed, the data and the settings decide the samples, never the
run's name (the generator seeds a task by its position in the prompt stream, not its id)."""

from __future__ import annotations

import subprocess
import threading
import zlib
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from test_up import rollstream_cmd

from rollstream.core import steplog
from rollstream.v1 import reward_pb2, reward_pb2_grpc, rollout_pb2

pytestmark = pytest.mark.e2e


class TextScorer(reward_pb2_grpc.RewardServicer):
    """A remote grader whose reward is a function of the completion's text, so that the
    rewards differ wherever the samples do (the tiny random model earns no built-in reward).
    It keeps every completion it scored by (task position, completion index)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: dict[tuple[str, int], str] = {}
        self.run = ""  # the run being scored: group ids are "<run>-<position>"

    def Score(self, request: reward_pb2.ScoreRequest, context: grpc.ServicerContext) -> reward_pb2.ScoreResponse:
        scores = []
        with self.lock:
            for item in request.items:
                self.seen[(item.group_id.removeprefix(f"{self.run}-"), item.completion_index)] = item.completion
                value = (zlib.crc32(item.completion.encode()) % 1000) / 1000
                component = rollout_pb2.RewardComponent(name="text_hash", value=value, weight=1.0, status="ok")
                scores.append(reward_pb2.ItemScore(reward=value, components=[component]))
        return reward_pb2.ScoreResponse(scores=scores)


def serve_text_scorer(folder: Path) -> tuple[TextScorer, grpc.Server, str]:
    """A TextScorer serving on a unix socket in `folder` (0700: `up` sends the reward's token
    there, and only over a socket nobody else can take): (scorer, server, address); stop the
    server after."""
    scorer = TextScorer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    reward_pb2_grpc.add_RewardServicer_to_server(scorer, server)
    folder.mkdir(mode=0o700, exist_ok=True)
    address = f"unix:{folder / 'scorer.sock'}"
    server.add_insecure_port(address)
    server.start()
    return scorer, server, address


def test_two_run_names_with_one_seed_sample_alike(tiny_model_dir: Path, redis_url: str, tmp_path: Path) -> None:
    scorer, server, address = serve_text_scorer(tmp_path / "scorer")
    rewards: dict[str, list[float]] = {}
    completions: dict[str, dict[tuple[str, int], str]] = {}
    try:
        for run in ("seedrun-a", "other-name-b"):
            scorer.run, scorer.seen = run, {}
            workdir = tmp_path / run
            cmd = [
                rollstream_cmd(), "up", "--model", str(tiny_model_dir), "--trainer.steps", "3", "--run", run, "--workdir", str(workdir),
                "--redis-url", redis_url, "--trainer.group-size", "4", "--trainer.groups-per-step", "2", "--trainer.max-new-tokens", "6", "--threads", "1",
                "--generator.seed", "7", "--trainer.lr", "1e-2", "--reward.scorer-address", address,
            ]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stdout + done.stderr
            log = steplog.read(workdir / steplog.FILE_NAME)
            assert [r["step"] for r in log.steps] == [1, 2, 3] and not log.skipped
            rewards[run] = [r["reward_mean"] for r in log.steps]
            completions[run] = dict(scorer.seen)
    finally:
        server.stop(grace=None)
    a, b = rewards["seedrun-a"], rewards["other-name-b"]
    assert a == b, f"per-step rewards differ between run names with one seed: {a} vs {b}"
    # A batch for a 4th step may have been sampled before `up` stopped: compare what both scored.
    both = completions["seedrun-a"].keys() & completions["other-name-b"].keys()
    assert len(both) >= 3 * 2 * 4
    assert {k: completions["seedrun-a"][k] for k in both} == {k: completions["other-name-b"][k] for k in both}
    # The comparison means something: the samples, and so the rewards, vary between groups.
    assert len(set(completions["seedrun-a"].values())) > 1 and len(set(a)) > 1, (a, completions["seedrun-a"])
