"""Built-in verifiers: pure functions from (completion text, reference answer) to scores.

A task kind names a recipe: a list of (component name, check). A check returns a value in
[0, 1]; the reward of a completion is the sum of weight * value over its components.
A check that raises gives that component the status "error: ..." and the value 0, so one
bad task never stops the stage. An unknown task kind is reported as such (never a silent
0 that would look like a wrong answer).

Recipes:
- "arithmetic": `answer` (the completion's final answer equals the reference: the number
  after "answer is" when the completion says so, else its last number) and `format` (the
  completion is "The answer is N." or just "N", as the demo prompt asks).
- "exact": `answer` (the stripped completion equals the stripped reference).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal

Check = Callable[[str, str], float]
Recipe = Sequence[tuple[str, Check]]

OK = "ok"
UNKNOWN_KIND_COMPONENT = "task_kind"

# A number: an optional minus sign (ASCII or U+2212, which models like to emit), then
# either digits with thousands commas ("1,234": each group exactly 3 digits, so "1,2"
# is the number 1) or plain digits, then an optional fraction. A fraction is part of
# the number so that "8.5" is not taken for a correct "8"; a period with no digit after
# it ("8.") ends a sentence and is not part of the number.
_NUMBER = r"(?P<sign>[-\u2212]?)(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<frac>\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
# The whole completion is one integer, optionally after "The answer is" and with a final
# period: "8", " -3.", "1,234", "The answer is 11."
_ANSWER_FORMAT_RE = re.compile(r"(?:the answer is:?\s*)?[-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)\.?", re.IGNORECASE)
_ANSWER_IS_RE = re.compile(r"answer is:?\s*(?=[-\u2212]?\d)", re.IGNORECASE)


def _to_decimal(match: re.Match[str]) -> Decimal:
    sign = "-" if match["sign"] else ""
    return Decimal(sign + match["int"].replace(",", "") + (match["frac"] or ""))


def first_number(text: str) -> Decimal | None:
    """The first number in `text` ("The answer is -1,234." -> -1234), or None."""
    match = _NUMBER_RE.search(text)
    return _to_decimal(match) if match else None


def final_number(text: str) -> Decimal | None:
    """The completion's final answer: the number right after the first "answer is" when
    there is one ("The answer is 11. Also 3" -> 11), else the last number in the text
    ("2 + 9 is 11." -> 11: restating the question is not wrong), or None."""
    stated = _ANSWER_IS_RE.search(text)
    if stated:
        return first_number(text[stated.end() :])
    matches = list(_NUMBER_RE.finditer(text))
    return _to_decimal(matches[-1]) if matches else None


def parse_reference_number(answer: str) -> Decimal:
    """The reference answer as a number; it must be exactly one number (else ValueError)."""
    match = _NUMBER_RE.fullmatch(answer.strip())
    if match is None:
        raise ValueError(f"reference answer {answer!r} is not a number")
    return _to_decimal(match)


def arithmetic_answer(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer (see final_number) equals the reference."""
    expected = parse_reference_number(answer)
    found = final_number(completion)
    return 1.0 if found is not None and found == expected else 0.0


def arithmetic_format(completion: str, answer: str) -> float:
    """1.0 when the completion is "The answer is N." or just "N" (period optional).

    Shape only: a well-formed wrong answer still gets the format credit, so the two
    components teach different things.
    """
    return 1.0 if _ANSWER_FORMAT_RE.fullmatch(completion.strip()) else 0.0


def exact_match(completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == answer.strip() else 0.0


def recipe_for(task_kind: str) -> Recipe | None:
    """The checks of a task kind, or None when the kind is unknown."""
    match task_kind:
        case "arithmetic":
            return (("answer", arithmetic_answer), ("format", arithmetic_format))
        case "exact":
            return (("answer", exact_match),)
        case _:
            return None


KNOWN_KINDS = ("arithmetic", "exact")


@dataclass(frozen=True)
class Component:
    name: str
    value: float
    weight: float
    status: str  # OK, "error: ...", or "unknown task_kind ..."

    @property
    def failed(self) -> bool:
        return self.status != OK


@dataclass(frozen=True)
class Score:
    reward: float
    components: tuple[Component, ...]
    unknown_kind: bool = False

    @property
    def errors(self) -> int:
        """Components whose verifier raised (an unknown kind is counted separately)."""
        return 0 if self.unknown_kind else sum(1 for c in self.components if c.failed)


def score_with(recipe: Recipe, completion: str, answer: str, weights: Mapping[str, float]) -> Score:
    """Run every check of `recipe`; a check that raises scores 0 with an error status."""
    components = []
    for name, check in recipe:
        # A missing weight is a programming error (a recipe whose component has no
        # setting), not bad data: fail loudly rather than weigh it 0.
        weight = weights[name]
        try:
            value = float(check(completion, answer))
            status = OK
        except Exception as e:  # noqa: BLE001 - any verifier failure is reported, never fatal
            value = 0.0
            status = f"error: {type(e).__name__}: {e}"
        components.append(Component(name=name, value=value, weight=weight, status=status))
    reward = sum(c.weight * c.value for c in components)
    return Score(reward=reward, components=tuple(components))


def score(task_kind: str, completion: str, answer: str, weights: Mapping[str, float]) -> Score:
    """Score one completion by its task kind's recipe."""
    recipe = recipe_for(task_kind)
    if recipe is None:
        status = f"unknown task_kind {task_kind!r} (known: {', '.join(KNOWN_KINDS)})"
        component = Component(name=UNKNOWN_KIND_COMPONENT, value=0.0, weight=0.0, status=status)
        return Score(reward=0.0, components=(component,), unknown_kind=True)
    return score_with(recipe, completion, answer, weights)
