"""ranks.py's pieces that need no process group: who is a rank, what N ranks refuse at start,
each rank's share of a step's micro-batches, the groups' payload, a shard's rows. The ranks
themselves run in the ranks tier (tests/ranks: torchrun, gloo)."""

from __future__ import annotations

import pytest
import torch

from rollstream.core.config import load_settings
from rollstream.trainer import ranks
from rollstream.trainer.config import TrainerSettings
from synthetic import scored_groups


def test_a_rank_only_under_torchrun() -> None:
    assert ranks.World.from_env({}) is None
    assert ranks.World.from_env({"WORLD_SIZE": "2", "RANK": "1"}) is None  # left over from something else
    env = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}
    assert ranks.World.from_env(env) == ranks.World(3, 4, 1)
    with pytest.raises(ValueError, match="outside WORLD_SIZE"):
        ranks.World.from_env({**env, "RANK": "4"})
    with pytest.raises(ValueError, match="malformed"):
        ranks.World.from_env({**env, "RANK": "three"})


@pytest.mark.parametrize(("setting", "value"), [("lora_rank", 8), ("grad_offload", True)])
def test_what_n_ranks_do_not_have_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, setting: str, value: object
) -> None:
    for name, v in {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, v)
    settings = load_settings(TrainerSettings, [], **{setting: value})
    with pytest.raises(SystemExit, match=f"^{setting}: .* not built"):
        ranks.Ranks.from_env(settings)  # before any process group is joined


def test_a_rank_takes_its_own_gpu() -> None:
    two = ranks.World(1, 2, 1)
    assert ranks.rank_device("cuda", two) == "cuda:1"
    assert ranks.rank_device("cpu", two) == "cpu"
    with pytest.raises(ValueError, match="one GPU a rank"):
        ranks.rank_device("cuda:0", two)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_micro_batch_runs_once_in_order(count: int, n: int) -> None:
    """Round by round, the ranks under `live` run micro-batches start..start+live-1 in rank
    order (the order their gradients are added in), each exactly once; the others pad."""
    plans = [ranks.Ranks(ranks.World(r, n, r), torch.device("cpu")).rounds(count) for r in range(n)]
    assert len({len(p) for p in plans}) == 1  # the same number of rounds: the same collectives
    ran = []
    for k in range(len(plans[0])):
        live = plans[0][k][1]
        assert all(p[k][1] == live for p in plans)
        ran += [plans[r][k][0] for r in range(live)]
    assert ran == list(range(count))


def test_the_groups_travel_whole() -> None:
    groups = scored_groups(3, 5)
    assert ranks.decode_groups(ranks.encode_groups(groups)) == groups
    assert ranks.decode_groups(ranks.encode_groups([])) == []
