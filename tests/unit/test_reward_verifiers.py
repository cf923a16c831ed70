"""The reward service's built-in verifiers, settings and group scoring (no Redis needed)."""

from __future__ import annotations

import subprocess
import sys
from decimal import Decimal

import pytest

from rollstream.core.config import ConfigError, load_settings
from rollstream.reward import verifiers
from rollstream.reward.config import RewardSettings
from rollstream.reward.service import score_group
from rollstream.v1 import rollout_pb2

WEIGHTS = {"answer": 1.0, "format": 0.1}


@pytest.mark.parametrize(
    ("completion", "answer", "correct"),
    [
        ("8", "8", True),
        (" 8.", "8", True),
        ("8\n", "8", True),
        ("The answer is 8", "8", True),
        ("The answer is 8.", "8", True),
        ("3 + 5 = 8", "8", True),  # restating the question is fine: the last number counts
        ("9 no wait 8", "8", True),
        ("8, no wait, 9", "8", False),
        ("The answer is 8. Then 3 + 4 = 7", "8", True),  # a stated answer wins over later numbers
        ("The answer is 7. 3 + 5 = 8", "8", False),
        ("answer is: 8", "8", True),
        ("eight", "8", False),
        ("", "8", False),
        ("80", "8", False),
        ("8.5", "8", False),  # a decimal is its own number, not a correct "8"
        ("8.0", "8", True),  # the same value
        ("-3", "-3", True),
        ("It is -3.", "-3", True),
        ("\u22123", "-3", True),  # U+2212 minus sign
        ("3", "-3", False),
        ("-3", "3", False),
        ("1,234", "1234", True),
        ("The total is 1,234 apples", "1234", True),
        ("1234", "1,234", True),
        ("1,2,3", "3", True),  # commas that are not thousands groups separate numbers
        ("12,34", "34", True),
        ("  \t 42  \n", "42", True),
        ("x=7", "7", True),
        ("007", "7", True),
    ],
)
def test_arithmetic_answer(completion: str, answer: str, correct: bool) -> None:
    assert verifiers.arithmetic_answer(completion, answer) == (1.0 if correct else 0.0)


@pytest.mark.parametrize(
    ("completion", "ok"),
    [
        ("8", True),
        (" 8.", True),
        ("-3", True),
        ("1,234", True),
        ("8\n", True),
        ("The answer is 8", True),
        ("the answer is 8.", True),
        ("The answer is eight", False),
        ("So the answer is 8", False),
        ("8 apples", False),
        ("8..", False),
        ("8.5", False),
        ("eight", False),
        ("", False),
        ("-", False),
    ],
)
def test_arithmetic_format(completion: str, ok: bool) -> None:
    assert verifiers.arithmetic_format(completion, "8") == (1.0 if ok else 0.0)


def test_first_number_parses_sign_commas_and_fraction() -> None:
    assert verifiers.first_number("we get -1,234.5 in the end") == Decimal("-1234.5")
    assert verifiers.first_number("none here") is None


def test_arithmetic_weights_combine() -> None:
    right_and_tidy = verifiers.score("arithmetic", "8", "8", WEIGHTS)
    assert right_and_tidy.reward == pytest.approx(1.1)
    assert [(c.name, c.value, c.weight, c.status) for c in right_and_tidy.components] == [
        ("answer", 1.0, 1.0, "ok"),
        ("format", 1.0, 0.1, "ok"),
    ]
    assert verifiers.score("arithmetic", "The answer is 8", "8", WEIGHTS).reward == pytest.approx(1.1)
    assert verifiers.score("arithmetic", "4 + 4 is 8", "8", WEIGHTS).reward == pytest.approx(1.0)
    assert verifiers.score("arithmetic", "9", "8", WEIGHTS).reward == pytest.approx(0.1)
    assert verifiers.score("arithmetic", "eight", "8", WEIGHTS).reward == 0.0
    custom = verifiers.score("arithmetic", "8.", "8", {"answer": 2.0, "format": -0.5})
    assert custom.reward == pytest.approx(1.5)


