"""`rollstream up --colocate sync`: the trainer and the generator in one process, the generator
sampling from the trainer's own model. It must train exactly as the separate services do
(same samples, same rewards, same losses: the trainer's model holds the bits it publishes),
with one process where there were two, and refuse what it cannot share. With no remote
generator registered nobody reads a delta, so none is encoded (issue 44).
`--colocate async`: the generator samples from its own copy while the trainer steps; at the
same version it samples exactly what the others do, and its groups are never too stale."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import redis
from pydantic import ValidationError
from test_up import rollstream_cmd
from test_up_seed import serve_text_scorer

from rollstream.core import steplog
from rollstream.core.run_keys import RunKeys, read_counters
from rollstream.launcher.run_config import RunConfig

pytestmark = pytest.mark.e2e


MODES = {
    "separate": ["--trainer.max-staleness", "0", "--colocate", "off"],
    "colocated": ["--trainer.max-staleness", "0", "--colocate", "sync"],
    "async": ["--trainer.max-staleness", "1", "--colocate", "async"],
}


def test_colocated_trains_exactly_as_the_separate_services(
    tiny_model_dir: Path, redis_url: str, rclient: redis.Redis, tmp_path: Path
) -> None:
    scorer, server, address = serve_text_scorer(tmp_path / "scorer")
    steps: dict[str, list[dict]] = {}
    completions: dict[str, dict[tuple[str, int], str]] = {}
    try:
        for mode, flags in MODES.items():
            run = f"colo-{mode}"
            scorer.run, scorer.seen = run, {}
            workdir = tmp_path / mode
            # Synchronous (max_staleness 0): which version samples which batch is fixed, so the
            # first two runs must match step for step.
            cmd = [
                rollstream_cmd(), "up", "--model", str(tiny_model_dir), "--trainer.steps", "3", "--run", run, "--workdir", str(workdir),
                "--redis-url", redis_url, "--trainer.group-size", "4", "--trainer.groups-per-step", "2", "--trainer.max-new-tokens", "6",
                "--threads", "1", "--generator.seed", "7", "--trainer.lr", "1e-2", "--reward.scorer-address", address, *flags,
            ]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stdout + done.stderr
            steps[mode] = steplog.read(workdir / steplog.FILE_NAME).steps
            completions[mode] = dict(scorer.seen)
            # The ledger: every group generated was trained once, none dropped.
            stats = read_counters(rclient, RunKeys(run))[0]
            assert stats["trained"] == 6 and stats.get("stale", 0) == 0 and stats.get("duplicates", 0) == 0, stats
            state = sorted(p.stem for p in (workdir / "state").glob("*.json"))
            if mode != "separate":
                # One process holds the model: no generator child; its lines are in the trainer's log.
                assert state == ["reward-0", "trainer"], state
                log = (workdir / "logs" / "trainer.log").read_text()
                assert " generator started " in log and " trainer serving " in log and "push_not_applied" not in log
                assert (
                    "no delta (no reader)" in done.stdout + done.stderr
                )  # up's step lines say it, not "0.00% of dense"
            else:
                assert state == ["generator-0", "reward-0", "trainer"], state
    finally:
        server.stop(grace=None)
    # The trained groups (the first 6 tasks; how many more were sampled ahead before the stop
    # depends on timing) were sampled alike.
    positions = sorted({position for position, _ in completions["separate"]})
    trained, first_step = positions[:6], positions[:2]
    assert len(trained) == 6
    at = {mode: {k: v for k, v in seen.items() if k[0] in trained} for mode, seen in completions.items()}
    assert at["colocated"] == at["separate"] and len(at["separate"]) == 6 * 4
    fields = ("step", "version", "reward_mean", "loss", "grad_norm", "mean_staleness")
    assert [{f: s[f] for f in fields} for s in steps["colocated"]] == [
        {f: s[f] for f in fields} for s in steps["separate"]
    ]
    assert any(s["delta_bytes"] > 0 for s in steps["separate"]), (
        "the weights never moved: the comparison would prove nothing"
    )
    # The separate generator reads every delta; the colocated one samples the trainer's own weights.
    assert not any("delta_skipped" in s for s in steps["separate"]), steps["separate"]
    for mode in ("colocated", "async"):
        assert all(s["delta_bytes"] == 0 and s.get("delta_skipped") == "no reader" for s in steps[mode]), steps[mode]
    # Asynchronous: the first step's tasks can only have been sampled by version 0, from the
    # generator's own copy, and are what the trainer's model sampled; later ones by whichever
    # version was copied last, at most one behind the step that trained them.
    assert {k: v for k, v in completions["async"].items() if k[0] in first_step} == {
        k: v for k, v in at["separate"].items() if k[0] in first_step
    }
    assert [s["step"] for s in steps["async"]] == [1, 2, 3] and all(s["mean_staleness"] <= 1 for s in steps["async"])


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"generators": 2}, "generators"),
        ({"trainer": {"max_staleness": 1, "lora_rank": 8}}, "trainer.lora_rank"),
        ({"generator": {"backend": "vllm"}, "trainer": {"max_staleness": 1, "lora_rank": 8}}, "trainer.lora_rank"),
        # vLLM colocated (tests/vllm/test_vllm_colocated.py runs it): one engine, on the trainer's device, written between batches.
        ({"generator": {"backend": "vllm", "in_flight": "interleave"}}, "generator.in_flight"),
        ({"generator": {"backend": "vllm", "device": "cuda"}}, "generator.device"),
        (
            {
                "trainer": {"max_staleness": 1, "device": "cuda"},
                "generator": {"backend": "vllm", "device": "cuda", "tensor_parallel_size": 2},
            },
            "generator.tensor_parallel_size",
        ),
    ],
)
def test_colocate_refuses_what_it_cannot_share(overrides: dict, field: str, tmp_path: Path) -> None:
    for mode in ("sync", "async"):
        with pytest.raises(ValidationError, match=field):
            RunConfig.model_validate(
                {"colocate": mode, "workdir": str(tmp_path), "trainer": {"max_staleness": 1}, **overrides}
            )


def test_colocate_takes_the_vllm_backend(tmp_path: Path) -> None:
    """One setting of `up` with either variant: the generator's backend (refused before vLLM colocation existed)."""
    for mode in ("sync", "async"):
        cfg = RunConfig.model_validate(
            {
                "colocate": mode,
                "workdir": str(tmp_path),
                "trainer": {"max_staleness": 1},
                "generator": {"backend": "vllm"},
            }
        )
        assert cfg.colocated and cfg.generator.backend == "vllm"


def test_colocated_vllm_without_vllm_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """`up` runs every service on its own Python: one without vllm says so at once, naming the setting."""
    from rollstream.generator.config import GeneratorSettings
    from rollstream.launcher.colocation import vllm_missing

    if not vllm_missing(GeneratorSettings(backend="vllm")):
        pytest.skip("vllm is installed in this venv")
    cmd = [
        rollstream_cmd(),
        "up",
        "--workdir",
        str(tmp_path),
        "--trainer.steps",
        "1",
        "--colocate",
        "sync",
        "--generator.backend",
        "vllm",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "generator.backend" in done.stderr and "install_vllm.sh" in done.stderr, (
        done.stdout + done.stderr
    )
    assert not (tmp_path / "logs").exists(), "nothing should have started"


def test_colocate_async_needs_room_for_one_version_of_staleness(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="trainer.max_staleness"):
        RunConfig.model_validate({"colocate": "async", "workdir": str(tmp_path), "trainer": {"max_staleness": 0}})
    assert RunConfig.model_validate(
        {"colocate": "async", "workdir": str(tmp_path), "trainer": {"max_staleness": 1}}
    ).colocated
