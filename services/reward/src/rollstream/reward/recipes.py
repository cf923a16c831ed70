"""Reward recipes: per task kind, a weighted list of components built from config.

A recipe is what the reward of one completion is made of. Each component is a check (a
verifier from rollstream.reward.verifiers, or the code sandbox) with a weight, a name in
the per-completion breakdown, parameters and a time limit. The reward is the sum of
weight * value over the components.

Every component result carries a status, so a 0 always says why it is a 0:
- "ok": the check ran; its value is the verdict (a wrong answer is "ok" with value 0);
- "timeout": it ran out of time (the service runs every component in a worker process
  that is killed when it overruns, see rollstream.reward.scoring; for the code component
  also a program that ran past its per-test or whole-run limit); value 0;
- "error: <exception>": the check itself failed (say, a reference answer that does not
  parse, or a value that is not a finite number); value 0. One bad task never stops the stage.
An unknown task kind gives a single "task_kind" component with a status naming the known
kinds (never a silent 0 that would look like a wrong answer).

The scoring pool's worker processes (rollstream.reward.scoring.ScorePool) run the checks: each
builds the recipes once from a `RecipeSource` (the checks are closures, not picklable) and
runs components by index (`worker_init`, `worker_run`), with only this module loaded.

Configuration (TOML; a kind given here replaces the built-in recipe of that kind):

    [[recipes.math]]
    component = "math"
    weight = 1.0
    [[recipes.math]]
    component = "regex"
    name = "format"
    weight = 0.1
    params = { preset = "think_answer" }
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import re
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rollstream.reward import sandbox, verifiers

OK = "ok"
TIMEOUT = "timeout"
UNKNOWN_KIND_COMPONENT = "task_kind"
# The think/answer template of R1-style prompts: reasoning in <think>, the answer in <answer>.
THINK_ANSWER_PATTERN = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"


class ComponentTimeout(Exception):
    """A component ran out of its own time: the code sandbox's per-test or wall-clock limit.
    (The generic per-component limit is enforced from outside, by rollstream.reward.scoring.)"""


@dataclass(frozen=True)
class Sample:
    """What a component sees of one completion."""

    completion: str
    answer: str = ""
    metadata_json: str = ""
    num_tokens: int | None = None  # None when unknown (a Score call whose items carry no num_tokens)

    def metadata(self) -> dict[str, Any]:
        """The task's metadata_json as an object ({} when empty); ValueError otherwise."""
        if not self.metadata_json:
            return {}
        try:
            value = json.loads(self.metadata_json)
        except json.JSONDecodeError as e:
            raise ValueError(f"metadata_json is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("metadata_json is not a JSON object")
        return value


Check = Callable[[Sample], float]
ComponentKind = Literal[
    "arithmetic_answer", "arithmetic_format", "exact", "math", "regex", "length", "countdown", "code"
]


class ComponentSpec(BaseModel):
    """One entry of a recipe in the config."""

    model_config = ConfigDict(extra="forbid")

    component: ComponentKind
    # allow_inf_nan=False: a NaN weight would silently poison every reward downstream.
    weight: float = Field(allow_inf_nan=False)
    name: str = Field("", description="name in the reward breakdown (default: the component)")
    timeout_s: float | None = Field(None, gt=0, description="time limit (default: the service's component_timeout_s)")
    params: dict[str, Any] = Field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.name or self.component


# -- parameters of each component -------------------------------------------------------------


class _Params(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ExactParams(_Params):
    strip: bool = True
    case_sensitive: bool = True


class RegexParams(_Params):
    pattern: str = ""
    preset: Literal["", "think_answer"] = ""
    match: Literal["full", "search"] = "full"
    dotall: bool = True
    ignore_case: bool = False

    @model_validator(mode="after")
    def _one_pattern(self) -> "RegexParams":
        if bool(self.pattern) == bool(self.preset):
            raise ValueError("give exactly one of `pattern` and `preset`")
        try:
            re.compile(self.pattern or THINK_ANSWER_PATTERN)  # a bad pattern fails at start, not per completion
        except re.error as e:
            raise ValueError(f"pattern does not compile: {e}") from None
        return self


class LengthParams(_Params):
    """DAPO's overlong shaping: 0 up to max_length - cache_length, then down to -1 at max_length."""

    max_length: int = Field(ge=1)
    cache_length: int = Field(ge=1)
    unit: Literal["tokens", "chars"] = "tokens"

    @model_validator(mode="after")
    def _cache_fits(self) -> "LengthParams":
        if self.cache_length > self.max_length:
            raise ValueError("cache_length must be at most max_length")
        return self


class CodeParams(_Params):
    """Limits of the code sandbox (see rollstream.reward.sandbox)."""

    wall_s: float = Field(10.0, gt=0)
    test_timeout_s: float = Field(5.0, gt=0)
    cpu_s: int = Field(10, ge=1)
    memory_mb: int = Field(512, ge=64)
    max_processes: int = Field(64, ge=2)
    max_file_mb: int = Field(16, ge=1)
    require_isolation: bool = True
    python: str = ""
    partial_credit: bool = Field(True, description="value = fraction of tests passed (else 1 only when all pass)")

    def limits(self) -> sandbox.SandboxLimits:
        return sandbox.SandboxLimits(**self.model_dump(exclude={"partial_credit"}))


# -- building checks ------------------------------------------------------------------------


def _exact(p: ExactParams) -> Check:
    def check(s: Sample) -> float:
        got, want = (s.completion.strip(), s.answer.strip()) if p.strip else (s.completion, s.answer)
        if not p.case_sensitive:
            got, want = got.casefold(), want.casefold()
        return 1.0 if got == want else 0.0

    return check


def _regex(p: RegexParams) -> Check:
    flags = (re.DOTALL if p.dotall else 0) | (re.IGNORECASE if p.ignore_case else 0)
    pattern = re.compile(p.pattern or THINK_ANSWER_PATTERN, flags)
    find = pattern.fullmatch if p.match == "full" else pattern.search
    return lambda s: 1.0 if find(s.completion) else 0.0


def _length(p: LengthParams) -> Check:
    def check(s: Sample) -> float:
        if p.unit == "chars":
            length = len(s.completion)
        elif s.num_tokens is None:
            raise ValueError("the token count is unknown here (use unit = 'chars')")
        else:
            length = s.num_tokens
        return verifiers.overlong_penalty(length, p.max_length, p.cache_length)

    return check


def _countdown(s: Sample) -> float:
    meta = s.metadata()
    numbers, target = meta.get("numbers"), meta.get("target", s.answer)
    if not isinstance(numbers, list) or not all(isinstance(n, int) for n in numbers):
        raise ValueError('countdown metadata_json needs "numbers": a list of integers')
    try:
        target_int = int(target)
    except (TypeError, ValueError):
        raise ValueError(f"countdown target {target!r} is not an integer") from None
    return verifiers.countdown_value(s.completion, numbers, target_int)


def _code(p: CodeParams) -> Check:
    limits = p.limits()

    def check(s: Sample) -> float:
        tests = sandbox.parse_tests(s.metadata())
        result = sandbox.run_tests(verifiers.extract_code(s.completion), tests, limits)
        if result.timed_out:
            raise ComponentTimeout(f"the program ran past {limits.wall_s}s")
        if result.timeouts:
            # A program that hangs on a test is a timeout (status "timeout", value 0), not
            # a wrong answer, even where it passed the other tests.
            raise ComponentTimeout(f"the program ran past {limits.test_timeout_s}s on {result.timeouts} test(s)")
        if p.partial_credit:
            return result.fraction
        return 1.0 if all(result.passed) else 0.0

    return check


def _lift(check: Callable[[str, str], float]) -> Check:
    """A verifier of (completion, answer) as a component check."""
    return lambda s: check(s.completion, s.answer)


# The components without parameters.
_PLAIN_CHECKS: dict[str, Check] = {
    "arithmetic_answer": _lift(verifiers.arithmetic_answer),
    "arithmetic_format": _lift(verifiers.arithmetic_format),
    "math": _lift(verifiers.math_equal),
    "countdown": _countdown,
}


def build_check(spec: ComponentSpec) -> Check:
    """The check of a spec; ValueError (naming the problem) for bad parameters."""
    params = spec.params
    try:
        match spec.component:
            case "exact":
                return _exact(ExactParams.model_validate(params))
            case "regex":
                return _regex(RegexParams.model_validate(params))
            case "length":
                return _length(LengthParams.model_validate(params))
            case "code":
                return _code(CodeParams.model_validate(params))
        _Params.model_validate(params)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc']) or 'params'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"component {spec.component!r} params: {problems}") from None
    if spec.component == "math":
        # Import math-verify and build its parsers now, at start: a first call pays about a
        # second for that, which must not count against a completion's limit.
        verifiers.math_equal(r"\boxed{1}", "1")
    return _PLAIN_CHECKS[spec.component]


# -- recipes and scores -----------------------------------------------------------------------


@dataclass(frozen=True)
class RecipeComponent:
    name: str
    weight: float
    check: Check
    timeout_s: float | None


Recipe = tuple[RecipeComponent, ...]


@dataclass(frozen=True)
class ComponentResult:
    name: str
    value: float
    weight: float
    status: str  # OK, TIMEOUT, "error: ...", or "unknown task_kind ..."

    @property
    def failed(self) -> bool:
        return self.status != OK


@dataclass(frozen=True)
class Score:
    reward: float
    components: tuple[ComponentResult, ...]
    unknown_kind: bool = False

    @property
    def timeouts(self) -> int:
        return sum(1 for c in self.components if c.status == TIMEOUT)

    @property
    def errors(self) -> int:
        """Components whose check failed (not timeouts; an unknown kind is counted separately)."""
        return 0 if self.unknown_kind else sum(1 for c in self.components if c.failed and c.status != TIMEOUT)


def run_component(component: RecipeComponent, sample: Sample) -> ComponentResult:
    """Run one check here, in this process, with no time limit of its own: the service runs
    this inside a worker of rollstream.reward.scoring.ScorePool, which enforces timeout_s."""
    try:
        value = float(component.check(sample))
        if not math.isfinite(value):
            # A NaN or infinite value would poison the reward (and the training step).
            raise ValueError(f"the check gave a non-finite value ({value})")
        status = OK
    except ComponentTimeout:
        value, status = 0.0, TIMEOUT
    except Exception as e:  # noqa: BLE001 - any verifier failure is reported, never fatal
        value, status = 0.0, f"error: {type(e).__name__}: {e}"
    return ComponentResult(name=component.name, value=value, weight=component.weight, status=status)


def score_with(recipe: Recipe, sample: Sample) -> Score:
    components = tuple(run_component(c, sample) for c in recipe)
    return Score(reward=sum(c.weight * c.value for c in components), components=components)


class Recipes:
    """The recipe of every task kind the service knows.

    `score` and `score_many` run the checks here, in this process and without time limits
    (tests, tools); the service scores through rollstream.reward.scoring.ScorePool, which has
    the same `score_many` and runs each check in a worker process under its time limit."""

    def __init__(self, table: Mapping[str, Recipe]):
        self.table = dict(table)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(sorted(self.table))

    def unknown(self, task_kind: str) -> Score:
        """The score of a completion of a task kind no recipe knows: 0, saying so."""
        status = f"unknown task_kind {task_kind!r} (known: {', '.join(self.kinds)})"
        component = ComponentResult(name=UNKNOWN_KIND_COMPONENT, value=0.0, weight=0.0, status=status)
        return Score(reward=0.0, components=(component,), unknown_kind=True)

    def score(self, task_kind: str, sample: Sample) -> Score:
        recipe = self.table.get(task_kind)
        if recipe is None:
            return self.unknown(task_kind)
        return score_with(recipe, sample)

    def score_many(self, items: Sequence[tuple[str, Sample]], timeout_s: float | None = None) -> list[Score]:
        """`score` of every (task_kind, sample), in order (`timeout_s` is ignored here)."""
        return [self.score(kind, sample) for kind, sample in items]


def default_specs(answer_weight: float = 1.0, format_weight: float = 0.1) -> dict[str, list[ComponentSpec]]:
    """The built-in recipes. `arithmetic` is the demo's (its semantics are part of the demo)."""

    def spec(component: str, name: str, weight: float, **params: Any) -> ComponentSpec:
        return ComponentSpec(component=component, name=name, weight=weight, params=params)  # type: ignore[arg-type, call-arg]  # pydantic checks the name and fills timeout_s's Field default

    return {
        "arithmetic": [
            spec("arithmetic_answer", "answer", answer_weight),
            spec("arithmetic_format", "format", format_weight),
        ],
        "exact": [spec("exact", "answer", answer_weight)],
        "math": [spec("math", "answer", answer_weight)],
        "countdown": [spec("countdown", "answer", answer_weight)],
        "code": [spec("code", "answer", answer_weight)],
    }


def code_backstop_s(spec: ComponentSpec) -> float:
    """The code component has its own wall-clock limit; the generic limit is only a backstop
    behind it. The sandbox is killed in a `finally`; a worker killed by this backstop (or by
    kill -9) runs no `finally`, and leaves the sandbox to its own rlimits (CPU seconds) in
    its own process group: one more reason the backstop comes well after wall_s."""
    return float(CodeParams.model_validate(spec.params).wall_s) + 5.0


Specs = Mapping[str, Sequence[ComponentSpec | Mapping[str, Any]]]
"""Task kind -> its components: ComponentSpecs, or their dumps (what crosses to a scoring worker)."""


def sandbox_problems(specs: Specs) -> dict[str, str]:
    """Task kind -> why its code component's sandbox cannot run here, for each kind whose
    sandbox cannot (one trivial program per distinct set of limits). Where it cannot, every
    completion of that kind scores 0 with status error (SandboxUnavailable): the service says
    so once at start instead, from a scoring worker (ScorePool.check_sandboxes)."""
    why: dict[sandbox.SandboxLimits, str] = {}
    problems: dict[str, str] = {}
    for kind, components in specs.items():
        for spec in map(ComponentSpec.model_validate, components):
            if spec.component == "code":
                limits = CodeParams.model_validate(spec.params).limits()
                if limits not in why:
                    why[limits] = sandbox.unavailable(limits)
                if why[limits]:
                    problems[kind] = why[limits]
    return problems


def build_recipes(specs: Specs, default_timeout_s: float | None) -> Recipes:
    """Build every recipe; ValueError names the kind and entry of a bad one."""
    table: dict[str, Recipe] = {}
    for kind, dumps in specs.items():
        entries = [ComponentSpec.model_validate(e) for e in dumps]
        if not entries:
            raise ValueError(f"recipes.{kind}: a recipe needs at least one component")
        names = [e.label for e in entries]
        if len(set(names)) != len(names):
            raise ValueError(
                f"recipes.{kind}: component names repeat ({', '.join(names)}); give each a distinct `name`"
            )
        components = []
        for i, spec in enumerate(entries):
            try:
                check = build_check(spec)
            except ValueError as e:
                raise ValueError(f"recipes.{kind}[{i}]: {e}") from None
            timeout = spec.timeout_s if spec.timeout_s is not None else default_timeout_s
            if spec.component == "code" and spec.timeout_s is None:
                timeout = code_backstop_s(spec)
            components.append(RecipeComponent(name=spec.label, weight=spec.weight, check=check, timeout_s=timeout))
        table[kind] = tuple(components)
    return Recipes(table)


def plain_specs(specs: Mapping[str, Sequence[ComponentSpec]]) -> dict[str, list[dict[str, Any]]]:
    """The specs as plain data, validated again in the worker that gets them."""
    return {kind: [e.model_dump() for e in entries] for kind, entries in specs.items()}


RecipeSource = Callable[[], Recipes]
"""Builds the recipes; picklable (a module-level function, or a functools.partial of one
with plain arguments), as the pool hands it to every worker it starts."""


def recipe_source(specs: Mapping[str, Sequence[ComponentSpec]], default_timeout_s: float | None) -> RecipeSource:
    """The RecipeSource of configured recipes: build_recipes of the specs as plain data."""
    return functools.partial(build_recipes, plain_specs(specs), default_timeout_s)


# -- in the scoring pool's worker processes ---------------------------------------------------

_recipes: Recipes | None = None
PR_SET_PDEATHSIG = 1


def worker_init(source: RecipeSource) -> None:
    global _recipes
    # pebble makes SIGTERM run a Python handler, which waits for the interpreter: a worker
    # stuck in one long C call would then hold on for pebble's 3 s before its SIGKILL. The
    # default action ends it at once, wherever it is.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parent = os.getppid()
    try:
        # Die with the forkserver (which exits when the service does, kill -9 included).
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)  # orphaned before the line above took effect
    _recipes = source()


def worker_run(task_kind: str, index: int, sample: tuple[str, str, str, int | None]) -> tuple[float, str]:
    assert _recipes is not None, "worker not initialised"
    result = run_component(_recipes.table[task_kind][index], Sample(*sample))
    return result.value, result.status
