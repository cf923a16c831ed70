"""examples/model_scorer: a model-based reward (the tiny model's log-likelihood) served over
`Reward/Score`, used by the built-in reward stage as its remote scorer, end to end: a real
scorer process with a real model, a real reward process, a real redis-server."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from helpers import MIN_WAIT_S, LoggedProc, groups_in, wait_for, wait_healthy, write_many
from procs import start_reward
from rollstream.core.grpc_utils import channel
from rollstream.core.run_keys import RunKeys
from rollstream.v1 import reward_pb2, reward_pb2_grpc
from synthetic import rollout_group

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "model_scorer" / "loglik_scorer.py"


def test_reward_stage_scores_with_the_model_scorer(
    tiny_model_dir: Path, redis_url: str, rclient: redis.Redis, keys: RunKeys, tmp_path: Path
) -> None:
    port_file, log_path = tmp_path / "port", tmp_path / "scorer.log"
    with log_path.open("wb") as log:
        scorer = subprocess.Popen([sys.executable, str(EXAMPLE), "--model", str(tiny_model_dir), "--port-file", str(port_file), "--device", "cpu"],
                                  stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    watched = LoggedProc("the model scorer", scorer, log_path)
    reward = None
    try:
        wait_for(
            lambda: port_file.exists() and port_file.read_text().strip(),
            120,
            "the scorer's port",
            procs=[watched],
            poll_s=0.2,
        )
        address = f"127.0.0.1:{port_file.read_text().strip()}"
        wait_healthy(address, service="rollstream.v1.Reward")
        groups = [
            rollout_group("m0", ["7 + 1 = 8", "The answer is 8.", ""]),
            rollout_group("m1", ["zzzz qqqq", "What is 3 + 4?"]),
        ]
        write_many(rclient, keys, groups)
        reward = start_reward(tmp_path, redis_url, keys.run, "--scorer-address", address, "--scorer-deadline-s", "60")
        wait_for(
            lambda: len(groups_in(rclient, keys.stream("scored"))) == 2,
            120,
            "both groups scored",
            procs=[reward, watched],
        )
        out = {g.group_id: g for g in groups_in(rclient, keys.stream("scored"))}

        # The stream carries exactly what the scorer answers for the same texts.
        items = [reward_pb2.ScoreItem(completion=c.text) for g in groups for c in g.completions]
        with channel(address, None) as ch:
            direct = reward_pb2_grpc.RewardStub(ch).Score(reward_pb2.ScoreRequest(items=items), timeout=60).scores
        written = [c for gid in ("m0", "m1") for c in out[gid].completions]
        # (approx: another batch composition may take another BLAS path; the values are the same up to rounding)
        assert [c.reward for c in written] == pytest.approx([s.reward for s in direct], rel=1e-5)
        for c in written:
            assert [(rc.name, rc.status) for rc in c.reward_components] == [("fluency", "ok")]
            assert 0.0 <= c.reward <= 1.0 and math.isfinite(c.reward)
        assert out["m0"].completions[2].reward == 0.0  # the empty completion: a verdict of 0
        assert all(c.reward > 0 for c in written if c.text)
        assert rclient.xlen(keys.dead) == 0
    finally:
        if reward is not None:
            assert reward.stop() == 0, reward.log()
        scorer.terminate()
        scorer.wait(timeout=MIN_WAIT_S)
    assert scorer.returncode == 0, watched.log()
