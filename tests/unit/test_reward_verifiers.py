"""The reward service's built-in verifiers: pure functions, no Redis, no recipes."""

from __future__ import annotations

import subprocess
import sys
from decimal import Decimal
from fractions import Fraction

import pytest

from rollstream.reward import verifiers


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


# -- math (math-verify) ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer", "correct"),
    [
        (r"So the answer is $\boxed{\frac{1}{2}}$.", "1/2", True),
        (r"\boxed{0.5}", r"\frac{1}{2}", True),  # a bare LaTeX reference is understood too
        (r"\boxed{\frac12}", "0.5", True),
        (r"We get $x = \boxed{\frac{\sqrt{3}}{2}}$", r"\frac{\sqrt{3}}{2}", True),
        (r"\boxed{\dfrac{2}{4}}", "1/2", True),
        (r"The total is 12 apples, so \boxed{12}", "12", True),
        (r"\boxed{13}", "12", False),
        (r"First 3, then \boxed{4}", "3", False),  # the boxed answer wins over other numbers
        ("I think it is 7", "7", True),  # no box: the plain expression counts
        (r"\boxed{x^2 + 2x + 1}", "(x+1)^2", True),  # symbolic equality
        (r"\boxed{2\pi}", r"2\pi", True),
        ("no idea", "5", False),
    ],
)
def test_math_equal(completion: str, answer: str, correct: bool) -> None:
    assert verifiers.math_equal(completion, answer) == (1.0 if correct else 0.0)


def test_math_reference_that_does_not_parse_is_an_error_not_a_zero() -> None:
    with pytest.raises(ValueError, match="does not parse as math"):
        verifiers.math_equal(r"\boxed{1}", "")


# -- length ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "value"),
    [(0, 0.0), (60, 0.0), (70, -0.5), (80, -1.0), (81, -1.0), (1000, -1.0)],
)
def test_overlong_penalty(length: int, value: float) -> None:
    # Free up to max - cache = 60, then linear down to -1 at max = 80.
    assert verifiers.overlong_penalty(length, max_length=80, cache_length=20) == pytest.approx(value)


# -- countdown ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "expression"),
    [
        ("(3 + 5) * 2", "(3 + 5) * 2"),
        ("(3 + 5) * 2 = 16", "(3 + 5) * 2"),
        ("Let me think.\n3 * 5 + 2 = 17.", "3 * 5 + 2"),
        ("<think>3+5=8, 8*2=16</think>\n<answer>(3+5)*2</answer>", "(3+5)*2"),
        ("<answer>1+1</answer> then <answer>2*8</answer>", "2*8"),  # the last answer tag
        ("3 × 5 ÷ 5", "3 * 5 / 5"),
        ("no expression here", None),
        ("", None),
    ],
)
def test_countdown_expression(completion: str, expression: str | None) -> None:
    assert verifiers.countdown_expression(completion) == expression


def test_evaluate_countdown_is_exact_and_reports_numbers() -> None:
    assert verifiers.evaluate_countdown("(7 - 1) / 4 * 2") == (Fraction(3), [7, 1, 4, 2])
    assert verifiers.evaluate_countdown("1 / 3 + 1 / 3 + 1 / 3") == (Fraction(1), [1, 3, 1, 3, 1, 3])


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('true')", "Call is not allowed"),
        ("2 ** 10", "BinOp is not allowed"),  # Pow: only + - * /
        ("-3 + 5", "UnaryOp is not allowed"),
        ("1.5 * 2", "Constant is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("4 / (2 - 2)", "division by zero"),
        ("(1 +", "not an expression"),
        ("1+" * 150 + "1", "longer than"),
    ],
)
def test_evaluate_countdown_refuses_everything_else(expression: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        verifiers.evaluate_countdown(expression)


@pytest.mark.parametrize(
    ("completion", "numbers", "target", "correct"),
    [
        ("(3 + 5) * 2", [2, 3, 5], 16, True),
        ("3 * 5 + 2", [2, 3, 5], 17, True),
        ("3 * 5", [2, 3, 5], 15, True),  # not every number has to be used
        ("3 * 3 + 2", [2, 3, 5], 11, False),  # 3 used twice but given once
        ("3 * 3 + 2", [2, 3, 3], 11, True),  # given twice: fine
        ("(3 + 5) * 2", [2, 3, 5], 17, False),  # wrong value
        ("25 - 9", [2, 3, 5], 16, False),  # numbers that were not given
        ("6 / 4 * 2", [2, 4, 6], 3, True),  # exact fractions in between
        ("2 ** 4", [2, 4], 16, False),  # not allowed: a wrong answer, not an error
        ("", [1], 1, False),
    ],
)
def test_countdown_value(completion: str, numbers: list[int], target: int, correct: bool) -> None:
    assert verifiers.countdown_value(completion, numbers, target) == (1.0 if correct else 0.0)


# -- code extraction ---------------------------------------------------------------------


def test_extract_code_takes_the_last_python_block() -> None:
    text = "Plan:\n```\nfirst\n```\nThen:\n```python\ndef f():\n    return 1\n```\nand a note\n```text\nnot code\n```"
    assert verifiers.extract_code(text) == "def f():\n    return 1\n"
    assert verifiers.extract_code("def g(): return 2") == "def g(): return 2"  # no fence: all of it


def test_reward_package_does_not_import_torch() -> None:
    # A fresh interpreter: the reward image has no torch, so importing it must not need it.
    code = (
        "import sys, rollstream.reward.service\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'vllm', 'numpy'))\n"
        "assert not heavy, heavy\n"
        "from rollstream.reward import verifiers\n"
        "verifiers.math_equal('\\\\boxed{1}', '1')  # math-verify (sympy) must not bring torch in either\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'vllm'))\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
