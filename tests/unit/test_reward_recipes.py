"""Reward recipes: composition with weights, statuses (ok / error), config, group scoring.
Time limits (status timeout) need the worker pool: tests/unit/test_reward_limits.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollstream.core.config import ConfigError, load_settings
from rollstream.reward import recipes
from rollstream.reward.config import RewardSettings
from rollstream.reward.recipes import ComponentSpec, RecipeComponent, Recipes, Sample, build_recipes, default_specs
from rollstream.reward.scoring import score_groups
from rollstream.v1 import rollout_pb2


@pytest.fixture(scope="module")
def builtin() -> Recipes:
    return build_recipes(default_specs(answer_weight=1.0, format_weight=0.1), default_timeout_s=5.0)


def test_arithmetic_weights_combine(builtin: Recipes) -> None:
    right_and_tidy = builtin.score("arithmetic", Sample("8", "8"))
    assert right_and_tidy.reward == pytest.approx(1.1)
    assert [(c.name, c.value, c.weight, c.status) for c in right_and_tidy.components] == [
        ("answer", 1.0, 1.0, "ok"),
        ("format", 1.0, 0.1, "ok"),
    ]
    assert builtin.score("arithmetic", Sample("The answer is 8", "8")).reward == pytest.approx(1.1)
    assert builtin.score("arithmetic", Sample("4 + 4 is 8", "8")).reward == pytest.approx(1.0)
    assert builtin.score("arithmetic", Sample("9", "8")).reward == pytest.approx(0.1)
    assert builtin.score("arithmetic", Sample("eight", "8")).reward == 0.0
    custom = build_recipes(default_specs(answer_weight=2.0, format_weight=-0.5), 5.0)
    assert custom.score("arithmetic", Sample("8.", "8")).reward == pytest.approx(1.5)


def test_exact_kind(builtin: Recipes) -> None:
    assert builtin.score("exact", Sample("  Paris\n", "Paris")).reward == pytest.approx(1.0)
    miss = builtin.score("exact", Sample("paris", "Paris"))
    assert miss.reward == 0.0
    assert [(c.name, c.status) for c in miss.components] == [("answer", "ok")]


def test_builtin_math_countdown_and_code_kinds(builtin: Recipes) -> None:
    assert builtin.score("math", Sample(r"so $\boxed{\frac{3}{4}}$", "0.75")).reward == 1.0
    assert builtin.score("math", Sample(r"\boxed{0.7}", "3/4")).reward == 0.0
    countdown = json.dumps({"numbers": [2, 3, 5], "target": 16})
    assert builtin.score("countdown", Sample("(3 + 5) * 2 = 16", "16", countdown)).reward == 1.0
    assert builtin.score("countdown", Sample("3 * 5 + 2", "16", countdown)).reward == 0.0
    code = json.dumps({"tests": ["assert inc(1) == 2", "assert inc(-1) == 0"]})
    assert builtin.score("code", Sample("```python\ndef inc(x):\n    return x + 1\n```", "", code)).reward == 1.0
    assert builtin.score("code", Sample("```python\ndef inc(x):\n    return 2\n```", "", code)).reward == pytest.approx(
        0.5
    )


def test_unknown_kind_is_reported_not_silently_zero(builtin: Recipes) -> None:
    s = builtin.score("chess", Sample("e4", "e4"))
    assert s.unknown_kind
    assert s.reward == 0.0
    assert s.errors == 0 and s.timeouts == 0  # counted as unknown kind, not as a verifier error
    (component,) = s.components
    assert component.failed and component.name == "task_kind"
    assert "unknown task_kind 'chess'" in component.status
    assert "arithmetic" in component.status and "countdown" in component.status
    assert builtin.score("", Sample("8", "8")).unknown_kind


def test_raising_check_gives_error_status_and_zero() -> None:
    def broken(sample: Sample) -> float:
        raise RuntimeError("regex engine on fire")

    fmt = recipes.build_check(ComponentSpec(component="arithmetic_format", weight=0.1))
    recipe = (RecipeComponent("answer", 1.0, broken, None), RecipeComponent("format", 0.1, fmt, None))
    s = recipes.score_with(recipe, Sample("8", "8"))
    answer, fmt_result = s.components
    assert answer.status == "error: RuntimeError: regex engine on fire"
    assert answer.value == 0.0 and answer.failed
    assert fmt_result.status == "ok" and fmt_result.value == 1.0
    assert s.reward == pytest.approx(0.1)  # the other component still counts
    assert s.errors == 1 and s.timeouts == 0


def test_non_numeric_reference_answer_is_a_verifier_error(builtin: Recipes) -> None:
    s = builtin.score("arithmetic", Sample("8", "eight"))
    answer, fmt = s.components
    assert answer.status.startswith("error: ValueError: reference answer 'eight' is not a number")
    assert fmt.status == "ok"
    assert s.errors == 1


def test_metadata_problems_are_errors_with_the_reason(builtin: Recipes) -> None:
    missing = builtin.score("countdown", Sample("1 + 2", "3", json.dumps({"target": 3})))
    assert (
        missing.components[0].status == 'error: ValueError: countdown metadata_json needs "numbers": a list of integers'
    )
    not_json = builtin.score("countdown", Sample("1 + 2", "3", "{oops"))
    assert not_json.components[0].status.startswith("error: ValueError: metadata_json is not JSON")
    no_tests = builtin.score("code", Sample("print(1)", "", "{}"))
    assert 'no "tests" list' in no_tests.components[0].status


def test_regex_length_and_exact_params() -> None:
    specs = {
        "r1": [
            ComponentSpec(component="math", name="answer", weight=1.0),
            ComponentSpec(component="regex", name="format", weight=0.2, params={"preset": "think_answer"}),
            ComponentSpec(component="length", name="length", weight=1.0, params={"max_length": 10, "cache_length": 4}),
        ],
        "caseless": [ComponentSpec(component="exact", weight=1.0, params={"case_sensitive": False})],
        "shout": [ComponentSpec(component="regex", weight=1.0, params={"pattern": "[A-Z ]+!", "dotall": False})],
        "chars": [
            ComponentSpec(component="length", weight=1.0, params={"max_length": 10, "cache_length": 5, "unit": "chars"})
        ],
    }
    table = build_recipes(specs, default_timeout_s=5.0)
    good = "<think>2+2 is 4</think>\n<answer>\\boxed{4}</answer>"
    s = table.score("r1", Sample(good, "4", num_tokens=6))  # 6 <= 10 - 4: no penalty
    assert [(c.name, c.value) for c in s.components] == [("answer", 1.0), ("format", 1.0), ("length", 0.0)]
    assert s.reward == pytest.approx(1.2)
    s = table.score("r1", Sample("\\boxed{4}", "4", num_tokens=8))  # no template; 8 tokens: -0.5
    assert [(c.name, c.value) for c in s.components] == [("answer", 1.0), ("format", 0.0), ("length", -0.5)]
    assert s.reward == pytest.approx(0.5)
    # A Score item without num_tokens: a token-length component says the count is unknown.
    s = table.score("r1", Sample(good, "4"))
    assert s.components[2].status == "error: ValueError: the token count is unknown here (use unit = 'chars')"
    assert table.score("caseless", Sample(" PARIS ", "paris")).reward == 1.0
    assert table.score("shout", Sample("HELLO THERE!", "")).reward == 1.0
    assert table.score("shout", Sample("hello!", "")).reward == 0.0
    assert table.score("chars", Sample("x" * 8, "")).reward == pytest.approx(-0.6)


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ({"k": []}, "recipes.k: a recipe needs at least one component"),
        ({"k": [{"component": "regex", "weight": 1, "params": {"pattern": "("}}]}, "recipes.k[0]"),
        ({"k": [{"component": "regex", "weight": 1, "params": {}}]}, "exactly one of `pattern` and `preset`"),
        (
            {"k": [{"component": "exact", "weight": 1, "params": {"strip": True, "colour": "red"}}]},
            "colour: Extra inputs are not permitted",
        ),
        ({"k": [{"component": "math", "weight": 1, "params": {"x": 1}}]}, "component 'math' params"),
        (
            {"k": [{"component": "length", "weight": 1, "params": {"max_length": 4, "cache_length": 8}}]},
            "cache_length must be at most max_length",
        ),
        ({"k": [{"component": "exact", "weight": 1}, {"component": "exact", "weight": 2}]}, "component names repeat"),
    ],
)
def test_bad_recipes_are_refused_at_start_with_the_place_named(specs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(RewardSettings, [], recipes=specs)
    assert message in str(err.value)


def test_spec_fields_are_checked() -> None:
    with pytest.raises(ConfigError, match="weight"):
        load_settings(RewardSettings, [], recipes={"k": [{"component": "exact", "weight": float("nan")}]})
    with pytest.raises(ConfigError, match="component"):
        load_settings(RewardSettings, [], recipes={"k": [{"component": "telepathy", "weight": 1}]})


def test_recipes_from_a_toml_file_replace_and_add_kinds(tmp_path: Path) -> None:
    config = tmp_path / "reward.toml"
    config.write_text(
        """
