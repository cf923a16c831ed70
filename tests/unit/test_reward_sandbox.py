"""The code-execution sandbox: real subprocesses, real namespaces and rlimits.

Most checks run a program whose *own* test asserts that the limit held (e.g. "connecting
raised OSError"), so a pass means the sandbox did its job from the inside."""

from __future__ import annotations

import ast
import json
import os
import stat
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from helpers import wait_for
from rollstream.launcher.redis_server import EmbeddedRedis
from rollstream.reward import sandbox
from rollstream.reward.sandbox import SandboxLimits, SandboxUnavailable, run_tests

# Generous: these tests check what the sandbox allows, not how fast; on a loaded 2-core machine
# a test's interpreter took over 5 s to start. The timeout tests set their own limits.
LIMITS = SandboxLimits(wall_s=240.0, test_timeout_s=60.0)
TEMP_DIRS = [d for d in ("/tmp", "/var/tmp", "/dev/shm") if Path(d).is_dir()]
# Defines refusal(path): "written", or the errno name with which creating `path` failed.
REFUSAL = (
    "import errno, os\n"
    "def refusal(path):\n"
    "    try:\n"
    "        open(path, 'w').close()\n"
    "        return 'written'\n"
    "    except OSError as e:\n"
    "        return errno.errorcode.get(e.errno, str(e.errno))\n"
)