def test_exact_kind() -> None:
    assert verifiers.score("exact", "  Paris\n", "Paris", WEIGHTS).reward == pytest.approx(1.0)
    miss = verifiers.score("exact", "paris", "Paris", WEIGHTS)
    assert miss.reward == 0.0
    assert [(c.name, c.status) for c in miss.components] == [("answer", "ok")]


def test_unknown_kind_is_reported_not_silently_zero() -> None:
    s = verifiers.score("chess", "e4", "e4", WEIGHTS)
    assert s.unknown_kind
    assert s.reward == 0.0
    assert s.errors == 0  # counted as unknown kind, not as a verifier error
    (component,) = s.components
    assert component.failed
    assert "unknown task_kind 'chess'" in component.status
    assert "arithmetic" in component.status
    assert verifiers.score("", "8", "8", WEIGHTS).unknown_kind


def test_raising_verifier_gives_error_status_and_zero() -> None:
    def broken(completion: str, answer: str) -> float:
        raise RuntimeError("regex engine on fire")

    recipe = (("answer", broken), ("format", verifiers.arithmetic_format))
    s = verifiers.score_with(recipe, "8", "8", WEIGHTS)
    answer, fmt = s.components
    assert answer.status == "error: RuntimeError: regex engine on fire"
    assert answer.value == 0.0 and answer.failed
    assert fmt.status == "ok" and fmt.value == 1.0
    assert s.reward == pytest.approx(0.1)  # the other component still counts
    assert s.errors == 1


def test_non_numeric_reference_answer_is_a_verifier_error() -> None:
    s = verifiers.score("arithmetic", "8", "eight", WEIGHTS)
    answer, fmt = s.components
    assert answer.status.startswith("error: ValueError: reference answer 'eight' is not a number")
    assert fmt.status == "ok"
    assert s.errors == 1


def test_every_known_kind_has_a_recipe_with_configured_weights() -> None:
    weights = RewardSettings().weights()
    for kind in verifiers.KNOWN_KINDS:
        recipe = verifiers.recipe_for(kind)
        assert recipe is not None, kind
        assert {name for name, _ in recipe} <= weights.keys(), kind


def test_score_group_fills_rewards_and_marks_scored() -> None:
    group = rollout_pb2.RolloutGroup(
        group_id="g",
        task_kind="arithmetic",
        answer="8",
        prompt_ids=[1],
        completions=[
            rollout_pb2.Completion(text="8", token_ids=[1], behaviour_logprobs=[-0.1]),
            rollout_pb2.Completion(
                text="7",
                token_ids=[1],
                behaviour_logprobs=[-0.1],
                # Stale components (e.g. from a replayed entry) are replaced, not appended to.
                reward_components=[rollout_pb2.RewardComponent(name="stale", value=5.0)],
            ),
        ],
    )
    scores = score_group(group, WEIGHTS)
    assert group.scored
    assert [s.reward for s in scores] == pytest.approx([1.1, 0.1])
    assert [c.reward for c in group.completions] == pytest.approx([1.1, 0.1])
    assert [[rc.name for rc in c.reward_components] for c in group.completions] == [["answer", "format"], ["answer", "format"]]
    assert group.completions[1].reward_components[0].value == 0.0


def test_settings_defaults_and_validation() -> None:
    s = load_settings(RewardSettings, ["--output-stage", "ready", "--format-weight", "0.25"])
    assert s.output_stage == "ready"
    assert s.weights() == {"answer": 1.0, "format": 0.25}
    assert s.group == "reward"
    with pytest.raises(ConfigError, match="output_stage"):
        load_settings(RewardSettings, ["--output-stage", "trainer"])
    with pytest.raises(ConfigError, match="format_weight"):
        load_settings(RewardSettings, ["--format-weight", "inf"])
    with pytest.raises(ConfigError, match="trim_every_s"):
        load_settings(RewardSettings, ["--trim-every-s", "0"])


def test_reward_package_does_not_import_torch() -> None:
    # A fresh interpreter: the reward image has no torch, so importing it must not need it.
    code = (
        "import sys, rollstream.reward.service\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'vllm', 'numpy'))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