answer_weight = 2.0

[[recipes.math]]
component = "math"
weight = 1.0
timeout_s = 2.5

[[recipes.math]]
component = "regex"
name = "format"
weight = 0.25
params = { preset = "think_answer" }

[[recipes.yes]]
component = "regex"
weight = 1.0
params = { pattern = "yes", match = "search", ignore_case = true }
"""
    )
    s = load_settings(RewardSettings, ["--config", str(config)])
    table = s.build_recipes()
    assert set(table.kinds) == {"arithmetic", "exact", "math", "countdown", "code", "yes"}
    assert [(c.name, c.weight, c.timeout_s) for c in table.table["math"]] == [("math", 1.0, 2.5), ("format", 0.25, 5.0)]
    # Built-in kinds not configured keep their recipe, with the service's weights.
    assert [(c.name, c.weight) for c in table.table["arithmetic"]] == [("answer", 2.0), ("format", 0.1)]
    assert table.score("yes", Sample("Well... YES", "")).reward == 1.0
    # The same table as JSON through a flag (or ROLLSTREAM_RECIPES).
    flag = load_settings(RewardSettings, ["--recipes", json.dumps({"yes": [{"component": "exact", "weight": 3}]})])
    assert flag.build_recipes().score("yes", Sample("ok", "ok")).reward == 3.0


def test_settings_defaults_and_validation() -> None:
    s = load_settings(RewardSettings, ["--output-stage", "ready", "--format-weight", "0.25"])
    assert s.output_stage == "ready"
    assert s.weights() == {"answer": 1.0, "format": 0.25}
    assert s.group == "reward"
    assert s.scorer_address == ""
    with pytest.raises(ConfigError, match="output_stage"):
        load_settings(RewardSettings, ["--output-stage", "trainer"])
    with pytest.raises(ConfigError, match="format_weight"):
        load_settings(RewardSettings, ["--format-weight", "inf"])
    with pytest.raises(ConfigError, match="trim_every_s"):
        load_settings(RewardSettings, ["--trim-every-s", "0"])
    with pytest.raises(ConfigError, match="scorer_breaker_failures"):
        load_settings(RewardSettings, ["--scorer-breaker-failures", "0"])
    assert s.score_workers == 2 and load_settings(RewardSettings, ["--score-workers", "3"]).score_workers == 3
    with pytest.raises(ConfigError, match="score_workers"):
        load_settings(RewardSettings, ["--score-workers", "0"])
    with pytest.raises(ConfigError, match="scorer_retries"):  # gRPC makes at most 5 attempts
        load_settings(RewardSettings, ["--scorer-retries", "5"])


def test_the_workers_recipes_are_the_services() -> None:
    s = load_settings(
        RewardSettings,
        [
            "--answer-weight",
            "2",
            "--recipes",
            json.dumps({"yes": [{"component": "exact", "weight": 3, "timeout_s": 1}]}),
        ],
    )
    mine, theirs = s.build_recipes(), s.recipe_source()()
    assert {k: [(c.name, c.weight, c.timeout_s) for c in r] for k, r in mine.table.items()} == {
        k: [(c.name, c.weight, c.timeout_s) for c in r] for k, r in theirs.table.items()
    }
    assert theirs.score("yes", Sample("ok", "ok")).reward == 3.0


def test_score_group_fills_rewards_and_marks_scored(builtin: Recipes) -> None:
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
    scores = score_groups({0: group}, builtin)[0]
    assert group.scored
    assert [s.reward for s in scores] == pytest.approx([1.1, 0.1])
    assert [c.reward for c in group.completions] == pytest.approx([1.1, 0.1])
    assert [[rc.name for rc in c.reward_components] for c in group.completions] == [
        ["answer", "format"],
        ["answer", "format"],
    ]
    assert group.completions[1].reward_components[0].value == 0.0


def test_group_token_counts_reach_the_length_component() -> None:
    table = build_recipes(
        {"len": [ComponentSpec(component="length", weight=1.0, params={"max_length": 4, "cache_length": 2})]}, 5.0
    )
    group = rollout_pb2.RolloutGroup(
        group_id="g",
        task_kind="len",
        prompt_ids=[1],
        completions=[
            rollout_pb2.Completion(text="a", token_ids=[1] * n, behaviour_logprobs=[-0.1] * n) for n in (2, 3, 4, 9)
        ],
    )
    score_groups({0: group}, table)
    assert [c.reward for c in group.completions] == pytest.approx([0.0, -0.5, -1.0, -1.0])
