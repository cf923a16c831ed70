"""Built-in verifiers: pure functions from a completion (and the task's reference answer
or metadata) to a value: `arithmetic_answer` and `arithmetic_format` (the demo's recipe),
`math_equal`, `overlong_penalty`, `countdown_value`, and `extract_code` for the code
reward; each one's docstring says what it checks. Nothing here knows about weights,
recipes, time limits or streams: rollstream.reward.recipes composes these into recipes.
"""

from __future__ import annotations

import ast
import logging
import operator
import re
from collections import Counter
from decimal import Decimal
from fractions import Fraction
from typing import Any

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
    return 1.0 if final_number(completion) == expected else 0.0


def arithmetic_format(completion: str, answer: str) -> float:
    """1.0 when the completion is "The answer is N." or just "N" (period optional).

    Shape only: a well-formed wrong answer still gets the format credit, so the two
    components teach different things.
    """
    return 1.0 if _ANSWER_FORMAT_RE.fullmatch(completion.strip()) else 0.0


# -- math (math-verify) ---------------------------------------------------------------------


def _math_verify() -> Any:
    """math_verify, imported on first use: it pulls in sympy and antlr (a second to import),
    which the other task kinds do not need.

    Its own time limits are SIGALRM-based: they cannot stop a long C call, and cover parts
    of the check only. So every call below switches them off and the recipe's time limit
    (rollstream.reward.limits: the worker process is killed) covers the whole check; its
    warning that the limits are off is expected, hence silenced.
    """
    import math_verify

    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return math_verify


def parse_math_reference(answer: str) -> list[Any]:
    """The reference answer as math-verify parses it. A bare answer is read as LaTeX
    first ("$...$": as plain text, "2\\pi" would be read as 2), then as it is. An answer
    that does not parse at all raises ValueError: a silent 0 for every completion would
    look like a model that is always wrong."""
    mv = _math_verify()
    delimited = "$" in answer or "\\boxed" in answer or "\\(" in answer or "\\[" in answer
    for text in (answer,) if delimited else (f"${answer}$", answer):
        gold = mv.parse(text, parsing_timeout=None)
        if gold:
            return gold
    raise ValueError(f"reference answer {answer!r} does not parse as math")


def math_equal(completion: str, answer: str) -> float:
    """1.0 when the completion's final answer is mathematically equal to the reference.

    math-verify extracts the answer from the completion (a \\boxed{} answer first, then
    LaTeX, then plain expressions) and compares numerically and symbolically.
    """
    mv = _math_verify()
    gold = parse_math_reference(answer)
    predicted = mv.parse(completion, parsing_timeout=None)
    if not predicted:
        return 0.0
    return 1.0 if mv.verify(gold, predicted, timeout_seconds=None) else 0.0


# -- length ------------------------------------------------------------------------------------


def overlong_penalty(length: int, max_length: int, cache_length: int) -> float:
    """DAPO's soft overlong punishment: 0 up to max_length - cache_length, then falling
    linearly to -1 at max_length, and -1 beyond. Weight it positively: the value is <= 0."""
    if length <= max_length - cache_length:
        return 0.0
    if length <= max_length:
        return (max_length - cache_length - length) / cache_length
    return -1.0


# -- countdown -------------------------------------------------------------------------------

# Longer "expressions" are not an answer to a 3-6 number puzzle; the cap also bounds the
# parser's work on whatever a model emits.
COUNTDOWN_MAX_CHARS = 200
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_EXPRESSION_CHARS_RE = re.compile(r"^[\d\s+\-*/().×÷]+$")
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def countdown_expression(completion: str) -> str | None:
    """The expression a countdown completion proposes: the text of its last <answer> tag
    when it has one, else its last line that looks like arithmetic; a trailing "= N" is
    dropped ("(3 + 5) * 2 = 16" -> "(3 + 5) * 2")."""
    tagged = _ANSWER_TAG_RE.findall(completion)
    candidates = [tagged[-1]] if tagged else reversed(completion.strip().splitlines())
    for line in candidates:
        expression = line.split("=")[0].strip().rstrip(".").strip()
        if expression and _EXPRESSION_CHARS_RE.match(expression):
            return expression.replace("×", "*").replace("÷", "/")
    return None


def evaluate_countdown(expression: str) -> tuple[Fraction, list[int]]:
    """Exact value of an expression of integers, + - * / and parentheses, and the integers
    it uses. Raises ValueError for anything else (names, calls, powers, unary minus, floats,
    division by zero): `ast` parses, a small walker evaluates; nothing is ever eval'd."""
    if len(expression) > COUNTDOWN_MAX_CHARS:
        raise ValueError(f"expression longer than {COUNTDOWN_MAX_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from None
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"{type(node).__name__} is not allowed (only integers, + - * / and parentheses)")

    return walk(tree.body), used


def countdown_value(completion: str, numbers: list[int], target: int) -> float:
    """1.0 when the completion's expression uses only the given numbers, each at most as
    often as it is given, and evaluates exactly to the target."""
    expression = countdown_expression(completion)
    if expression is None:
        return 0.0
    try:
        value, used = evaluate_countdown(expression)
    except ValueError:
        return 0.0  # the model wrote something that is not a valid expression: wrong, not a verifier error
    overused = Counter(used) - Counter(numbers)
    return 1.0 if value == target and not overused else 0.0


# -- code -------------------------------------------------------------------------------------

_FENCE_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The program in a completion: the last fenced block (```python ... ```, or any
    language-less fence), else the whole completion."""
    python = [body for lang, body in _FENCE_RE.findall(completion) if lang.lower() in ("python", "py", "python3", "")]
    return python[-1] if python else completion
