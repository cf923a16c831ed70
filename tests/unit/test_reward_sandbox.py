"""The code-execution sandbox: real subprocesses, real namespaces and rlimits.

Most checks run a program whose *own* test asserts that the limit held (e.g. "connecting
raised OSError"), so a pass means the sandbox did its job from the inside."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from rollstream.core.redis_server import EmbeddedRedis
from rollstream.reward import sandbox
from rollstream.reward.sandbox import SandboxLimits, SandboxUnavailable, run_tests

LIMITS = SandboxLimits(wall_s=20.0, test_timeout_s=5.0)


def test_assert_tests_partial_credit() -> None:
    result = run_tests("def add(a, b):\n    return a + b\n", ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(-1, 1) == 0"], LIMITS)
    assert result.passed == (True, False, True)
    assert result.fraction == pytest.approx(2 / 3)
    assert not result.timed_out
    assert result.isolated


def test_io_tests_compare_stdout() -> None:
    code = "import sys\na, b = map(int, sys.stdin.readline().split())\nprint(a + b)\n"
    tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10   \n\n"}, {"input": "1 1\n", "output": "3"}]
    assert run_tests(code, tests, LIMITS).passed == (True, True, False)
    # input() and open(0) read the same stdin.
    assert run_tests("print(int(input()) * 2)", [{"input": "21\n", "output": "42"}], LIMITS).passed == (True,)
    assert run_tests("print(open(0).read().upper(), end='')", [{"input": "abc", "output": "ABC"}], LIMITS).passed == (True,)


def test_main_block_runs_for_io_tests_not_for_assert_tests() -> None:
    code = "def f():\n    return 1\nif __name__ == '__main__':\n    print(input())\n"
    assert run_tests(code, ["assert f() == 1"], LIMITS).passed == (True,)  # stdin is empty: input() would fail
    assert run_tests(code, [{"input": "hi\n", "output": "hi"}], LIMITS).passed == (True,)


@pytest.mark.parametrize("code", ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit", "quit()"])
def test_exiting_early_is_a_failure_not_a_pass(code: str) -> None:
    assert run_tests(code, ["assert False, 'never reached'"], LIMITS).passed == (False,)


def test_exceptions_and_syntax_errors_fail_the_tests() -> None:
    assert run_tests("def f(:\n", ["assert True"], LIMITS).passed == (False,)
    assert run_tests("raise ValueError('boom')", ["assert True", "assert True"], LIMITS).passed == (False, False)


def test_a_test_that_hangs_fails_and_the_others_still_run() -> None:
    code = "import time\ndef f(x):\n    if x == 2:\n        while True:\n            time.sleep(0.01)\n    return x\n"
    result = run_tests(code, ["assert f(1) == 1", "assert f(2) == 2", "assert f(3) == 3"], SandboxLimits(wall_s=20.0, test_timeout_s=0.5))
    assert result.passed == (True, False, True)
    assert not result.timed_out
    assert "test 1: timed out" in result.detail


def test_the_whole_run_is_killed_at_the_wall_limit_with_everything_it_started(tmp_path: Path) -> None:
    # The program starts a detached grandchild that would write a file after 2 s; the run is
    # killed at 1 s, and the PID namespace must take the grandchild with it.
    marker = Path("/tmp") / f"rollstream-sandbox-escape-{uuid.uuid4().hex}"
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    time.sleep(2.0)\n    open({str(marker)!r}, 'w').write('escaped')\n    os._exit(0)\n"
        "while True:\n    time.sleep(0.01)\n"
    )
    result = run_tests(code, ["assert True"], SandboxLimits(wall_s=1.0, test_timeout_s=10.0))
    assert result.timed_out and result.passed == (False,)
    time.sleep(3.0)  # past the moment the grandchild would have written
    assert not marker.exists(), "a process the program started outlived the sandbox"


def test_no_network(redis_server: EmbeddedRedis) -> None:
    # The session's redis-server listens on 127.0.0.1; from inside the sandbox even the
    # loopback is gone.
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    code = (
        "import socket\n"
        "def blocked(host, port):\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=2).close()\n"
        "        return False\n"
        "    except OSError:\n"
        "        return True\n"
    )
    result = run_tests(code, [f"assert blocked('127.0.0.1', {port})", "assert blocked('1.1.1.1', 53)"], LIMITS)
    assert result.passed == (True, True)
    # The same connection works from outside the sandbox, so the test above means something.
    import socket

    socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_memory_limit() -> None:
    code = "def grab():\n    try:\n        bytearray(1024 * 1024 * 1024)\n        return False\n    except MemoryError:\n        return True\n"
    assert run_tests(code, ["assert grab()"], SandboxLimits(memory_mb=256)).passed == (True,)


def test_fork_bomb_is_capped() -> None:
    code = (
        "import os, time\n"
        "started = 0\n"
        "try:\n"
        "    for _ in range(500):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30)\n"
        "            os._exit(0)\n"
        "        started += 1\n"
        "except OSError:\n"
        "    pass\n"
    )
    result = run_tests(code, ["assert started < 20, started"], SandboxLimits(max_processes=20, wall_s=20.0))
    assert result.passed == (True,)


@pytest.mark.skipif(os.geteuid() != 0, reason="the drop to nobody happens only when the service runs as root")
def test_runs_as_nobody_and_cannot_touch_roots_files(tmp_path: Path) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("keep")
    code = (
        "import os\n"
        "def refused(path):\n"
        "    try:\n"
        "        open(path, 'a').write('x')\n"
        "        return False\n"
        "    except OSError:\n"
        "        return True\n"
    )
    tests = ["assert os.getuid() == 65534", f"assert refused({str(target)!r})", "assert refused('/etc/passwd')"]
    assert run_tests(code, tests, LIMITS).passed == (True, True, True)
    assert target.read_text() == "keep"


def test_the_program_cannot_read_the_expected_outputs() -> None:
    # The job file (code, tests, expected outputs) is deleted before the program runs.
    code = "import os\nleft = sorted(os.listdir('.'))\n"
    assert run_tests(code, ["assert not any('job' in name for name in left), left"], LIMITS).passed == (True,)


def test_output_flood_is_bounded() -> None:
    code = "import sys\nfor _ in range(10**6):\n    sys.stdout.write('x' * 1000)\n"
    result = run_tests(code, [{"input": "", "output": "x"}], SandboxLimits(max_file_mb=1, wall_s=20.0))
    assert result.passed == (False,)


def test_unavailable_interpreter_is_reported() -> None:
    with pytest.raises(SandboxUnavailable, match="cannot start /no/such/python"):
        run_tests("print(1)", ["assert True"], SandboxLimits(python="/no/such/python"))


def test_parse_tests_explains_bad_metadata() -> None:
    assert sandbox.parse_tests({"tests": ["assert 1", {"input": "", "output": "1"}]}) == ["assert 1", {"input": "", "output": "1"}]
    with pytest.raises(ValueError, match='no "tests" list'):
        sandbox.parse_tests({})
    with pytest.raises(ValueError, match="test 1 is neither"):
        sandbox.parse_tests({"tests": ["assert 1", {"input": "x"}]})