def _processes_with(marker: str) -> list[int]:
    """PIDs (in the host's /proc, which shows every namespace) whose command line has `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass  # gone meanwhile
    return found


def test_assert_tests_partial_credit() -> None:
    result = run_tests(
        "def add(a, b):\n    return a + b\n",
        ["assert add(1, 2) == 3", "assert add(2, 2) == 5", "assert add(-1, 1) == 0"],
        LIMITS,
    )
    assert result.passed == (True, False, True)
    assert result.fraction == pytest.approx(2 / 3)
    assert not result.timed_out
    assert result.isolated


def test_io_tests_compare_stdout() -> None:
    code = "import sys\na, b = map(int, sys.stdin.readline().split())\nprint(a + b)\n"
    tests = [
        {"input": "1 2\n", "output": "3\n"},
        {"input": "5 5", "output": "10   \n\n"},
        {"input": "1 1\n", "output": "3"},
    ]
    assert run_tests(code, tests, LIMITS).passed == (True, True, False)
    # input() and open(0) read the same stdin.
    assert run_tests("print(int(input()) * 2)", [{"input": "21\n", "output": "42"}], LIMITS).passed == (True,)
    assert run_tests("print(open(0).read().upper(), end='')", [{"input": "abc", "output": "ABC"}], LIMITS).passed == (
        True,
    )


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
    result = run_tests(
        code,
        ["assert f(1) == 1", "assert f(2) == 2", "assert f(3) == 3"],
        SandboxLimits(wall_s=20.0, test_timeout_s=0.5),
    )
    assert result.passed == (True, False, True)
    assert not result.timed_out and result.timeouts == 1  # the code component makes this a "timeout"
    assert "test 1: timed out" in result.detail


def test_the_whole_run_is_killed_at_the_wall_limit_with_everything_it_started() -> None:
    # The program starts a detached grandchild (a sleeping interpreter with a marker in
    # its command line, visible in the host's /proc); the run is killed at 1 s, and the PID
    # namespace must take the grandchild with it. (A file it would write is no evidence:
    # it could only land in the run's private /tmp.)
    marker = f"rollstream-sandbox-escape-{uuid.uuid4().hex}"
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', {marker!r}])\n"
        "while True:\n    time.sleep(0.01)\n"
    )
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_tests, code, ["assert True"], SandboxLimits(wall_s=1.0, test_timeout_s=10.0))
        wait_for(lambda: _processes_with(marker), 5.0, "the grandchild to start (else the test proves nothing)")
        result = running.result()
    assert result.timed_out and result.passed == (False,)
    wait_for(lambda: not _processes_with(marker), 2.0, "every process the program started to end with the sandbox")


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
    # With the private file system the file (in the host's /tmp) and /etc are out of reach
    # twice over; /root (0700) is not in the minimal root, and refused by the user anyway.
    tests = [
        "assert os.getuid() == 65534",
        f"assert refused({str(target)!r})",
        "assert refused('/etc/passwd')",
        "try:\n    os.listdir('/root')\n    raise AssertionError('listed /root')\nexcept (PermissionError, FileNotFoundError):\n    pass\n",
    ]
    assert run_tests(code, tests, LIMITS).passed == (True, True, True, True)
    assert target.read_text() == "keep"


def test_the_program_cannot_read_the_expected_outputs() -> None:
    # The job file (code, tests, expected outputs) is deleted before the program runs, and
    # no file of the harness's is in the work dir (see test_reward_sandbox_gaming.py for the
    # harness's memory).
    code = "import os\nleft = sorted(os.listdir('.'))\n"
    assert run_tests(code, ["assert not any('job' in name for name in left), left"], LIMITS).passed == (True,)


def test_temp_dirs_are_private_to_the_run() -> None:
    # The program writes (and reads back) a file in each shared temp dir, and does not see
    # one the host has there; none of its files reaches the host's.
    name = f"rollstream-sandbox-{uuid.uuid4().hex}"
    host_file = Path("/tmp") / f"{name}-host"
    host_file.write_text("the host's")
    code = (
        "import os\n"
        "def write_and_read(path):\n"
        "    with open(path, 'w') as f:\n"
        "        f.write('left behind')\n"
        "    with open(path) as f:\n"
        "        return f.read() == 'left behind'\n"
    )
    tests = [
        f"assert not os.path.exists({str(host_file)!r})",
        *(f"assert write_and_read({f'{d}/{name}'!r})" for d in TEMP_DIRS),
    ]
    try:
        result = run_tests(code, tests, LIMITS)
    finally:
        host_file.unlink()
    assert result.passed == (True,) * len(tests), result.detail
    assert result.private_fs
    for d in TEMP_DIRS:
        assert not (Path(d) / name).exists(), f"the program left a file in the host's {d}"


def test_system_v_ipc_is_private_to_the_run() -> None:
    # A shared-memory segment made inside (the kernel lists it in /proc/sysvipc/shm of the
    # namespace it lives in) never shows up in the host's list, and dies with the run.
    key = 0x5A000000 + os.getpid() % 0xFFFF
    code = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"shm_id = libc.shmget({key}, 4096, 0o1600)  # IPC_CREAT | 0600\n"
    )
    tests = [
        "assert shm_id >= 0",
        f"assert any(line.split()[0] == {str(key)!r} for line in open('/proc/sysvipc/shm').readlines()[1:])",
    ]
    result = run_tests(code, tests, LIMITS)
    assert result.passed == (True, True), result.detail
    host_keys = [line.split()[0] for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]]
    assert str(key) not in host_keys


def test_the_rest_of_the_file_system_is_read_only() -> None:
    # EROFS, not EACCES: the mount refuses before the permission check, whoever the user is.
    # The service's own files (this checkout) are not in the minimal root at all (ENOENT).
    name = f"rollstream-sandbox-{uuid.uuid4().hex}"
    own = Path(__file__).resolve().parent
    targets = {f"/{name}": "EROFS", f"/etc/{name}": "EROFS", f"/usr/local/{name}": "EROFS", str(own / name): "ENOENT"}
    tests = [f"assert refusal({t!r}) == {why!r}, refusal({t!r})" for t, why in targets.items()]
    result = run_tests(REFUSAL, tests, LIMITS)
    assert result.passed == (True,) * len(targets), result.detail
    assert result.private_fs
    assert not any(Path(t).exists() for t in targets)


def test_the_program_can_write_in_its_work_dir() -> None:
    # Its files stay there from one test to the next (same run), and an io test's program
    # reads them too.
    code = (
        "import os\n"
        "os.makedirs('sub', exist_ok=True)\n"
        "with open('sub/notes.txt', 'w') as f:\n"
        "    f.write('kept')\n"
        "if __name__ == '__main__':\n"
        "    print(open('sub/notes.txt').read())\n"
    )
    tests = [
        "assert open(os.path.join(os.getcwd(), 'sub', 'notes.txt')).read() == 'kept'",
        {"input": "", "output": "kept"},
    ]
    result = run_tests(code, tests, LIMITS)
    assert result.passed == (True, True), result.detail
    assert result.private_fs


def test_proc_shows_only_the_sandboxs_processes() -> None:
    code = "import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\ncmdlines = [open(f'/proc/{p}/cmdline', 'rb').read() for p in pids]\n"
    # The harness's init and the test's child; pytest (this process) is out of sight.
    tests = ["assert len(pids) <= 3, pids", "assert not any(b'pytest' in c for c in cmdlines)"]
    assert run_tests(code, tests, LIMITS).passed == (True, True)
    assert b"pytest" in Path("/proc/self/cmdline").read_bytes()  # so the second test means something


def test_the_program_cannot_undo_the_mounts() -> None:
    # Without capabilities it cannot unmount; nor can it make a user and mount namespace of
    # its own to get some (EPERM: it is chrooted into the minimal root), so unmounting and
    # making the tree writable stay refused, and /tmp is still the private one.
    host_file = Path("/tmp") / f"rollstream-sandbox-{uuid.uuid4().hex}"
    host_file.write_text("the host's")
    code = REFUSAL + (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "MNT_DETACH, MS_REMOUNT, MS_BIND = 2, 0x20, 0x1000\n"
        "def attempt(call):\n"
        "    return errno.errorcode.get(ctypes.get_errno(), '?') if call() != 0 else 'done'\n"
        "before = attempt(lambda: libc.umount2(b'/tmp', MNT_DETACH))\n"
        "own_namespace = libc.unshare(0x10000000 | 0x00020000)  # CLONE_NEWUSER | CLONE_NEWNS\n"
        "unmount = attempt(lambda: libc.umount2(b'/tmp', MNT_DETACH))\n"
        "remount = attempt(lambda: libc.mount(None, b'/', None, ctypes.c_ulong(MS_REMOUNT | MS_BIND), None))\n"
    )
    tests = [
        "assert before == 'EPERM', before",
        "assert own_namespace == -1",
        "assert unmount == 'EPERM', unmount",
        "assert remount == 'EPERM', remount",
        f"assert not os.path.exists({str(host_file)!r})",
        "assert refusal('/etc/rollstream-sandbox-probe') == 'EROFS'",
    ]
    try:
        result = run_tests(code, tests, LIMITS)
    finally:
        host_file.unlink()
    assert result.passed == (True,) * len(tests), result.detail


# Runs run_tests in a user namespace (ids 0-65535 mapped to themselves, written by this
# privileged parent) whose limit on mount namespaces is 0: there unshare(CLONE_NEWNS)
# fails while the network and PID namespaces still work.
NO_MOUNT_NAMESPACE = r"""
import ctypes, json, os, sys
from rollstream.reward.sandbox import SandboxLimits, run_tests

