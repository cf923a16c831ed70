"""The asynchronous colocated generator's weights (launcher/colocated.py, CopiedWeights): its
own model, copied from the trainer's after each step, in the trainer's thread, between two of
its batches. The copy must be the trainer's published bits exactly (in either dtype) and must
sample what the trainer's own model samples at that version."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from rollstream.core import modeling
from rollstream.core.config import load_settings
from rollstream.core.service import ServiceHost
from rollstream.generator.backends import SampleRequest, TransformersBackend
from rollstream.launcher.colocated import CopiedWeights
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.trainer import Trainer
from synthetic import scored_groups


@pytest.fixture
def trainer(tiny_model_dir: Path, one_thread: None) -> Trainer:
    settings = load_settings(TrainerSettings, [], model=str(tiny_model_dir), lr=1e-2, max_new_tokens=6, group_size=4)
    return Trainer(settings, ServiceHost("trainer", settings))


def copy_of(trainer: Trainer, dtype: str = "float32") -> tuple[TransformersBackend, CopiedWeights]:
    backend = TransformersBackend(trainer.model_dir, dtype=dtype)
    weights = CopiedWeights(trainer, backend.model)
    trainer.weights.after_step(weights.follow)
    return backend, weights


def same_bits(model: torch.nn.Module, trainer: Trainer) -> bool:
    copied, published = modeling.model_bits(model), trainer.publisher.bits()
    return copied.keys() == published.keys() and all((copied[name] == published[name]).all() for name in published)


def step(trainer: Trainer, seed: int) -> None:
    trainer.train_and_push(
        scored_groups(seed, 2), targets=lambda: [], from_registry=False, record=lambda metrics, outcomes: None
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_copy_is_the_trainers_published_bits_after_every_step(trainer: Trainer, dtype: str) -> None:
    backend, weights = copy_of(trainer, dtype)
    assert weights.version == 0 and same_bits(backend.model, trainer)
    start = {name: bits.copy() for name, bits in trainer.publisher.bits().items()}
    for seed in (1, 2):
        step(trainer, seed)
        assert weights.version == trainer.version == seed
        assert same_bits(backend.model, trainer)
    published = trainer.publisher.bits()
    assert any((start[name] != published[name]).any() for name in published), (
        "the weights never moved: the check would prove nothing"
    )


def test_a_replayed_step_is_copied_too(trainer: Trainer) -> None:
    """A resume replays the trained log's steps before the loop starts: the copy follows them,
    or the generator would wait forever, too many versions behind."""
    backend, weights = copy_of(trainer)
    trainer.replay_step(scored_groups(3, 2))
    assert weights.version == trainer.version == 1 and same_bits(backend.model, trainer)


def test_the_copy_samples_what_the_trainers_model_samples(trainer: Trainer) -> None:
    backend, _ = copy_of(trainer)
    step(trainer, 4)
    requests = [
        SampleRequest(prompt_ids=[5, 9, 12, 3], n=3, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, seed=11)
    ]
    own = backend.sample(requests)
    theirs = TransformersBackend.sharing(trainer.model, trainer.tokenizer).sample(requests)
    assert [[(s.token_ids, s.logprobs) for s in g] for g in own] == [
        [(s.token_ids, s.logprobs) for s in g] for g in theirs
    ]


def test_the_copy_waits_for_the_batch_being_sampled(trainer: Trainer) -> None:
    """The generator holds the lock through a batch: the trainer's copy must not change the
    weights under it, and lands once the batch is done."""
    backend, weights = copy_of(trainer)
    before = modeling.model_bits(backend.model)
    with weights.lock:  # a batch being sampled
        stepping = threading.Thread(target=step, args=(trainer, 5))
        stepping.start()
        stepping.join(timeout=1.0)
        assert stepping.is_alive() and weights.version == 0
        assert all((modeling.model_bits(backend.model)[n] == before[n]).all() for n in before)
    stepping.join(timeout=120.0)
    assert not stepping.is_alive() and weights.version == trainer.version == 1


def test_a_model_that_is_not_the_trainers_is_refused(trainer: Trainer) -> None:
    other = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="not the trainer's"):
        CopiedWeights(trainer, other)
