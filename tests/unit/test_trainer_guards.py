"""The trainer's last line of defence: a step whose loss or gradient norm is not finite
applies nothing and publishes nothing (validation keeps such values out of the ready
stream; this is for what slips through, e.g. a diverged model), and a ready entry that
would have crashed the trainer is refused by its check with the reason."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest

from rollstream.core import deltas, validation
from rollstream.core.config import load_settings
from rollstream.core.service import ServiceHost
from rollstream.core.streams import Entry
from rollstream.trainer.config import TrainerSettings
from rollstream.trainer.optimizer import NonFiniteStep
from rollstream.trainer.service import Trainer
from synthetic import scored_groups


@pytest.fixture
def trainer(tiny_model_dir: Path, one_thread: None) -> Trainer:
    settings = load_settings(TrainerSettings, [], model=str(tiny_model_dir), lr=1e-3, max_new_tokens=6, group_size=4)
    return Trainer(settings, ServiceHost("trainer", settings))


def test_a_non_finite_loss_applies_and_publishes_nothing(trainer: Trainer) -> None:
    before = deltas.weights_sha256(trainer.publisher.bits())
    groups = scored_groups(1, 2)
    groups[1].completions[0].behaviour_logprobs[0] = math.nan  # bypasses the stream check on purpose
    with pytest.raises(NonFiniteStep, match="loss is nan"):
        trainer.train_step(groups)
    assert (trainer.step, trainer.version, trainer.optimizer.step_count) == (0, 0, 0)
    assert deltas.weights_sha256(trainer.publisher.bits()) == before
    assert all(p.grad is None for p in trainer.params.values())
    # The next, sound step trains from exactly where it was: no stale gradient leaks into it.
    trainer.train_step(scored_groups(2, 2))
    assert (trainer.step, trainer.version) == (1, 1)


def test_a_refused_step_blames_only_the_group_that_overflows(trainer: Trainer) -> None:
    """Behaviour log-probs at validation's floor are finite and accepted, yet a ratio of
    exp(87) times the gradient overflows: the step is refused, and of its two groups only
    the one that does it alone is blamed; the other trains in the next step."""
    good, bad = scored_groups(1, 2)
    for c in bad.completions:
        c.behaviour_logprobs[:] = [validation.MIN_LOGPROB] * len(c.token_ids)
    entry = Entry(id=b"1-0", fields={k.encode(): v for k, v in validation.encode(bad).items()}, deliveries=1)
    validation.parse_group(entry, trainer.limits, stage="ready", need_ref=trainer.need_ref)  # inside every bound
    before = deltas.weights_sha256(trainer.publisher.bits())
    with pytest.raises(NonFiniteStep):
        trainer.train_step([good, bad])
    (blamed,) = trainer.nonfinite_groups([good, bad]).items()
    assert blamed[0] == 1 and ("gradient norm is inf" in blamed[1] or "loss is" in blamed[1])
    # Finding it applied nothing, and left no gradient behind.
    assert (trainer.step, trainer.optimizer.step_count) == (0, 0)
    assert deltas.weights_sha256(trainer.publisher.bits()) == before
    assert all(p.grad is None for p in trainer.params.values())
    assert trainer.nonfinite_groups([good]) == {}
    trainer.train_step([good])
    assert trainer.step == 1


def test_a_non_finite_gradient_norm_applies_nothing(trainer: Trainer) -> None:
    for p in trainer.params.values():
        p.grad = p.detach().clone().fill_(math.inf)
    with pytest.raises(NonFiniteStep, match="gradient norm is inf"):
        trainer.optimizer.step(1.0)
    assert trainer.optimizer.step_count == 0
    assert all(p.grad is None for p in trainer.params.values())


def _forged_ref(value: float):
    def poison(g) -> None:
        g.has_ref_logprobs = True
        for c in g.completions:
            c.ref_logprobs[:] = [value] * len(c.token_ids)

    return poison


def _grown_to(n: int):
    def poison(g) -> None:
        g.group_size = n
        while len(g.completions) < n:
            g.completions.add().CopyFrom(g.completions[0])

    return poison


@pytest.mark.parametrize(
    "poison, reason",
    [
        (lambda g: g.completions[0].token_ids.__setitem__(0, 10**6), "is not a token id"),
        (lambda g: setattr(g.completions[0], "reward", math.nan), "reward"),
        (lambda g: setattr(g.completions[0], "reward", 1e30), "reward"),
        (lambda g: g.completions[1].behaviour_logprobs.__setitem__(0, math.inf), "log-prob"),
        (lambda g: g.completions.add(token_ids=[5], behaviour_logprobs=[-1.0], reward=0.0), "completions"),
        (lambda g: setattr(g, "scored", False), "scored"),
        # The attack findings of issue 27, each refused at intake with the field named:
        # a finite log-prob whose ratio overflows float32 (G1) ...
        (
            lambda g: g.completions[1].behaviour_logprobs.__setitem__(0, -200.0),
            r"behaviour_logprobs\[0\] = -200.0 is not a log-prob",
        ),
        (_forged_ref(-9999.0), r"ref_logprobs\[0\] = -9999.0 is not a log-prob"),
        # ... a prompt the model's context (2048) cannot hold (G2) ...
        (
            lambda g: g.prompt_ids.extend([5] * 120_000),
            r"longer than the model's context of 2048 \(max_position_embeddings\)",
        ),
        # ... and a group of 200 in a group-size-4 run, claiming group_size 200 itself.
        (_grown_to(200), "200 completions, more than the limit 4"),
    ],
)
def test_ready_entries_that_would_crash_the_trainer_are_refused(trainer: Trainer, poison, reason: str) -> None:
    group = scored_groups(1, 1)[0]
    group.group_size = 4

    ready = functools.partial(
        validation.parse_group, limits=trainer.limits, stage="ready", need_ref=trainer.need_ref
    )  # as TrainerLoop reads
    ready(Entry(id=b"1-0", fields={k.encode(): v for k, v in validation.encode(group).items()}, deliveries=1))
    poison(group)
    with pytest.raises(validation.EntryError, match=reason):
        ready(Entry(id=b"1-0", fields={k.encode(): v for k, v in validation.encode(group).items()}, deliveries=1))