libc = ctypes.CDLL(None, use_errno=True)
ready_r, ready_w = os.pipe()
go_r, go_w = os.pipe()
pid = os.fork()
if pid == 0:
    if libc.unshare(0x10000000) != 0:
        os._exit(3)
    os.write(ready_w, b"x")
    os.read(go_r, 1)
    with open("/proc/sys/user/max_mnt_namespaces", "w") as f:
        f.write("0")
    result = run_tests(sys.argv[1], json.loads(sys.argv[2]), SandboxLimits(wall_s=20.0))
    print(json.dumps({"passed": result.passed, "isolated": result.isolated, "private_fs": result.private_fs, "detail": result.detail}), flush=True)
    os._exit(0)
os.close(ready_w)  # so that a child that failed reads as EOF here, not as a hang
os.read(ready_r, 1)
for name in ("uid_map", "gid_map"):
    with open("/proc/%d/%s" % (pid, name), "w") as f:
        f.write("0 0 65536")
os.write(go_w, b"x")
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _run_script(argv: list[str], **kwargs: Any) -> Any:
    """Run a helper script that prints a run's result as JSON; that JSON."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, **kwargs)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(os.geteuid() != 0, reason="mapping a range of ids into a user namespace needs root")
def test_without_a_mount_namespace_the_run_goes_on() -> None:
    code = "def f():\n    with open('x', 'w') as f:\n        return f.write('hi')\nif __name__ == '__main__':\n    print(f())\n"
    # The run still drops to nobody and still writes in its work dir (the service's).
    tests = ["assert f() == 2", "import os\nassert os.getuid() == 65534", {"input": "", "output": "2"}]
    report = _run_script([sys.executable, "-c", NO_MOUNT_NAMESPACE, code, json.dumps(tests)])
    assert report == {"passed": [True, True, True], "isolated": True, "private_fs": False, "detail": ""}


# Runs run_tests from a service that is not root: the sandbox module loaded by path into
# the system's interpreter (this one may not be readable by `nobody`).
NOT_ROOT = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sandbox_under_test", sys.argv[1])
sandbox = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = sandbox  # dataclasses look the module up
spec.loader.exec_module(sandbox)
result = sandbox.run_tests(sys.argv[2], json.loads(sys.argv[3]), sandbox.SandboxLimits(wall_s=20.0))
print(json.dumps({"passed": result.passed, "isolated": result.isolated, "private_fs": result.private_fs, "detail": result.detail}))
"""


def _readable_by_others(path: Path) -> bool:
    return bool(path.stat().st_mode & stat.S_IROTH) and all(p.stat().st_mode & stat.S_IXOTH for p in path.parents)


