"""Completions that try to game the code reward: they must score 0, and a correct one 1.

Scores go through `score_items`, what the Reward service's `Score` RPC runs, with the code
recipe. Every fake is tried against both test styles: top-level assertions (judged outside
the program's process) and stdin/stdout tests. The first one is the attack an outside
review reported against the old design (the program ran in the harness's memory image):
it looks for the harness's per-test token and the expected outputs in the frames above
it, in gc, in the harness's globals and in /proc/PID/mem, and forges a pass with them.
Against the old sandbox it scored 1.0 on a program that fails every test.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from rollstream.reward import sandbox, sandbox_judge
from rollstream.reward.recipes import ComponentSpec, Recipes, build_recipes
from rollstream.reward.sandbox import SandboxLimits, run_tests
from rollstream.reward.scoring import score_items
from rollstream.v1 import reward_pb2

LIMITS = SandboxLimits(wall_s=20.0, test_timeout_s=5.0)
ASSERT_TESTS = ["assert add(1234, 4321) == 5555", "assert add(-1, 1) == 0"]
IO_TESTS = [{"input": "1234 4321\n", "output": "5555"}, {"input": "-1 1\n", "output": "0"}]
CORRECT = "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n"

ATTACK = r'''
import gc, os, re, sys

HEX_TOKEN = re.compile(r"[0-9a-f]{32}")


def _reachable():
    """Everything the process can reach: the frames above (locals, globals, code constants),
    then every object gc tracks, then the memory of the process that started it."""
    found = []
    frame = sys._getframe(1)
    while frame is not None:
        found += [frame.f_locals, frame.f_globals, frame.f_code.co_consts]
        frame = frame.f_back
    found += gc.get_objects()
    for pid in {1, os.getppid()}:
        try:
            with open("/proc/%d/maps" % pid) as maps, open("/proc/%d/mem" % pid, "rb") as mem:
                for line in maps:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    if "rw" in line.split()[1] and hi - lo < (64 << 20):
                        try:
                            mem.seek(lo)
                            found.append(mem.read(hi - lo))
                        except (OSError, OverflowError, ValueError):
                            pass
        except OSError:
            pass
    return found


def _walk(values, depth=0, out=None):
    out = [] if out is None else out
    for v in values:
        if isinstance(v, (str, int)) and not isinstance(v, bool):
            out.append(v)
        elif isinstance(v, bytes):
            out.append(v.decode("latin-1"))
        elif depth < 3 and isinstance(v, dict):
            out.append(v)
            _walk(list(v.values()), depth + 1, out)
        elif depth < 3 and isinstance(v, (list, tuple, set, frozenset)):
            _walk(list(v), depth + 1, out)
    return out


def _forge_tokens(values):
    """The harness's per-test token, if it is anywhere: written to every fd, then exit."""
    tokens = {v for v in values if isinstance(v, str) and HEX_TOKEN.fullmatch(v)}
    tokens |= {m for v in values if isinstance(v, str) and len(v) > 4096 for m in HEX_TOKEN.findall(v)}
    tokens = {t for t in tokens if len(set(t)) > 8}  # random, not a run of one digit
    if tokens:
        import stat
        for fd in range(3, 64):
            try:
                if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                    continue
            except OSError:
                continue
            for t in tokens:
                try:
                    os.write(fd, t.encode())
                except OSError:
                    pass
        os._exit(0)


def add(a, b):
    values = _walk(_reachable())
    _forge_tokens(values)
    # The expected value: a number in the calling test's code that is not an argument.
    frame = sys._getframe(1)
    while frame is not None:
        for c in frame.f_code.co_consts:
            if type(c) is int and c not in (a, b) and c > 1000:
                return c
        frame = frame.f_back
    return -7


if __name__ == "__main__":
    stdin = sys.stdin.read()
    values = _walk(_reachable())
    # The test's expected output, if any {"input", "output"} is in reach.
    for v in values:
        if isinstance(v, dict) and v.get("input") == stdin and isinstance(v.get("output"), str):
            sys.stdout.write(v["output"])
            sys.stdout.flush()
            break
    else:
        print("no idea")
        sys.stdout.flush()
    _forge_tokens(values)
'''


def _recipes(test_timeout_s: float = 5.0) -> Recipes:
    params = {"wall_s": 20.0, "test_timeout_s": test_timeout_s}
    return build_recipes(
        {"code": [ComponentSpec(component="code", name="tests", weight=1.0, params=params)]}, default_timeout_s=None
    )


def _score(code: str, tests: list, recipes: Recipes | None = None) -> tuple[float, str]:
    """(reward, status) of a completion that is `code` in a fence, as Reward.Score reports it."""
    item = reward_pb2.ScoreItem(
        task_kind="code", completion=f"```python\n{code}\n```", metadata_json=json.dumps({"tests": tests})
    )
    [score] = score_items([item], recipes or _recipes())
    return score.reward, score.components[0].status


@pytest.mark.parametrize("tests", [ASSERT_TESTS, IO_TESTS], ids=["assert", "io"])
def test_a_correct_program_scores_1(tests: list) -> None:
    assert _score(CORRECT, tests) == (1.0, "ok")


@pytest.mark.parametrize("tests", [ASSERT_TESTS, IO_TESTS], ids=["assert", "io"])
def test_the_reported_attack_scores_0(tests: list) -> None:
    assert _score(ATTACK, tests) == (0.0, "ok")


def test_the_attack_is_real_where_the_test_runs_in_the_programs_process() -> None:
    # The documented limit (module docstring): an assertion inside a function runs in the
    # program's process, and the program reads the expected value from the test's own code.
    # This shows the attack above is competent, so its 0s mean something.
    check = "def check(candidate):\n    assert candidate(1234, 4321) == 5555\ncheck(add)"
    assert run_tests(ATTACK, [check], LIMITS).passed == (True,)


FAKES = {
    "os._exit(0) before the test": "import os\ndef add(a, b):\n    return 0\nos._exit(0)\n",
    "sys.exit(0) before the test": "import sys\ndef add(a, b):\n    return 0\nsys.exit(0)\n",
    "raise SystemExit": "def add(a, b):\n    return 0\nraise SystemExit\n",
    "print and sys.stdout patched": (
        "import builtins, sys\n"
        "class Quiet:\n"
        "    def write(self, s):\n"
        "        return len(s)\n"
        "    def flush(self):\n"
        "        raise SystemExit(0)\n"
        "builtins.print = lambda *a, **k: None\n"
        "sys.stdout = Quiet()\n"
        "def add(a, b):\n"
        "    return a - b\n"
        "if __name__ == '__main__':\n"
        "    print(add(*map(int, input().split())))\n"
    ),
    "AssertionError redefined": (
        "import builtins\n"
        "class AssertionError(Exception):\n"
        "    pass\n"
        "builtins.AssertionError = AssertionError\n"
        "builtins.BaseException = AssertionError\n"
        "def add(a, b):\n"
        "    return a - b\n"
        "if __name__ == '__main__':\n"
        "    print(add(*map(int, input().split())))\n"
    ),
    "SystemExit in an atexit handler": (
        "import atexit, os, sys\n"
        "def leave():\n"
        "    raise SystemExit(0)\n"
        "atexit.register(lambda: os._exit(0))\n"
        "atexit.register(leave)\n"
        "def add(a, b):\n"
        "    return a - b\n"
        "if __name__ == '__main__':\n"
        "    print(add(*map(int, input().split())))\n"
        "    sys.exit(3)\n"
    ),
    "an object equal to anything": (
        "class Anything:\n"
        "    def __eq__(self, other):\n"
        "        return True\n"
        "    def __ne__(self, other):\n"
        "        return False\n"
        "    __hash__ = object.__hash__\n"
        "def add(a, b):\n"
        "    return Anything()\n"
        "if __name__ == '__main__':\n"
        "    print(add(1, 2))\n"
    ),
    "int subclass equal to anything": (
        "class Int(int):\n"
        "    def __eq__(self, other):\n"
        "        return True\n"
        "    __hash__ = int.__hash__\n"
        "def add(a, b):\n"
        "    return Int(0)\n"
    ),
    "forged report on fd 4": (
        "import os\n"
        "def add(a, b):\n"
        '    os.write(4, b\'["r",0,["i","0x0"]]\\n["d"]\\n\')\n'
        "    os._exit(0)\n"
        "if __name__ == '__main__':\n"
        "    add(0, 0)\n"
    ),
    "forged end without the assertion": "import os\ndef add(a, b):\n    os.write(4, b'[\"d\"]\\n')\n    os._exit(0)\n",
    "the expected output on fd 1, then an exception": "import os\nos.write(1, b'5555\\n')\nraise RuntimeError\n",
    "the expected output on fd 1, then SIGKILL": "import os, signal\nos.write(1, b'5555\\n')\nos.kill(os.getpid(), signal.SIGKILL)\n",
    "the expected output on fd 1, then exit status 1": "import os\nos.write(1, b'5555\\n')\nos._exit(1)\n",
}


@pytest.mark.parametrize("tests", [ASSERT_TESTS, IO_TESTS], ids=["assert", "io"])
@pytest.mark.parametrize("fake", list(FAKES), ids=list(FAKES))
def test_classic_fakes_score_0(fake: str, tests: list) -> None:
    # Checked on the first test only (the second, "-1 1" -> 0, a fake may get right by luck).
    assert run_tests(FAKES[fake], tests[:1], LIMITS).passed == (False,)
    assert _score(FAKES[fake], tests[:1]) == (0.0, "ok")


@pytest.mark.parametrize(
    "code",
    [
        "import os\nos.ftruncate(4, 0)\nos._exit(0)",
        "import os\nos.close(4)\nos._exit(0)",
        "import os\nos.write(4, b'x' * 100000)",
    ],
)
def test_tampering_with_the_report_is_a_failure_not_a_sandbox_error(code: str) -> None:
    # RUNNER's first line tells "the interpreter started" from "it did not" (an error of the
    # sandbox, not of the program): the program cannot take it back, so it cannot turn its
    # 0 into an error status either.
    assert run_tests(code, ["assert True"], SandboxLimits(wall_s=20.0, max_file_mb=1)).passed == (False,)
    assert _score(code, ["assert True"]) == (0.0, "ok")


def test_a_forged_unreadable_report_fails_its_test_alone() -> None:
    # ["u", k, <not hex>] on fd 4 once made the harness itself raise, and every test of the
    # run was lost with it: now it is that test's failure, and the next test still counts.
    code = (
        "import os\n"
        "def add(a, b):\n"
        "    if a == 0:\n"
        '        os.write(4, b\'["u",0,"zz"]\\n["d"]\\n\')\n'
        "        os._exit(0)\n"
        "    return a + b\n"
    )
    result = run_tests(code, ["assert add(0, 0) == 0", "assert add(1, 2) == 3"], LIMITS)
    assert result.passed == (False, True), result


@pytest.mark.parametrize("tests", [ASSERT_TESTS, IO_TESTS], ids=["assert", "io"])
def test_an_endless_loop_is_a_timeout_scored_0(tests: list) -> None:
    loop = "def add(a, b):\n    while True:\n        pass\nif __name__ == '__main__':\n    print(5555)\n    while True:\n        pass\n"
    assert _score(loop, tests[:1], _recipes(test_timeout_s=1.0)) == (0.0, "timeout")
    result = run_tests(loop, tests[:1], SandboxLimits(wall_s=20.0, test_timeout_s=1.0))
    assert result.passed == (False,) and result.timeouts == 1 and not result.timed_out
    assert "test 0: timed out after 1.0s" in result.detail


def test_one_hanging_test_makes_the_whole_score_a_timeout() -> None:
    code = "def add(a, b):\n    while a < 0:\n        pass\n    return a + b\n"
    assert _score(code, ASSERT_TESTS, _recipes(test_timeout_s=1.0)) == (0.0, "timeout")


def test_the_cpu_limit_counts_as_a_timeout() -> None:
    result = run_tests(
        "while True:\n    pass\n", ["assert True"], SandboxLimits(wall_s=20.0, test_timeout_s=10.0, cpu_s=1)
    )
    assert result.passed == (False,) and result.timeouts == 1, result
    assert "CPU limit" in result.detail


def test_expected_values_never_reach_the_program() -> None:
    # leak() returns any string in reach (frames, their code, gc) that looks like the
    # expected one. Judged outside, there is none; inside a function (the control), the
    # test's code object carries it.
    code = (
        "import gc, sys\n"
        "def leak():\n"
        "    seen = []\n"
        "    frame = sys._getframe(1)\n"
        "    while frame is not None:\n"
        "        seen += list(frame.f_code.co_consts) + list(frame.f_locals.values()) + list(frame.f_globals.values())\n"
        "        frame = frame.f_back\n"
        "    seen += [o for o in gc.get_objects() if isinstance(o, (list, tuple, dict))]\n"
        "    flat = []\n"
        "    for o in seen:\n"
        "        flat += list(o.values()) if isinstance(o, dict) else list(o) if isinstance(o, (list, tuple)) else [o]\n"
        "    return next((s for s in flat if isinstance(s, str) and s.startswith('sekrit-') and s != 'sekrit-'), None)\n"
    )
    assert run_tests(code, ["assert leak() == 'sekrit-4c7e'"], LIMITS).passed == (False,)
    assert run_tests(code, ["def check():\n    assert leak() == 'sekrit-4c7e'\ncheck()"], LIMITS).passed == (True,)


PROBE = (
    "import ctypes, errno, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def opened(path):\n"
    "    try:\n"
    "        with open(path, 'rb') as f:\n"
    "            f.read(1)\n"
    "        return 'read'\n"
    "    except OSError as e:\n"
    "        return errno.errorcode.get(e.errno, str(e.errno))\n"
    "def listed(path):\n"
    "    try:\n"
    "        return sorted(os.listdir(path))\n"
    "    except OSError as e:\n"
    "        return errno.errorcode.get(e.errno, str(e.errno))\n"
    "def attach(pid):\n"
    "    return 'attached' if libc.ptrace(16, pid, 0, 0) == 0 else errno.errorcode.get(ctypes.get_errno(), '?')\n"
    "def peek(pid):\n"
    "    buf = ctypes.create_string_buffer(16)\n"
    "    local = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 16)\n"
    "    remote = (ctypes.c_void_p * 2)(0x400000, 16)\n"
    "    n = libc.process_vm_readv(pid, local, 1, remote, 1, 0)\n"
    "    return 'read' if n >= 0 else errno.errorcode.get(ctypes.get_errno(), '?')\n"
    "harness = os.getppid()\n"
)
# The harness (the PID namespace's init, the test's parent) holds every test's expected
# values; the program runs as the same user, and must reach none of it.
PROBE_TESTS = [
    "assert harness == 1",
    "assert opened('/proc/1/mem') in ('EACCES', 'EPERM')",
    "assert opened('/proc/1/environ') in ('EACCES', 'EPERM')",
    "assert listed('/proc/1/fd') in ('EACCES', 'EPERM')",
    "assert attach(1) in ('EPERM', 'EACCES')",
    "assert peek(1) in ('EPERM', 'EACCES', 'ESRCH')",
]


def test_the_harness_is_out_of_the_programs_reach() -> None:
    result = run_tests(PROBE, PROBE_TESTS, LIMITS)
    assert result.passed == (True,) * len(PROBE_TESTS), result.detail
    # And the program's own process is readable (so the refusals above are about the harness).
    assert run_tests(PROBE, ["assert opened('/proc/self/mem') in ('read', 'EIO')"], LIMITS).passed == (True,)


NOT_ROOT = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sandbox_under_test", sys.argv[1])
sandbox = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sandbox
spec.loader.exec_module(sandbox)
result = sandbox.run_tests(sys.argv[2], json.loads(sys.argv[3]), sandbox.SandboxLimits(wall_s=20.0))
print(json.dumps({"passed": result.passed, "isolated": result.isolated, "detail": result.detail}))
"""


def _readable_by_others(path: Path) -> bool:
    return bool(path.stat().st_mode & stat.S_IROTH) and all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)


@pytest.mark.skipif(
    os.geteuid() != 0
    or not Path("/usr/bin/python3").exists()
    or not _readable_by_others(Path(sandbox.__file__).resolve()),
    reason="needs root (to start the service as nobody), /usr/bin/python3, and the sandbox module readable by others",
)
def test_the_harness_is_out_of_reach_in_a_user_namespace_too() -> None:
    # A service that is not root: harness and program share the user (mapped to itself).
    done = subprocess.run(
        ["/usr/bin/python3", "-I", "-c", NOT_ROOT, str(Path(sandbox.__file__).resolve()), PROBE, json.dumps(PROBE_TESTS)],
        check=False,
        user=65534, group=65534, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["isolated"] and report["passed"] == [True] * len(PROBE_TESTS), report


# -- what is judged outside, and how --------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "test", "passed"),
    [
        ("def f():\n    return 3", "assert f() == 3.0", True),
        ("def f():\n    return 0.1 + 0.2", "assert f() == 0.3", False),
        ("def f():\n    return float('nan')", "assert f() == float('nan')", False),
        ("def f():\n    return float('inf')", "assert f() == float('inf')", True),
        ("def f():\n    return 10 ** 5000", "assert f() == pow(10, 5000)", True),
        ("def f():\n    return -(1 << 70)", "assert f() == -1180591620717411303424", True),
        ("def f():\n    return 'caf\\u00e9 \\ud800'", "assert f() == 'caf\\u00e9 \\ud800'", True),
        ("def f():\n    return b'\\x00\\xff'", "assert f() == b'\\x00\\xff'", True),
        ("def f():\n    return 1 + 2j", "assert f() == complex(1, 2)", True),
        (
            "def f():\n    return {(1, 2): [None, True, {3}], 'k': frozenset({'a'})}",
            "assert f() == {'k': frozenset({'a'}), (1, 2): [None, True, {3}]}",
            True,
        ),
        ("def f():\n    return (4, 5)", "assert f() == [4, 5]", False),
        ("def f(x):\n    return x[::-1]", "assert set(f((4, 5))) == set((5, 4))", True),
        ("from fractions import Fraction\ndef f():\n    return Fraction(1, 3)", "assert f() == 1 / 3", False),
        ("from fractions import Fraction\ndef f():\n    return Fraction(6, 2)", "assert f() == 3", True),
        ("from decimal import Decimal\ndef f():\n    return Decimal('2.50')", "assert f() == 2.5", True),
        (
            "from collections import Counter\ndef f():\n    return Counter('aab')",
            "assert f() == {'a': 2, 'b': 1}",
            True,
        ),
        ("from collections import deque\ndef f():\n    return deque([1])", "assert f() == [1]", False),
        ("def f():\n    return None", "assert f() is None", True),
        ("def f():\n    return 1", "assert f() is True", False),
        ("def f():\n    return 3", "assert f() in (1, 2, 3)", True),
        ("def f():\n    return [1, 2]", "assert 3 not in f()", True),
        ("def f():\n    return 2", "assert 1 < f()", True),
        ("def f():\n    return 'a'", "assert f() < 1", False),
        ("def f():\n    return 4", "assert f() == 4, 'with a message'", True),
        (
            "def f(xs):\n    xs.sort()\n    return len(xs)",
            "xs = [3, 1, 2]\nassert f(xs) == 3\nassert xs == [1, 2, 3]",
            True,
        ),
        ("def f(xs):\n    return xs", "xs = [3, 1]\nassert f(xs) == [3, 1]\nassert f(xs) == [1, 3]", False),
        ("sorted = lambda xs: xs\ndef f():\n    return [1, 2]", "assert f() == sorted([2, 1])", True),
        ("def f():\n    return 1", "assert f() == f()", True),
        ("def f():\n    return 1", "assert f( == 1", False),
    ],
)
def test_judged_assertions(code: str, test: str, passed: bool) -> None:
    result = run_tests(code, [test], LIMITS)
    assert result.passed == (passed,), result.detail


def test_what_a_failed_judgement_says() -> None:
    result = run_tests("def f():\n    return [1, 2]", ["assert f() == [1, 2, 3]"], LIMITS)
    assert result.detail == "test 0: assertion 0 failed: got [1, 2], expected == [1, 2, 3]"
    result = run_tests("class A:\n    pass\ndef f():\n    return A()", ["assert f() == 1"], LIMITS)
    assert result.detail == "test 0: assertion 0: the program's side is a A, not plain data"
    result = run_tests("def f():\n    raise ValueError('no')", ["assert f() == 1"], LIMITS)
    assert result.detail == "test 0: ValueError: no"


def test_what_is_sent_to_the_program() -> None:
    # The steps RUNNER gets: the expected side of a judged assertion is not among them.
    steps, expected = sandbox_judge.plan("x = [3, 1]\nassert f(x) == 'sekrit'\nassert g(x)\nassert 'also' in h()")
    assert steps == [("x", "x = [3, 1]"), ("r", "(\nf(x)\n)", 0), ("x", "assert g(x)"), ("r", "(\nh()\n)", 1)]
    assert [(op, value, left) for op, _, value, left in expected] == [("==", "sekrit", True), ("in", "also", False)]
    assert "sekrit" not in repr(steps) and "also" not in repr(steps)