@pytest.mark.skipif(
    os.geteuid() != 0
    or not Path("/usr/bin/python3").exists()
    or not _readable_by_others(Path(sandbox.__file__).resolve()),
    reason="needs root (to start the service as nobody), /usr/bin/python3, and the sandbox module readable by others",
)
def test_a_service_that_is_not_root_gets_the_same_file_system() -> None:
    # Then the harness makes a user namespace: it maps its own ids and must drop the
    # capabilities that come with it, or the program could unmount the private /tmp.
    name = f"rollstream-sandbox-{uuid.uuid4().hex}"
    code = REFUSAL + (
        "import ctypes\n"
        "caps = [line.split()[1] for line in open('/proc/self/status') if line.startswith('CapEff')][0]\n"
        "unmounted = ctypes.CDLL(None, use_errno=True).umount2(b'/tmp', 2)\n"
    )
    tests = [
        "assert os.getuid() == 65534",  # the service's user, mapped to itself
        "assert int(caps, 16) == 0, caps",
        "assert unmounted == -1",
        f"assert refusal('/etc/{name}') == 'EROFS'",
        f"assert refusal('/tmp/{name}') == 'written'",
        f"assert refusal('{name}') == 'written'",
    ]
    report = _run_script(
        ["/usr/bin/python3", "-I", "-c", NOT_ROOT, str(Path(sandbox.__file__).resolve()), code, json.dumps(tests)],
        user=65534, group=65534, extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert report == {"passed": [True] * len(tests), "isolated": True, "private_fs": True, "detail": ""}
    assert not (Path("/tmp") / name).exists()


def test_a_report_without_the_file_system_field_means_not_private() -> None:
    # What an older harness (or a partial report) says: no claim of a private file system.
    old = sandbox._parse_report(b'{"passed": [true], "isolated": true, "detail": ""}', 1, False, "")
    assert old.passed == (True,) and old.isolated and not old.private_fs
    assert sandbox._parse_report(b'{"passed": [true], "isolated": true, "fs_private": true}', 1, False, "").private_fs
    assert not sandbox._parse_report(b"", 1, True, "killed").private_fs


def test_the_harness_and_the_runner_use_the_standard_library_only() -> None:
    # They run with -I -S (no site-packages), the runner inside the fence: another import fails there.
    # The harness imports one file besides, the judge from its own folder, checked here too.
    for path in (sandbox.HARNESS_PATH, sandbox.HARNESS_PATH.with_name("sandbox_judge.py"), sandbox.RUNNER_PATH):
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        outside = {name for name in names if name.split(".")[0] not in sys.stdlib_module_names | {"sandbox_judge"}}
        assert not outside, (path.name, outside)


def test_output_flood_is_bounded() -> None:
    code = "import sys\nfor _ in range(10**6):\n    sys.stdout.write('x' * 1000)\n"
    result = run_tests(code, [{"input": "", "output": "x"}], SandboxLimits(max_file_mb=1, wall_s=20.0))
    assert result.passed == (False,)


def test_unavailable_interpreter_is_reported() -> None:
    with pytest.raises(SandboxUnavailable, match="cannot start /no/such/python"):
        run_tests("print(1)", ["assert True"], SandboxLimits(python="/no/such/python"))


def test_parse_tests_explains_bad_metadata() -> None:
    assert sandbox.parse_tests({"tests": ["assert 1", {"input": "", "output": "1"}]}) == [
        "assert 1",
        {"input": "", "output": "1"},
    ]
    with pytest.raises(ValueError, match='no "tests" list'):
        sandbox.parse_tests({})
    with pytest.raises(ValueError, match="test 1 is neither"):
        sandbox.parse_tests({"tests": ["assert 1", {"input": "x"}]})


def test_a_sandbox_that_cannot_run_is_found_at_start() -> None:
    """recipes.sandbox_problems, which the reward logs at start (code_sandbox_unavailable): a
    code kind whose sandbox cannot start is named with why; one that can (here) is not."""
    from rollstream.reward.recipes import ComponentSpec, sandbox_problems

    broken = ComponentSpec(
        component="code", weight=1.0, params={"python": "/nonexistent/python3", "wall_s": 240.0, "test_timeout_s": 60.0}
    )
    working = ComponentSpec(component="code", weight=1.0, params={"wall_s": 240.0, "test_timeout_s": 60.0})
    problems = sandbox_problems({"broken_code": [broken], "code": [working], "arithmetic": []})
    assert list(problems) == ["broken_code"] and "/nonexistent/python3" in problems["broken_code"]
